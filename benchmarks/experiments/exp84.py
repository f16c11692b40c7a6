"""exp84 (session 28): the tree's backward with its dKV^T chunks software-pipelined (two chunk
accumulators per MMA warpgroup, chunk k + 1's GEMMs under chunk k's staging stores;
``make_exp84.py``) at 224 / 56 and 232 / 40 registers (at the tree's 216 / 72 ptxas serialises the
wgmma, C7512), against the tree at 216 / 72 and 224 / 56; 8 alternating rounds through
TileLangBackend (dq bitwise against the tree's; dkv differs by the atomics' order)."""
import functools, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import build, new_result, timed_rows, deterministic_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp84 as e84
OUT = os.environ.get("OUT", ".")
k84 = e84.sparse_mla_bwd_ws_kernel
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel,
       "tree224": functools.partial(tk.sparse_mla_bwd_ws_kernel, mma_regs=224, producer_regs=56),
       "exp84r224": functools.partial(k84, mma_regs=224, producer_regs=56),
       "exp84r232": functools.partial(k84, mma_regs=232, producer_regs=40)}
build(BWD, ((64, 1, False), (16, 4, False), (8, 8, False)))
res = new_result()
timed_rows(BWD, (("W2", 64), ("W1", 64), ("W2", 16), ("W2", 8)), res, os.path.join(OUT, "exp84.json"))
