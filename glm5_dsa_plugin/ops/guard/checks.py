"""The guard's checks of a call's outputs: device-side, into a flag slot, without a host sync
(Triton on CUDA; plain torch elsewhere, for fault-injection tests on CPU), and the host-side
masks of bad rows."""

from __future__ import annotations

import torch

from ..contract import EMPTY_ROW_LSE
from . import slots
from .slots import Flag

__all__ = ["flag_nonfinite", "check_forward", "all_finite", "bad_rows"]


def flag_nonfinite(flags: torch.Tensor, slot: int, a: torch.Tensor, b: torch.Tensor | None = None) -> None:
    """flags[slot] becomes nonzero if a (or b) holds NaN/inf; one pass over both."""
    if a.is_cuda:
        from .device_checks import flag_nonfinite as flag_on_device

        flag_on_device(a, flags, slot, b)
        return
    for t in (a,) if b is None else (a, b):
        flags[slot : slot + 1] += (~torch.isfinite(t)).any().to(torch.int32)


def check_forward(flags: torch.Tensor, slot: int, out: torch.Tensor, lse: torch.Tensor, gate: int,
                  lse_bound: float, extent: torch.Tensor | None) -> None:
    """The forward check for a backend with ``finite_out_lse_bound`` (``guard.device_checks.check_forward``):
    lse (contiguous, written in place) of the rows the backend does not vouch for (|lse| >
    ``lse_bound`` other than EMPTY_ROW_LSE; EMPTY_ROW_LSE on a row whose ``extent`` [B, T, G] is
    > 0) becomes NaN, and flags[slot] becomes nonzero when such a row exists, lse is NaN / inf, or
    (read only when flags[gate] is set) out is."""
    hg = lse.shape[-1] // extent.shape[-1] if extent is not None else 1
    if out.is_cuda:
        from .device_checks import check_forward as check_on_device

        check_on_device(out, lse, flags, slot, gate, lse_bound, EMPTY_ROW_LSE, extent, hg)
        return
    rows = lse.view(-1)
    doubtful = (rows.abs() > lse_bound) & (rows != EMPTY_ROW_LSE)
    if extent is not None:
        doubtful |= (rows == EMPTY_ROW_LSE) & (extent.reshape(-1).repeat_interleave(hg) > 0)
    bad = (~torch.isfinite(rows)).any() | doubtful.any()
    if bool(flags[gate] != 0):
        bad |= (~torch.isfinite(out)).any()
    rows[doubtful] = float("nan")
    flags[slot : slot + 1] += bad.to(torch.int32)


def all_finite(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b hold no NaN / inf (one host read)."""
    flags = slots.new_flags(a.device)
    flag_nonfinite(flags, Flag.NONFINITE, a, b)
    return not slots.read(flags)[Flag.NONFINITE]


def bad_rows(t: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> bool [B, T]: rows with any nonfinite entry."""
    return ~torch.isfinite(t).flatten(2).all(-1)
