"""Triton radix select: the indexer's deterministic top-k of wide score rows without sorting them.

    scores [C, n] fp32 (-inf where invisible)  ->  indices [C, topk] int32

The result equals ``topk_from_keys(score_keys(scores), topk)`` of
:mod:`glm5_dsa_plugin.model.indexer` bit for bit: highest score first, equal scores to the lower
key index, ``-1`` (invisible or missing keys) last. With ``ordered=False`` each row holds the same
entries in ascending key order, ``-1`` last (the order the attention reads at long T): the kernel
writes int32 indices as it walks the row, and the int64 keys and their sort are skipped.

Method, one program per row. Each score maps to its order-preserving 32-bit image ``u`` (the
same image as ``score_keys``'s high half, offset to unsigned).

Sampled threshold (``sample_stride`` s > 1): two 256-bin histogram passes over every s-th entry
of the row choose the 16-bit bucket holding the sample's ``r``-th largest image, ``r`` a quarter
above ``topk / s``; one pass over the row then writes every entry at or above that bucket's lower
edge, in key order, to a per-row candidate list (about ``1.3 x topk`` entries on real scores). When
that list holds at least ``topk`` entries and fits, the top-k is among them and is settled there:
four histogram passes and a last select over the list, taking the lowest-index entries at the
k-th image. Otherwise (a sample that misleads, or a row with fewer visible keys than the list
needs) the row falls back to the full passes below, so the result never depends on the sample.

Full passes: two passes over the row build 256-bin histograms of u's top two bytes (the second
among the entries matching the first) and choose the bytes whose bucket holds the k-th largest
image. A third pass writes every key above that 16-bit bucket to the output and the bucket's
entries, in key order, to the candidate list; two histogram passes and a last select over the
candidates (about a hundred entries on real scores) settle the low bytes. A bucket larger than the
list (thousands of ties) takes the same two histograms and the select over the row instead.

The output holds the int64 keys of ``score_keys``; one sort of those ``[C, k]`` keys gives the
order (unless ``ordered=False``). The row's entries go through the histogram instructions once
on the sampled path (1 / s of them twice, then the list), three or five times otherwise, and
nothing of size ``C x n`` is written, where ``torch.topk`` over the int64 keys needs the keys
written first and a sixteen-pass radix select over them.
Runs under ``TRITON_INTERPRET=1`` on CPU (how CI tests it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..contract import PAD_INDEX
from .masked_scores import INVISIBLE_KEY, order_preserving_bits

__all__ = ["radix_topk"]


@triton.jit
def _image(x):
    """fp32 -> int64 in [0, 2**32): the order-preserving image, offset to unsigned."""
    return order_preserving_bits(x).to(tl.int64) + 2147483648


_NEG_INF_IMAGE: tl.constexpr = tl.constexpr(8388607)  # _image(-inf)


@triton.jit
def _load_image(src, offs, inb, FROM_CANDIDATES: tl.constexpr):
    """(image u, key index) of a tile: from the row's fp32 scores, or from the candidate list's
    ``u << 32 | index`` entries."""
    if FROM_CANDIDATES:
        c = tl.load(src + offs, mask=inb, other=0)
        u = (c >> 32) & 0xFFFFFFFF
        idx = c & 0xFFFFFFFF
    else:
        u = _image(tl.load(src + offs, mask=inb, other=float("-inf")))
        idx = offs.to(tl.int64)
    return u, idx


@triton.jit
def _histogram(src, m, shift, prefix, BLOCK: tl.constexpr, FROM_CANDIDATES: tl.constexpr, STRIDE: tl.constexpr = 1):
    """256-bin histogram of byte ``shift`` of u over the entries whose bits above it equal ``prefix``,
    among every ``STRIDE``-th of the first ``m``."""
    hist = tl.zeros([256], tl.int32)
    for start in range(0, tl.cdiv(m, STRIDE), BLOCK):
        offs = (start + tl.arange(0, BLOCK)) * STRIDE
        inb = offs < m
        u, _ = _load_image(src, offs, inb, FROM_CANDIDATES)
        match = inb & ((u >> (shift + 8)) == prefix)
        hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=match)
    return hist


@triton.jit
def _choose(hist, need, prefix):
    """The byte whose bucket holds the need-th largest: (prefix extended by it, keys still to take
    from that bucket, the bucket's size)."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist
    b = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
    need = need - tl.sum(tl.where(bins > b, hist, 0), 0)
    count = tl.sum(tl.where(bins == b, hist, 0), 0)
    return (prefix << 8) | b.to(tl.int64), need, count


@triton.jit
def _emit(src, m, n, K, level, prefix, need, out, taken, cand, BLOCK: tl.constexpr, FROM_CANDIDATES: tl.constexpr,
          COLLECT: tl.constexpr, KEYS: tl.constexpr):
    """Write, in key order, the keys (KEYS) or int32 indices of the entries whose ``u >> level`` is
    above ``prefix`` to ``out[taken:]``, and those equal to it: with COLLECT all of them to the
    candidate list ``cand``, else the first ``need``. Returns the new ``taken``. Indices of
    invisible entries are written as -1 from the row's end, so a single emission leaves the row in
    ascending key order with its -1 last; with COLLECT, indices go nowhere but the list (the caller
    writes the row in one more emission)."""
    ties = tl.zeros([], tl.int32)
    taken_inv = tl.zeros([], tl.int32)
    for start in range(0, m, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < m
        u, idx = _load_image(src, offs, inb, FROM_CANDIDATES)
        hi = u >> level
        eq = inb & (hi == prefix)
        eq_i = eq.to(tl.int32)
        rank = ties + tl.cumsum(eq_i, 0) - eq_i
        if COLLECT:
            sel = inb & (hi > prefix)
            tl.store(cand + rank, (u << 32) | idx, mask=eq)
        else:
            sel = (inb & (hi > prefix)) | (eq & (rank < need))
        if KEYS:
            sel_i = sel.to(tl.int32)
            pos = taken + tl.cumsum(sel_i, 0) - sel_i
            val = tl.where(u == _NEG_INF_IMAGE, INVISIBLE_KEY, ((u - 2147483648) << 32) | (n - 1 - idx))
            tl.store(out + pos, val, mask=sel)
            taken += tl.sum(sel_i, 0)
        elif not COLLECT:
            inv = u == _NEG_INF_IMAGE
            vis_i = (sel & ~inv).to(tl.int32)
            inv_i = (sel & inv).to(tl.int32)
            pos = tl.where(inv, K - 1 - (taken_inv + tl.cumsum(inv_i, 0) - inv_i), taken + tl.cumsum(vis_i, 0) - vis_i)
            tl.store(out + pos, tl.where(inv, -1, idx).to(tl.int32), mask=sel)
            taken += tl.sum(vis_i, 0)
            taken_inv += tl.sum(inv_i, 0)
        ties += tl.sum(eq_i, 0)
    return taken


@triton.jit
def _collect(src, n, lo, cand, cap, BLOCK: tl.constexpr):
    """Write, in key order, the row's entries with ``u >= lo`` to the candidate list (the first
    ``cap`` of them); return how many there are."""
    count = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < n
        u, idx = _load_image(src, offs, inb, False)
        sel_i = (inb & (u >= lo)).to(tl.int32)
        rank = count + tl.cumsum(sel_i, 0) - sel_i
        tl.store(cand + rank, (u << 32) | idx, mask=(sel_i != 0) & (rank < cap))
        count += tl.sum(sel_i, 0)
    return count


@triton.jit
def _full_passes(src, out, cand, n, K, cap, BLOCK: tl.constexpr, KEYS: tl.constexpr):
    """The top-k of the row from its top two bytes' histograms (module docstring, full passes)."""
    need = K
    prefix = tl.zeros([], tl.int64)
    count = n
    for p in tl.static_range(2):  # the high 16 bits of u, over the whole row
        hist = _histogram(src, n, 24 - 8 * p, prefix, BLOCK, False)
        prefix, need, count = _choose(hist, need, prefix)
    if count <= cap:
        # the keys above the bucket go out (KEYS); the bucket's entries become the candidate list
        taken = _emit(src, n, n, K, 16, prefix, need, out, tl.zeros([], tl.int32), cand, BLOCK, False, True, KEYS)
        for p in tl.static_range(2):
            hist = _histogram(cand, count, 8 - 8 * p, prefix, BLOCK, True)
            prefix, need, _ = _choose(hist, need, prefix)
        if KEYS:
            _emit(cand, count, n, K, 0, prefix, need, out, taken, cand, BLOCK, True, False, KEYS)
        else:  # indices in key order: the whole row once more, by its full 32-bit threshold
            _emit(src, n, n, K, 0, prefix, need, out, tl.zeros([], tl.int32), cand, BLOCK, False, False, KEYS)
    else:  # a bucket wider than the list (ties by the thousand): two more passes over the row
        for p in tl.static_range(2):
            hist = _histogram(src, n, 8 - 8 * p, prefix, BLOCK, False)
            prefix, need, _ = _choose(hist, need, prefix)
        _emit(src, n, n, K, 0, prefix, need, out, tl.zeros([], tl.int32), cand, BLOCK, False, False, KEYS)


@triton.jit
def _radix_select_kernel(S, OUT, CAND, n, stride, K, cap, r_sample, BLOCK: tl.constexpr, KEYS: tl.constexpr,
                         STRIDE: tl.constexpr):
    row = tl.program_id(0)
    src = S + row.to(tl.int64) * stride
    out = OUT + row.to(tl.int64) * K
    cand = CAND + row.to(tl.int64) * cap
    if STRIDE > 1:
        # the 16-bit bucket of the sample's r-th largest image; its lower edge bounds the list
        r = tl.minimum(r_sample, tl.cdiv(n, STRIDE))
        prefix = tl.zeros([], tl.int64)
        for p in tl.static_range(2):
            hist = _histogram(src, n, 24 - 8 * p, prefix, BLOCK, False, STRIDE)
            prefix, r, _ = _choose(hist, r, prefix)
        count = _collect(src, n, prefix << 16, cand, cap, BLOCK)
        if (count >= K) & (count <= cap):
            need = K
            prefix = tl.zeros([], tl.int64)
            for p in tl.static_range(4):
                hist = _histogram(cand, count, 24 - 8 * p, prefix, BLOCK, True)
                prefix, need, _ = _choose(hist, need, prefix)
            _emit(cand, count, n, K, 0, prefix, need, out, tl.zeros([], tl.int32), cand, BLOCK, True, False, KEYS)
        else:
            _full_passes(src, out, cand, n, K, cap, BLOCK, KEYS)
    else:
        _full_passes(src, out, cand, n, K, cap, BLOCK, KEYS)


def radix_topk(scores: torch.Tensor, topk: int, block: int = 1024, candidates: int = 1024, num_warps: int = 4,
               ordered: bool = True, sample_stride: int = 8) -> torch.Tensor:
    """scores [C, n] fp32, -inf where invisible -> indices [C, topk] int32 (module docstring); with
    ``ordered=False`` each row's same entries in ascending key order, -1 last.

    ``sample_stride``: the sampled threshold from every ``sample_stride``-th score (1: the full
    passes only). Workspace: ``C x min(topk, n)`` int64 keys and a candidate list of
    ``C x min(n, max(candidates, 2 x topk))`` int64 entries with the sampled threshold, else
    ``C x min(n, candidates)`` (a row whose list would overflow makes more passes over its scores
    instead); the scores are only read."""
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise TypeError(f"radix_topk: scores must be 2-D float32, got {scores.dtype} {tuple(scores.shape)}")
    if sample_stride < 1:
        raise ValueError(f"radix_topk: sample_stride must be >= 1, got {sample_stride}")
    C, n = scores.shape
    k = min(topk, n)
    out = torch.empty(C, k, dtype=torch.int64 if ordered else torch.int32, device=scores.device)
    if C and k:
        s = scores if scores.stride(-1) == 1 else scores.contiguous()
        cap = max(1, min(n, candidates if sample_stride == 1 else max(candidates, 2 * k)))
        # the sample's rank whose bucket bounds the list: a quarter above k / stride, so that the
        # list holds the top-k unless the sample misleads (then the row takes the full passes)
        per_sample = -(-k // sample_stride)
        r_sample = per_sample + per_sample // 4 + 16
        cand = torch.empty(C, cap, dtype=torch.int64, device=scores.device)
        _radix_select_kernel[(C,)](s, out, cand, n, s.stride(0), k, cap, r_sample,
                                   BLOCK=min(block, triton.next_power_of_2(n)), KEYS=ordered, STRIDE=sample_stride,
                                   num_warps=num_warps)
    if ordered:
        vals = out.sort(dim=-1, descending=True).values
        idx = torch.where(vals == INVISIBLE_KEY.value, torch.full_like(vals, PAD_INDEX), (n - 1) - (vals & 0xFFFFFFFF))
        idx = idx.to(torch.int32)
    else:
        idx = out
    if topk > k:
        idx = torch.nn.functional.pad(idx, (0, topk - k), value=PAD_INDEX)
    return idx
