"""exp59 (session 23): the persistent warp-specialised forwards against the tree's kernel, one
row per block. exp57 = static stride (make_exp57.py), exp58 = rows from an atomic counter
(make_exp58.py), exp59 = exp58 with the next row's Q tile and first block loaded under the
current row's epilogue, out through kv buffer 1 (make_exp59.py; run it first: it writes all
three). Raw launches on the same prepared inputs: out / lse against the tree's (bitwise, else the
largest difference and how many differ; the tree against itself too), at W2 / W1 H64, W2 H128, a
ragged case and one with fewer rows than CTAs; each launch twice (the counter must reset itself);
then alternating rounds of raw launches and of the backend's forward (builder patched) at W2 / W1
H64. Run it under ``timeout``: a barrier-phase mistake hangs the kernel. Session 23's second run
(exp60, after make_exp60.py): ``NAME=exp60 VARIANTS=tree,exp58,exp60,exp61,exp62``."""
import functools, json, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, alternating, prepared_forward_inputs, ragged_workload, raw_forward, workload
from glm5_dsa_plugin.ops import tilelang_kernels as tk
import importlib
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
OUT = os.environ.get("OUT", ".")
SMS = torch.cuda.get_device_properties(0).multi_processor_count
TREE = tk.sparse_mla_fwd_ws_kernel
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), sms=SMS, rows={})


def with_counter(make):
    """A builder whose kernels take the row counter as their last argument -> one whose kernels
    do not (each built kernel gets its own zeroed counter, kept as ``.counter``; built once per
    arguments, as the tree's builders are)."""
    @functools.cache
    def build(*a, **kw):
        k = make(*a, persistent=SMS, **kw)
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        run = lambda *args: k(*args, counter)  # noqa: E731
        run.counter = counter
        return run
    return build


def variant(name):
    """exp57: static stride; exp58-61: a row counter (their last argument); exp62: one row per CTA."""
    make = importlib.import_module(f"glm5_dsa_plugin.ops._{name}").sparse_mla_fwd_ws_kernel
    return (functools.partial(make, persistent=SMS) if name == "exp57" else make if name == "exp62"
            else with_counter(make))


NAME = os.environ.get("NAME", "exp59")
BUILDERS = {n: TREE if n == "tree" else variant(n) for n in os.environ.get("VARIANTS", "tree,exp57,exp58,exp59").split(",")}
for name in filter(None, os.environ.get("EXCLUDE", "").split(",")):  # variants that hung in an earlier run
    BUILDERS.pop(name)
SHAPES = ((64, 2048), (128, 2048), (64, 512))
t0 = time.time()
with ThreadPoolExecutor(8) as pool:  # (TileLang compiles outside the GIL)
    list(pool.map(lambda job: BUILDERS[job[0]](job[1][0], DV, 64, job[1][1], 1, float(SCALE), rows_per_block=1),
                  [(n, s) for n in BUILDERS for s in SHAPES]))
res["build_s"] = time.time() - t0
print(f"built in {res['build_s']:.0f} s", flush=True)


def save():
    json.dump(res, open(os.path.join(OUT, f"{NAME}.json"), "w"), indent=1)


def hung(label, case):
    res["hung"] = dict(variant=label, case=case)
    save()
    print("hung:", label, case, flush=True)
    os._exit(3)


def compare(a, b):
    """-> bitwise, largest |difference| over entries finite in both, count differing, NaN in b."""
    d = (a.float() - b.float()).abs()
    return dict(bitwise=bool(torch.equal(a, b)), max_diff=float(torch.nan_to_num(d, nan=0.0).max()),
                n_diff=int((a != b).sum()), nan=int(torch.isnan(b).sum()))


cases = [("W2 H64", lambda: workload("W2", 64, seed=37)[:3], 2048), ("W1 H64", lambda: workload("W1", 64, seed=37)[:3], 2048),
         ("W2 H128", lambda: workload("W2", 128, seed=37)[:3], 2048), ("ragged H64", lambda: ragged_workload(64), 512),
         ("50 rows H64", lambda: ragged_workload(64, T=50, T_kv=400), 512)]
for name, make, topk in cases:
    q, kv, idx = make()
    H = q.shape[2]
    inputs = prepared_forward_inputs(q, kv, idx)
    got = {}
    for label, builder in BUILDERS.items():
        k, o, l, run = raw_forward(builder, H, topk, inputs, q)
        watchdog = threading.Timer(60, hung, (label, name))  # a barrier-phase mistake hangs the kernel
        watchdog.start()
        run()
        torch.cuda.synchronize()
        first = (o.clone(), l.clone())
        o.fill_(float("nan")); l.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        watchdog.cancel()
        got[label] = (o, l)
        row = dict(repeat_out=compare(first[0], o), repeat_lse=compare(first[1], l))
        if hasattr(k, "counter"):
            row["counter_after"] = int(k.counter.item())
        if label != "tree":
            row.update(out=compare(got["tree"][0], o), lse=compare(got["tree"][1], l))
        res["rows"][f"{name} {label}"] = row
        print(name, label, row, flush=True)
    save()

for wl in ("W2", "W1"):
    q, kv, idx, _ = workload(wl, 64, seed=41)
    inputs = prepared_forward_inputs(q, kv, idx)
    runs = {label: raw_forward(b, 64, 2048, inputs, q)[3] for label, b in BUILDERS.items()}
    times, med = alternating(runs)
    res["rows"][f"{wl} H64 raw"] = dict(median_ms=med, rounds=times)
    print(f"{wl} H64 raw: " + " ".join(f"{k} {v:.4f} ({v / med['tree']:.4f}x)" for k, v in med.items()), flush=True)
    be = TileLangBackend()
    forward = lambda: be.forward_saving(q, kv, idx, SCALE, DV)  # noqa: E731
    times, med = alternating({k: forward for k in BUILDERS},
                             before=lambda k: setattr(tk, "sparse_mla_fwd_ws_kernel", BUILDERS[k]))
    tk.sparse_mla_fwd_ws_kernel = TREE
    res["rows"][f"{wl} H64 backend forward"] = dict(median_ms=med, rounds=times)
    print(f"{wl} H64 backend forward: " + " ".join(f"{k} {v:.4f} ({v / med['tree']:.4f}x)" for k, v in med.items()),
          flush=True)
    save()
