"""Small memory-bound Triton kernels around the sparse-MLA call (no Megatron here).

* ``row_delta(out, grad_out)``: Delta [..., H] fp32 = sum_d out * grad_out, one pass over both
  tensors (the backward's preprocessing; the torch form materialised fp32 copies of both).
* ``flag_nonfinite(x, flags, slot)``: sets ``flags[slot] = 1`` (int32, device) when ``x`` holds a
  NaN or +-inf, with no host sync; several tensors share one flags buffer so a caller reads
  all of its checks with one small device-to-host copy.
* ``segment_sum_rows(contrib, keys, out, src)``: deterministic scatter-add (the deterministic
  backward's dKV reduction), one program per destination row, fixed summation order.
All run under ``TRITON_INTERPRET=1`` on CPU (how CI tests them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_delta_kernel(O, G, OUT, n_rows, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    o = tl.load(O + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + rows, tl.sum(o * g, axis=1), mask=rows < n_rows)


def row_delta(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """out, grad_out [..., D] (same shape) -> fp32 [...] = sum over the last dim of out * grad_out."""
    if out.shape != grad_out.shape:
        raise ValueError(f"row_delta: out {tuple(out.shape)} vs grad_out {tuple(grad_out.shape)}")
    o, g = out.contiguous(), grad_out.contiguous()
    D = o.shape[-1]
    n_rows = o.numel() // max(D, 1)
    res = torch.empty(o.shape[:-1], dtype=torch.float32, device=o.device)
    if n_rows == 0:
        return res
    BD = triton.next_power_of_2(D)
    BR = max(1, 4096 // BD)
    _row_delta_kernel[(triton.cdiv(n_rows, BR),)](o, g, res, n_rows, D=D, BD=BD, BR=BR)
    return res


@triton.jit
def _nonfinite_kernel(X, n, FLAGS, slot, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    bad = tl.max(((x - x) != 0).to(tl.int32), axis=0)  # x - x is NaN exactly for NaN and +-inf
    if bad > 0:
        tl.atomic_max(FLAGS + slot, 1)


def flag_nonfinite(x: torch.Tensor, flags: torch.Tensor, slot: int, block: int = 8192) -> None:
    """Set ``flags[slot] = 1`` if ``x`` (any float dtype, contiguous) holds NaN/inf; no host sync."""
    if flags.dtype != torch.int32:
        raise ValueError("flags must be int32")
    if not x.is_contiguous():
        x = x.contiguous()
    n = x.numel()
    if n:
        _nonfinite_kernel[(triton.cdiv(n, block),)](x.view(-1), n, flags, slot, BLOCK=block)


@triton.jit
def _segment_sum_kernel(C, SRC, SEG_START, SEG_ROW, OUT, D: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr):
    seg = tl.program_id(0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < D
    start = tl.load(SEG_START + seg)
    end = tl.load(SEG_START + seg + 1)
    acc = tl.zeros([BD], dtype=tl.float32)
    p0 = start
    while p0 < end:  # (a while loop: Triton's CPU interpreter cannot run range() over loaded bounds)
        p = p0 + tl.arange(0, BP)
        pmask = p < end
        src = tl.load(SRC + p, mask=pmask, other=0)
        x = tl.load(C + src[:, None] * D + cols[None, :], mask=pmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.sum(x, axis=0)
        p0 += BP
    row = tl.load(SEG_ROW + seg)
    optr = OUT + row * D + cols
    tl.store(optr, tl.load(optr, mask=cmask, other=0.0) + acc, mask=cmask)


def segment_sum_rows(contrib: torch.Tensor, keys: torch.Tensor, out: torch.Tensor,
                     src: torch.Tensor | None = None, block_p: int = 16) -> None:
    """Deterministic scatter-add: ``out[keys[i]] += contrib[src[i]]`` for every i (src defaults to i).

    contrib [N, D] fp32, keys / src [M] int64, out [R, D] fp32. Entries are grouped by key with a
    stable sort and each key's group is summed by one program in position order (blocks of
    ``block_p`` rows reduced by a fixed tree): bitwise identical from run to run, unlike
    atomics. No two programs write the same row of ``out``."""
    if keys.numel() == 0:
        return
    D = contrib.shape[1]
    sorted_keys, order = torch.sort(keys, stable=True)
    src = order if src is None else src[order]
    seg_rows, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    seg_start = torch.zeros(seg_rows.numel() + 1, dtype=torch.int64, device=keys.device)
    torch.cumsum(counts, 0, out=seg_start[1:])
    BD = 64
    grid = (seg_rows.numel(), triton.cdiv(D, BD))
    _segment_sum_kernel[grid](contrib.contiguous(), src, seg_start, seg_rows, out, D=D, BP=block_p, BD=BD)
