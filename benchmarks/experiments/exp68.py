"""exp68 (session 23): the landed warp-specialised backward (its own three fences, TileLang's fence
pass skipped) against the tree before it (``git show 2d44a43:glm5_dsa_plugin/ops/tilelang_kernels.py
> glm5_dsa_plugin/ops/_exp68.py`` first), through TileLangBackend with the builder patched in turn,
8 alternating rounds, W2 / W1 H64. dq must be bitwise equal; dkv sums its atomics in another
order (relative difference reported). (As run in session 23 its json named the checks
``dq_bitwise`` / ``dkv_rel``; through ``common.backward_ab`` they carry the variant's name.)"""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, backward_ab
from glm5_dsa_plugin.ops import _exp68 as before_module
from glm5_dsa_plugin.ops import tilelang_kernels as tk
OUT = os.environ.get("OUT", ".")
BWD = {"before": before_module.sparse_mla_bwd_ws_kernel, "landed": tk.sparse_mla_bwd_ws_kernel}
with ThreadPoolExecutor(2) as pool:
    list(pool.map(lambda f: f(64, DV, 64, 2048, 1, float(SCALE), rows_per_block=1), BWD.values()))
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})


for wl in ("W2", "W1"):
    row = res["rows"][f"{wl} H64 backward"] = backward_ab(BWD, wl, seed=31)
    med = row["median_ms"]
    print(f"{wl} H64 backward: before {med['before']:.4f} landed {med['landed']:.4f} "
          f"({med['landed'] / med['before']:.4f}x) dq bitwise {row['landed dq_bitwise']}, dkv {row['landed dkv_rel']:.1e}",
          flush=True)
    json.dump(res, open(os.path.join(OUT, "exp68.json"), "w"), indent=1)
