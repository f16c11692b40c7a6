"""GLM-5 lightning indexer math: scores, deterministic top-k, the scores at the selected slots.

Pure PyTorch, no Megatron, with Triton fast paths on CUDA (:mod:`glm5_dsa_plugin.ops.indexer`).
Matches HF transformers >= 5.13 ``GlmMoeDsaIndexer`` (model type ``glm_moe_dsa``). Its neighbours:
:mod:`.rope` (the indexer's RoPE), :mod:`.visibility` (who may see whom), :mod:`.indexer_loss`
(the KL loss), :mod:`.index_sharing` (which layers compute their top-k).

Shapes (packed THD; a batch is flattened into one packed sequence with ``cu_seqlens``):
    q  [T, Hi, Di]   indexer queries after RoPE          (GLM-5: Hi = 32, Di = 128)
    k  [T_kv, Di]    indexer keys after LayerNorm + RoPE
    w  [T, Hi]       weights_proj(x) * Hi ** -0.5
    score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * Di ** -0.5)   for visible (t, s)
"""

from __future__ import annotations

import torch

from ..ops import indexer as indexer_kernels
from ..ops.contract import PAD_INDEX
from ..ops.indexer import fp8_index
from ..ops.indexer.topk_keys import INVISIBLE_KEY
from ..ops.reference import live_slot_columns
from .visibility import Visibility

__all__ = ["index_scores", "deterministic_topk", "score_keys", "INVISIBLE_KEY", "RADIX_MIN_KEYS", "topk_from_keys",
           "KEY_ORDER_MIN_KEYS", "slots_in_key_order", "reads_key_order", "attention_slot_order", "topk_row_block",
           "select_topk", "check_topk", "selected_scores_reference", "selected_scores"]

_CHUNK_ELEMS = 1 << 25  # fp32 elements of [rows, Hi, T_kv] scratch per chunk


# --------------------------------------------------------------------------- scores + top-k
def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q [C, Hi, Di], k [T_kv, Di], w [C, Hi] -> fp32 scores [C, T_kv] (no visibility mask)."""
    s = torch.einsum("chd,sd->chs", q.float(), k.float()) * (q.shape[-1] ** -0.5)
    return torch.einsum("chs,ch->cs", torch.relu(s), w.float())


def deterministic_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [C, T_kv] fp32 with -inf for invisible keys -> indices [C, topk] int32.

    Highest score first; equal scores in ascending key index (lowest index wins the last places);
    slots with no visible key are -1 and come last. Exact and independent of the order in
    which torch.topk happens to return ties: one ``topk`` over :func:`score_keys`."""
    return topk_from_keys(score_keys(scores), topk)


def score_keys(scores: torch.Tensor) -> torch.Tensor:
    """scores [C, T_kv] fp32 (-inf where invisible) -> int64 keys whose descending order is the
    top-k order of :func:`deterministic_topk`: the order-preserving integer image of the score in the
    high 32 bits (``-0.0`` folded into ``+0.0``), ``T_kv - 1 - s`` in the low 32 bits (lower key index
    wins a tie), and ``INVISIBLE_KEY`` for -inf. Distinct for distinct keys, so one ``topk`` is exact."""
    n = scores.shape[-1]
    bits = (scores.float() + 0.0).view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    low = (n - 1 - torch.arange(n, device=scores.device, dtype=torch.int64))
    keys = (ordered.to(torch.int64) << 32) | low
    return keys.masked_fill(scores == float("-inf"), INVISIBLE_KEY)


def topk_from_keys(keys: torch.Tensor, topk: int, ordered: bool = True) -> torch.Tensor:
    """keys [C, T_kv] int64 from :func:`score_keys` -> indices [C, topk] int32, highest first, -1 last;
    with ``ordered=False`` each row's same entries in no particular order (-1 where invisible)."""
    C, n = keys.shape
    k_eff = min(topk, n)
    vals, idx = keys.topk(k_eff, dim=-1, sorted=ordered)
    idx = torch.where(vals == INVISIBLE_KEY, torch.full_like(idx, PAD_INDEX), idx).to(torch.int32)
    if topk > k_eff:
        idx = torch.nn.functional.pad(idx, (0, topk - k_eff), value=PAD_INDEX)
    return idx


# kv rows from which sparse MLA reads each row's top-k in key order (slots_in_key_order): at 64K the
# backward's fp32 dKV [T_kv, 576] atomics stay in L2; at every T the top-k selected in key order
# skips the radix select's score-order output and torch.topk's sort; docs/kernels.md has the figures
KEY_ORDER_MIN_KEYS = 0


def slots_in_key_order(indices: torch.Tensor) -> torch.Tensor:
    """A copy of ``indices`` [..., K] int32 with each row's entries in ascending unsigned order: the
    valid keys ascending, then any other negative value, then the -1 padding (every value kept,
    so index validation downstream still sees a bad one).

    Sparse attention over a row's slots does not depend on their order. In key order the query
    rows a GPU runs at once walk their keys in step, so the backward's fp32 dKV atomics land in
    neighbouring kv rows and stay in L2 at long T (the attention does this from
    ``KEY_ORDER_MIN_KEYS`` kv rows; docs/kernels.md). Flipping the sign bit maps the
    unsigned order onto int32's, so the sort is one signed sort between two xors."""
    flip = torch.iinfo(torch.int32).min
    return torch.bitwise_xor(indices, flip).sort(dim=-1).values.bitwise_xor_(flip)


def reads_key_order(n_kv: int) -> bool:
    """Whether sparse MLA reads each row's slots in key order against ``n_kv`` kv rows
    (from ``KEY_ORDER_MIN_KEYS``)."""
    return n_kv >= KEY_ORDER_MIN_KEYS


def attention_slot_order(indices: torch.Tensor, n_kv: int) -> torch.Tensor:
    """The top-k [T, topk] as sparse MLA reads it against ``n_kv`` kv rows: from
    ``KEY_ORDER_MIN_KEYS`` kv rows each row's slots in key order (:func:`slots_in_key_order`, the
    same attention), else as they are. The layer's indexer loss reads the same order (its value does
    not depend on it), so one copy of the top-k is kept for the backward. A top-k the layer selects
    itself comes in this order from ``select_topk(..., key_order=reads_key_order(n_kv))``."""
    return slots_in_key_order(indices) if reads_key_order(n_kv) else indices


# keys per row (the block's key prefix) from which a GPU block selects by the radix-select kernel
# over fp32 scores instead of torch.topk over the int64 keys: any prefix wider than GLM-5's top-k of
# 2048 (docs/kernels.md has the layer figures)
RADIX_MIN_KEYS = 2049

_KEY_CHUNK_BYTES = 1 << 29  # int64 keys of one row block on a GPU (the only O(rows x T_kv) buffer)


def topk_row_block(n_keys: int) -> int:
    """Query rows per block of :func:`select_topk` on a GPU, against ``n_keys`` keys: the block's
    int64 fused keys (``rows x n_keys x 8`` bytes) stay within 512 MiB."""
    return max(1, _KEY_CHUNK_BYTES // (8 * max(1, n_keys)))


def select_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int, vis: Visibility,
                chunk_rows: int | None = None, check: bool = True, precision: str = "bf16",
                key_order: bool = False) -> torch.Tensor:
    """Indices [T, topk] int32 in packed kv coordinates, chunked over query rows.

    :func:`deterministic_topk` of the masked scores (highest score first, ties to the lower key
    index, -1 last), the keys fused into the score kernel on a GPU; a block whose key prefix reaches
    ``RADIX_MIN_KEYS`` is selected from fp32 scores by the radix-select kernel
    (:mod:`glm5_dsa_plugin.ops.indexer.radix_topk`) instead, in the same order. With ``key_order``
    the same entries in :func:`slots_in_key_order`'s order (what sparse MLA reads at long T): the
    radix select writes each row in that order as it walks it, and a ``torch.topk`` block skips its
    score-order sort and is sorted once, by key.
    ``precision="fp8"`` scores as the rollout engines do
    (:func:`glm5_dsa_plugin.ops.indexer.fp8_index.fp8_index_scores`: Hadamard rotation, e4m3 with
    UE8M0 scales, q and k quantised once), on the same kernels and in the same order. Every emitted
    index is visible to its row (same sequence, not in the future) and < T_kv; -1 fills the slots a
    row cannot use. ``check`` verifies all of that before returning (three host
    reads and a sort; a violation is a bug here, raised). The attention module passes
    ``check=False``: these hold by construction (tested), and ``sparse_mla`` validates the index range
    right after, so nothing out of range ever reaches a kernel. Memory: one block of rows x T_kv int64
    keys (or fp32 scores for the radix select) at a time (at most 512 MiB on a GPU), nothing of size
    T x T_kv."""
    T, Hi, _ = q.shape
    n = k.shape[0]
    out = torch.empty(T, topk, dtype=torch.int32, device=q.device)
    key_scale = None
    if precision == "fp8":
        k, key_scale = fp8_index.quantize_keys(k)
        q, w = fp8_index.quantize_queries(q, w)
    elif precision != "bf16":
        raise ValueError(f"select_topk: precision must be 'bf16' or 'fp8', got {precision!r}")
    use_triton = indexer_kernels.runs_on(q)
    if chunk_rows:
        c = chunk_rows
    elif use_triton:
        c = topk_row_block(n)
    else:
        c = max(1, _CHUNK_ELEMS // max(1, Hi * n))
    qidx = vis.qidx
    if use_triton:
        from ..ops.indexer import masked_scores, radix_topk
    with torch.no_grad():
        for t0 in range(0, T, c):
            t1 = min(T, t0 + c)
            # query row t is key t (no query_index): keys after the block's last row are invisible to
            # it, so the block scores and selects over the key prefix [0, t1) only; the same order, as
            # the tie-break key T_kv - 1 - s and the prefix's t1 - 1 - s both fall as s grows
            m = min(n, t1) if vis.query_index is None else n
            keys = sel = None
            by_key = False  # sel already in key order (the radix select writes it so)
            if use_triton:
                radix = m >= RADIX_MIN_KEYS and m > topk  # fp32 scores for the radix select, else int64 keys
                keys = indexer_kernels.call_or_none(masked_scores.masked_index_scores, q[t0:t1], k[:m], w[t0:t1],
                                       vis.query_seq[t0:t1], vis.query_pos[t0:t1], qidx[t0:t1], vis.key_seq[:m],
                                       vis.key_pos[:m], keys=not radix,
                                       key_scale=None if key_scale is None else key_scale[:m])
                if keys is not None and radix:
                    sel = indexer_kernels.call_or_none(radix_topk.radix_topk, keys, topk, ordered=not key_order)
                    by_key = sel is not None and key_order
                    keys = score_keys(keys) if sel is None else None  # the kernel refused: int64 keys
            if keys is None and sel is None:
                sc = (index_scores(q[t0:t1], k[:m], w[t0:t1]) if key_scale is None
                      else fp8_index.fp8_index(q[t0:t1], w[t0:t1], k[:m], key_scale[:m]))
                keys = score_keys(sc.masked_fill(~vis.mask(slice(t0, t1))[:, :m], float("-inf")))
            if sel is None:
                sel = topk_from_keys(keys, topk, ordered=not key_order)
            out[t0:t1] = slots_in_key_order(sel) if key_order and not by_key else sel
            del keys, sel
    if check:
        check_topk(out, vis)
    return out


def check_topk(indices: torch.Tensor, vis: Visibility) -> None:
    """Raise if any index is outside [-1, T_kv), invisible to its row, or repeated in its row."""
    n = vis.key_seq.shape[0]
    bad_range = (indices < PAD_INDEX) | (indices >= n)
    if bool(bad_range.any()):
        t, j = bad_range.nonzero()[0].tolist()
        raise RuntimeError(f"indexer produced index {int(indices[t, j])} at row {t}, slot {j}; T_kv = {n}")
    valid = indices >= 0
    safe = indices.clamp(min=0).long()
    seen = (vis.key_seq[safe] == vis.query_seq[:, None]) & (vis.key_pos[safe] <= vis.query_pos[:, None])
    if bool((valid & ~seen).any()):
        t, j = (valid & ~seen).nonzero()[0].tolist()
        raise RuntimeError(f"indexer selected key {int(indices[t, j])} invisible to row {t} (slot {j})")
    srt = torch.sort(torch.where(valid, indices, torch.full_like(indices, -2 - 0)), dim=-1).values
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(dup.any()):
        t = int(dup.nonzero()[0, 0])
        raise RuntimeError(f"indexer selected a key twice in row {t}")


def selected_scores_reference(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The PyTorch definition of :func:`selected_scores` (gathers [T, K, Di]; for tests and CPU)."""
    live = live_slot_columns(indices)
    idx = indices if live is None else indices[:, live]
    valid = idx >= 0
    ks = k[idx.clamp(min=0).long()]  # [T, K_live, Di]
    s = torch.einsum("thd,tkd->thk", q.float(), ks.float()) * (q.shape[-1] ** -0.5)
    sc = torch.einsum("thk,th->tk", torch.relu(s), w.float()).masked_fill(~valid, float("-inf"))
    if live is None:
        return sc
    return sc.new_full(indices.shape, float("-inf")).index_copy(1, live, sc)


class _SelectedScores(torch.autograd.Function):
    """Triton forward / backward of the selected-slot scores (:mod:`glm5_dsa_plugin.ops.indexer.slot_scores`)."""

    @staticmethod
    def forward(ctx, q, k, w, indices, deterministic):
        from ..ops.indexer import slot_scores

        ctx.save_for_backward(q, k, w, indices)
        ctx.deterministic = deterministic
        return slot_scores.slot_scores_forward(q, k, w, indices)

    @staticmethod
    def backward(ctx, grad):
        from ..ops.indexer import slot_scores

        q, k, w, indices = ctx.saved_tensors
        dq, dk, dw = slot_scores.slot_scores_backward(q, k, w, indices, grad, deterministic=ctx.deterministic)
        return dq.to(q.dtype), dk.to(k.dtype), dw.to(w.dtype), None, None


def selected_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, indices: torch.Tensor,
                    deterministic: bool = False) -> torch.Tensor:
    """Differentiable indexer logits at the selected slots: [T, topk] fp32, -inf at padding.

    q [T, Hi, Di], k [T_kv, Di], w [T, Hi], indices [T, topk] int32 (-1 padding). On CUDA the Triton
    kernels compute it and its gradients without gathering [T, topk, Di]: dk accumulated in fp32
    atomics, or with ``deterministic`` in a fixed order (bitwise reproducible, a bounded
    workspace; see :mod:`glm5_dsa_plugin.ops.indexer.slot_scores`). On CPU: the PyTorch definition."""
    if indexer_kernels.runs_on(q):
        return _SelectedScores.apply(q, k, w, indices.to(torch.int32).contiguous(), bool(deterministic))
    return selected_scores_reference(q, k, w, indices)
