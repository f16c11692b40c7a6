"""exp66 (session 23): the warp-specialised backward: the tree's, make_exp65.py's (compiled without
TileLang's fence pass) and make_exp66.py's (the drain's kv row numbers loaded once per block; run
both make scripts first, from the repository root), through TileLangBackend with the builder
patched in turn, alternating rounds (8), W2 / W1 H64. dq must be bitwise equal to the tree's;
dkv sums its atomics in another order (relative difference reported). As run (session 23,
call 6) "tree" was v24's backward; since v25 the tree's backward is "nofence"'s kernel."""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, backward_ab
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp65, _exp66
OUT = os.environ.get("OUT", ".")
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "nofence": _exp65.sparse_mla_bwd_ws_kernel,
       "keys": _exp66.sparse_mla_bwd_ws_kernel}
t0 = time.time()
with ThreadPoolExecutor(4) as pool:
    list(pool.map(lambda f: f(64, DV, 64, 2048, 1, float(SCALE), rows_per_block=1), BWD.values()))
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
           build_s=time.time() - t0, rows={})
print(f"built in {res['build_s']:.0f} s", flush=True)


for wl in ("W2", "W1"):
    row = res["rows"][f"{wl} H64 backward"] = backward_ab(BWD, wl, seed=29)
    med = row["median_ms"]
    print(f"{wl} H64 backward: " + " ".join(f"{k} {v:.4f} ({v / med['tree']:.4f}x)" for k, v in med.items()),
          {k: v for k, v in row.items() if k not in ("median_ms", "rounds")}, flush=True)
    json.dump(res, open(os.path.join(OUT, "exp66.json"), "w"), indent=1)
