"""exp97 / exp98 (session 29, prepared, not run): exp96's two changes apart (``make_exp97.py``):
v32 (tree), exp96 (relaxed free, count from the reads), exp97 (relaxed free, no dependency: timing
only), exp98 (exp96's asm block with release semantics); 8 alternating rounds through
TileLangBackend at W2 / W1 H64, W2 H16 / H8 (dq bitwise against the tree's), then exp95's race
check at W2 H64 for each (per kv row, the largest distance of 6 runs from their fp64 mean,
relative to the row's norm). Run ``make_exp97.py`` from the repository root first."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import four_shapes, spread_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp96, _exp97, _exp98
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp96": _exp96.sparse_mla_bwd_ws_kernel,
       "exp97": _exp97.sparse_mla_bwd_ws_kernel, "exp98": _exp98.sparse_mla_bwd_ws_kernel}
res, path = four_shapes(BWD, "exp97", os.environ.get("OUT", "."))
spread_rows(BWD, (("W2", 64),), res, path)
