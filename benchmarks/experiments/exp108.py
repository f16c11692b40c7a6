"""exp108 (session 32): the hardware counters of v32's kernels, to test session 31's reading that
the backward's step is paced by shared-memory traffic. One forward and one backward through
TileLangBackend per workload (W2 H64, then W1 H64) inside ``cudaProfilerStart / Stop``, after two
untimed warm-up calls (the builds). Run under Nsight Compute from the repository root, e.g.

    ncu --profile-from-start off --clock-control none -k regex:'^(fwd|bwd)_kernel' \\
        --section SpeedOfLight ... python3 benchmarks/experiments/exp108.py

(``.gpu``'s call script ran it twice: the sections, then the explicit metrics ``ncu
--query-metrics`` lists). Prints the workloads' step and block counts, which turn counter totals
into per-step figures. ``EXP108_WORKLOADS`` (default ``W2,W1``) picks the workloads."""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, workload  # noqa: E402

from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend  # noqa: E402

for wl in os.environ.get("EXP108_WORKLOADS", "W2,W1").split(","):
    q, kv, idx, g = workload(wl, 64, seed=41)
    valid = (idx >= 0) & (idx < kv.shape[1])  # [1, T, 1, topk]
    # the backward steps 32 slots, the forward 64-slot blocks, both up to each row's last valid slot
    last = torch.where(valid, torch.arange(idx.shape[-1], device="cuda") + 1, 0).amax(-1)
    print(f"{wl} H64: valid slots {int(valid.sum())}, backward steps {int(((last + 31) // 32).sum())}, "
          f"forward blocks {int(((last + 63) // 64).sum())}", flush=True)
    be = TileLangBackend()
    for _ in range(2):
        out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
        be.backward_saved(q, saved, out, lse, g, SCALE, DV)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
    be.backward_saved(q, saved, out, lse, g, SCALE, DV)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
