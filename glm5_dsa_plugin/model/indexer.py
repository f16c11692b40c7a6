"""GLM-5 lightning indexer math: RoPE, scores, deterministic top-k, indexer KL loss, index sharing.

Pure PyTorch, no Megatron. Matches HF transformers >= 5.13 ``GlmMoeDsaIndexer`` (model type
``glm_moe_dsa``). Internal layout (the HF one, chosen once here): the RoPE part is the *first*
``rope_dim`` channels of the indexer q/k. Two rotation conventions (``apply_rope_first``):
interleaved (GLM-5.x: config ``indexer_rope_interleave: true``, megatron-core
``dsa_indexer_rope_interleaved=True``) rotates the channel pairs (0, 1), (2, 3), ...; half split
(DeepSeek-V3.2) rotates the pairs (i, i + rope_dim / 2).

Shapes (packed THD; a batch is flattened into one packed sequence with ``cu_seqlens``):
    q  [T, Hi, Di]   indexer queries after RoPE          (GLM-5: Hi = 32, Di = 128)
    k  [T_kv, Di]    indexer keys after LayerNorm + RoPE
    w  [T, Hi]       weights_proj(x) * Hi ** -0.5
    score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * Di ** -0.5)   for visible (t, s)
Visibility: same sequence and key position <= query position (positions within the sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import indexer as indexer_kernels
from ..ops.contract import PAD_INDEX
from ..ops.indexer import fp8_index
from ..ops.indexer.topk_keys import INVISIBLE_KEY
from ..ops.reference import live_slot_columns

__all__ = ["rope_cos_sin", "apply_rope_first", "Visibility", "index_scores", "deterministic_topk", "score_keys",
           "INVISIBLE_KEY", "RADIX_MIN_KEYS", "topk_from_keys", "KEY_ORDER_MIN_KEYS", "slots_in_key_order",
           "reads_key_order", "attention_slot_order", "topk_row_block", "select_topk", "check_topk",
           "selected_scores_reference", "selected_scores", "attention_target_reference",
           "indexer_kl_loss_from_target", "indexer_kl_loss", "indexer_kl_loss_and_grad", "computes_indices", "index_source_layer",
           "check_stage_layers"]

_CHUNK_ELEMS = 1 << 25  # fp32 elements of [rows, Hi, T_kv] scratch per chunk


# --------------------------------------------------------------------------- RoPE
def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float, dtype=torch.float32):
    """positions [T] int -> (cos, sin) [T, rope_dim] in HF's ``cat(freqs, freqs)`` layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device) / rope_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
                     ) -> torch.Tensor:
    """RoPE on the first ``r = cos.shape[-1]`` channels of x [T, ..., D]; cos/sin [T, r] (``rope_cos_sin``).

    ``interleaved=False``: channel i pairs with i + r/2 (half split). ``interleaved=True``: channel
    2j pairs with 2j + 1, rotated by frequency j; the rotated channels come out de-interleaved
    (the j-th pair's two outputs at j and j + r/2), as HF and megatron-core lay them out. Every
    score is a dot product of a rotated q with a rotated k, so that output order is invisible
    as long as q and k use the same convention."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    if interleaved:
        x_rot = torch.cat([x_rot[..., 0::2], x_rot[..., 1::2]], dim=-1)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    c, s = cos.view(shape), sin.view(shape)
    half = r // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * c + rotated * s, x_pass], dim=-1)


# --------------------------------------------------------------------------- visibility
def _boundary_errors(cu: torch.Tensor, padded: torch.Tensor | None) -> tuple[bool, bool, int, int]:
    """(lengths decrease somewhere, a padded length is below its real one, first boundary, packed
    total) of int64 boundaries, in one host read."""
    layout = cu if padded is None else padded
    lengths = cu[1:] - cu[:-1]
    bad_order, bad_pad, first, total = torch.stack([(lengths < 0).any().long(),
                                                    ((layout[1:] - layout[:-1]) < lengths).any().long(),
                                                    layout[0], layout[-1]]).tolist()
    return bool(bad_order), bool(bad_pad), int(first), int(total)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the device's queue (pinned staging)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class Visibility:
    """Who may see whom, in packed coordinates.

    query_seq/query_pos [T] and key_seq/key_pos [T_kv] (int64): sequence id and position inside
    the sequence; key s is visible to query t iff same sequence and key_pos[s] <= query_pos[t].
    Query rows and key rows may be different token sets (context parallel: local queries against
    the all-gathered keys, both in the natural packed order)."""

    query_seq: torch.Tensor
    query_pos: torch.Tensor
    key_seq: torch.Tensor
    key_pos: torch.Tensor
    query_index: torch.Tensor | None = None  # packed index of each query row among the keys (default: same rows)

    @property
    def qidx(self) -> torch.Tensor:
        if self.query_index is not None:
            return self.query_index
        return torch.arange(self.query_seq.shape[0], device=self.query_seq.device)

    @staticmethod
    def from_cu_seqlens(cu_seqlens: torch.Tensor, device=None, cu_seqlens_padded: torch.Tensor | None = None
                        ) -> "Visibility":
        """cu_seqlens [n_seq + 1] (megatron-core PackedSeqParams) -> self-attention visibility.

        With ``cu_seqlens_padded`` the packed layout is the padded one: sequence i occupies
        [padded[i], padded[i + 1]) and its real tokens are the first cu_seqlens[i+1] - cu_seqlens[i];
        pad tokens see no key and no query sees them (their top-k rows are all padding).

        Host reads: none for boundaries on the host (checked there, copied through pinned memory);
        one for boundaries on a GPU (the check and the total read together). Each read waits for
        the GPU's queued work, so a layer that hands over host boundaries keeps the host ahead."""
        dev = torch.device(device) if device is not None else cu_seqlens.device
        cu = cu_seqlens.to(dtype=torch.int64)
        cp = cu_seqlens_padded.to(dtype=torch.int64) if cu_seqlens_padded is not None else None
        if cp is not None and cp.shape != cu.shape:
            raise ValueError(f"cu_seqlens_padded {cp.tolist()} does not hold cu_seqlens {cu.tolist()}")
        if cu.device.type == "cpu" and (cp is None or cp.device.type == "cpu"):
            bad_order, bad_pad, first, total = _boundary_errors(cu, cp)
            cu, cp = _to_device(cu, dev), None if cp is None else _to_device(cp, dev)
        else:
            cu, cp = cu.to(dev), None if cp is None else cp.to(dev)
            bad_order, bad_pad, first, total = _boundary_errors(cu, cp)
        layout = cu if cp is None else cp
        if bad_order:
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
        if bad_pad:
            raise ValueError(f"cu_seqlens_padded {layout.tolist()} does not hold cu_seqlens {cu.tolist()}")
        if first != 0:
            raise ValueError(f"packed boundaries must start at 0, got {layout.tolist()}")
        lengths = layout[1:] - layout[:-1]
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lengths, output_size=total)
        pos = torch.arange(total, device=dev) - layout[:-1][seq]
        if cp is None:
            return Visibility(seq, pos, seq, pos)
        real = pos < (cu[1:] - cu[:-1])[seq]
        q_seq = torch.where(real, seq, torch.full_like(seq, -1))
        k_seq = torch.where(real, seq, torch.full_like(seq, -2))
        return Visibility(q_seq, pos, k_seq, pos)

    @staticmethod
    def uniform(batch: int, seq_len: int, device=None) -> "Visibility":
        """``batch`` sequences of ``seq_len`` tokens each, packed one after another (bshd as THD):
        the same as ``from_cu_seqlens(arange(batch + 1) * seq_len)``, built on the device with no
        host read or copy."""
        rows = torch.arange(batch * seq_len, device=device)
        seq, pos = rows // max(1, seq_len), rows % max(1, seq_len)
        return Visibility(seq, pos, seq, pos)

    @staticmethod
    def causal(T: int, device=None) -> "Visibility":
        return Visibility.uniform(1, T, device=device)

    def rows(self, sel) -> "Visibility":
        """Visibility of a subset of query rows (index tensor or slice) against the same keys."""
        return Visibility(self.query_seq[sel], self.query_pos[sel], self.key_seq, self.key_pos, self.qidx[sel])

    def mask(self, rows=slice(None)) -> torch.Tensor:
        """bool [T_rows, T_kv]."""
        qs, qp = self.query_seq[rows], self.query_pos[rows]
        return (qs[:, None] == self.key_seq[None, :]) & (self.key_pos[None, :] <= qp[:, None])


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
# backward's fp32 dKV [T_kv, 576] atomics stay in L2; at 16K the top-k selected in key order skips
# the radix select's int64 sort; docs/kernels.md has the figures
KEY_ORDER_MIN_KEYS = 16384


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
# over fp32 scores instead of torch.topk over the int64 keys (docs/kernels.md has the crossover)
RADIX_MIN_KEYS = 8192

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
    use_triton = _kernels_run_on(q)
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
                keys = _kernel_or_none(masked_scores.masked_index_scores, q[t0:t1], k[:m], w[t0:t1],
                                       vis.query_seq[t0:t1], vis.query_pos[t0:t1], qidx[t0:t1], vis.key_seq[:m],
                                       vis.key_pos[:m], keys=not radix,
                                       key_scale=None if key_scale is None else key_scale[:m])
                if keys is not None and radix:
                    sel = _kernel_or_none(radix_topk.radix_topk, keys, topk, ordered=not key_order)
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


def _kernels_run_on(t: torch.Tensor) -> bool:
    """Whether the indexer's Triton kernels take this tensor's work (CUDA, kernels not switched off)."""
    return t.is_cuda and indexer_kernels.triton_available()


def _kernel_or_none(kernel, *args, **kwargs):
    """``kernel(*args, **kwargs)``, or None (after one warning; the indexer kernels are then off) if it
    cannot run here: the caller falls back to the exact torch path."""
    try:
        return kernel(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a performance path
        indexer_kernels.disable(exc, stacklevel=4)
        return None


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
    if _kernels_run_on(q):
        return _SelectedScores.apply(q, k, w, indices.to(torch.int32).contiguous(), bool(deterministic))
    return selected_scores_reference(q, k, w, indices)


# --------------------------------------------------------------------------- loss
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
    if _kernels_run_on(logits):
        from ..ops.indexer import kl_rows

        rows = _kernel_or_none(kl_rows.kl_rows, logits, target, indices.to(torch.int32).contiguous(), eps)
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


# --------------------------------------------------------------------------- index sharing
def computes_indices(layer_number: int, topk_freq: int = 1, skip_offset: int = 0) -> bool:
    """1-indexed layer: True if it runs its indexer, False if it reuses the last computing layer's
    indices (GLM-5.2: freq 4, offset 3; same rule as HF ``indexer_types`` and megatron-core)."""
    if layer_number < 1 or topk_freq < 1 or skip_offset < 0:
        raise ValueError(f"bad index-sharing arguments: layer {layer_number}, freq {topk_freq}, offset {skip_offset}")
    return max(layer_number - max(skip_offset, 1), 0) % topk_freq == 0


def index_source_layer(layer_number: int, topk_freq: int = 1, skip_offset: int = 0) -> int:
    """The computing layer whose indices ``layer_number`` uses (itself if it computes)."""
    L = layer_number
    while not computes_indices(L, topk_freq, skip_offset):
        L -= 1
    return L


def check_stage_layers(first_layer: int, last_layer: int, topk_freq: int = 1, skip_offset: int = 0) -> None:
    """A pipeline stage owning 1-indexed layers [first, last] must not start on a reusing layer:
    its source layer's indices live on another stage."""
    if not computes_indices(first_layer, topk_freq, skip_offset):
        src = index_source_layer(first_layer, topk_freq, skip_offset)
        raise ValueError(
            f"pipeline stage starting at layer {first_layer} would reuse the DSA indices of layer {src}, "
            f"which is on an earlier stage (index_topk_freq={topk_freq}, index_skip_topk_offset={skip_offset}); "
            f"move the stage boundary to a layer that computes indices "
            f"(e.g. layer {src} or {src + topk_freq})"
        )
