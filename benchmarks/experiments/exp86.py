"""exp86 (session 28): exp84 (the dKV^T chunks software-pipelined), exp85 (+ the first chunk issued
behind the dQ GEMMs) and exp86 (+ warpgroup 0's next score GEMM before the step-end barrier) at
224 / 56 registers (exp86 also at 232 / 40) against the tree (216 / 72); 8 alternating rounds
through TileLangBackend at W2 / W1 H64, W2 H16 / H8 (row groups), dq bitwise against the tree's;
then deterministic mode at W2 H64 / H8 (each bitwise over 3 runs, 4 rounds)."""
import functools, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pairs_ab import build, deterministic_rows, new_result, timed_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp84, _exp85, _exp86
OUT = os.environ.get("OUT", ".")
R224 = dict(mma_regs=224, producer_regs=56)
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel,
       "exp84": functools.partial(_exp84.sparse_mla_bwd_ws_kernel, **R224),
       "exp85": functools.partial(_exp85.sparse_mla_bwd_ws_kernel, **R224),
       "exp86": functools.partial(_exp86.sparse_mla_bwd_ws_kernel, **R224),
       "exp86r232": functools.partial(_exp86.sparse_mla_bwd_ws_kernel, mma_regs=232, producer_regs=40)}
build(BWD, ((64, 1, False), (16, 4, False), (8, 8, False), (64, 1, True), (8, 8, True)))
res = new_result()
path = os.path.join(OUT, "exp86.json")
timed_rows(BWD, (("W2", 64), ("W1", 64), ("W2", 16), ("W2", 8)), res, path)
deterministic_rows({k: BWD[k] for k in ("tree", "exp85", "exp86")}, (("W2", 64), ("W2", 8)), res, path)
