"""Triton kernels of the lightning indexer, and which of them run here.

* :mod:`.masked_scores`: the indexer scores with the visibility mask fused in (or their top-k keys);
* :mod:`.slot_scores`: the differentiable scores at the selected slots, forward and backward;
* :mod:`.attention_target`: the head-summed attention probabilities at the selected slots;
* :mod:`.kl_rows`: the indexer's KL loss and its gradient, one row per program;
* :mod:`.radix_topk`: the top-k of wide fp32 score rows by radix select.

The exact PyTorch definitions of all of them live with the model (:mod:`glm5_dsa_plugin.model.indexer`);
these kernels are its fast path on CUDA. :func:`triton_available` says whether they may run,
:func:`runs_on` whether they take a tensor's work; :func:`disable` switches them off for the
process after a kernel failed (one warning, then the PyTorch path, which is exact too), which
:func:`call_or_none` does for its caller.
"""

from __future__ import annotations

import warnings

__all__ = ["call_or_none", "disable", "runs_on", "status", "triton_available"]

_STATE: dict[str, object] = {"ok": None, "why": "not checked yet"}


def triton_available() -> bool:
    """True when Triton imports and no indexer kernel has failed in this process."""
    if _STATE["ok"] is None:
        try:
            from . import masked_scores  # noqa: F401

            _STATE.update(ok=True, why="triton imports")
        except Exception as exc:  # noqa: BLE001 - no Triton: the PyTorch path is exact too
            _STATE.update(ok=False, why=f"triton does not import ({type(exc).__name__}: {exc})")
    return bool(_STATE["ok"])


def disable(exc: BaseException, stacklevel: int = 3) -> None:
    """Switch the indexer kernels off for this process after ``exc``; warns once."""
    if _STATE["ok"] is not False:
        warnings.warn(f"indexer Triton kernel unavailable ({type(exc).__name__}: {exc}); using the torch path",
                      RuntimeWarning, stacklevel=stacklevel)
    _STATE.update(ok=False, why=f"a kernel failed ({type(exc).__name__}: {exc})")


def runs_on(t) -> bool:
    """Whether the kernels take this tensor's work: it is on CUDA and they are not switched off."""
    return t.is_cuda and triton_available()


def call_or_none(kernel, *args, **kwargs):
    """``kernel(*args, **kwargs)``, or None (after one warning; the kernels are then off) if it cannot
    run here: the caller falls back to its exact PyTorch path."""
    try:
        return kernel(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a performance path
        disable(exc, stacklevel=4)
        return None


def status() -> str:
    """Which path the indexer takes on CUDA, and why (printed by ``doctor``)."""
    return ("triton" if triton_available() else "torch") + f": {_STATE['why']}"
