"""exp105 (session 31): warpgroup 1 adds its rope-tail chunk to dKV itself (``make_exp105.py``: a
with the slot keys read before the tail's GEMM, b after its staging). 8 alternating rounds through
TileLangBackend at W2 / W1 H64, W2 H16 / H8 against the tree (v32); the winner (dq bitwise, 1% or
more faster at W2 and W1 H64) is named in ``$OUT/exp105_winner``. Run ``make_exp105.py`` from the
repository root first."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import four_shapes_with_gate
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp105a, _exp105b
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp105a": _exp105a.sparse_mla_bwd_ws_kernel,
       "exp105b": _exp105b.sparse_mla_bwd_ws_kernel}
four_shapes_with_gate(BWD, "exp105", os.environ.get("OUT", "."))
