"""Model cards (``layer_specs/*.json``): HF ``config.json`` fields of each published GLM-5 variant.

A card is an HF-style config dict plus a ``_card`` block (name, description). It converts to
an HF ``GlmMoeDsaConfig`` and back, and to megatron-core's ``MLATransformerConfig``.

RoPE conventions (the published GLM-5, 5.1 and 5.2 ``config.json`` values): the main MLA
attention rotates interleaved pairs (``rope_interleave: true``; megatron-core's MLA always does),
and so does the lightning indexer (``indexer_rope_interleave: true`` ->
``dsa_indexer_rope_interleaved=True``). A config without ``indexer_rope_interleave`` is read as
true: transformers >= 5.13 always rotates the GLM-5 indexer interleaved.

Where the cards are read from: an installed wheel ships them as package data
(``glm5_dsa_plugin/layer_specs/``, copied there by the build, see setup.py); a source checkout
or an editable install reads the repository's top-level ``layer_specs/``.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
from collections.abc import Mapping
from pathlib import Path

import torch

__all__ = ["CARDS_DIR", "CARD_ALIASES", "ARCH_FIELDS", "available_cards", "load_card", "index_sharing",
           "indexer_rope_interleave",
           "rope_theta", "card_to_hf_config", "hf_config_to_card", "DSA_GEOMETRY_KEYS", "dsa_geometry",
           "card_to_transformer_config", "with_overrides"]


def _cards_dir():
    """The packaged cards if this is an installed wheel, else the checkout's ``layer_specs/``."""
    packaged = importlib.resources.files("glm5_dsa_plugin") / "layer_specs"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / "layer_specs"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(
        f"glm5_dsa_plugin: no model cards, neither packaged ({packaged}) nor in a checkout ({checkout}); "
        "reinstall the package from a wheel or a full source tree"
    )


CARDS_DIR = _cards_dir()
CARD_ALIASES = {"glm5": "glm5_744b_a40b", "glm5-744b-a40b": "glm5_744b_a40b", "glm5.1": "glm5_1",
                "glm5.2": "glm5_2", "tiny": "tiny"}
ARCH_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
    "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
    "first_k_dense_replace", "hidden_act", "rms_norm_eps", "max_position_embeddings", "attention_bias",
    "tie_word_embeddings",
)


def available_cards() -> list[str]:
    return sorted(p.name[: -len(".json")] for p in CARDS_DIR.iterdir() if p.name.endswith(".json"))


def load_card(name_or_path: str) -> dict:
    """A card by name (``glm5``, ``glm5.2``, ``tiny``, a file stem) or path."""
    p = Path(name_or_path)
    if name_or_path in CARD_ALIASES or not p.suffix:
        p = CARDS_DIR / f"{CARD_ALIASES.get(name_or_path, name_or_path)}.json"
    if not p.is_file():
        raise FileNotFoundError(f"no model card {name_or_path!r}; available: {available_cards()}")
    return json.loads(p.read_text())


def indexer_rope_interleave(card: dict) -> bool:
    """The indexer's RoPE convention (True = interleaved pairs, the GLM-5.x value)."""
    v = card.get("indexer_rope_interleave", True)
    if not isinstance(v, bool):
        raise ValueError(f"indexer_rope_interleave must be true or false, got {v!r}")
    return v


def _check_main_rope(card: dict) -> None:
    if card.get("rope_interleave", True) is not True:
        raise ValueError(f"rope_interleave={card['rope_interleave']!r}: GLM-5's MLA attention rotates interleaved "
                         f"pairs (megatron-core's MLA and transformers' GlmMoeDsa both do); no other layout exists")


def rope_theta(card: dict) -> float:
    rp = card.get("rope_parameters") or {}
    return float(rp.get("rope_theta", card.get("rope_theta", 10000.0)))


def card_to_hf_config(card: dict):
    """-> transformers ``GlmMoeDsaConfig`` (index sharing via index_topk_freq / index_skip_topk_offset)."""
    from transformers import GlmMoeDsaConfig

    kw = {k: v for k, v in card.items() if not k.startswith("_") and k not in ("architectures", "model_type",
                                                                                "indexer_loss_coeff")}
    return GlmMoeDsaConfig(**kw)


def hf_config_to_card(cfg, name: str = "from-hf") -> dict:
    """HF config (object or dict) -> card dict."""
    d = cfg if isinstance(cfg, dict) else cfg.to_dict()
    card = {"_card": {"name": name}, "model_type": "glm_moe_dsa"}
    for f in ARCH_FIELDS:
        if f in d:
            card[f] = d[f]
    card["rope_parameters"] = {"rope_theta": rope_theta(d), "rope_type": (d.get("rope_parameters") or {}).get(
        "rope_type", "default")}
    card["num_nextn_predict_layers"] = d.get("num_nextn_predict_layers", 0)
    card["rope_interleave"] = d.get("rope_interleave", True)
    card["indexer_rope_interleave"] = indexer_rope_interleave(d)
    _check_main_rope(card)
    types = d.get("indexer_types")
    freq, offset = d.get("index_topk_freq"), d.get("index_skip_topk_offset")
    if freq is None and types:
        freq, offset = _infer_sharing(types)
    card["index_topk_freq"], card["index_skip_topk_offset"] = freq or 1, offset or 0
    return card


def index_sharing(card: Mapping) -> tuple[int, int]:
    """A card's index-sharing schedule ``(index_topk_freq, index_skip_topk_offset)``; ``(1, 0)``
    (every layer computes its top-k) where the card leaves them unset or None."""
    return card.get("index_topk_freq") or 1, card.get("index_skip_topk_offset") or 0


def _infer_sharing(types: list[str]) -> tuple[int, int]:
    from ..model.index_sharing import computes_indices

    n = len(types)
    for freq in range(1, n + 1):
        for offset in range(0, n + 1):
            if all((types[i] == "full") == computes_indices(i + 1, freq, offset) for i in range(n)):
                return freq, offset
    raise ValueError(f"indexer_types {types} is not a (freq, offset) pattern")


# HF config key -> megatron-core ``TransformerConfig`` field, for the DSA geometry. The one map:
# the cards, the spec's geometry resolution and the slime name conversion all read it.
DSA_GEOMETRY_KEYS = (
    ("dsa_indexer_n_heads", "index_n_heads"),
    ("dsa_indexer_head_dim", "index_head_dim"),
    ("dsa_indexer_topk", "index_topk"),
    ("dsa_indexer_topk_freq", "index_topk_freq"),
    ("dsa_indexer_skip_topk_offset", "index_skip_topk_offset"),
    ("dsa_indexer_rope_interleaved", "indexer_rope_interleave"),  # miles reads this HF field too
)


def dsa_geometry(hf: Mapping) -> dict:
    """The ``dsa_indexer_*`` fields an HF config dict (or a card) states, by megatron-core name.

    The index-sharing schedule comes from ``index_topk_freq`` / ``index_skip_topk_offset``, else
    from ``indexer_types`` (GLM-5.2), else every layer computes its own indices (freq 1, offset 0).
    ``dsa_indexer_rope_interleaved`` is present only when the config states it."""
    out = {field: hf[key] for field, key in DSA_GEOMETRY_KEYS if hf.get(key) is not None}
    if "dsa_indexer_topk_freq" not in out and hf.get("indexer_types"):
        out["dsa_indexer_topk_freq"], out["dsa_indexer_skip_topk_offset"] = _infer_sharing(hf["indexer_types"])
    out.setdefault("dsa_indexer_topk_freq", 1)
    out.setdefault("dsa_indexer_skip_topk_offset", 0)
    return out


def card_to_transformer_config(card: dict, **overrides):
    """-> megatron-core ``MLATransformerConfig`` for our spec (DSA fields set; local or TE impl)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    _check_main_rope(card)
    geo = dsa_geometry(card)
    n, k = card["num_hidden_layers"], card.get("first_k_dense_replace", 0)
    kw = dict(
        num_layers=n, hidden_size=card["hidden_size"], ffn_hidden_size=card["intermediate_size"],
        num_attention_heads=card["num_attention_heads"], multi_latent_attention=True,
        q_lora_rank=card["q_lora_rank"], kv_lora_rank=card["kv_lora_rank"], qk_head_dim=card["qk_nope_head_dim"],
        qk_pos_emb_head_dim=card["qk_rope_head_dim"], v_head_dim=card["v_head_dim"], rope_type="rope",
        rotary_base=rope_theta(card), rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
        normalization="RMSNorm", layernorm_epsilon=card["rms_norm_eps"], qk_layernorm=True,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=card["n_routed_experts"], moe_router_topk=card["num_experts_per_tok"],
        moe_ffn_hidden_size=card["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=card["moe_intermediate_size"] * card.get("n_shared_experts", 0) or None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=card["routed_scaling_factor"], moe_router_pre_softmax=False,
        moe_router_num_groups=card.get("n_group", 1), moe_router_group_topk=card.get("topk_group", 1),
        moe_layer_freq=[0] * k + [1] * (n - k), moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall",
        moe_router_dtype="fp32", moe_aux_loss_coeff=0.0,
        experimental_attention_variant="dsa", dsa_indexer_n_heads=geo["dsa_indexer_n_heads"],
        dsa_indexer_head_dim=geo["dsa_indexer_head_dim"], dsa_indexer_topk=geo["dsa_indexer_topk"],
        dsa_indexer_loss_coeff=card.get("indexer_loss_coeff", 0.001),
        dsa_indexer_topk_freq=geo["dsa_indexer_topk_freq"],
        dsa_indexer_skip_topk_offset=geo["dsa_indexer_skip_topk_offset"],
        dsa_indexer_rotate_activation=False, dsa_indexer_scoring_relu=True,
        dsa_indexer_rope_interleaved=indexer_rope_interleave(card), dsa_indexer_use_sparse_loss=True,
        dsa_indexer_k_norm_epsilon=1e-6,
        mtp_num_layers=card.get("num_nextn_predict_layers") or None,
        transformer_impl="local", params_dtype=torch.float32, use_cpu_initialization=True,
    )
    kw.update(overrides)
    return MLATransformerConfig(**kw)


def with_overrides(card: dict, **fields) -> dict:
    c = copy.deepcopy(card)
    c.update(fields)
    return c
