"""Public sparse-MLA op: ``out, lse = sparse_mla(q, kv, indices, sm_scale, d_v=512, backend="auto")``."""

from __future__ import annotations

import torch

from . import backends as _backends
from . import guard as _guard
from .contract import canonicalize, check_indices

__all__ = ["sparse_mla"]


class _SparseMLAFunction(torch.autograd.Function):
    """A call autograd records (a backward follows); calls with nothing to differentiate run the
    guard's forward directly (``sparse_mla``)."""

    @staticmethod
    def forward(ctx, q, kv, indices, prob, backend, defer_index_check):
        out, lse, saved, ctx.pending_flags = _guard.run_forward(backend, q, kv, indices, prob,
                                                                defer_index_check, backward_follows=True)
        # saved replaces (kv, indices): a backend's prepared inputs are built once per call
        ctx.save_for_backward(q, out, lse, *saved)
        ctx.prob, ctx.backend = prob, backend
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for lse (one fill per backward)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, out, lse, *saved = ctx.saved_tensors
        dq = dkv = None
        if grad_out is not None:
            dq, dkv = _guard.run_backward(ctx.backend, q, tuple(saved), ctx.prob, out, lse, grad_out.contiguous())
        if ctx.pending_flags is not None:
            # the forward's index / finiteness flags, read only now that the backward's kernels are
            # queued (its forward finished long ago): raises here, before any gradient is returned
            _guard.settle_through(ctx.pending_flags)
            ctx.pending_flags = None  # its closure holds q / kv / indices: not past this backward
        return dq, dkv, None, None, None, None


def sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    backend: str = "auto",
    *,
    validate: bool = True,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse multi-head latent attention over top-k selected keys (GLM-5 / DeepSeek DSA).

    Args:
        q: ``[T, H, Dqk]`` or ``[B, T, H, Dqk]`` queries (absorbed MLA: Dqk = d_v + d_tail = 512 + 64).
        kv: ``[T_kv, G, Dqk]`` or ``[B, T_kv, G, Dqk]`` latent keys; the first ``d_v`` channels are
            also the values. ``H % G == 0``; head ``h`` reads group ``h // (H // G)``.
        indices: ``[T, G, topk]`` or ``[B, T, G, topk]`` int32 rows of kv per query row; ``-1`` is
            padding, any other value must lie in ``[0, T_kv)``. Slots are a multiset (a repeated
            index counts once per slot). No causal rule is applied: visibility is the indices.
        sm_scale: softmax scale, required. Absorbed MLA needs the un-absorbed qk head dim:
            ``(qk_nope + qk_rope) ** -0.5`` (GLM-5: ``256 ** -0.5``), not ``Dqk ** -0.5``.
        d_v: value width (leading channels of kv).
        backend: ``"reference"``, ``"tilelang"`` or ``"auto"`` (TileLang on CUDA sm_90 when it
            imports, else the reference with one warning).
        validate: check every index. Backends memory-safe for any index value (TileLang: invalid
            slots count as padding, read the zero sentinel row, issue no atomics) check during the
            call and read the flag with the nonfinite guard's: when autograd records the call (a
            backward will come), on CUDA, that read happens in the call's backward, after its
            kernels are queued, so the forward never stalls the GPU: a bad index raises there
            (before any gradient is returned), or at a later call / ``guard_stats()`` if no
            backward runs. Otherwise (no grad, guard policy ``raise``, CPU) the call raises before
            returning; without grad it can read late too (``configure(forward_flags="deferred")``:
            raised at a later call, ``guard_stats()``, or printed at exit). Other backends check
            before any kernel runs. Either way the error names the first bad entry. Only trusted
            callers that already guarantee the index rule should pass False.
        deterministic: dq/dkv bitwise identical from run to run (TileLang: dKV reduced per kv row
            in a fixed order instead of fp32 atomics; slower, see docs/kernels.md; the
            reference is deterministic on CPU, and on CUDA under torch.use_deterministic_algorithms).
            The forward is deterministic either way. The Megatron attention module passes
            ``config.deterministic_mode``.

    Returns:
        ``out [.., T, H, d_v]`` in q's dtype, where for row t, head h:
        ``out = sum_j softmax_j(sm_scale * q . kv[idx_j]) * kv[idx_j, :d_v]`` over valid slots;
        ``lse [.., T, H]`` float32, natural log of the softmax denominator (incl. sm_scale),
        non-differentiable. Rows with no valid slot: ``out == 0``, ``dq == 0``,
        ``lse == contract.EMPTY_ROW_LSE`` (-1e30, finite).
        Backward: dq, dkv in the input dtype, accumulated in fp32.

    Raises:
        SparseMLAInputError (a ValueError) naming the tensor, position and value of bad input.
    """
    q4, kv4, idx4, prob = canonicalize(q, kv, indices, sm_scale, d_v)
    impl = _backends.resolve(backend, q4.device)
    if deterministic:
        impl = impl.deterministic_variant(q4.device)
    # a backend memory-safe for any index checks them during the kernel (flag read with the guard's)
    defer = validate and impl.memory_safe_on_any_index
    if validate and not defer:
        check_indices(idx4, prob.seq_len_kv)
    backward_follows = torch.is_grad_enabled() and (q4.requires_grad or kv4.requires_grad)
    if backward_follows:
        out, lse = _SparseMLAFunction.apply(q4, kv4, idx4, prob, impl, defer)
    else:  # nothing to differentiate: no autograd node (its bookkeeping is host time on every call)
        out, lse, _, _ = _guard.run_forward(impl, q4, kv4, idx4, prob, defer, False)
    if not prob.batched_input:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return out, lse
