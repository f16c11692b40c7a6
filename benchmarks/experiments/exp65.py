"""exp65 (session 23): make_exp65.py's kernels (run it first, from the repository root): the
tree's warp-specialised forward and backward compiled without TileLang's InjectFenceProxy pass,
against the tree's, through TileLangBackend with the builders patched in turn, alternating
rounds, W2 / W1 H64 (one row per block), plus raw forward launches. out / lse / dq must be
bitwise equal (the fences order memory, no arithmetic changes); dkv sums its atomics in another
order (relative difference reported)."""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, alternating, workload
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp65 as ex
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend, _kernel_lists
OUT = os.environ.get("OUT", ".")
FWD = {"tree": tk.sparse_mla_fwd_ws_kernel, "nofence": ex.sparse_mla_fwd_ws_kernel}
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "nofence": ex.sparse_mla_bwd_ws_kernel}
args = (64, DV, 64, 2048, 1, float(SCALE))
t0 = time.time()
with ThreadPoolExecutor(4) as pool:
    list(pool.map(lambda f: f(*args, rows_per_block=1), [FWD["tree"], BWD["tree"], FWD["nofence"], BWD["nofence"]]))
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
           build_s=time.time() - t0, rows={})
print(f"built in {res['build_s']:.0f} s", flush=True)


def save():
    json.dump(res, open(os.path.join(OUT, "exp65.json"), "w"), indent=1)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def set_fwd(name):
    tk.sparse_mla_fwd_ws_kernel = FWD[name]


def set_bwd(name):
    tk.sparse_mla_bwd_ws_kernel = BWD[name]


for wl in ("W2", "W1"):
    q, kv, idx, g = workload(wl, 64, seed=23)
    be = TileLangBackend()
    got = {}
    for name in FWD:
        set_fwd(name)
        o, l, saved = be.forward_saving(q, kv, idx, SCALE, DV)
        got[name] = (o.clone(), l.clone())
    chk = dict(out_bitwise=bool(torch.equal(got["tree"][0], got["nofence"][0])),
               lse_bitwise=bool(torch.equal(got["tree"][1], got["nofence"][1])))
    times, med = alternating({k: (lambda: be.forward_saving(q, kv, idx, SCALE, DV)) for k in FWD}, before=set_fwd)
    set_fwd("tree")
    res["rows"][f"{wl} H64 forward"] = dict(median_ms=med, rounds=times, **chk)
    print(f"{wl} H64 forward: tree {med['tree']:.4f} nofence {med['nofence']:.4f} "
          f"({med['nofence'] / med['tree']:.4f}x) {chk}", flush=True)
    _, keys, members, ext = _kernel_lists(saved)
    o1 = torch.empty(1, q.shape[1], 64, DV, dtype=q.dtype, device="cuda")
    l1 = torch.empty(1, q.shape[1], 64, device="cuda")
    raw = {k: f(*args, rows_per_block=1) for k, f in FWD.items()}
    times, med = alternating({k: (lambda k=k: raw[k](q, saved[0], keys, ext, members, o1, l1)) for k in raw})
    res["rows"][f"{wl} H64 raw forward kernel"] = dict(median_ms=med, rounds=times)
    print(f"{wl} H64 raw forward kernel: tree {med['tree']:.4f} nofence {med['nofence']:.4f} "
          f"({med['nofence'] / med['tree']:.4f}x)", flush=True)
    save()
    out, lse = got["tree"]
    grads = {}
    for name in BWD:
        set_bwd(name)
        dq, dkv = be.backward_saved(q, saved, out, lse, g, SCALE, DV)
        grads[name] = (dq.clone(), dkv.clone())
    chk = dict(dq_bitwise=bool(torch.equal(grads["tree"][0], grads["nofence"][0])),
               dkv_rel=rel(grads["nofence"][1], grads["tree"][1]),
               finite=bool(torch.isfinite(grads["nofence"][0]).all() and torch.isfinite(grads["nofence"][1]).all()))
    times, med = alternating({k: (lambda: be.backward_saved(q, saved, out, lse, g, SCALE, DV)) for k in BWD},
                             before=set_bwd)
    set_bwd("tree")
    res["rows"][f"{wl} H64 backward"] = dict(median_ms=med, rounds=times, **chk)
    print(f"{wl} H64 backward: tree {med['tree']:.4f} nofence {med['nofence']:.4f} "
          f"({med['nofence'] / med['tree']:.4f}x) {chk}", flush=True)
    save()
