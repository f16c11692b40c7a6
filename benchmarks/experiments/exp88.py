"""exp88 (session 28, prepared, not run): v31's backward with the kv gathers issued by the MMA
warpgroups (``make_exp88.py``: each gathers the columns its own dQ GEMMs read, right after they
are done; the third warpgroup only drains) at 224 / 56 and 232 / 40 registers, exp89 (v31 with the
drain's keys read once per block) and exp90 (both; ``make_exp89.py``, which runs make_exp88.py,
writes exp89 and exp90) against the tree; 8 alternating rounds through TileLangBackend at W2 / W1
H64, W2 H16 / H8 (dq bitwise against the tree's), then deterministic mode at W2 H64 / H8 (bitwise
over 3 runs, 4 rounds). Run ``make_exp89.py`` from the repository root first."""
import functools, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import build, deterministic_rows, new_result, timed_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp88, _exp89, _exp90
OUT = os.environ.get("OUT", ".")
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel,
       "exp88": _exp88.sparse_mla_bwd_ws_kernel,
       "exp88r232": functools.partial(_exp88.sparse_mla_bwd_ws_kernel, mma_regs=232, producer_regs=40),
       "exp89": _exp89.sparse_mla_bwd_ws_kernel,
       "exp90": _exp90.sparse_mla_bwd_ws_kernel}
build(BWD, ((64, 1, False), (16, 4, False), (8, 8, False), (64, 1, True), (8, 8, True)))
res = new_result()
path = os.path.join(OUT, "exp88.json")
timed_rows(BWD, (("W2", 64), ("W1", 64), ("W2", 16), ("W2", 8)), res, path)
deterministic_rows(BWD, (("W2", 64), ("W2", 8)), res, path)
