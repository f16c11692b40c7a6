"""Deterministic scatter-add of rows (no Megatron here).

``segment_sum_rows(contrib, keys, out, src)``: one program per destination row, summing its
contributions in a fixed order, so the result is bitwise reproducible. The deterministic sparse-MLA
backward's dKV and the deterministic indexer backward's dk both reduce through it. Runs under
``TRITON_INTERPRET=1`` on CPU (how CI tests it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["segment_sum_rows"]


@triton.jit
def _segment_sum_kernel(C, SRC, SEG_START, SEG_ROW, OUT, D: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr):
    """Program (seg, c): OUT[SEG_ROW[seg], c*BD : (c+1)*BD] += the sum of C[SRC[p]] over the segment's
    positions p in [SEG_START[seg], SEG_START[seg + 1]), BP positions at a time in position order
    (each block reduced by a fixed tree). An empty segment leaves its row unread and unwritten."""
    seg = tl.program_id(0)
    start = tl.load(SEG_START + seg)
    end = tl.load(SEG_START + seg + 1)
    if end > start:
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        cmask = cols < D
        acc = tl.zeros([BD], dtype=tl.float32)
        p = start + tl.arange(0, BP)
        src = tl.load(SRC + p, mask=p < end, other=0)
        p0 = start
        while p0 < end:  # (a while loop: Triton's CPU interpreter cannot run range() over loaded bounds)
            pmask = p0 + tl.arange(0, BP) < end
            x = tl.load(C + src[:, None].to(tl.int64) * D + cols[None, :], mask=pmask[:, None] & cmask[None, :],
                        other=0.0)
            p0 += BP
            p = p0 + tl.arange(0, BP)
            src = tl.load(SRC + p, mask=p < end, other=0)  # the next block's rows, read under this one's
            acc += tl.sum(x, axis=0)
        optr = OUT + tl.load(SEG_ROW + seg) * D + cols
        tl.store(optr, tl.load(optr, mask=cmask, other=0.0) + acc, mask=cmask)


def segment_sum_rows(contrib: torch.Tensor, keys: torch.Tensor, out: torch.Tensor,
                     src: torch.Tensor | None = None, block_p: int = 8, n_keys: int | None = None,
                     block_d: int | None = None, num_warps: int = 4) -> None:
    """Deterministic scatter-add: ``out[keys[i]] += contrib[src[i]]`` for every i (src defaults to i).

    contrib [N, D] fp32, keys / src [M] int32 or int64, out [R, D] fp32. Entries are grouped by key
    with a stable sort and each key's group is summed by one program in position order (blocks of
    ``block_p`` rows reduced by a fixed tree): bitwise identical from run to run, unlike
    atomics. No two programs write the same row of ``out``; rows no entry names are not touched.
    ``block_d`` columns per program (default: all D, so each entry's row is read whole, 2304 B at
    D = 576). The bits follow ``block_p``, ``block_d`` and ``num_warps`` (the reduction tree).
    ``n_keys`` (= R): no host sync (one program per row of ``out``, segments found by
    ``searchsorted``), and entries whose key is outside [0, ``n_keys``) (e.g. the sentinel
    ``n_keys``, or -1 padding) are dropped (their contrib rows are never read). Without it the segments come from ``unique_consecutive``, which waits for
    the device."""
    if keys.numel() == 0:
        return
    D = contrib.shape[1]
    sorted_keys, order = torch.sort(keys, stable=True)  # (int32 keys: half the radix passes of int64)
    src = order if src is None else src[order]
    if n_keys is not None:
        if n_keys != out.shape[0]:
            raise ValueError(f"segment_sum_rows: n_keys={n_keys} but out has {out.shape[0]} rows")
        seg_rows = torch.arange(n_keys + 1, dtype=keys.dtype, device=keys.device)
        seg_start = torch.searchsorted(sorted_keys, seg_rows)
        seg_rows = seg_rows[:n_keys]
    else:
        seg_rows, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
        seg_start = torch.zeros(seg_rows.numel() + 1, dtype=torch.int64, device=keys.device)
        torch.cumsum(counts, 0, out=seg_start[1:])
    BD = triton.next_power_of_2(D) if block_d is None else block_d
    grid = (seg_rows.numel(), triton.cdiv(D, BD))
    _segment_sum_kernel[grid](contrib.contiguous(), src, seg_start, seg_rows, out, D=D, BP=block_p, BD=BD,
                              num_warps=num_warps)
