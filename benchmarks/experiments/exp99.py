"""exp99 (session 30): the forward with Q's last 64-column unit(s) in registers (``make_exp99.py``:
a = the rope tail, b = two units) against the tree's forward; exp100 runs through it too
(``VARIANTS=tree,exp100a,exp100b NAME=exp100``), and since then it records how far a variant that
is not bitwise lies from the tree. Raw launches on the backend's prepared inputs (out / lse
poisoned with NaN, compared bitwise with the tree's) at W2 / W1 H64, then through
TileLangBackend's forward (``sparse_mla_fwd_ws_kernel`` patched) at W2 H16 / H8 (row groups;
bitwise); timing: 8 alternating rounds of raw launches at W2 / W1 H64, of the op without grad
(deferred flags) at W2 H64 and of the backend's forward at W2 H16 / H8, then sustained loops (1.5
s of back-to-back raw launches each, 4 alternating rounds) at W2 / W1 H64, the regime in which
the forward runs at the power limit. (exp99's outputs were not the tree's: TileLang 0.1.15 drops
the column offset of its Q copy; NOTES, session 30.) Run ``make_exp99.py`` from the repository
root first."""
import importlib, json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, alternating, prepared_forward_inputs, raw_forward, workload
from glm5_dsa_plugin.ops import configure, sparse_mla
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
OUT = os.environ.get("OUT", ".")
TREE = tk.sparse_mla_fwd_ws_kernel
NAMES = os.environ.get("VARIANTS", "tree,exp99a,exp99b").split(",")
BUILDERS = {n: TREE if n == "tree" else importlib.import_module(f"glm5_dsa_plugin.ops._{n}").sparse_mla_fwd_ws_kernel
            for n in NAMES}
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})
path = os.path.join(OUT, os.environ.get("NAME", "exp99") + ".json")
save = lambda: json.dump(res, open(path, "w"), indent=1)  # noqa: E731
t0 = time.time()
with ThreadPoolExecutor(9) as pool:
    list(pool.map(lambda j: BUILDERS[j[0]](j[1], DV, 64, 2048, 1, float(SCALE), rows_per_block=j[2]),
                  [(n, H, R) for n in BUILDERS for H, R in ((64, 1), (16, 4), (8, 8))]))
print(f"built in {time.time() - t0:.0f} s", flush=True)


def diff(a, b):
    """(largest |a - b| over entries finite in both, its ratio to max |a|, entries non-finite in b
    but not in a): how far a variant that is not bitwise lies from the tree."""
    a, b = a.float(), b.float()
    fin = torch.isfinite(a) & torch.isfinite(b)
    d = float((a - b).abs()[fin].max()) if fin.any() else 0.0
    return dict(max_abs=d, rel_to_max=d / max(float(a[fin].abs().max()), 1e-30),
                new_nonfinite=int((~torch.isfinite(b) & torch.isfinite(a)).sum()))


def use(name):
    tk.sparse_mla_fwd_ws_kernel = BUILDERS[name]


def sustained(run, seconds=1.5):
    """ms per call of back-to-back launches for about ``seconds`` (after 0.3 s of the same)."""
    for warm in (True, False):
        n = 0
        t = time.time()
        start = torch.cuda.Event(enable_timing=True); end = torch.cuda.Event(enable_timing=True)
        start.record()
        while time.time() - t < (0.3 if warm else seconds):
            for _ in range(20):
                run()
            n += 20
        end.record(); end.synchronize()
    return start.elapsed_time(end) / n


for wl in ("W2", "W1"):
    q, kv, idx, _ = workload(wl, 64, seed=41)
    inputs = prepared_forward_inputs(q, kv, idx)
    runs, got = {}, {}
    for name, b in BUILDERS.items():
        k, o, l, run = raw_forward(b, 64, 2048, inputs, q)
        run(); torch.cuda.synchronize()
        got[name], runs[name] = (o, l), run
    row = {f"{n} out_bitwise": bool(torch.equal(got["tree"][0], got[n][0])) for n in BUILDERS if n != "tree"}
    row.update({f"{n} lse_bitwise": bool(torch.equal(got["tree"][1], got[n][1])) for n in BUILDERS if n != "tree"})
    row.update({f"{n} {what}": diff(got["tree"][i], got[n][i]) for n in BUILDERS if n != "tree"
                for i, what in ((0, "out_vs_tree"), (1, "lse_vs_tree"))})
    row["tree nan"] = int(torch.isnan(got["tree"][0]).sum())
    times, med = alternating(runs, rounds=8)
    row.update(median_ms=med, rounds=times)
    sus = {n: [] for n in BUILDERS}
    for rnd in range(4):
        for n in (list(BUILDERS) if rnd % 2 == 0 else list(BUILDERS)[::-1]):
            sus[n].append(sustained(runs[n]))
    row["sustained_ms"] = sus
    res["rows"][f"{wl} H64 raw"] = row
    print(f"{wl} H64 raw: " + " ".join(f"{k} {v:.4f} ({v / med['tree']:.4f}x)" for k, v in med.items()),
          {k: v for k, v in row.items() if "bitwise" in k or "vs_tree" in k}, flush=True)
    print(f"{wl} H64 sustained: " + " ".join(f"{k} {sorted(v)[1]:.4f}/{sorted(v)[2]:.4f}" for k, v in sus.items()),
          flush=True)
    save()
    if wl == "W2":
        q.requires_grad_(False)
        configure(forward_flags="deferred")

        def fwd_only():
            with torch.no_grad():
                sparse_mla(q[0], kv[0], idx[0], SCALE, d_v=DV, backend="tilelang")

        times, med = alternating({n: fwd_only for n in BUILDERS}, rounds=8, before=use)
        use("tree")
        configure(forward_flags="eager")
        res["rows"]["W2 H64 op no-grad deferred"] = dict(median_ms=med, rounds=times)
        print("W2 H64 op no-grad deferred: " + " ".join(f"{k} {v:.4f} ({v / med['tree']:.4f}x)" for k, v in med.items()),
              flush=True)
        save()

for H in (16, 8):
    q, kv, idx, _ = workload("W2", H, seed=41)
    be = TileLangBackend()
    got = {}
    for n in BUILDERS:
        use(n)
        got[n] = be.forward_saving(q, kv, idx, SCALE, DV)[:2]
    row = {f"{n} bitwise": bool(torch.equal(got["tree"][0], got[n][0]) and torch.equal(got["tree"][1], got[n][1]))
           for n in BUILDERS if n != "tree"}
    row.update({f"{n} {what}": diff(got["tree"][i], got[n][i]) for n in BUILDERS if n != "tree"
                for i, what in ((0, "out_vs_tree"), (1, "lse_vs_tree"))})
    times, med = alternating({n: (lambda: be.forward_saving(q, kv, idx, SCALE, DV)) for n in BUILDERS}, rounds=8,
                             before=use)
    use("tree")
    row.update(median_ms=med, rounds=times)
    res["rows"][f"W2 H{H} backend forward"] = row
    print(f"W2 H{H} backend forward: " + " ".join(f"{k} {v:.4f} ({v / med['tree']:.4f}x)" for k, v in med.items()),
          {k: v for k, v in row.items() if "bitwise" in k or "vs_tree" in k}, flush=True)
    save()
