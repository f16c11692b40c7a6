"""exp110 (session 32): the backward's gather lanes remapped against its shared-memory bank
conflicts (``make_exp110.py``; they did not move). 8 alternating rounds through TileLangBackend at
W2 / W1 H64, W2 H16 / H8 (below 64 heads the kernel is the tree's: controls) against the tree
(v32), then deterministic mode at W2 H64 (bitwise over 3 runs, 4 rounds); the gate's winner (dq
bitwise, 1% or more faster at W2 and W1 H64) is named in ``$OUT/exp110_winner``. Run
``make_exp110.py`` from the repository root first."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import four_shapes_with_gate
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp110
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp110": _exp110.sparse_mla_bwd_ws_kernel}
four_shapes_with_gate(BWD, "exp110", os.environ.get("OUT", "."), deterministic=(("W2", 64),))
