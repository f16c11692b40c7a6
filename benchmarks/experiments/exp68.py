"""exp68 (session 23): the landed warp-specialised backward (its own three fences, TileLang's fence
pass skipped) against the tree before it (``git show 2d44a43:glm5_dsa_plugin/ops/tilelang_kernels.py
> glm5_dsa_plugin/ops/_exp68.py`` first), through TileLangBackend with the builder patched in turn,
8 alternating rounds, W2 / W1 H64. dq must be bitwise equal; dkv sums its atomics in another
order (relative difference reported)."""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, alternating, workload
from glm5_dsa_plugin.ops import _exp68 as before_module
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
OUT = os.environ.get("OUT", ".")
BWD = {"before": before_module.sparse_mla_bwd_ws_kernel, "landed": tk.sparse_mla_bwd_ws_kernel}
with ThreadPoolExecutor(2) as pool:
    list(pool.map(lambda f: f(64, DV, 64, 2048, 1, float(SCALE), rows_per_block=1), BWD.values()))
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})


def set_bwd(name):
    tk.sparse_mla_bwd_ws_kernel = BWD[name]


for wl in ("W2", "W1"):
    q, kv, idx, g = workload(wl, 64, seed=31)
    be = TileLangBackend()
    out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
    grads = {}
    for name in BWD:
        set_bwd(name)
        grads[name] = be.backward_saved(q, saved, out, lse, g, SCALE, DV)
    d = (grads["landed"][1].double() - grads["before"][1].double()).norm() / grads["before"][1].double().norm()
    chk = dict(dq_bitwise=bool(torch.equal(grads["before"][0], grads["landed"][0])), dkv_rel=float(d))
    times, med = alternating({k: (lambda: be.backward_saved(q, saved, out, lse, g, SCALE, DV)) for k in BWD},
                             rounds=8, before=set_bwd)
    set_bwd("landed")
    res["rows"][f"{wl} H64 backward"] = dict(median_ms=med, rounds=times, **chk)
    print(f"{wl} H64 backward: before {med['before']:.4f} landed {med['landed']:.4f} "
          f"({med['landed'] / med['before']:.4f}x) {chk}", flush=True)
    json.dump(res, open(os.path.join(OUT, "exp68.json"), "w"), indent=1)
