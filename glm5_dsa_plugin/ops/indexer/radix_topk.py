"""Triton radix select: the indexer's deterministic top-k of wide score rows without sorting them.

    scores [C, n] fp32 (-inf where invisible)  ->  indices [C, topk] int32

The result equals ``topk_from_keys(score_keys(scores), topk)`` of
:mod:`glm5_dsa_plugin.model.indexer` bit for bit: highest score first, equal scores to the lower
key index, ``-1`` (invisible or missing keys) last.

Method, one program per row. Each score maps to its order-preserving 32-bit image ``u`` (the
same image as ``score_keys``'s high half, offset to unsigned). Up to four passes over the row
build a 256-bin histogram of one byte of ``u`` (most significant first) among the keys that
match the bytes chosen so far, and choose the byte whose bucket holds the k-th largest image;
a pass whose bucket is needed whole ends the search early. A last pass writes, in key order,
every key above the chosen prefix and the lowest-index keys at it until k are taken, as the
int64 keys of ``score_keys``; one sort of those ``[C, k]`` keys gives the order. The row is
read two to five times and nothing of size ``C x n`` is written, where ``torch.topk`` over the
int64 keys needs the keys written first and a sixteen-pass radix select over them.
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


@triton.jit
def _radix_select_kernel(S, OUT, n, stride, K, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    src = S + row.to(tl.int64) * stride
    bins = tl.arange(0, 256)
    need = K                     # keys still to take from the bucket `prefix` (the k-th is among them)
    prefix = tl.zeros([], tl.int64)  # the chosen high bytes of u
    level = tl.full([], 32, tl.int32)  # bit position below the chosen bytes
    done = K == 0
    for p in tl.static_range(4):
        if not done:
            shift = 24 - 8 * p
            hist = tl.zeros([256], tl.int32)
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                inb = offs < n
                u = _image(tl.load(src + offs, mask=inb, other=float("-inf")))
                match = inb & ((u >> (shift + 8)) == prefix)
                hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=match)
            at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist
            b = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
            need -= tl.sum(tl.where(bins > b, hist, 0), 0)
            prefix = (prefix << 8) | b.to(tl.int64)
            level = tl.full([], shift, tl.int32)
            done = tl.sum(tl.where(bins == b, hist, 0), 0) == need
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < n
        x = tl.load(src + offs, mask=inb, other=float("-inf"))
        u = _image(x)
        hi = u >> level
        eq = inb & (hi == prefix)
        eq_i = eq.to(tl.int32)
        tie_rank = ties + tl.cumsum(eq_i, 0) - eq_i
        sel = (inb & (hi > prefix)) | (eq & (tie_rank < need))
        sel_i = sel.to(tl.int32)
        pos = taken + tl.cumsum(sel_i, 0) - sel_i
        key = ((u - 2147483648) << 32) | (n - 1 - offs).to(tl.int64)
        key = tl.where(x == float("-inf"), INVISIBLE_KEY, key)
        tl.store(OUT + row.to(tl.int64) * K + pos, key, mask=sel)
        taken += tl.sum(sel_i, 0)
        ties += tl.sum(eq_i, 0)


def radix_topk(scores: torch.Tensor, topk: int, block: int = 2048) -> torch.Tensor:
    """scores [C, n] fp32, -inf where invisible -> indices [C, topk] int32 (module docstring).

    Workspace: ``C x min(topk, n)`` int64 keys; the scores are only read."""
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise TypeError(f"radix_topk: scores must be 2-D float32, got {scores.dtype} {tuple(scores.shape)}")
    C, n = scores.shape
    k = min(topk, n)
    keys = torch.empty(C, k, dtype=torch.int64, device=scores.device)
    if C and k:
        s = scores if scores.stride(-1) == 1 else scores.contiguous()
        _radix_select_kernel[(C,)](s, keys, n, s.stride(0), k, BLOCK=min(block, triton.next_power_of_2(n)),
                                   num_warps=8)
    vals = keys.sort(dim=-1, descending=True).values
    idx = torch.where(vals == INVISIBLE_KEY.value, torch.full_like(vals, PAD_INDEX), (n - 1) - (vals & 0xFFFFFFFF))
    idx = idx.to(torch.int32)
    if topk > k:
        idx = torch.nn.functional.pad(idx, (0, topk - k), value=PAD_INDEX)
    return idx
