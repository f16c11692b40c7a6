"""The interface every sparse-MLA backend implements (registered in :mod:`.backends`)."""

from __future__ import annotations

import torch

from .contract import Problem

__all__ = ["Backend"]


class Backend:
    """A sparse-MLA implementation, registered under its ``name`` with :func:`register_backend`.

    A backend implements :meth:`available`, :meth:`forward` and :meth:`backward` (tensors in the
    layout of ``contract.py``: q [B, T, H, Dqk], kv [B, T_kv, G, Dqk], indices [B, T, G, topk]
    int32). Every method receives the call's :class:`~.contract.Problem` ``prob`` (sizes and
    ``prob.sm_scale``, a float), built once by ``contract.canonicalize``: a backend reads sizes
    and the scale from it instead of re-reading shapes or re-casting the scale. Everything else is
    an optional capability; the defaults here describe a backend without it, and the op and the
    guard call these members without probing for them.
    """

    name: str = ""
    #: True when no index value can make the kernels touch memory out of bounds. The backend
    #: then receives ``forward(..., index_flag=f)`` (int32 [1] on the device, zero) and must make
    #: ``f`` nonzero, without a host sync, when some index lies outside {-1} U [0, T_kv): the guard
    #: reads it after the kernel, with its own flags, instead of validating before the call.
    memory_safe_on_any_index: bool = False
    #: True when :meth:`backward_saved` takes ``nonfinite_flag`` (int32 [1]) and sets it when dq or
    #: dkv holds NaN / inf, so the guard makes no finiteness pass of its own over them.
    reports_nonfinite: bool = False

    def available(self) -> tuple[bool, str]:
        """(usable here, the reason)."""
        raise NotImplementedError

    def forward(self, q, kv, indices, prob: Problem, **flags):
        """-> (out [B, T, H, d_v], lse [B, T, H] fp32). ``flags``: ``index_flag`` (see
        :attr:`memory_safe_on_any_index`), ``kv_flag`` (see :meth:`finite_out_lse_bound`)."""
        raise NotImplementedError

    def backward(self, q, kv, indices, out, lse, grad_out, prob: Problem):
        """-> (dq, dkv) in the dtypes of q and kv."""
        raise NotImplementedError

    def forward_saving(self, q, kv, indices, prob: Problem, **flags):
        """-> (out, lse, saved): ``saved``, a tuple of tensors, is what autograd keeps in place of
        (kv, indices) for :meth:`backward_saved`. A backend that prepares its inputs (e.g.
        rewritten indices) once per call keeps them here; the default keeps (kv, indices)."""
        out, lse = self.forward(q, kv, indices, prob, **flags)
        return out, lse, (kv, indices)

    def backward_saved(self, q, saved, out, lse, grad_out, prob: Problem, nonfinite_flag=None):
        """-> (dq, dkv) from :meth:`forward_saving`'s ``saved``; ``nonfinite_flag`` only when
        :attr:`reports_nonfinite`; ``head_probs`` only where :meth:`head_probs_in_backward`."""
        return self.backward(q, *saved, out, lse, grad_out, prob)

    def head_probs_in_backward(self, saved: tuple, prob: Problem) -> bool:
        """Whether :meth:`backward_saved` also takes ``head_probs`` (fp32 [B, T, G, topk],
        zero-filled) for this call and fills it with each slot's attention probabilities summed
        over the group's heads, as part of the backward (``op.SlotProbsGrad``). The default: no;
        the op then computes them after the backward."""
        return False

    def originals(self, saved: tuple, prob: Problem):
        """(kv, indices) of the call that returned ``saved``, as the caller passed them (the
        guard's reference repair and dumps read these)."""
        return saved[0], saved[1]

    def padded_views(self, saved: tuple, prob: Problem):
        """(kv, indices) as views of ``saved`` without a copy, where a slot is valid iff
        0 <= index < T_kv (the guard's device-side repair reads these on every backward)."""
        return self.originals(saved, prob)

    def finite_out_lse_bound(self, prob: Problem) -> float | None:
        """None, or a bound B with which :meth:`forward_saving` also takes ``kv_flag`` (int32 [1])
        and sets it when kv is suspect. While that flag is clear, B promises that a row is finite
        and exact when its lse is finite with |lse| <= B, or when it is empty (EMPTY_ROW_LSE) with
        :meth:`row_extent` 0: the guard then reads only lse (and out when the flag is set) and
        recomputes the other rows."""
        return None

    def row_extent(self, saved: tuple):
        """int32 [B, T, G]: 1 + the position of each row's last valid slot, 0 for a row without one
        (needed with :meth:`finite_out_lse_bound`)."""
        raise NotImplementedError(f"backend {self.name!r} has a finite_out_lse_bound but no row_extent")

    def saved_bytes(self, prob: Problem, itemsize: int) -> dict[str, int]:
        """Bytes of the tensors :meth:`forward_saving` keeps for the backward (its ``saved``) in a
        call of ``prob`` whose q / kv elements take ``itemsize`` bytes, by tensor; an upper bound
        where the layout depends on the index values or on choices made per call. ``kv``: the kv
        it keeps; ``indices``: an index tensor of its own (0 when it keeps the caller's, which the
        caller counts); other names are the backend's own. What memory planners read instead of
        restating a backend's layout. The default keeps (kv, indices) as the caller passed them."""
        return {"kv": prob.batch * prob.seq_len_kv * prob.kv_groups * prob.d_qk * itemsize, "indices": 0}

    def backward_bytes(self, prob: Problem, itemsize: int) -> dict[str, int]:
        """Bytes :meth:`backward_saved` allocates for a call of ``prob`` (q / kv elements of
        ``itemsize`` bytes) besides dq, by tensor; an upper bound where it depends on the call.
        ``dkv``: the returned kv gradient; other names are the backend's own scratch. The default
        counts the kv gradient only."""
        return {"dkv": prob.batch * prob.seq_len_kv * prob.kv_groups * prob.d_qk * itemsize}

    def deterministic_variant(self, device: torch.device | None = None) -> "Backend":
        """The backend whose backward is bitwise reproducible on ``device``, or a ValueError
        saying why there is none."""
        raise ValueError(f"sparse_mla(deterministic=True): backend {self.name!r} has no deterministic mode")
