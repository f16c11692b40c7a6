"""exp80 (session 27): exp80_kernel's backward (exp77 with each warpgroup's dKV chunks
software-pipelined: chunk k + 1's GEMMs in flight while chunk k's atomics go out; 240 / 24
registers: at 232 / 40 ptxas serialises its wgmma, C7512) against the tree's, exp77's and exp77's
atomics-free ablation (exp79), 8 alternating rounds at W2 / W1 H64 and W2 H16 through
TileLangBackend (dq bitwise against the tree's, dkv's relative difference). Run make_exp80.py first."""
import functools, json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, backward_ab
import exp77_kernel
from glm5_dsa_plugin.ops import _exp80 as exp80_kernel  # written by make_exp80.py
from glm5_dsa_plugin.ops import tilelang_kernels as tk
OUT = os.environ.get("OUT", ".")
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp77": exp77_kernel.sparse_mla_bwd_ws_kernel,
       "exp80r240": functools.partial(exp80_kernel.sparse_mla_bwd_ws_kernel, mma_regs=240, producer_regs=24),
       "exp77_no_atomics": functools.partial(exp77_kernel.sparse_mla_bwd_ws_kernel, skip_dkv_writes=True)}
t0 = time.time()
with ThreadPoolExecutor(2 * len(BWD)) as pool:
    list(pool.map(lambda a: a[0](a[1], DV, 64, 2048, 1, float(SCALE), rows_per_block=a[2]),
                  [(f, H, R) for f in BWD.values() for H, R in ((64, 1), (16, 4))]))
print(f"built in {time.time() - t0:.0f} s", flush=True)
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})
for wl, H in (("W2", 64), ("W1", 64), ("W2", 16)):
    row = res["rows"][f"{wl} H{H} backward"] = backward_ab(BWD, wl, seed=41, H=H)
    med = row["median_ms"]
    print(f"{wl} H{H} backward: tree {med['tree']:.4f} " + " ".join(
        f"{n} {med[n]:.4f} ({med[n] / med['tree']:.4f}x, dq bitwise {row[n + ' dq_bitwise']}, dkv {row[n + ' dkv_rel']:.1e})"
        for n in BWD if n != "tree"), flush=True)
    json.dump(res, open(os.path.join(OUT, "exp80.json"), "w"), indent=1)
