"""exp107 (session 31): the drain takes the chunks in the order they are staged
(``make_exp107.py``). 8 alternating rounds through TileLangBackend at W2 / W1 H64, W2 H16 / H8
against the tree (v32); the winner (dq bitwise, 1% or more faster at W2 and W1 H64) is named in
``$OUT/exp107_winner``. Run ``make_exp107.py`` from the repository root first."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import four_shapes_with_gate
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp107
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp107": _exp107.sparse_mla_bwd_ws_kernel}
four_shapes_with_gate(BWD, "exp107", os.environ.get("OUT", "."))
