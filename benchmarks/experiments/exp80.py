"""exp80 (session 27): make_exp80.py's backward (exp77 with each warpgroup's dKV chunks
software-pipelined: chunk k + 1's GEMMs in flight while chunk k's atomics go out; 240 / 24
registers: at 232 / 40 ptxas serialises its wgmma, C7512) against the tree's, exp77's and exp77's
atomics-free ablation (exp79), 8 alternating rounds at W2 / W1 H64 and W2 H16 through
TileLangBackend (dq bitwise against the tree's, dkv's relative difference). Run make_exp80.py first."""
import functools, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import build, new_result, timed_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
OUT = os.environ.get("OUT", ".")
import exp77_kernel
from glm5_dsa_plugin.ops import _exp80  # written by make_exp80.py
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp77": exp77_kernel.sparse_mla_bwd_ws_kernel,
       "exp80r240": functools.partial(_exp80.sparse_mla_bwd_ws_kernel, mma_regs=240, producer_regs=24),
       "exp77_no_atomics": functools.partial(exp77_kernel.sparse_mla_bwd_ws_kernel, skip_dkv_writes=True)}
build(BWD, ((64, 1, False), (16, 4, False)))
res = new_result()
timed_rows(BWD, (("W2", 64), ("W1", 64), ("W2", 16)), res, os.path.join(OUT, "exp80.json"))
