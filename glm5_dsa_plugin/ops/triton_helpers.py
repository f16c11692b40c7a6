"""Small memory-bound Triton kernels around the sparse-MLA call (no Megatron here).

* ``row_delta(out, grad_out)``: Delta [..., H] fp32 = sum_d out * grad_out, one pass over both
  tensors (the backward's preprocessing; the torch form materialised fp32 copies of both).
* ``flag_nonfinite(x, flags, slot)``: sets ``flags[slot] = 1`` (int32, device) when ``x`` holds a
  NaN or +-inf, with no host sync; several tensors share one flags buffer so a caller reads
  all of its checks with one small device-to-host copy.
Both run under ``TRITON_INTERPRET=1`` on CPU (how CI tests them).
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
