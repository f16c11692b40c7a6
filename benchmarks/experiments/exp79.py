"""exp79 (session 27): what exp77's atomics from the MMA registers cost. exp77_kernel's backward at
232 / 40 and 240 / 24 registers, and at 232 / 40 with its dKV atomics left out (an ablation: the
chunks' GEMMs run, dkv comes out zero), against the tree's; 8 alternating rounds at W2 / W1 H64
through TileLangBackend (dq bitwise against the tree's)."""
import functools, json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, backward_ab
import exp77_kernel
from glm5_dsa_plugin.ops import tilelang_kernels as tk
OUT = os.environ.get("OUT", ".")
k77 = exp77_kernel.sparse_mla_bwd_ws_kernel
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp77": k77,
       "exp77r240": functools.partial(k77, mma_regs=240, producer_regs=24),
       "exp77_no_atomics": functools.partial(k77, skip_dkv_writes=True)}
t0 = time.time()
with ThreadPoolExecutor(len(BWD)) as pool:
    list(pool.map(lambda f: f(64, DV, 64, 2048, 1, float(SCALE), rows_per_block=1), BWD.values()))
print(f"built in {time.time() - t0:.0f} s", flush=True)
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})
for wl in ("W2", "W1"):
    row = res["rows"][f"{wl} H64 backward"] = backward_ab(BWD, wl, seed=41, H=64)
    med = row["median_ms"]
    print(f"{wl} H64 backward: tree {med['tree']:.4f} " + " ".join(
        f"{n} {med[n]:.4f} ({med[n] / med['tree']:.4f}x, dq bitwise {row[n + ' dq_bitwise']}, dkv {row[n + ' dkv_rel']:.1e})"
        for n in BWD if n != "tree"), flush=True)
    json.dump(res, open(os.path.join(OUT, "exp79.json"), "w"), indent=1)
