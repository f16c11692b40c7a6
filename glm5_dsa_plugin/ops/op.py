"""Public sparse-MLA op: ``out, lse = sparse_mla(q, kv, indices, sm_scale, d_v=512, backend="auto")``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import backends as _backends
from . import guard as _guard
from . import reference as _reference
from .contract import canonicalize, check_indices

__all__ = ["sparse_mla", "SlotProbsGrad"]


@dataclass(frozen=True)
class SlotProbsGrad:
    """A loss on the attention's slot probabilities, differentiated in the attention's backward.

    ``input``: the tensor that loss differentiates (the DSA indexer's logits at the slots), with a
    graph of its own. ``grad_from(p)``: called once in the backward with
    ``p [.., T, G, topk]`` fp32 (batched as the call's q), each slot's attention probability
    summed over the kv group's heads, ``sum_h exp(sm_scale * q_h . kv[idx] - lse_h)``, 0 at
    padding; returns the gradient of ``input`` (its shape). The indexer loss's target is ``p``:
    formed inside the backward kernel where the backend can (no second pass over the selected kv
    rows), so nothing of it is computed or kept in the forward."""

    input: torch.Tensor
    grad_from: Callable[[torch.Tensor], torch.Tensor]


def _slot_probs(backend, q, saved, lse, prob) -> torch.Tensor:
    """p [B, T, G, topk] (see SlotProbsGrad) where the backward did not form it: the Triton kernel
    on CUDA for one batch of one kv group, else the PyTorch definition."""
    kv, indices = backend.originals(saved, prob)
    if q.is_cuda and prob.batch == 1 and prob.kv_groups == 1 and q.dtype != torch.float64:
        from .indexer.attention_target import head_prob_sum

        p = head_prob_sum(q[0], kv[0, :, 0], lse[0], indices[0, :, 0].to(torch.int32).contiguous(), prob.sm_scale)
        return p.view(1, prob.seq_len, 1, prob.topk)
    return _reference.slot_probs(q, kv, indices, lse, prob.sm_scale)


class _SparseMLAFunction(torch.autograd.Function):
    """A call autograd records (a backward follows); calls with nothing to differentiate run the
    guard's forward directly (``sparse_mla``)."""

    @staticmethod
    def forward(ctx, q, kv, indices, prob, backend, defer_index_check, slot_input, slot_grad):
        out, lse, saved, ctx.pending_flags = _guard.run_forward(backend, q, kv, indices, prob,
                                                                defer_index_check, backward_follows=True)
        # saved replaces (kv, indices): a backend's prepared inputs are built once per call
        ctx.save_for_backward(q, out, lse, *saved)
        ctx.prob, ctx.backend = prob, backend
        ctx.slot_grad = slot_grad  # (its input is slot_input, an input of this node)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for lse (one fill per backward)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, out, lse, *saved = ctx.saved_tensors
        saved, prob, slot_grad = tuple(saved), ctx.prob, ctx.slot_grad
        dq = dkv = probs = None
        if slot_grad is not None and grad_out is not None and ctx.backend.head_probs_in_backward(saved, prob):
            probs = torch.zeros(prob.batch, prob.seq_len, prob.kv_groups, prob.topk, dtype=torch.float32,
                                device=q.device)
        if grad_out is not None:
            dq, dkv = _guard.run_backward(ctx.backend, q, saved, prob, out, lse, grad_out.contiguous(),
                                          head_probs=probs)
        if ctx.pending_flags is not None:
            # the forward's index / finiteness flags, read only now that the backward's kernels are
            # queued (its forward finished long ago): raises here, before any gradient is returned
            _guard.settle_through(ctx.pending_flags)
            ctx.pending_flags = None  # its closure holds q / kv / indices: not past this backward
        d_slot = None
        if slot_grad is not None:
            ctx.slot_grad = None  # (a second backward through this node is refused by autograd)
            if probs is None:
                probs = _slot_probs(ctx.backend, q, saved, lse, prob)
            d_slot = slot_grad.grad_from(probs if prob.batched_input else probs[0])
        return dq, dkv, None, None, None, None, d_slot, None


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
    slot_probs_grad: SlotProbsGrad | None = None,
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
        slot_probs_grad: a loss on the slot probabilities (:class:`SlotProbsGrad`, the DSA
            indexer loss) whose gradient the backward forms: its ``input`` gets the gradient
            ``grad_from`` returns. Ignored when nothing is differentiated.

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
    slot_input = slot_probs_grad.input if slot_probs_grad is not None else None
    backward_follows = torch.is_grad_enabled() and (q4.requires_grad or kv4.requires_grad or (
        slot_input is not None and slot_input.requires_grad))
    if backward_follows:
        out, lse = _SparseMLAFunction.apply(q4, kv4, idx4, prob, impl, defer, slot_input,
                                            slot_probs_grad if slot_input is not None else None)
    else:  # nothing to differentiate: no autograd node (its bookkeeping is host time on every call)
        out, lse, _, _ = _guard.run_forward(impl, q4, kv4, idx4, prob, defer, False)
    if not prob.batched_input:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return out, lse
