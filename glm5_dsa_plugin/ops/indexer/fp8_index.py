"""FP8 lightning-indexer scoring as DeepSeek-V3.2's inference code defines it (PyTorch reference).

The rollout engines (SGLang / vLLM on DeepSeek-V3.2 and GLM-5.x) score the indexer in FP8:

1. Hadamard rotation of the indexer q [T, Hi, Di] and k [S, Di] (orthonormal, ``Had / sqrt(Di)``,
   on the bf16 values after RoPE; result rounded to bf16);
2. :func:`act_quant`: e4m3 with one fp32 scale per block of 128 channels, the scale rounded up to a
   power of two (UE8M0): ``s = 2 ** ceil(log2(max(amax, 1e-4) * (1 / 448)))``,
   ``x8 = e4m3(clamp(x / s, -448, 448))``; with Di = 128 that is one scale per (row, head) of q and
   one per key;
3. :func:`fp8_index`: ``score[t, s] = k_s[s] * sum_h relu(q8[t, h] . k8[s]) * w'[t, h]`` with
   ``w'[t, h] = w[t, h] * q_s[t, h] * Di ** -0.5`` (w = weights_proj(x) * Hi ** -0.5, fp32).

Exact arithmetic of this definition: every e4m3 x e4m3 product is exact in fp32, the 128-term dot
products are summed in fp32. The top-k on these scores (:func:`fp8_select_topk`) is in a
documented order: highest score first, equal scores in ascending key index, keys invisible to the
row never selected, slots no visible key fills are -1 and come last; the same order as
:func:`glm5_dsa_plugin.model.indexer.deterministic_topk`.

Units: scores are fp32, same scale as the bf16 definition
``sum_h w * relu(q . k * Di ** -0.5)`` up to the FP8 rounding of q and k.
"""

from __future__ import annotations

from typing import Callable

import torch

E4M3_MAX = 448.0
BLOCK = 128  # channels per scale
AMAX_FLOOR = 1e-4  # smallest amax a block is scaled for (an all-zero block gets 2 ** -22)
PAD_INDEX = -1


def ue8m0_ceil(s: torch.Tensor) -> torch.Tensor:
    """Positive normal fp32 ``s`` -> ``2 ** ceil(log2(s))`` (fp32), from the IEEE bits as the kernels
    do: exponent field - 127, plus one when any mantissa bit is set. Exact powers of two stay."""
    if s.dtype != torch.float32:
        raise TypeError(f"ue8m0_ceil: s must be float32, got {s.dtype}")
    if bool((s <= 0).any()) or not bool(torch.isfinite(s).all()):
        bad = ((s <= 0) | ~torch.isfinite(s)).nonzero()[0].tolist()
        raise ValueError(f"ue8m0_ceil: s must be positive and finite, got {float(s[tuple(bad)])} at {bad}")
    bits = s.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    e = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (e << 23).view(torch.float32)


def act_quant(x: torch.Tensor, block: int = BLOCK, scale_fmt: str | None = "ue8m0"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] (N % block == 0) -> (x8 [..., N] float8_e4m3fn, s [..., N // block] fp32).

    Per block of ``block`` channels: ``amax = max(max|x|, 1e-4)`` (fp32), ``s = amax * fp32(1/448)``,
    rounded up to a power of two when ``scale_fmt == "ue8m0"`` (None: kept as is);
    ``x8 = e4m3(clamp(x / s, -448, 448))`` (round to nearest even). ``x8 * s`` approximates x."""
    N = x.shape[-1]
    if N % block:
        raise ValueError(f"act_quant: last dim {N} of x {tuple(x.shape)} is not a multiple of block {block}")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"act_quant: scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")
    xb = x.float().reshape(*x.shape[:-1], N // block, block)
    amax = xb.abs().amax(-1).clamp_min(AMAX_FLOOR)
    s = amax * torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)
    if scale_fmt == "ue8m0":
        s = ue8m0_ceil(s)
    y = (xb / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return y.reshape(x.shape), s


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a power of two) -> x @ (Had_D / sqrt(D)) in x's dtype (computed in fp32).

    ``Had_D`` is Sylvester's (symmetric, entries +-1), the matrix of the fast Walsh-Hadamard
    transform the inference code applies; it is orthonormal after the scale."""
    D = x.shape[-1]
    if D < 1 or D & (D - 1):
        raise ValueError(f"hadamard_rotate: last dim of x {tuple(x.shape)} must be a power of two")
    y = x.float().reshape(-1, D)
    h = 1
    while h < D:  # butterflies: (a, b) -> (a + b, a - b) on pairs h apart
        y = y.view(-1, D // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(x.shape) * D ** -0.5).to(x.dtype)


def fp8_index(q8: torch.Tensor, weights: torch.Tensor, k8: torch.Tensor, k_s: torch.Tensor) -> torch.Tensor:
    """q8 [C, Hi, D] e4m3, weights [C, Hi] fp32 (= w * q_s * D ** -0.5), k8 [S, D] e4m3, k_s [S] fp32
    -> scores [C, S] fp32: ``k_s[s] * sum_h relu(q8[c, h] . k8[s]) * weights[c, h]``."""
    logits = torch.einsum("chd,sd->chs", q8.float(), k8.float())
    return torch.einsum("chs,ch->cs", torch.relu(logits), weights.float()) * k_s.float()[None, :]


def quantize_keys(k: torch.Tensor, rotate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys k [S, D] (after RoPE) -> (k8 [S, D] e4m3, k_s [S] fp32), as the FP8 key cache holds them."""
    D = k.shape[-1]
    if D != BLOCK:
        raise ValueError(f"fp8 indexer: head dim {D} must be {BLOCK} (one scale per key), k is {tuple(k.shape)}")
    kr = hadamard_rotate(k.to(torch.bfloat16)) if rotate else k
    k8, ks = act_quant(kr.contiguous())
    return k8, ks[:, 0]


def fp8_index_scores(q: torch.Tensor, k: torch.Tensor | tuple, w: torch.Tensor, rotate: bool = True) -> torch.Tensor:
    """FP8 indexer scores, no visibility mask: q [C, Hi, D] (after RoPE), k [S, D] or the pair
    :func:`quantize_keys` returns, w [C, Hi] (weights_proj(x) * Hi ** -0.5) -> [C, S] fp32.

    ``rotate``: the Hadamard rotation of q and k before quantisation (DeepSeek-V3.2 / GLM-5.x
    rollout engines apply it; the rotation is exact in bf16 arithmetic but not after FP8)."""
    C, Hi, D = q.shape
    if D != BLOCK:
        raise ValueError(f"fp8 indexer: head dim {D} must be {BLOCK} (one scale per head), q is {tuple(q.shape)}")
    if w.shape != (C, Hi):
        raise ValueError(f"fp8 indexer: w must be {(C, Hi)}, got {tuple(w.shape)}")
    k8, ks = k if isinstance(k, tuple) else quantize_keys(k, rotate)
    return fp8_index(*quantize_queries(q, w, rotate), k8, ks)


def quantize_queries(q: torch.Tensor, w: torch.Tensor, rotate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer queries q [C, Hi, D] (after RoPE, D = 128) and w [C, Hi] -> (q8 [C, Hi, D] e4m3,
    weights [C, Hi] fp32 = ``w * q_scale * D ** -0.5``): the query operands of :func:`fp8_index`."""
    D = q.shape[-1]
    if D != BLOCK:
        raise ValueError(f"fp8 indexer: head dim {D} must be {BLOCK} (one scale per head), q is {tuple(q.shape)}")
    qr = hadamard_rotate(q.to(torch.bfloat16)) if rotate else q
    q8, qs = act_quant(qr.contiguous())
    return q8, w.float() * qs[..., 0] * (D ** -0.5)


def topk_ordered(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [C, S] fp32 (-inf where invisible) -> [C, topk] int32: highest first, equal scores in
    ascending key index (a stable descending sort), -1 for slots without a visible key."""
    C, S = scores.shape
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    vals, idx = torch.sort(scores + 0.0, dim=-1, descending=True, stable=True)  # + 0.0: -0.0 ties +0.0
    k_eff = min(topk, S)
    vals, idx = vals[:, :k_eff], idx[:, :k_eff].to(torch.int32)
    idx = torch.where(vals == float("-inf"), torch.full_like(idx, PAD_INDEX), idx)
    if topk > k_eff:
        idx = torch.nn.functional.pad(idx, (0, topk - k_eff), value=PAD_INDEX)
    return idx


def fp8_select_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int,
                    visible: Callable[[slice], torch.Tensor], rotate: bool = True,
                    chunk_rows: int | None = None) -> torch.Tensor:
    """Top-k indices [T, topk] int32 on the FP8 scores of :func:`fp8_index_scores`.

    ``visible(rows)`` returns the bool mask [rows, S] of keys each query row may see. Row blocks of
    ``chunk_rows`` (default: about 2**25 fp32 elements of [rows, Hi, S] scratch at a time); the keys
    are quantised once. Order: :func:`topk_ordered`."""
    T, Hi, _ = q.shape
    S = k.shape[0]
    c = chunk_rows or max(1, (1 << 25) // max(1, Hi * S))
    keys = quantize_keys(k, rotate)
    out = torch.empty(T, topk, dtype=torch.int32, device=q.device)
    with torch.no_grad():
        for t0 in range(0, T, c):
            t1 = min(T, t0 + c)
            sc = fp8_index_scores(q[t0:t1], keys, w[t0:t1], rotate)
            out[t0:t1] = topk_ordered(sc.masked_fill(~visible(slice(t0, t1)), float("-inf")), topk)
    return out


__all__ = ["act_quant", "ue8m0_ceil", "hadamard_rotate", "fp8_index", "quantize_keys", "quantize_queries",
           "fp8_index_scores",
           "topk_ordered", "fp8_select_topk", "E4M3_MAX", "BLOCK"]
