"""exp97 / exp98 (session 29, prepared, not run): exp96's two changes apart (``make_exp97.py``):
v32 (tree), exp96 (relaxed free, count from the reads), exp97 (relaxed free, no dependency: timing
only), exp98 (exp96's asm block with release semantics); 8 alternating rounds through
TileLangBackend at W2 / W1 H64, W2 H16 / H8 (dq bitwise against the tree's), then exp95's race
check at W2 H64 for each (per kv row, the largest distance of 6 runs from their fp64 mean,
relative to the row's norm). Run ``make_exp97.py`` from the repository root first."""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from common import DV, SCALE, workload
from pairs_ab import build, new_result, timed_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
from glm5_dsa_plugin.ops import _exp96, _exp97, _exp98
OUT = os.environ.get("OUT", ".")
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp96": _exp96.sparse_mla_bwd_ws_kernel,
       "exp97": _exp97.sparse_mla_bwd_ws_kernel, "exp98": _exp98.sparse_mla_bwd_ws_kernel}
build(BWD, ((64, 1, False), (16, 4, False), (8, 8, False)))
res = new_result()
path = os.path.join(OUT, "exp97.json")
timed_rows(BWD, (("W2", 64), ("W1", 64), ("W2", 16), ("W2", 8)), res, path)
original = tk.sparse_mla_bwd_ws_kernel
q, kv, idx, g = workload("W2", 64, seed=47)
be = TileLangBackend()
out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
row = {}
for name, f in BWD.items():
    tk.sparse_mla_bwd_ws_kernel = f
    runs = [be.backward_saved(q, saved, out, lse, g, SCALE, DV) for _ in range(6)]
    dkv = torch.stack([r[1].double() for r in runs])
    mean = dkv.mean(0)
    norm = mean.flatten(0, 2).norm(dim=-1)
    live = norm > 0
    dev = ((dkv - mean).abs().amax(0).flatten(0, 2).amax(-1)[live] / norm[live])
    row[name] = dict(dq_bitwise_6_runs=all(torch.equal(r[0], runs[0][0]) for r in runs[1:]),
                     max_row_rel=float(dev.max()), rows_above_1e_4=int((dev > 1e-4).sum()), rows=int(live.sum()))
tk.sparse_mla_bwd_ws_kernel = original
res["rows"]["W2 H64 race check"] = row
print("W2 H64 race check", json.dumps(row), flush=True)
json.dump(res, open(path, "w"), indent=1)
