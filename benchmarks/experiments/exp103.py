"""exp103 (session 31): warpgroup 0 defers its last chunk of each block into the next block
(``make_exp103.py``: a after the scores' exp2, b behind the score GEMM with the first block peeled,
p the tree peeled). 8 alternating rounds through TileLangBackend at W2 / W1 H64, W2 H16 / H8
against the tree (v32); the winner (dq bitwise, 1% or more faster at W2 and W1 H64) is named in
``$OUT/exp103_winner``. Run ``make_exp103.py`` from the repository root first."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import four_shapes_with_gate
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp103a, _exp103b, _exp103p
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp103a": _exp103a.sparse_mla_bwd_ws_kernel,
       "exp103b": _exp103b.sparse_mla_bwd_ws_kernel, "exp103p": _exp103p.sparse_mla_bwd_ws_kernel}
four_shapes_with_gate(BWD, "exp103", os.environ.get("OUT", "."), candidates=["exp103a", "exp103b"])
