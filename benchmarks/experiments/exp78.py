"""exp78 (session 27): make_exp78.py's backward (exp77's pairs, pair i - 1's chunks spread over
pair i) at 232 / 40 and 240 / 24 registers against the tree's, as exp77.py: 8
alternating rounds at W2 / W1 H64, W2 H16, W2 H8 (dq bitwise, dkv's relative difference), then
deterministic mode at W2 H64 and H16 (bitwise over 3 runs, dkv against the tree's, time). Writes
$OUT/exp78_winner: the variant faster than the tree by 1% or more at W2 and W1 H64 (dq bitwise
everywhere), for the GPU suite (exp78_plugin, EXP78_REGS). Run make_exp78.py first."""
import functools, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import build, deterministic_rows, new_result, timed_rows, winner
from glm5_dsa_plugin.ops import tilelang_kernels as tk
OUT = os.environ.get("OUT", ".")
from glm5_dsa_plugin.ops import _exp78  # written by make_exp78.py
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp78": _exp78.sparse_mla_bwd_ws_kernel,
       "exp78r240": functools.partial(_exp78.sparse_mla_bwd_ws_kernel, mma_regs=240, producer_regs=24)}
build(BWD, ((64, 1, False), (16, 4, False), (8, 8, False), (64, 1, True), (16, 4, True)))
res, path = new_result(), os.path.join(OUT, "exp78.json")
timed_rows(BWD, (("W2", 64), ("W1", 64), ("W2", 16), ("W2", 8)), res, path)
winner(BWD, res, {"exp78": "232,40", "exp78r240": "240,24"}, os.path.join(OUT, "exp78_winner"))
deterministic_rows(BWD, (("W2", 64), ("W2", 16)), res, path)
