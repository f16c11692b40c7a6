"""exp79 (session 27): what exp77's atomics from the MMA registers cost. exp77_kernel's backward at
232 / 40 and 240 / 24 registers, and at 232 / 40 with its dKV atomics left out (an ablation: the
chunks' GEMMs run, dkv comes out zero), against the tree's; 8 alternating rounds at W2 / W1 H64
through TileLangBackend (dq bitwise against the tree's)."""
import functools, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import build, new_result, timed_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
OUT = os.environ.get("OUT", ".")
import exp77_kernel
k77 = exp77_kernel.sparse_mla_bwd_ws_kernel
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp77": k77,
       "exp77r240": functools.partial(k77, mma_regs=240, producer_regs=24),
       "exp77_no_atomics": functools.partial(k77, skip_dkv_writes=True)}
build(BWD, ((64, 1, False),))
res = new_result()
timed_rows(BWD, (("W2", 64), ("W1", 64)), res, os.path.join(OUT, "exp79.json"))
