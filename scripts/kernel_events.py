"""The GPU kernels of a few calls of a step, for the benchmarks' idle and kernel-time figures."""

from __future__ import annotations

import torch


def kernel_events(step, calls: int) -> list[tuple[float, float, str]]:
    """(start us, end us, kernel name) of every GPU kernel of ``calls`` calls of ``step`` under
    torch.profiler, after one unprofiled call; sorted by start."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)
