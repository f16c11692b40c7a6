"""One guarded call: the backend's forward / backward, the checks into the call's flags, and
the repair, now (flags read before returning) or on the device with the flags read later."""

from __future__ import annotations

from . import events, pending, slots
from .checks import check_forward, flag_nonfinite
from .config import cfg
from .repair import repair_backward, repair_forward
from .slots import Flag

__all__ = ["run_forward", "run_backward"]


def _forward(backend, q, kv, indices, prob, index_flag, kv_flag=None):
    """-> (out, lse, saved) from ``backend.forward_saving``."""
    kw = {} if index_flag is None else {"index_flag": index_flag}
    if kv_flag is not None:  # (only backends with a finite_out_lse_bound)
        kw["kv_flag"] = kv_flag
    return backend.forward_saving(q, kv, indices, prob, **kw)


def run_forward(backend, q, kv, indices, prob, defer_index_check: bool = False,
                backward_follows: bool = False):
    """Forward through ``backend`` with the nonfinite check -> (out, lse, saved, pending): ``prob``
    is the call's ``contract.Problem`` (batched q / kv / indices of those sizes); ``saved``
    as ``backend.forward_saving`` returns it; ``pending`` is None, or the queued flags that the
    call's backward must settle (``settle_through``) before it returns gradients.

    ``defer_index_check`` (only for backends memory-safe on any index): the backend sets the
    index-rule flag during the call; it travels with the finiteness flag. A violation raises the
    usual SparseMLAInputError (naming the first bad entry).

    ``backward_follows`` (autograd recorded the call) on CUDA under ``fallback`` / ``off``: no
    host read here. Bad out / lse rows are repaired on the device (``row_repair``) and the flags
    travel to pinned host memory behind the kernels; they are settled at the latest by this
    call's backward, else by a later guarded call or ``stats()``, so an index violation raises
    there instead of from this call. The same without grad under ``forward_flags="deferred"``
    (settled by a later call, ``stats()`` or at exit). Otherwise (no backward to come,
    ``raise``, CPU, graph capture) the flags are read before returning, as the backward does in
    those cases."""
    check = cfg.policy != "off" and backend.name != "reference"
    flags = slots.new_flags(q.device) if (check or defer_index_check) else None
    lse_bound = backend.finite_out_lse_bound(prob) if check else None
    kv_flag = None if lse_bound is None else flags[Flag.KV_SUSPECT : Flag.KV_SUSPECT + 1]
    index_flag = flags[Flag.INDEX_RULE : Flag.INDEX_RULE + 1] if defer_index_check else None
    out, lse, saved = _forward(backend, q, kv, indices, prob, index_flag, kv_flag)
    if flags is None:
        return out, lse, saved, None
    if check:
        if lse_bound is None:
            flag_nonfinite(flags, Flag.NONFINITE, out, lse)
        else:  # (rows the backend does not vouch for get lse NaN: the repair below recomputes them)
            lse = lse.contiguous()
            check_forward(flags, Flag.NONFINITE, out, lse, Flag.KV_SUSPECT, lse_bound, backend.row_extent(saved))
    read_late = backward_follows or cfg.forward_flags == "deferred"
    if read_late and cfg.policy != "raise" and slots.reads_late(q.device):
        if check:
            from .row_repair import repair_forward_rows

            out, lse = out.contiguous(), lse.contiguous()
            repair_forward_rows(q, kv, indices, prob.sm_scale, prob.d_v, out, lse, flags)
            events.counters.calls_checked += 1
        call = (backend, q, kv, indices, prob)
        # a recorded call's inputs stay alive for its backward anyway, which settles these flags
        held = 0 if backward_follows else pending.storage_bytes(q, kv, indices)
        return out, lse, saved, pending.queue.push(flags, lambda values: _settle_forward_event(values, call), held)
    values = slots.read(flags)  # the one host read
    pending.queue.settle()  # earlier calls' flags have arrived by now (may raise for such a call)
    if values[Flag.INDEX_RULE]:
        events.raise_index_error(indices, prob.seq_len_kv)
    if not check:
        return out, lse, saved, None
    events.counters.calls_checked += 1
    if values[Flag.NONFINITE]:
        out, lse = repair_forward(backend, q, kv, indices, prob, out, lse, stacklevel=3)
    return out, lse, saved, None


def _settle_forward_event(values: list[int], call: tuple) -> None:
    """A forward whose flags were read late: the index error, or count / warn / dump a
    device-repaired forward (and raise if even the repair was nonfinite)."""
    backend, q, kv, indices, prob = call
    if values[Flag.INDEX_RULE]:
        events.raise_index_error(indices, prob.seq_len_kv, settled_late=True)
    if not values[Flag.NONFINITE]:
        return
    events.counters.rows_repaired += values[Flag.ROWS_REPAIRED]

    def recompute_bad():
        out, lse, _ = _forward(backend, q, kv, indices, prob, None)
        return dict(out=out, lse=lse)

    events.device_repair_event("forward", backend,
                               dict(q=q, kv=kv, indices=indices, sm_scale=prob.sm_scale, d_v=prob.d_v),
                               recompute_bad, values[Flag.ROWS_REPAIRED], bool(values[Flag.STILL_NONFINITE]))


def _backward(backend, q, saved, out, lse, grad_out, prob, flags, head_probs=None):
    """-> (dq, dkv) with flags[NONFINITE] set when either is nonfinite (``flags`` None: no check);
    ``head_probs`` (where the backend forms them, ``Backend.head_probs_in_backward``) filled too."""
    own = flags is not None and backend.reports_nonfinite
    extra = {"nonfinite_flag": flags[Flag.NONFINITE : Flag.NONFINITE + 1]} if own else {}
    if head_probs is not None:
        extra["head_probs"] = head_probs
    dq, dkv = backend.backward_saved(q, saved, out, lse, grad_out, prob, **extra)
    if flags is not None and not own:
        flag_nonfinite(flags, Flag.NONFINITE, dq, dkv)
    return dq, dkv


def run_backward(backend, q, saved, prob, out, lse, grad_out, head_probs=None):
    """Backward from the forward's ``saved`` tensors (``prob``: the forward's ``contract.Problem``);
    ``head_probs``: see ``Backend.backward_saved`` (rows the guard repairs keep the kernel's)."""
    if cfg.policy == "off" or backend.name == "reference":
        return _backward(backend, q, saved, out, lse, grad_out, prob, None, head_probs)
    flags = slots.new_flags(q.device)
    dq, dkv = _backward(backend, q, saved, out, lse, grad_out, prob, flags, head_probs)
    events.counters.calls_checked += 1
    if cfg.policy == "fallback" and slots.reads_late(q.device):
        from .row_repair import repair_backward_rows

        dq, dkv = dq.contiguous(), dkv.contiguous()
        kv_v, idx_v = backend.padded_views(saved, prob)
        repair_backward_rows(q, kv_v, idx_v, grad_out, prob.sm_scale, prob.d_v, dq, dkv, flags)
        # what a dump needs; out and lse (as large as grad_out) are recomputed if one is due. A call
        # whose tensors alone exceed pending_bytes keeps none: they would outlive its backward (into
        # the next layer's) for a dump that is rarely due; its event is still counted and warned.
        held = pending.storage_bytes(q, grad_out, *saved)
        if held <= cfg.pending_bytes:
            call = (backend, q, saved, prob, grad_out)
            pending.queue.push(flags, lambda values: _settle_backward_event(values, call), held)
        else:
            pending.queue.push(flags, lambda values: _settle_backward_event(values, (backend,), unkept_bytes=held))
        return dq, dkv
    if not slots.read(flags)[Flag.NONFINITE]:  # the one host read
        return dq, dkv
    kv, indices = backend.originals(saved, prob)
    return repair_backward(backend, q, kv, indices, grad_out, prob, dq, dkv, stacklevel=3)


def _settle_backward_event(values: list[int], call: tuple, unkept_bytes: int = 0) -> None:
    """Count, warn, dump (and raise if even the repair was nonfinite) for a device-repaired backward.
    ``call``: (backend, q, saved, prob, grad_out), or (backend,) with
    ``unkept_bytes``, the size of the tensors that were not kept (no dump then)."""
    if not values[Flag.NONFINITE]:
        return
    events.counters.rows_repaired += values[Flag.ROWS_REPAIRED]
    events.counters.kv_rows_repaired += values[Flag.KV_ROWS_REPAIRED]
    n_rows, still_bad = values[Flag.ROWS_REPAIRED] + values[Flag.KV_ROWS_REPAIRED], bool(values[Flag.STILL_NONFINITE])
    if unkept_bytes:
        events.device_repair_event("backward", call[0], None, None, n_rows, still_bad,
                                   no_dump=f"its tensors ({unkept_bytes / 2**30:.2f} GiB) exceed pending_bytes "
                                           f"({cfg.pending_bytes / 2**30:.2f} GiB, GLM5_DSA_PENDING_BYTES)")
        return
    backend, q, saved, prob, grad_out = call
    kv, indices = backend.originals(saved, prob)

    def recompute_bad():
        out, lse, saved_again = _forward(backend, q, kv, indices, prob, None)
        dq, dkv = _backward(backend, q, saved_again, out, lse, grad_out, prob, None)
        return dict(dq=dq, dkv=dkv)

    events.device_repair_event("backward", backend,
                               dict(q=q, kv=kv, indices=indices, grad_out=grad_out, sm_scale=prob.sm_scale,
                                    d_v=prob.d_v),
                               recompute_bad, n_rows, still_bad)
