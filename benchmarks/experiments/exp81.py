"""exp81 (session 27): make_exp81.py's backward (exp77's pairs with the tree's staged drain; P's fp32
hand-off through warpgroup 0's first staging half) at 240 / 24 registers (no C7512 from ptxas) and
232 / 40 (ptxas serialises its wgmma: C7512) against the tree's, as exp78.py: 8 alternating rounds
at W2 / W1 H64, W2 H16, W2 H8 (dq bitwise, dkv's relative difference), then deterministic mode at
W2 H64 and H16 (bitwise over 3 runs, dkv against the tree's, time). Writes $OUT/exp81_winner: the
variant faster than the tree by 1% or more at W2 and W1 H64 with dq bitwise everywhere. Run
make_exp81.py first."""
import functools, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import build, deterministic_rows, new_result, timed_rows, winner
from glm5_dsa_plugin.ops import tilelang_kernels as tk
OUT = os.environ.get("OUT", ".")
from glm5_dsa_plugin.ops import _exp81  # written by make_exp81.py
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel,
       "exp81r240": functools.partial(_exp81.sparse_mla_bwd_ws_kernel, mma_regs=240, producer_regs=24),
       "exp81r232": functools.partial(_exp81.sparse_mla_bwd_ws_kernel, mma_regs=232, producer_regs=40)}
build(BWD, ((64, 1, False), (16, 4, False), (8, 8, False), (64, 1, True), (16, 4, True)))
res, path = new_result(), os.path.join(OUT, "exp81.json")
timed_rows(BWD, (("W2", 64), ("W1", 64), ("W2", 16), ("W2", 8)), res, path)
winner(BWD, res, {"exp81r232": "232,40", "exp81r240": "240,24"}, os.path.join(OUT, "exp81_winner"))
deterministic_rows(BWD, (("W2", 64), ("W2", 16)), res, path)
