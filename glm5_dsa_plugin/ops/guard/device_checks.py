"""Device-side finiteness checks of the guard: one launch, no host sync (no Megatron here).

* ``flag_nonfinite(x, flags, slot, y=None)``: sets ``flags[slot] = 1`` (int32, device) when ``x``
  (or ``y``) holds a NaN or +-inf; several checks share one flags buffer so a caller reads all of
  them with one small device-to-host copy.
* ``check_forward(out, lse, flags, slot, gate, lse_bound, empty_lse, extent)``: the same for a
  forward's outputs from a backend that vouches for its rows within a bound: lse read always,
  out only when ``flags[gate]`` is set; rows outside the bound get lse NaN (and the flag).

``_has_nonfinite`` / ``_any_nonfinite`` are the Triton helpers the other device passes reuse.
All run under ``TRITON_INTERPRET=1`` on CPU (how CI tests them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["check_forward", "flag_nonfinite"]


@triton.jit
def _has_nonfinite(x):
    y = x.to(tl.float32)
    return tl.max(((y - y) != 0).to(tl.int32), axis=0)  # y - y is NaN exactly for NaN and +-inf


@triton.jit
def _any_nonfinite(X, start, n, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    return _has_nonfinite(tl.load(X + offs, mask=offs < n, other=0.0))


@triton.jit
def _nonfinite_kernel(X, nx, Y, ny, FLAGS, slot, BLOCK: tl.constexpr):
    """Programs [0, cdiv(nx, BLOCK)) scan X, the rest scan Y (one launch for two tensors)."""
    pid = tl.program_id(0).to(tl.int64)
    nbx = tl.cdiv(nx, BLOCK)
    if pid < nbx:
        bad = _any_nonfinite(X, pid * BLOCK, nx, BLOCK)
    else:
        bad = _any_nonfinite(Y, (pid - nbx) * BLOCK, ny, BLOCK)
    if bad > 0:
        tl.atomic_max(FLAGS + slot, 1)


def flag_nonfinite(x: torch.Tensor, flags: torch.Tensor, slot: int, y: torch.Tensor | None = None,
                   block: int = 8192) -> None:
    """Set ``flags[slot] = 1`` if ``x`` (or ``y``; any float dtypes) holds NaN/inf; one launch, no host sync."""
    if flags.dtype != torch.int32:
        raise ValueError("flags must be int32")
    x = x.contiguous()
    y = x[:0] if y is None else y.contiguous()
    nx, ny = x.numel(), y.numel()
    grid = triton.cdiv(nx, block) + triton.cdiv(ny, block)
    if grid:
        _nonfinite_kernel[(grid,)](x.view(-1), nx, y.view(-1) if ny else x.view(-1), ny, flags, slot, BLOCK=block)


@triton.jit
def _check_forward_kernel(LSE, n_rows, OUT, row_len, FLAGS, slot, gate, lse_bound, empty_lse, EXT, heads_per_group,
                          WITH_EXT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Program p: lse rows [p * ROWS, (p + 1) * ROWS). Doubtful rows (|lse| > lse_bound other than
    exactly empty_lse; with WITH_EXT also empty_lse where EXT[row // heads_per_group] > 0) get lse
    NaN; FLAGS[slot] = 1 when a row is doubtful or nonfinite, or, only read when FLAGS[gate] is
    set (written earlier on the stream), when the chunk's out entries (row_len per row) are."""
    r0 = tl.program_id(0).to(tl.int64) * ROWS
    rows = r0 + tl.arange(0, ROWS)
    in_range = rows < n_rows
    lse = tl.load(LSE + rows, mask=in_range, other=0.0)
    doubtful = (tl.abs(lse) > lse_bound) & (lse != empty_lse)  # (NaN compares false: it is bad below)
    if WITH_EXT:
        ext = tl.load(EXT + rows // heads_per_group, mask=in_range & (lse == empty_lse), other=0)
        doubtful = doubtful | ((lse == empty_lse) & (ext > 0))
    doubtful = doubtful & in_range
    tl.store(LSE + rows, tl.full([ROWS], float("nan"), tl.float32), mask=doubtful)
    bad = tl.maximum(tl.max(((lse - lse) != 0).to(tl.int32), axis=0), tl.max(doubtful.to(tl.int32), axis=0))
    if (tl.load(FLAGS + gate) > 0) & (bad == 0):
        end = tl.minimum(r0 + ROWS, n_rows) * row_len
        start = r0 * row_len
        while start < end:  # (a while loop: the CPU interpreter runs it too)
            bad = tl.maximum(bad, _any_nonfinite(OUT, start, end, BLOCK))
            start += BLOCK
    if bad > 0:
        tl.atomic_max(FLAGS + slot, 1)


def check_forward(out: torch.Tensor, lse: torch.Tensor, flags: torch.Tensor, slot: int, gate: int,
                  lse_bound: float, empty_lse: float, extent: torch.Tensor | None = None, heads_per_group: int = 1,
                  rows: int = 1024, block: int = 4096) -> None:
    """The guard's forward check for a backend that vouches for its rows within a bound
    (``TileLangBackend.finite_out_lse_bound``): reads lse [...] (fp32, contiguous: written in
    place) and out [..., d_v] only where it must. A row is doubtful when its lse is larger than
    ``lse_bound`` in magnitude (other than exactly ``empty_lse``) or, with ``extent`` (int32,
    one entry per ``heads_per_group`` consecutive lse rows: > 0 when that query row has a valid
    slot), when it came out empty although it has a valid slot; a doubtful row's lse becomes NaN,
    so the guard's repair recomputes it. ``flags[slot] = 1`` when some row is doubtful, some lse
    is NaN / inf, or, read only when ``flags[gate]`` is nonzero by the time the launch runs, out
    is (in chunks of ``rows`` rows: a doubtful or nonfinite lse skips its chunk's read). The
    backend's promise makes this flag set whenever ``flag_nonfinite(out, ..., lse)``'s would be,
    from a read of lse alone (1 / d_v of out's entries) while the gate is clear. One launch, no
    host sync."""
    if flags.dtype != torch.int32 or not 0 <= gate < flags.numel() or not 0 <= slot < flags.numel():
        raise ValueError(f"check_forward: int32 flags with slots {slot} and {gate} expected")
    if lse.dtype != torch.float32 or not lse.is_contiguous() or out.shape[:-1] != lse.shape:
        raise ValueError(f"check_forward: contiguous fp32 lse {tuple(lse.shape)} with out {tuple(out.shape)} "
                         "[..., d_v] expected")
    if extent is not None and (extent.dtype != torch.int32 or extent.numel() * heads_per_group != lse.numel()):
        raise ValueError(f"check_forward: int32 extent with {lse.numel()} / {heads_per_group} entries expected, "
                         f"got {extent.dtype} {tuple(extent.shape)}")
    out = out.contiguous()
    n_rows = lse.numel()
    if n_rows:
        ext = lse if extent is None else extent.contiguous().view(-1)
        _check_forward_kernel[(triton.cdiv(n_rows, rows),)](lse.view(-1), n_rows, out.view(-1), out.shape[-1], flags,
                                                             slot, gate, float(lse_bound), float(empty_lse), ext,
                                                             heads_per_group, WITH_EXT=extent is not None, ROWS=rows,
                                                             BLOCK=block)
