"""Model FLOPs of GLM-5 DSA layers and models (fwd + bwd), and model FLOPs utilisation.

Counted: matmul FLOPs (2 per multiply-add) of the computation the model defines, the same on any
hardware; norms, RoPE, softmax and other elementwise work are left out. Every matmul with a
gradient costs 3x its forward (forward, input gradient, weight gradient); frozen weights are
counted as trained. Sequences are causal and packed: ``seq_lens`` lists their lengths.

Per DSA layer, with T = sum(seq_lens), K = top-k, H heads, Hi x Di indexer heads, the absorbed MLA
latent Dqk = kv_lora + rope (576 for GLM-5) and Dv = kv_lora (512):

    projections          3 * 2 * T * (q down, q up, kv down, kv up, output projection parameters)
    indexer_projections  3 * 2 * T * (q_lora * Hi * Di + hidden * Di + hidden * Hi)
    mlp                  3 * 2 * T * 3 * hidden * ffn                       (SwiGLU: gate, up, down)
    moe                  3 * 2 * T * (hidden * experts                       (router)
                                      + 3 * hidden * moe_ffn * (top_k + shared experts))
    sparse_mla           3 * 2 * S * H * (Dqk + Dv)   S = selected pairs = sum_t min(K, t + 1)
    indexer_scores       2 * V * Hi * Di               V = visible pairs = sum L (L + 1) / 2; no gradient
    indexer_loss         2 * S * Hi * Di * 3           (selected-slot logits, their dq and dk)
    indexer_target       2 * S * H * Dqk               (the loss's target: q . kv again, no gradient; the
                                                        attention backward forms it from its own P where
                                                        its kernel can, so a floor leaves it out)

The absorbed attention's per-head q and value up-projections cost exactly the kv up-projection's
FLOPs, so ``projections`` counts that matrix once. A layer that reuses another layer's indices
(``index_topk_freq`` > 1) has no indexer parts. Per model: the layers, the output logits
(3 * 2 * T * hidden * vocab) and, with ``mtp``, each MTP layer (a DSA MoE layer computing its
indices, its 2 * hidden -> hidden projection and its own logits).
"""

from __future__ import annotations

from dataclasses import dataclass

from .dsa_fields import dsa_geometry
from .layer_pattern import split_pattern

__all__ = ["DEVICE_PEAKS", "LAYER_PARTS", "DSAShape", "visible_pairs", "selected_pairs", "layer_flops", "model_flops",
           "device_peaks", "mfu"]

# bf16 dense matmul peak (FLOP/s) and HBM bandwidth (bytes/s) from the vendors' data sheets, by a
# substring of ``torch.cuda.get_device_name()``; most specific first
DEVICE_PEAKS = (
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100 NVL", 835e12, 3.9e12),
    ("H100", 989.4e12, 3.35e12),
    ("H800", 989.4e12, 3.35e12),
    ("H200", 989.4e12, 4.8e12),
    ("H20", 148e12, 4.0e12),
)

LAYER_PARTS = ("projections", "indexer_projections", "mlp", "moe", "sparse_mla", "indexer_scores", "indexer_loss",
               "indexer_target")


@dataclass(frozen=True)
class DSAShape:
    """The widths that set a GLM-5 DSA model's FLOPs (HF / card names)."""

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    intermediate_size: int
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    num_hidden_layers: int = 1
    first_k_dense_replace: int = 0
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 0
    num_nextn_predict_layers: int = 0
    vocab_size: int = 0

    def __post_init__(self):
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"DSAShape.{name} must be a non-negative int, got {value!r}")

    @classmethod
    def from_card(cls, card: dict) -> "DSAShape":
        """From a model card / HF config dict (``glm5_dsa_plugin.checkpoints.cards``)."""
        names = cls.__dataclass_fields__
        kw = {k: card[k] for k in names if card.get(k) is not None}
        return cls(**kw)

    @classmethod
    def from_config(cls, config, vocab_size: int = 0) -> "DSAShape":
        """From a megatron-core ``MLATransformerConfig`` with DSA fields (``vocab_size`` is not in it).

        A HybridModel config (``config.hybrid_layer_pattern`` set) counts one GLM-5 layer per ``D``
        symbol of the main pattern, MoE layers from its ``E`` symbols and MTP layers from its ``/``
        depths; its ``num_layers`` counts every symbol (two per GLM-5 layer) and is not used."""
        c = config
        hybrid = getattr(c, "hybrid_layer_pattern", None)
        if hybrid:
            segments, depths = split_pattern(hybrid)
            main = "".join(segments)
            num_layers, mtp_layers = main.count("D"), len(depths)
            pattern = [1 if s == "E" else 0 for s in main if s in "-E"]
            if len(pattern) != num_layers:
                raise ValueError(f"hybrid_layer_pattern {hybrid!r}: {num_layers} attention layers 'D' but "
                                 f"{len(pattern)} MLP/MoE layers ('-', 'E'); GLM-5 pairs one with each")
        else:
            num_layers, mtp_layers = c.num_layers, c.mtp_num_layers or 0
            pattern = c.moe_layer_freq if c.num_moe_experts else 0
            if isinstance(pattern, int):
                pattern = [1 if pattern and i % pattern == 0 else 0 for i in range(num_layers)]
        first_dense = pattern.index(1) if 1 in pattern else num_layers
        if not all(pattern[first_dense:]):
            where = f"hybrid_layer_pattern {hybrid!r}" if hybrid else f"moe_layer_freq {c.moe_layer_freq}"
            raise ValueError(f"{where}: only dense layers first, then MoE layers, are counted")
        moe_ffn = c.moe_ffn_hidden_size or 0
        shared = (c.moe_shared_expert_intermediate_size or 0) // moe_ffn if moe_ffn else 0
        geometry = dsa_geometry(c)
        return cls(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                   kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_head_dim,
                   qk_rope_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim,
                   index_n_heads=geometry.indexer_heads, index_head_dim=geometry.indexer_head_dim,
                   index_topk=geometry.topk, intermediate_size=c.ffn_hidden_size,
                   moe_intermediate_size=moe_ffn, n_routed_experts=c.num_moe_experts or 0,
                   num_experts_per_tok=c.moe_router_topk or 0, n_shared_experts=shared,
                   num_hidden_layers=num_layers, first_k_dense_replace=first_dense,
                   index_topk_freq=geometry.topk_freq, index_skip_topk_offset=geometry.skip_offset,
                   num_nextn_predict_layers=mtp_layers, vocab_size=vocab_size)


def _lengths(seq_lens) -> list[int]:
    lens = [int(x) for x in seq_lens]
    for i, L in enumerate(lens):
        if L < 0:
            raise ValueError(f"seq_lens[{i}] = {L}: sequence lengths must be >= 0")
    return lens


def visible_pairs(seq_lens) -> int:
    """Causal (query, key) pairs: sum over sequences of L (L + 1) / 2."""
    return sum(L * (L + 1) // 2 for L in _lengths(seq_lens))


def selected_pairs(seq_lens, topk: int) -> int:
    """(query, selected key) pairs of a causal top-``topk``: sum over rows t of min(topk, t + 1)."""
    total = 0
    for L in _lengths(seq_lens):
        head = min(L, topk)
        total += head * (head + 1) // 2 + (L - head) * topk
    return total


def layer_flops(shape: DSAShape, seq_lens, moe: bool = False, computes_indices: bool = True,
                indexer_loss: bool = True) -> dict[str, float]:
    """Model FLOPs (fwd + bwd) of one DSA layer over packed causal sequences: one entry per
    :data:`LAYER_PARTS` name plus ``total``."""
    s = shape
    T = sum(_lengths(seq_lens))
    H, Hi, Di = s.num_attention_heads, s.index_n_heads, s.index_head_dim
    dqk, dv = s.kv_lora_rank + s.qk_rope_head_dim, s.kv_lora_rank
    S, V = selected_pairs(seq_lens, s.index_topk), visible_pairs(seq_lens)
    attn_params = (s.hidden_size * s.q_lora_rank + s.q_lora_rank * H * (s.qk_nope_head_dim + s.qk_rope_head_dim)
                   + s.hidden_size * (s.kv_lora_rank + s.qk_rope_head_dim)
                   + s.kv_lora_rank * H * (s.qk_nope_head_dim + s.v_head_dim) + H * s.v_head_dim * s.hidden_size)
    idx_params = s.q_lora_rank * Hi * Di + s.hidden_size * Di + s.hidden_size * Hi
    out = dict.fromkeys(LAYER_PARTS, 0.0)
    out["projections"] = 6.0 * T * attn_params
    if moe:
        if not (s.n_routed_experts and s.num_experts_per_tok and s.moe_intermediate_size):
            raise ValueError(f"a MoE layer needs experts, top-k and moe_intermediate_size; got {s}")
        out["moe"] = 6.0 * T * (s.hidden_size * s.n_routed_experts + 3 * s.hidden_size * s.moe_intermediate_size
                                * (s.num_experts_per_tok + s.n_shared_experts))
    else:
        out["mlp"] = 6.0 * T * 3 * s.hidden_size * s.intermediate_size
    out["sparse_mla"] = 6.0 * S * H * (dqk + dv)
    if computes_indices:
        out["indexer_projections"] = 6.0 * T * idx_params
        out["indexer_scores"] = 2.0 * V * Hi * Di
        if indexer_loss:
            out["indexer_loss"] = 6.0 * S * Hi * Di
            out["indexer_target"] = 2.0 * S * H * dqk
    out["total"] = sum(out[p] for p in LAYER_PARTS)
    return out


def model_flops(shape: DSAShape, seq_lens, mtp: bool = False, indexer_loss: bool = True) -> float:
    """Model FLOPs (fwd + bwd) of a whole GLM-5 DSA model on packed causal sequences: its layers
    (dense for the first ``first_k_dense_replace``, MoE after; the indexer only on layers that
    compute their indices), the output logits when ``vocab_size`` is set and, with ``mtp``, the
    MTP layers."""
    from .index_sharing import computes_indices

    s = shape
    T = sum(_lengths(seq_lens))
    total = 0.0
    for n in range(1, s.num_hidden_layers + 1):
        total += layer_flops(s, seq_lens, moe=n > s.first_k_dense_replace and s.n_routed_experts > 0,
                             computes_indices=computes_indices(n, s.index_topk_freq, s.index_skip_topk_offset),
                             indexer_loss=indexer_loss)["total"]
    logits = 6.0 * T * s.hidden_size * s.vocab_size
    total += logits
    if mtp:
        for _ in range(s.num_nextn_predict_layers):
            total += layer_flops(s, seq_lens, moe=s.n_routed_experts > 0, indexer_loss=indexer_loss)["total"]
            total += 6.0 * T * 2 * s.hidden_size * s.hidden_size + logits
    return total


def device_peaks(device_name: str) -> tuple[float, float] | None:
    """(bf16 dense FLOP/s, HBM bytes/s) of a known GPU by its name, else None."""
    for key, flops, bw in DEVICE_PEAKS:
        if key in device_name:
            return flops, bw
    return None


def mfu(flops: float, seconds: float, device_name: str, n_devices: int = 1) -> float | None:
    """Model FLOPs utilisation: flops / (seconds * n_devices * bf16 peak), or None for an unknown device."""
    peaks = device_peaks(device_name)
    if peaks is None or seconds <= 0 or n_devices < 1:
        return None
    return flops / (seconds * n_devices * peaks[0])
