"""exp95 (session 29): is v32's drain (chunk values into registers, buffer freed, then the
atomics) free of races? v32 and v31's drain (``make_exp95.py``) each run the W2 / W1 H64 and W2 H8
backward 6 times on the same inputs; per kv row, the largest difference of dkv from the fp64 sum
of the six runs' mean, relative to the row's norm (the atomics' order alone moves a row by about
1e-6; a chunk buffer overwritten before the drain read it would move whole rows), and whether
dq is bitwise the same over the runs and across the two. Writes exp95.json."""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from common import DV, SCALE, workload
from pairs_ab import new_result
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
from glm5_dsa_plugin.ops import _exp95

OUT = os.environ.get("OUT", ".")
BWD = {"v32": tk.sparse_mla_bwd_ws_kernel, "v31": _exp95.sparse_mla_bwd_ws_kernel}
res = new_result()
original = tk.sparse_mla_bwd_ws_kernel
for wl, H in (("W2", 64), ("W1", 64), ("W2", 8)):
    q, kv, idx, g = workload(wl, H, seed=47)
    be = TileLangBackend()
    out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
    row, dqs = {}, {}
    for name, f in BWD.items():
        tk.sparse_mla_bwd_ws_kernel = f
        runs = [be.backward_saved(q, saved, out, lse, g, SCALE, DV) for _ in range(6)]
        dkv = torch.stack([r[1].double() for r in runs])  # [6, 1, T_kv, 1, 576]
        mean = dkv.mean(0)
        norm = mean.flatten(0, 2).norm(dim=-1).clamp_min(1e-30)  # per kv row
        dev = (dkv - mean).abs().amax(0).flatten(0, 2).amax(-1) / norm
        live = mean.flatten(0, 2).norm(dim=-1) > 0
        d = dev[live]
        row[name] = dict(dq_bitwise_6_runs=all(torch.equal(r[0], runs[0][0]) for r in runs[1:]),
                         rows=int(live.sum()), max_row_rel=float(d.max()), p999_row_rel=float(d.quantile(0.999)),
                         median_row_rel=float(d.median()), rows_above_1e_4=int((d > 1e-4).sum()))
        dqs[name] = runs[0][0]
    row["dq_bitwise_v32_v31"] = bool(torch.equal(dqs["v32"], dqs["v31"]))
    tk.sparse_mla_bwd_ws_kernel = original
    res["rows"][f"{wl} H{H}"] = row
    print(wl, H, json.dumps(row), flush=True)
    json.dump(res, open(os.path.join(OUT, "exp95.json"), "w"), indent=1)
