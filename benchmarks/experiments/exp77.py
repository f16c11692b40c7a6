"""exp77 (session 27): exp77_kernel's backward (dKV per pair of 32-slot blocks as [64 slots, 64
features] chunks, added with 8-byte atomics from the MMA registers; no chunk staging, no drain)
against the tree's, through TileLangBackend with the builder patched in turn, 8 alternating rounds:
W2 / W1 H64, W2 H16 (R = 4), W2 H8 (R = 8). dq must be bitwise equal to the tree's; dkv sums its
atomics in another order (relative difference reported). Then deterministic mode at W2 H64 and
H16: bitwise over 3 runs, dkv against the tree's deterministic dkv, and the time."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import build, deterministic_rows, new_result, timed_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
OUT = os.environ.get("OUT", ".")
import exp77_kernel
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp77": exp77_kernel.sparse_mla_bwd_ws_kernel}
build(BWD, ((64, 1, False), (16, 4, False), (8, 8, False), (64, 1, True), (16, 4, True)))
res, path = new_result(), os.path.join(OUT, "exp77.json")
timed_rows(BWD, (("W2", 64), ("W1", 64), ("W2", 16), ("W2", 8)), res, path)
deterministic_rows(BWD, (("W2", 64), ("W2", 16)), res, path)
