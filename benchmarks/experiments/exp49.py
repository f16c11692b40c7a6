"""exp49 (prepared in session 20, run in session 21, landed): the warp-specialised backward storing dq through the dead
Q tile (make_exp49.py; run it first, from the repository root) against the tree's kernel, through
TileLangBackend.backward_saved with the kernel builder patched in turn, alternating rounds, W2 H64
and W1 H64 (one row per block). dq must be bitwise equal (same values, another store path)."""
import json, os, statistics, sys, time
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, bench, workload
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp49 as ex
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
OUT = os.environ.get("OUT", ".")
TREE = tk.sparse_mla_bwd_ws_kernel
VARIANTS = {"tree": TREE, "staged_dq": ex.sparse_mla_bwd_ws_kernel}


res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})
for wl in ("W2", "W1"):
    q, kv, idx, g = workload(wl, 64, seed=11)
    be = TileLangBackend()
    out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
    dqs = {}
    for name, builder in VARIANTS.items():
        tk.sparse_mla_bwd_ws_kernel = builder
        dqs[name] = be.backward_saved(q, saved, out, lse, g, SCALE, DV)[0].clone()
    chk = dict(dq_bitwise=bool(torch.equal(dqs["tree"], dqs["staged_dq"])))
    times = {name: [] for name in VARIANTS}
    for rnd in range(6):
        for name in (list(VARIANTS) if rnd % 2 == 0 else list(VARIANTS)[::-1]):
            tk.sparse_mla_bwd_ws_kernel = VARIANTS[name]
            times[name].append(bench(lambda: be.backward_saved(q, saved, out, lse, g, SCALE, DV)))
    tk.sparse_mla_bwd_ws_kernel = TREE
    med = {k: statistics.median(v) for k, v in times.items()}
    res["rows"][f"{wl} H64"] = dict(median_ms=med, rounds=times, **chk)
    print(f"{wl} H64 backward tree {med['tree']:.3f} staged dq {med['staged_dq']:.3f} "
          f"({med['staged_dq'] / med['tree']:.3f}x) {chk}", flush=True)
json.dump(res, open(os.path.join(OUT, "exp49.json"), "w"), indent=1)
