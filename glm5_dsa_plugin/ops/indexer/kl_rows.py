"""Triton kernel for the indexer's KL loss, one query row per program, in one pass over [T, K].

For each row t, over its valid slots V_t = {j : idx[t, j] >= 0}:

    p[t, j]    = target[t, j] / max(sum_{V_t} target[t, :], eps)          (0 off V_t)
    logq[t, j] = logits[t, j] - logsumexp_{V_t}(logits[t, :])             (0 off V_t)
    loss[t]    = sum_{V_t} p[t, j] * (log(max(p[t, j], eps)) - logq[t, j])
    grad[t, j] = exp(logq[t, j]) * sum_{V_t} p[t, :] - p[t, j]             (0 off V_t)

logits and target [T, K] fp32, idx [T, K] int32 (-1 padding); loss [T] fp32; grad = d loss[t] /
d logits[t, j], written over ``target`` (each program reads its row before writing it). A row
without a valid slot has loss 0 and grad 0. The same values, to fp32 rounding, as the PyTorch
definition in :func:`glm5_dsa_plugin.model.indexer_loss.indexer_kl_loss_from_target`, which makes a
pass over [T, K] per elementwise step where this reads and writes each row once. Runs under
``TRITON_INTERPRET=1`` on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["kl_rows"]


@triton.jit
def _kl_rows_kernel(LOGITS, TARGET, IDX, LOSS, n_slots, eps, BK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BK)
    inb = j < n_slots
    valid = tl.load(IDX + t * n_slots + j, mask=inb, other=-1) >= 0
    p = tl.where(valid, tl.load(TARGET + t * n_slots + j, mask=inb, other=0.0), 0.0)
    p = p / tl.maximum(tl.sum(p, axis=0), eps)
    x = tl.where(valid, tl.load(LOGITS + t * n_slots + j, mask=inb, other=0.0), float("-inf"))
    m = tl.max(x, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row without a valid slot
    e = tl.where(valid, tl.exp(x - m), 0.0)
    lse = tl.log(tl.maximum(tl.sum(e, axis=0), 1.1754943508222875e-38)) + m
    logq = tl.where(valid, x - lse, 0.0)
    loss = tl.sum(tl.where(valid, p * (tl.log(tl.maximum(p, eps)) - logq), 0.0), axis=0)
    grad = tl.where(valid, tl.exp(logq) * tl.sum(p, axis=0) - p, 0.0)
    tl.store(LOSS + t, loss)
    tl.store(TARGET + t * n_slots + j, grad, mask=inb)


def kl_rows(logits: torch.Tensor, target: torch.Tensor, indices: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """Per-row KL loss [T] fp32; ``target`` [T, K] fp32 (contiguous, owned by the caller) is
    overwritten with d loss / d logits. See the module docstring."""
    T, K = logits.shape
    if target.shape != (T, K) or target.dtype != torch.float32 or not target.is_contiguous():
        raise ValueError(f"target must be a contiguous fp32 [{T}, {K}] buffer, got {target.dtype} "
                         f"{tuple(target.shape)}")
    if indices.shape != (T, K) or indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32 [{T}, {K}], got {indices.dtype} {tuple(indices.shape)}")
    loss = torch.empty(T, dtype=torch.float32, device=logits.device)
    if T == 0 or K == 0:
        target.zero_()
        return loss.zero_()
    BK = triton.next_power_of_2(K)
    _kl_rows_kernel[(T,)](logits.float().contiguous(), target, indices.contiguous(), loss, K, eps, BK=BK,
                          num_warps=4 if BK <= 1024 else 8)
    return loss
