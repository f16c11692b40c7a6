"""exp95 (session 29): is v32's drain (chunk values into registers, buffer freed, then the
atomics) free of races? v32 and v31's drain (``make_exp95.py``) each run the W2 / W1 H64 and W2 H8
backward 6 times on the same inputs; per kv row, the largest distance of a run's dkv from the six
runs' fp64 mean, relative to the row's norm, and whether dq is bitwise the same over the runs and
across the two (``pairs_ab.spread_rows``). Writes exp95.json. (The recorded JSON predates
spread_rows: its dq_bitwise_6_runs / dq_bitwise_v32_v31 are dq_bitwise_runs / dq_bitwise_across.)"""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import new_result, spread_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp95

OUT = os.environ.get("OUT", ".")
BWD = {"v32": tk.sparse_mla_bwd_ws_kernel, "v31": _exp95.sparse_mla_bwd_ws_kernel}
res = new_result()
spread_rows(BWD, (("W2", 64), ("W1", 64), ("W2", 8)), res, os.path.join(OUT, "exp95.json"))
