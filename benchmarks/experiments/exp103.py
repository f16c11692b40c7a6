"""exp103 (session 31): warpgroup 0 defers its last chunk of each block into the next block
(``make_exp103.py``: a after the scores' exp2, b behind the score GEMM with the first block peeled,
p the tree peeled). 8 alternating rounds through TileLangBackend at W2 / W1 H64, W2 H16 / H8
against the tree (v32); the winner (dq bitwise, 1% or more faster at W2 and W1 H64) is named in
``$OUT/exp103_winner``. Run ``make_exp103.py`` from the repository root first."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import build, new_result, timed_rows, winner
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp103a, _exp103b, _exp103p
OUT = os.environ.get("OUT", ".")
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp103a": _exp103a.sparse_mla_bwd_ws_kernel,
       "exp103b": _exp103b.sparse_mla_bwd_ws_kernel, "exp103p": _exp103p.sparse_mla_bwd_ws_kernel}
build(BWD, ((64, 1, False), (16, 4, False), (8, 8, False)))
res = new_result()
path = os.path.join(OUT, "exp103.json")
timed_rows(BWD, (("W2", 64), ("W1", 64), ("W2", 16), ("W2", 8)), res, path)
winner(BWD, res, {"exp103a": "exp103a", "exp103b": "exp103b"}, os.path.join(OUT, "exp103_winner"))
