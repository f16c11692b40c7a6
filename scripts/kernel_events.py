"""The GPU kernels of a few calls of a step, for the benchmarks' idle and kernel-time figures, and
their split by kernel group (``kernel_split``)."""

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


# groups of the in-layer kernel split (``--breakdown`` on a GPU): (group, exact kernel names, name
# fragments); the first group that matches takes a kernel, the rest is "glue" (elementwise, copies,
# concatenations, fills, reductions)
KERNEL_GROUPS = (
    ("sparse_mla_forward", ("fwd_kernel",), ()),
    ("sparse_mla_backward", ("bwd_kernel",), ()),
    ("sparse_mla_passes", ("_prepare_indices_kernel", "_finish_backward_kernel", "_head_prob_sum_kernel",
                           "_segment_sum_kernel", "_check_forward_kernel", "_nonfinite_kernel"),
     ("_mark_bad_", "_repair_", "_write_bad_kv_rows")),
    ("indexer_scores", ("_index_scores_kernel",), ()),
    ("topk_select", ("_radix_select_kernel",), ("topk", "TopK", "Sort", "sort")),
    ("indexer_loss", ("_slot_scores_fwd_kernel", "_slot_scores_bwd_kernel", "_kl_rows_kernel"), ()),
    ("gemm", (), ("nvjet", "gemm", "cutlass", "xmma", "splitKreduce")),
    ("norms", (), ("layer_norm", "rms_norm", "GammaBeta", "RowwiseMoments")),
)


def kernel_group(name: str) -> str:
    """The :data:`KERNEL_GROUPS` group of a GPU kernel's name, else ``"glue"``."""
    for group, exact, fragments in KERNEL_GROUPS:
        if name in exact or any(f in name for f in fragments):
            return group
    return "glue"


def kernel_split(step, steps: int = 2) -> dict:
    """GPU kernel time of one ``step()`` inside the layer, ms per :func:`kernel_group` group (torch
    profiler over ``steps`` steps after one unprofiled step), with ``busy`` (all kernels) and ``span``
    (first kernel's start to last kernel's end, per step)."""
    kernels = kernel_events(step, steps)
    out = {group: 0.0 for group, _, _ in KERNEL_GROUPS} | {"glue": 0.0}
    for start, end, name in kernels:
        out[kernel_group(name)] += (end - start) / 1e3 / steps
    out["busy"] = sum(out.values())
    if kernels:
        out["span"] = (max(end for _, end, _ in kernels) - kernels[0][0]) / 1e3 / steps
    return out
