"""exp104 (session 31): the drain's share of the chunks and its order (``make_exp104.py``: h3 / h5
warpgroup 0 computes 3 / 5 of d_v's eight chunks, o the drain takes warpgroup 1's chunk first, k
the drain reads its slot keys once per block). 8 alternating rounds through TileLangBackend at
W2 / W1 H64, W2 H16 / H8 against the tree (v32); the winner (dq bitwise, 1% or more faster at W2
and W1 H64) is named in ``$OUT/exp104_winner``. Run ``make_exp104.py`` from the repository root
first."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import four_shapes_with_gate
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp104h3, _exp104h5, _exp104k, _exp104o
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp104h3": _exp104h3.sparse_mla_bwd_ws_kernel,
       "exp104h5": _exp104h5.sparse_mla_bwd_ws_kernel, "exp104o": _exp104o.sparse_mla_bwd_ws_kernel,
       "exp104k": _exp104k.sparse_mla_bwd_ws_kernel}
four_shapes_with_gate(BWD, "exp104", os.environ.get("OUT", "."))
