"""exp66 (session 23): the warp-specialised backward: the tree's, make_exp65.py's (compiled without
TileLang's fence pass) and make_exp66.py's (the drain's kv row numbers loaded once per block; run
both make scripts first, from the repository root), through TileLangBackend with the builder
patched in turn, alternating rounds (8), W2 / W1 H64. dq must be bitwise equal to the tree's;
dkv sums its atomics in another order (relative difference reported)."""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, alternating, workload
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp65, _exp66
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
OUT = os.environ.get("OUT", ".")
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "nofence": _exp65.sparse_mla_bwd_ws_kernel,
       "keys": _exp66.sparse_mla_bwd_ws_kernel}
t0 = time.time()
with ThreadPoolExecutor(4) as pool:
    list(pool.map(lambda f: f(64, DV, 64, 2048, 1, float(SCALE), rows_per_block=1), BWD.values()))
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
           build_s=time.time() - t0, rows={})
print(f"built in {res['build_s']:.0f} s", flush=True)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def set_bwd(name):
    tk.sparse_mla_bwd_ws_kernel = BWD[name]


for wl in ("W2", "W1"):
    q, kv, idx, g = workload(wl, 64, seed=29)
    be = TileLangBackend()
    out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
    grads = {}
    for name in BWD:
        set_bwd(name)
        grads[name] = be.backward_saved(q, saved, out, lse, g, SCALE, DV)
    chk = {f"{k} dq_bitwise": bool(torch.equal(grads["tree"][0], grads[k][0])) for k in BWD if k != "tree"}
    chk.update({f"{k} dkv_rel": rel(grads[k][1], grads["tree"][1]) for k in BWD if k != "tree"})
    times, med = alternating({k: (lambda: be.backward_saved(q, saved, out, lse, g, SCALE, DV)) for k in BWD},
                             rounds=8, before=set_bwd)
    set_bwd("tree")
    res["rows"][f"{wl} H64 backward"] = dict(median_ms=med, rounds=times, **chk)
    print(f"{wl} H64 backward: " + " ".join(f"{k} {v:.4f} ({v / med['tree']:.4f}x)" for k, v in med.items()), chk,
          flush=True)
    json.dump(res, open(os.path.join(OUT, "exp66.json"), "w"), indent=1)
