"""exp96 (session 29): v32's drain with a relaxed free after the reads (``make_exp96.py``) against
the tree (v32); 8 alternating rounds through TileLangBackend at W2 / W1 H64, W2 H16 / H8 (dq
bitwise against the tree's), deterministic mode at W2 H64 (bitwise over 3 runs, 4 rounds), then
exp95's race check at W2 H64 for both (per kv row, the largest distance of 6 runs from their fp64
mean, relative to the row's norm). Run ``make_exp96.py`` from the repository root first."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import build, deterministic_rows, new_result, timed_rows, spread_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp96
OUT = os.environ.get("OUT", ".")
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp96": _exp96.sparse_mla_bwd_ws_kernel}
build(BWD, ((64, 1, False), (16, 4, False), (8, 8, False), (64, 1, True)))
res = new_result()
path = os.path.join(OUT, "exp96.json")
timed_rows(BWD, (("W2", 64), ("W1", 64), ("W2", 16), ("W2", 8)), res, path)
deterministic_rows(BWD, (("W2", 64),), res, path)
spread_rows(BWD, (("W2", 64),), res, path)
