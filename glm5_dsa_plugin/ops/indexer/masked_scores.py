"""Triton kernel for the lightning-indexer scores with the visibility mask fused in.

    out[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * Di ** -0.5)   if s is visible to t, else -inf

q [T, Hi, Di], k [T_kv, Di], w [T, Hi] (bf16 or fp32), fp32 accumulation; out [T, T_kv] fp32, or
with ``keys=True`` the int64 top-k keys of :func:`glm5_dsa_plugin.model.indexer.score_keys` (the
order-preserving integer image of the score in the high 32 bits, ``T_kv - 1 - s`` in the low 32).
Tiles whose keys all lie after every query of the tile in packed order are invisible by
construction (a visible key is in the query's sequence at a position <= the query's) and are
written as -inf without computing them: half of the work for causal self-attention.
Runs under ``TRITON_INTERPRET=1`` on CPU (how CI tests it).

FP8 scores (``key_scale`` given; :mod:`glm5_dsa_plugin.ops.indexer.fp8_index`): q [T, Hi, Di] and
k [T_kv, Di] are e4m3, w [T, Hi] fp32 holds ``w * q_scale * Di ** -0.5``, and

    out[t, s] = key_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])

The e4m3 operands are widened to bf16 on a GPU (every e4m3 value is a bf16 value, and bf16 x bf16
products are exact in the fp32 accumulator) and to fp32 in the interpreter: the dot products are
the exact products summed in fp32, not Hopper's FP8 MMA, whose accumulator keeps fewer bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .topk_keys import INVISIBLE_KEY as _INVISIBLE_KEY

__all__ = ["INVISIBLE_KEY", "order_preserving_bits", "masked_index_scores"]


# the package's INVISIBLE_KEY as a kernel constant
INVISIBLE_KEY: tl.constexpr = tl.constexpr(_INVISIBLE_KEY)


@triton.jit
def order_preserving_bits(x):
    """fp32 -> int32 whose signed order is x's order (``-0.0`` folded into ``+0.0``): the high half
    of a top-k key."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _index_scores_kernel(Q, K, W, KSCALE, QSEQ, QPOS, QIDX, KSEQ, KPOS, OUT, T, S, scale,
                         HI: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                         KEYS: tl.constexpr, FP8_DOT: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_t * BT + tl.arange(0, BT)
    cols = pid_s * BS + tl.arange(0, BS)
    rmask = rows < T
    cmask = cols < S
    omask = rmask[:, None] & cmask[None, :]
    optr = OUT + rows[:, None].to(tl.int64) * S + cols[None, :]
    last_query = tl.max(tl.load(QIDX + rows, mask=rmask, other=-1), axis=0)
    if pid_s * BS > last_query:
        if KEYS:
            tl.store(optr, tl.full([BT, BS], INVISIBLE_KEY, tl.int64), mask=omask)
        else:
            tl.store(optr, tl.full([BT, BS], float("-inf"), tl.float32), mask=omask)
    else:
        d = tl.arange(0, D)
        k = tl.load(K + cols[:, None].to(tl.int64) * D + d[None, :], mask=cmask[:, None], other=0.0)
        if FP8_DOT is not None:
            k = k.to(FP8_DOT)
        acc = tl.zeros([BT, BS], dtype=tl.float32)
        for h in range(HI):
            q = tl.load(Q + rows[:, None].to(tl.int64) * (HI * D) + h * D + d[None, :], mask=rmask[:, None],
                        other=0.0)
            if FP8_DOT is not None:
                q = q.to(FP8_DOT)
            s = tl.dot(q, tl.trans(k)) * scale
            w = tl.load(W + rows * HI + h, mask=rmask, other=0.0).to(tl.float32)
            acc += tl.maximum(s, 0.0) * w[:, None]
        if FP8_DOT is not None:
            acc *= tl.load(KSCALE + cols, mask=cmask, other=0.0)[None, :]
        qs = tl.load(QSEQ + rows, mask=rmask, other=-1)
        qp = tl.load(QPOS + rows, mask=rmask, other=-1)
        ks = tl.load(KSEQ + cols, mask=cmask, other=-2)
        kp = tl.load(KPOS + cols, mask=cmask, other=0)
        vis = (qs[:, None] == ks[None, :]) & (kp[None, :] <= qp[:, None])
        if KEYS:
            # the score's order-preserving image above, the index tie-break below
            key = (order_preserving_bits(acc).to(tl.int64) << 32) | (S - 1 - cols[None, :]).to(tl.int64)
            tl.store(optr, tl.where(vis, key, INVISIBLE_KEY), mask=omask)
        else:
            tl.store(optr, tl.where(vis, acc, float("-inf")), mask=omask)


def masked_index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, query_seq, query_pos, query_index,
                        key_seq, key_pos, block_t: int = 64, block_s: int = 128, keys: bool = False,
                        key_scale: torch.Tensor | None = None, num_warps: int = 4, num_stages: int = 2
                        ) -> torch.Tensor:
    """Scores [C, T_kv] fp32 for the query rows given (their seq / pos / packed index), -inf where invisible;
    with ``keys`` the int64 top-k keys instead (``INVISIBLE_KEY`` where invisible).

    ``key_scale`` [T_kv] fp32: the FP8 scores (module docstring); q and k must then be float8_e4m3fn."""
    C, Hi, Di = q.shape
    n = k.shape[0]
    if Di < 16 or Di & (Di - 1):
        raise ValueError(f"indexer head dim {Di} must be a power of two >= 16 for the Triton kernel")
    fp8_dot, scale = None, Di ** -0.5
    if key_scale is not None:
        for name, x in (("q", q), ("k", k)):
            if x.dtype != torch.float8_e4m3fn:
                raise TypeError(f"masked_index_scores: with key_scale, {name} must be float8_e4m3fn, got {x.dtype}")
        if key_scale.shape != (n,) or key_scale.dtype != torch.float32:
            raise ValueError(f"masked_index_scores: key_scale must be float32 [{n}], got {key_scale.dtype} "
                             f"{tuple(key_scale.shape)}")
        # the interpreter's bf16 dot is not exact: widen to fp32 there (the same exact products)
        fp8_dot, scale = (tl.bfloat16 if q.is_cuda else tl.float32), 1.0
    out = torch.empty(C, n, dtype=torch.int64 if keys else torch.float32, device=q.device)
    if C == 0 or n == 0:
        return out
    grid = (triton.cdiv(C, block_t), triton.cdiv(n, block_s))
    _index_scores_kernel[grid](q.contiguous(), k.contiguous(), w.contiguous(),
                               key_scale.contiguous() if key_scale is not None else w, query_seq.contiguous(),
                               query_pos.contiguous(), query_index.contiguous(), key_seq.contiguous(),
                               key_pos.contiguous(), out, C, n, scale, HI=Hi, D=Di, BT=block_t, BS=block_s,
                               KEYS=keys, FP8_DOT=fp8_dot, num_warps=num_warps, num_stages=num_stages)
    return out
