"""exp94 (session 29): v31's drain frees each chunk buffer before it issues the chunk's atomics
(``make_exp94.py``) against the tree; 8 alternating rounds through TileLangBackend at W2 / W1 H64,
W2 H16 / H8 (dq bitwise against the tree's), then deterministic mode at W2 H64 / H8 (bitwise over
3 runs, 4 rounds). Run ``make_exp94.py`` from the repository root first."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import build, deterministic_rows, new_result, timed_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp94
OUT = os.environ.get("OUT", ".")
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp94": _exp94.sparse_mla_bwd_ws_kernel}
build(BWD, ((64, 1, False), (16, 4, False), (8, 8, False), (64, 1, True), (8, 8, True)))
res = new_result()
path = os.path.join(OUT, "exp94.json")
timed_rows(BWD, (("W2", 64), ("W1", 64), ("W2", 16), ("W2", 8)), res, path)
deterministic_rows(BWD, (("W2", 64), ("W2", 8)), res, path)
