"""The DSA indexer's KL loss: KL(attention target || indexer) over each row's selected slots.

The target is the attention's head-summed probabilities at the slots (the layer forms it in the
attention's backward, ``ops.SlotProbsGrad``; :func:`attention_target_reference` is its PyTorch
definition); the indexer's distribution is the softmax of its scores at the same slots
(:func:`glm5_dsa_plugin.model.indexer.selected_scores`). Shapes: index logits, target and
indices [T, K] (K = top-k, -1 padding). Same value as megatron-core 0.19.2's
``compute_dsa_indexer_loss(..., sparse_loss=True)``. Pure PyTorch with a Triton fast path on CUDA
(:mod:`glm5_dsa_plugin.ops.indexer.kl_rows`), no Megatron.
"""

from __future__ import annotations

import torch

from ..ops import indexer as indexer_kernels
from ..ops.reference import live_slot_columns

__all__ = ["attention_target_reference", "indexer_kl_loss_from_target", "indexer_kl_loss_and_grad",
           "indexer_kl_loss"]


def attention_target_reference(query: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                               chunk_rows: int = 1024) -> torch.Tensor:
    """Head-summed attention probabilities at the selected slots, fp32 [T, K], 0 at padding.

    query [T, H, D], kv [T_kv, D] (or [T_kv, G, D]: head h reads group h // (H // G)):
    p[t, j] = sum_h softmax_j(sm_scale * query[t, h] . kv[idx[t, j]]).
    PyTorch definition, in row blocks of ``chunk_rows`` ([chunk, K, G, D] gathered at a time)."""
    T, K = indices.shape
    H = query.shape[1]
    kv = kv if kv.dim() == 3 else kv[:, None]
    G = kv.shape[1]
    out = torch.zeros(T, K, dtype=torch.float32, device=query.device)
    with torch.no_grad():
        for t0 in range(0, T, chunk_rows):
            t1 = min(T, t0 + chunk_rows)
            live = live_slot_columns(indices[t0:t1])
            idx = indices[t0:t1] if live is None else indices[t0:t1, live]
            valid = idx >= 0
            kv_sel = kv[idx.clamp(min=0).long()].float()  # [c, K, G, D]
            qg = query[t0:t1].float().view(t1 - t0, G, H // G, -1)
            att = torch.einsum("tgrd,tkgd->tgrk", qg, kv_sel).reshape(t1 - t0, H, idx.shape[1]) * sm_scale
            att = att.masked_fill(~valid[:, None, :], float("-inf"))
            has = valid.any(-1)[:, None, None]
            att = torch.where(has, torch.softmax(torch.where(has, att, torch.zeros_like(att)), dim=-1),
                              torch.zeros_like(att))
            if live is None:
                out[t0:t1] = att.sum(1)
            else:
                out[t0:t1, live] = att.sum(1)
    return out


class _IndexerKL(torch.autograd.Function):
    """sum_t KL(normalise(target_t) || softmax(logits_t)) over valid slots.

    ``target`` (fp32 [T, K], head-summed probabilities, owned by this function) is overwritten with
    d(sum)/d(logits) = softmax(logits) * sum(p) - p, p the normalised target: the only tensor kept
    for the backward is that [T, K] gradient (not the logits, target and mask), which the backward
    scales in place by the incoming gradient. On CUDA one Triton program per row does it in one pass
    (:mod:`glm5_dsa_plugin.ops.indexer.kl_rows`); otherwise PyTorch in row blocks of ``chunk_rows``.
    A second backward through the same graph (``retain_graph=True``) is refused, as the kept
    gradient was scaled by the first."""

    @staticmethod
    def forward(ctx, logits, target, indices, chunk_rows, eps):
        keep = ctx.needs_input_grad[0]
        total = _kl_sum_and_grad(logits, target, indices, chunk_rows, eps, keep)
        if keep:
            ctx.save_for_backward(target)
        ctx.scaled = False
        return total

    @staticmethod
    def backward(ctx, g):
        if ctx.scaled:
            raise RuntimeError("indexer KL loss: a second backward through the same graph (retain_graph=True) is "
                               "not supported; the loss keeps one gradient buffer, scaled in place by the first")
        ctx.scaled = True
        (grad,) = ctx.saved_tensors
        return grad.mul_(g), None, None, None, None


def _kl_sum_and_grad(logits: torch.Tensor, target: torch.Tensor, indices: torch.Tensor, chunk_rows: int, eps: float,
                     keep: bool) -> torch.Tensor:
    """sum_t KL(normalise(target_t) || softmax(logits_t)) over valid slots (a 0-dim fp32 tensor);
    with ``keep`` the contiguous fp32 ``target`` [T, K] is overwritten with d(sum)/d(logits)
    (see :class:`_IndexerKL`)."""
    if indexer_kernels.runs_on(logits):
        from ..ops.indexer import kl_rows

        rows = indexer_kernels.call_or_none(kl_rows.kl_rows, logits, target, indices.to(torch.int32).contiguous(), eps)
        if rows is not None:
            return rows.sum()
    total = logits.new_zeros(())
    for t0 in range(0, logits.shape[0], chunk_rows):
        sl = slice(t0, t0 + chunk_rows)
        valid = indices[sl] >= 0
        p = target[sl].masked_fill_(~valid, 0.0)
        p.div_(p.sum(-1, keepdim=True).clamp_min(eps))
        logp = _masked_log_softmax(logits[sl], valid)
        total += (p * (torch.log(p.clamp_min(eps)) - logp)).masked_fill(~valid, 0.0).sum()
        if keep:
            p.copy_(logp.exp_().masked_fill_(~valid, 0.0).mul_(p.sum(-1, keepdim=True)).sub_(p))
    return total


def _masked_log_softmax(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log_softmax over valid slots (0 at invalid ones and in rows without a valid slot)."""
    x = logits.masked_fill(~valid, float("-inf"))
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lse = torch.log(torch.exp(x - m).sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)) + m
    return (x - lse).masked_fill(~valid, 0.0)


def indexer_kl_loss_from_target(index_logits: torch.Tensor, target: torch.Tensor, indices: torch.Tensor,
                                coeff: float, eps: float = 1e-10, chunk_rows: int = 4096) -> torch.Tensor:
    """coeff * mean over query rows of KL(normalise(target) || softmax(index_logits)) on valid slots.

    index_logits [T, K] fp32 (differentiable), target [T, K] head-summed probabilities (already
    reduced over TP ranks), indices [T, K] (-1 padding). Rows without a valid slot count in the mean
    with KL 0. Nothing beyond [T, K] tensors is formed (see :class:`_IndexerKL`)."""
    with torch.no_grad():
        tgt = target.detach().to(torch.float32, copy=True).contiguous()  # a new buffer: _IndexerKL overwrites it
    kl = _IndexerKL.apply(index_logits.float(), tgt, indices, chunk_rows, eps)
    return kl / max(index_logits.shape[0], 1) * coeff


def indexer_kl_loss_and_grad(index_logits: torch.Tensor, target: torch.Tensor, indices: torch.Tensor, coeff: float,
                             eps: float = 1e-10, chunk_rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d index_logits [T, K] fp32) of :func:`indexer_kl_loss_from_target`, formed
    without autograd: what the attention's backward hands the indexer when it formed the target
    itself (``ops.SlotProbsGrad``). ``target`` [T, K] fp32 contiguous is overwritten (it becomes
    the returned gradient); ``index_logits`` is only read."""
    if target.dtype != torch.float32 or not target.is_contiguous() or target.shape != index_logits.shape:
        raise ValueError(f"target must be a contiguous fp32 {tuple(index_logits.shape)} buffer, got {target.dtype} "
                         f"{tuple(target.shape)}")
    rows = max(index_logits.shape[0], 1)
    with torch.no_grad():
        total = _kl_sum_and_grad(index_logits.detach().float(), target, indices, chunk_rows, eps, keep=True)
    return total * (coeff / rows), target.mul_(coeff / rows)


def indexer_kl_loss(index_logits: torch.Tensor, query: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                    sm_scale: float, coeff: float, eps: float = 1e-10) -> torch.Tensor:
    """KL(target || indexer) over the selected slots, averaged over query rows, times ``coeff``.

    index_logits [T, K] (indexer scores at the slots, -inf at padding, differentiable);
    query [T, H, D] and kv [T_kv, D] the attention q / latent kv (not differentiated);
    target = normalise(sum_h softmax_h(sm_scale * q_h . kv[idx])) over valid slots.
    Same value as megatron-core 0.19.2 ``compute_dsa_indexer_loss(..., sparse_loss=True)``. The
    definition the layer's loss is checked against; the layer forms its target in the attention's
    backward instead (``ops.SlotProbsGrad``, :func:`indexer_kl_loss_and_grad`)."""
    target = attention_target_reference(query.detach(), kv.detach(), indices, sm_scale)
    return indexer_kl_loss_from_target(index_logits, target, indices, coeff, eps=eps)
