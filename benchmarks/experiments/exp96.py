"""exp96 (session 29): v32's drain with a relaxed free after the reads (``make_exp96.py``) against
the tree (v32); 8 alternating rounds through TileLangBackend at W2 / W1 H64, W2 H16 / H8 (dq
bitwise against the tree's), deterministic mode at W2 H64 (bitwise over 3 runs, 4 rounds), then
exp95's race check at W2 H64 for both (per kv row, the largest distance of 6 runs from their fp64
mean, relative to the row's norm). Run ``make_exp96.py`` from the repository root first."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import deterministic_rows, four_shapes, spread_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp96
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp96": _exp96.sparse_mla_bwd_ws_kernel}
res, path = four_shapes(BWD, "exp96", os.environ.get("OUT", "."), extra_configs=((64, 1, True),))
deterministic_rows(BWD, (("W2", 64),), res, path)
spread_rows(BWD, (("W2", 64),), res, path)
