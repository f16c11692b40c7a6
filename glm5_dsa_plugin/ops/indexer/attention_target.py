"""Triton kernel for the indexer loss's target: per-slot attention probabilities summed over heads.

    p[t, j] = sum_h exp(scale * q[t, h] . kv[idx[t, j]] - lse[t, h])     idx[t, j] >= 0
    p[t, j] = 0                                                           idx[t, j] == -1

q [T, H, D] and kv [T_kv, D] the sparse attention's inputs (absorbed MLA: D = 576, one kv
group), lse [T, H] fp32 the natural-log normaliser the attention forward returned for the same
indices, idx [T, K] int32. Each head's probabilities over a row's valid slots sum to 1, so
p[t, :] sums to the number of heads with a valid slot. Reusing lse makes every (row, slot block)
independent: the kernel streams blocks of selected kv rows through registers and never forms
[T, K, D]. Products run on the tensor cores with fp32 accumulation (IEEE fp32 for fp32 inputs).
Runs under ``TRITON_INTERPRET=1`` on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["head_prob_sum"]


@triton.jit
def _head_prob_sum_kernel(Q, KV, LSE, IDX, OUT, n_slots, scale_log2,
                          H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                          BJ: tl.constexpr, IEEE: tl.constexpr):
    # one flat grid, slot blocks of a row adjacent: they share the row's q in cache
    n_blocks = tl.cdiv(n_slots, BJ)
    pid = tl.program_id(0)
    t = (pid // n_blocks).to(tl.int64)
    jb = pid % n_blocks
    h = tl.arange(0, HP)
    hmask = h < H
    j = jb * BJ + tl.arange(0, BJ)
    jmask = j < n_slots
    idx = tl.load(IDX + t * n_slots + j, mask=jmask, other=-1)
    valid = idx >= 0
    rows = idx.to(tl.int64) * D
    acc = tl.zeros([HP, BJ], dtype=tl.float32)
    for d0 in range(0, D, BD):  # a loop (not unrolled): Triton pipelines its loads
        d = d0 + tl.arange(0, BD)
        dmask = d < D
        q = tl.load(Q + t * (H * D) + h[:, None] * D + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
        kv = tl.load(KV + rows[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(q, tl.trans(kv), input_precision="ieee")
        else:
            acc += tl.dot(q, tl.trans(kv))
    lse = tl.load(LSE + t * H + h, mask=hmask, other=0.0)
    # exp(scale * s - lse) == exp2(log2(e) * scale * s - log2(e) * lse)
    p = tl.exp2(acc * scale_log2 - lse[:, None] * 1.4426950408889634)
    p = tl.where(hmask[:, None] & valid[None, :], p, 0.0)
    tl.store(OUT + t * n_slots + j, tl.sum(p, axis=0), mask=jmask)


def head_prob_sum(q: torch.Tensor, kv: torch.Tensor, lse: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                  block_slots: int = 128, block_d: int = 64, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """p [T, K] fp32 (see the module docstring). q [T, H, D], kv [T_kv, D], lse [T, H], indices [T, K] int32."""
    T, H, D = q.shape
    if kv.dim() != 2 or kv.shape[1] != D:
        raise ValueError(f"kv must be [T_kv, {D}] (one kv group), got {tuple(kv.shape)}")
    if lse.shape != (T, H):
        raise ValueError(f"lse must be [{T}, {H}], got {tuple(lse.shape)}")
    if indices.dim() != 2 or indices.shape[0] != T or indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32 [{T}, topk], got {indices.dtype} {tuple(indices.shape)}")
    n = indices.shape[1]
    out = torch.empty(T, n, dtype=torch.float32, device=q.device)
    if T == 0 or n == 0:
        return out
    HP = max(16, triton.next_power_of_2(H))
    grid = (T * triton.cdiv(n, block_slots),)
    _head_prob_sum_kernel[grid](q.contiguous(), kv.contiguous(), lse.float().contiguous(), indices.contiguous(), out,
                                n, sm_scale * 1.4426950408889634, H=H, HP=HP, D=D, BD=block_d, BJ=block_slots,
                                IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages)
    return out
