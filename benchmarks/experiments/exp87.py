"""exp87 (session 28): exp83's ablations on v31's backward (``make_exp87.py``): without the drain's
atomics, without the chunks' staging stores, without both; 8 alternating rounds through
TileLangBackend at W2 / W1 H64 (timing only for the ablated variants)."""
import functools, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import build, new_result, timed_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp87
OUT = os.environ.get("OUT", ".")
k87 = _exp87.sparse_mla_bwd_ws_kernel
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel,
       "no_atomics": functools.partial(k87, skip_atomics=True),
       "no_stage": functools.partial(k87, skip_stage=True),
       "no_stage_no_atomics": functools.partial(k87, skip_stage=True, skip_atomics=True)}
build(BWD, ((64, 1, False),))
res = new_result()
timed_rows(BWD, (("W2", 64), ("W1", 64)), res, os.path.join(OUT, "exp87.json"))
