"""Triton kernels for the lightning indexer's scores at the selected slots, forward and backward.

    score[t, j] = sum_h w[t, h] * relu(scale * q[t, h] . k[idx[t, j]])     idx[t, j] >= 0
    score[t, j] = -inf                                                       idx[t, j] == -1

q [T, Hi, Di], k [T_kv, Di], w [T, Hi] (bf16 or fp32), idx [T, K] int32, scale = Di ** -0.5.
Nothing of size [T, K, Di] is formed: each program gathers a block of selected key rows into
registers. Backward, for the incoming g = dL/dscore [T, K] (ignored at padding slots):

    dw[t, h]   = sum_j g[t, j] * relu(s[t, h, j])
    dS[t, h, j] = g[t, j] * w[t, h] * [s[t, h, j] > 0] * scale
    dq[t, h]   = sum_j dS[t, h, j] * k[idx[t, j]]
    dk[s]     += sum_{(t, j): idx[t, j] = s} sum_h dS[t, h, j] * q[t, h]     (fp32 atomics)

One program per query row walks all of its slots, so dq and dw are complete in registers; dk is
accumulated in fp32 with atomics (its summation order is not fixed), or, with ``deterministic``,
in a fixed order: per block of query rows, each slot's dk contribution [Di] is written to a
workspace (at most ``workspace_bytes``) and added to dk by ``ops.segment_sum.segment_sum_rows``
(the block's slots stably sorted by key, one program per key summing them in that order; blocks
in row order), so the result is bitwise reproducible at O(T x topk) memory beyond the workspace.
Products run on the tensor cores with fp32 accumulation; the backward rounds dS to the inputs'
dtype for its two products (bf16: about 2e-3 relative error in dq and dk against fp32 math, as
the sparse-MLA backward); fp32 inputs use IEEE fp32 products. Runs under ``TRITON_INTERPRET=1``
on CPU (how CI tests it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..segment_sum import segment_sum_rows

__all__ = ["slot_scores_forward", "slot_scores_backward"]


@triton.jit
def _slot_scores_fwd_kernel(Q, K, W, IDX, OUT, n_slots, scale,
                            HI: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BJ: tl.constexpr,
                            IEEE: tl.constexpr):
    # one flat grid, slot blocks of a row adjacent: they share the row's q in cache
    n_blocks = tl.cdiv(n_slots, BJ)
    pid = tl.program_id(0)
    t = (pid // n_blocks).to(tl.int64)
    jb = pid % n_blocks
    h = tl.arange(0, HP)
    d = tl.arange(0, D)
    j = jb * BJ + tl.arange(0, BJ)
    jmask = j < n_slots
    idx = tl.load(IDX + t * n_slots + j, mask=jmask, other=-1)
    valid = idx >= 0
    q = tl.load(Q + t * (HI * D) + h[:, None] * D + d[None, :], mask=h[:, None] < HI, other=0.0)
    k = tl.load(K + idx[:, None].to(tl.int64) * D + d[None, :], mask=valid[:, None], other=0.0)
    w = tl.load(W + t * HI + h, mask=h < HI, other=0.0).to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.maximum(s * scale, 0.0)
    score = tl.sum(s * w[:, None], axis=0)
    tl.store(OUT + t * n_slots + j, tl.where(valid, score, float("-inf")), mask=jmask)


@triton.jit
def _slot_scores_bwd_kernel(Q, K, W, IDX, G, DQ, DW, DK, scale, n_slots: tl.constexpr,
                            HI: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BJ: tl.constexpr,
                            IEEE: tl.constexpr, DK_PER_SLOT: tl.constexpr):
    # DK_PER_SLOT: DK is a [rows * n_slots, D] workspace that takes each slot's contribution
    # (zeros at padding slots) instead of the atomics into dk [T_kv, D]
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)
    d = tl.arange(0, D)
    hmask = h < HI
    q = tl.load(Q + t * (HI * D) + h[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0)
    w = tl.load(W + t * HI + h, mask=hmask, other=0.0).to(tl.float32)
    dq = tl.zeros([HP, D], dtype=tl.float32)
    dw = tl.zeros([HP], dtype=tl.float32)
    for j0 in range(0, n_slots, BJ):
        j = j0 + tl.arange(0, BJ)
        jmask = j < n_slots
        idx = tl.load(IDX + t * n_slots + j, mask=jmask, other=-1)
        valid = idx >= 0
        g = tl.load(G + t * n_slots + j, mask=valid, other=0.0)
        k = tl.load(K + idx[:, None].to(tl.int64) * D + d[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        dw += tl.sum(tl.maximum(s, 0.0) * g[None, :], axis=1)
        ds = tl.where(s > 0.0, g[None, :] * w[:, None], 0.0) * scale  # [HP, BJ]
        if IEEE:
            dq += tl.dot(ds, k.to(tl.float32), input_precision="ieee")
            dk = tl.dot(tl.trans(ds), q.to(tl.float32), input_precision="ieee")
        else:  # dS rounded to the inputs' dtype, fp32 accumulation (as the sparse-MLA backward)
            dsl = ds.to(k.dtype)
            dq += tl.dot(dsl, k)
            dk = tl.dot(tl.trans(dsl), q)
        if DK_PER_SLOT:
            tl.store(DK + (t * n_slots + j)[:, None] * D + d[None, :], dk, mask=jmask[:, None])
        else:
            tl.atomic_add(DK + idx[:, None].to(tl.int64) * D + d[None, :], dk, mask=valid[:, None], sem="relaxed")
    tl.store(DQ + t * (HI * D) + h[:, None] * D + d[None, :], dq, mask=hmask[:, None])
    tl.store(DW + t * HI + h, dw, mask=hmask)


def _geometry(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, indices: torch.Tensor):
    T, Hi, Di = q.shape
    if Di < 16 or Di & (Di - 1):
        raise ValueError(f"indexer head dim {Di} must be a power of two >= 16 for the Triton kernels")
    if k.dim() != 2 or k.shape[1] != Di:
        raise ValueError(f"indexer k must be [T_kv, {Di}], got {tuple(k.shape)}")
    if w.shape != (T, Hi):
        raise ValueError(f"indexer w must be [{T}, {Hi}], got {tuple(w.shape)}")
    if indices.dim() != 2 or indices.shape[0] != T or indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32 [{T}, topk], got {indices.dtype} {tuple(indices.shape)}")
    return T, Hi, Di, max(16, triton.next_power_of_2(Hi))


def slot_scores_forward(q, k, w, indices, block_slots: int = 64) -> torch.Tensor:
    """Scores [T, K] fp32 at the selected slots (-inf at padding); see the module docstring."""
    T, Hi, Di, HP = _geometry(q, k, w, indices)
    n = indices.shape[1]
    out = torch.empty(T, n, dtype=torch.float32, device=q.device)
    if T == 0 or n == 0:
        return out
    grid = (T * triton.cdiv(n, block_slots),)
    _slot_scores_fwd_kernel[grid](q.contiguous(), k.contiguous(), w.contiguous(), indices.contiguous(), out, n,
                                  Di ** -0.5, HI=Hi, HP=HP, D=Di, BJ=block_slots, IEEE=q.dtype == torch.float32)
    return out


def slot_scores_backward(q, k, w, indices, grad, block_slots: int = 128, deterministic: bool = False,
                         workspace_bytes: int = 1 << 30, num_warps: int = 4, num_stages: int = 3):
    """(dq [T, Hi, Di] fp32, dk [T_kv, Di] fp32, dw [T, Hi] fp32) for dL/dscore ``grad`` [T, K].

    ``deterministic``: dk summed in a fixed order (bitwise reproducible) through a workspace of at
    most ``workspace_bytes`` (at least one query row's [K, Di] fp32); dq and dw are the same either way."""
    T, Hi, Di, HP = _geometry(q, k, w, indices)
    n, T_kv = indices.shape[1], k.shape[0]
    dq = torch.empty(T, Hi, Di, dtype=torch.float32, device=q.device)
    dw = torch.empty(T, Hi, dtype=torch.float32, device=q.device)
    dk = torch.zeros(T_kv, Di, dtype=torch.float32, device=q.device)
    if T == 0 or n == 0:
        return dq.zero_(), dk, dw.zero_()
    q, k, w, indices, grad = (x.contiguous() for x in (q, k, w, indices, grad.float()))
    geometry = dict(HI=Hi, HP=HP, D=Di, BJ=block_slots, IEEE=q.dtype == torch.float32, num_warps=num_warps,
                    num_stages=num_stages)
    if not deterministic:
        _slot_scores_bwd_kernel[(T,)](q, k, w, indices, grad, dq, dw, dk, Di ** -0.5, n, DK_PER_SLOT=False,
                                      **geometry)
        return dq, dk, dw
    rows = max(1, min(T, workspace_bytes // (n * Di * 4)))
    per_slot = torch.empty(rows * n, Di, dtype=torch.float32, device=q.device)
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        block = indices[t0:t1]
        _slot_scores_bwd_kernel[(t1 - t0,)](q[t0:t1], k, w[t0:t1], block, grad[t0:t1], dq[t0:t1], dw[t0:t1],
                                            per_slot, Di ** -0.5, n, DK_PER_SLOT=True, **geometry)
        segment_sum_rows(per_slot, block.reshape(-1), dk, n_keys=T_kv)  # padding slots (-1) dropped
    return dq, dk, dw
