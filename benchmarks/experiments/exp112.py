"""exp112 (session 32): the forward kernel's cycles and clocks under sustained load. exp109: the W1
H64 forward kernel takes 2.09 ms back to back after sustained load and 1.92 from a rested GPU;
exp108's single ncu launch took 1.82 ms at an SM clock of 1.70 GHz, about the clock exp71 read
from nvidia-smi during back-to-back loops. This tells clock from cycles: ``EXP112_LAUNCHES`` raw
launches of the tree's forward kernel (W1 or W2 H64, ``EXP112_WORKLOAD``) back to back, for
``ncu --clock-control none --cache-control none --launch-skip K --launch-count N`` with
one-pass metrics (duration, elapsed cycles and clock of the SM, L2 and DRAM domains), so the
profiled launches are launch K ... of the loop. Run from the repository root."""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import prepared_forward_inputs, raw_forward, workload  # noqa: E402

from glm5_dsa_plugin.ops import tilelang_kernels as tk  # noqa: E402

q, kv, idx, _ = workload(os.environ.get("EXP112_WORKLOAD", "W1"), 64, seed=41)
_, _, _, forward = raw_forward(tk.sparse_mla_fwd_ws_kernel, 64, 2048, prepared_forward_inputs(q, kv, idx), q)
for _ in range(int(os.environ.get("EXP112_LAUNCHES", "400"))):
    forward()
torch.cuda.synchronize()
