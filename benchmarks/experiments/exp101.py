"""exp101 (session 30): more chunk buffering in the backward (``make_exp101.py``): z, P's fp32 copy
dropped (dS from the bf16 P); a, z and a third chunk buffer for warpgroup 1. 8 alternating rounds
through TileLangBackend at W2 / W1 H64, W2 H16 / H8 against the tree (v32), then dq / dkv's
relative distance from the tree's at W2 H64 (not bitwise: dS's rounding changes). Run
``make_exp101.py`` from the repository root first."""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, workload
from pairs_ab import four_shapes
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp101a, _exp101z
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp101z": _exp101z.sparse_mla_bwd_ws_kernel,
       "exp101a": _exp101a.sparse_mla_bwd_ws_kernel}
res, path = four_shapes(BWD, "exp101", os.environ.get("OUT", "."))
q, kv, idx, g = workload("W2", 64, seed=43)
be = TileLangBackend()
out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
original, grads = tk.sparse_mla_bwd_ws_kernel, {}
for name, f in BWD.items():
    tk.sparse_mla_bwd_ws_kernel = f
    grads[name] = [t.double() for t in be.backward_saved(q, saved, out, lse, g, SCALE, DV)[:2]]
tk.sparse_mla_bwd_ws_kernel = original
rel = {n: [float((a - b).norm() / b.norm()) for a, b in zip(grads[n], grads["tree"])] for n in BWD if n != "tree"}
res["rows"]["W2 H64 distance from the tree (dq, dkv)"] = rel
print("W2 H64 distance from the tree (dq, dkv):", rel, flush=True)
json.dump(res, open(path, "w"), indent=1)
