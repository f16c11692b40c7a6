"""What the layer spec takes from its caller: the calling convention, the DSA geometry, client flags.

Callers and what they pass to ``--spec glm5_dsa_plugin.spec get_glm5_dsa_spec``:

* slime / miles: ``(args, config, vp_stage)`` positionally; ``args`` is their argparse namespace
  (``args.hf_checkpoint`` names the HF checkpoint, ``args.allgather_cp`` is ``--allgather-cp``);
  ``config`` is a megatron-core ``MLATransformerConfig`` built from their flags, which carry no
  ``--dsa-*`` values.
* upstream Megatron-LM (``megatron.training.models.gpt.GPTModelBuilder``, megatron-core 0.19.2):
  ``(model_config, vp_stage=...)`` where ``model_config`` is a ``GPTModelConfig`` wrapping the
  ``TransformerConfig`` in ``.transformer``; the geometry comes from its ``--dsa-indexer-*`` flags.
* Megatron-Bridge 0.6.2: ``(provider, vp_stage=...)``, the provider being a ``TransformerConfig``.

DSA geometry (``dsa_indexer_n_heads``, ``dsa_indexer_head_dim``, ``dsa_indexer_topk``,
``dsa_indexer_topk_freq``, ``dsa_indexer_skip_topk_offset``, ``dsa_indexer_rope_interleaved`` from
HF's ``indexer_rope_interleave``) is taken, field by field, from the first source that has it: the
config (a field counts as set when it is not None, and for the last three when it differs from
megatron-core's default 1 / 0 / False), then the HF ``config.json`` of
``args.hf_checkpoint`` (``args.hf`` for this project's launchers), then the model card
``args.card`` (only when no HF checkpoint is named). Every source that has a value must agree with
the one used, and the MLA shape fields the caller set (hidden size, heads, LoRA ranks, head dims)
must agree with the HF config: a disagreement raises ``ValueError`` naming the field, both sources
and both values. Which sources were used is logged once per distinct result (logger
``glm5_dsa_plugin.spec``, level INFO).

Client flags:

* ``--allgather-cp`` (slime, miles; ``args.allgather_cp``): context parallelism in the allgather
  layout. The packed token stream of a micro-batch (all sequences concatenated, padded to a
  multiple of the CP size) is cut into CP-size equal *contiguous* chunks, rank r holding chunk r
  (not megatron's load-balanced two-chunk zigzag split); ``PackedSeqParams.cu_seqlens_*`` describe
  the whole stream, not the local chunk; the attention all-gathers the keys / index keys over the
  CP group and answers the local query rows. The spec passes this on as
  ``config.cp_comm_type = "all_gather"`` (which megatron-core's ``TransformerLayer`` hands to the
  core attention as ``cp_comm_type`` when ``context_parallel_size > 1``) and
  ``config.<CP_LAYOUT_FIELD> = ALLGATHER_CP_LAYOUT`` (``glm5_dsa_cp_layout = "contiguous"``), the
  field the core attention reads to know the token layout. A ``cp_comm_type`` already set to
  ``a2a`` or ``a2a+p2p`` is refused (None and ``p2p``, megatron-training's default, are replaced).
  With ``context_parallel_size > 1`` the spec's self-attention is
  :class:`~glm5_dsa_plugin.model.contiguous_cp_mla.ContiguousCPAbsorbedMLA`, which rotates q / k by the
  positions of these contiguous chunks (megatron-core's MLA assumes its zigzag split).
* ``--freeze-indexer`` (slime, miles): applied by slime / miles themselves, by parameter name
  (``...self_attention.core_attention.indexer.*``, which are our names); nothing to do here.
* ``--miles-dsa-topk-backend`` (miles): selects miles' own top-k kernel; our indexer has its own,
  so the value has no effect here.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from ..checkpoints.cards import DSA_GEOMETRY_KEYS, dsa_geometry

__all__ = ["SHAPE_FIELDS", "CP_LAYOUT_FIELD", "ALLGATHER_CP_LAYOUT", "split_call", "transformer_config",
           "hf_checkpoint_path", "read_hf_config", "resolve_geometry", "apply_client_flags", "check_local_path"]

logger = logging.getLogger("glm5_dsa_plugin.spec")

# megatron-core 0.19.2 defaults of these fields: equal to the default means "not set"
_DEFAULTS = {"dsa_indexer_topk_freq": 1, "dsa_indexer_skip_topk_offset": 0, "dsa_indexer_rope_interleaved": False}
# MLA shape fields the caller sets from its own flags; checked against the HF config
SHAPE_FIELDS = (
    ("hidden_size", "hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("q_lora_rank", "q_lora_rank"),
    ("kv_lora_rank", "kv_lora_rank"),
    ("qk_head_dim", "qk_nope_head_dim"),
    ("qk_pos_emb_head_dim", "qk_rope_head_dim"),
    ("v_head_dim", "v_head_dim"),
)
CP_LAYOUT_FIELD = "glm5_dsa_cp_layout"
ALLGATHER_CP_LAYOUT = "contiguous"
_LOGGED: set[str] = set()


def split_call(args=None, config=None, vp_stage=None, pp_rank=None) -> tuple[Any, Any, Optional[int], Optional[int]]:
    """Normalise the calling conventions to ``(args, transformer_config, vp_stage, pp_rank)``.

    Accepted: ``(args, config, vp_stage, pp_rank)`` (slime / miles, positional or by keyword),
    ``(config, vp_stage=...)`` and ``(config=config, vp_stage=...)`` (upstream Megatron-LM,
    Megatron-Bridge). A lone first argument is the config when it is a ``TransformerConfig`` or
    wraps one in ``.transformer`` (``GPTModelConfig``)."""
    if config is None and args is not None and _is_config(args):
        args, config = None, args
    if config is None:
        raise TypeError("get_glm5_dsa_spec needs a config: call it as (args, config, vp_stage) or (config, vp_stage=...)")
    if not _is_config(config):
        raise TypeError(f"get_glm5_dsa_spec: config must be a megatron-core TransformerConfig (or a GPTModelConfig), "
                        f"got {type(config).__name__}")
    return args, transformer_config(config), vp_stage, pp_rank


def _is_config(obj) -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return isinstance(obj, TransformerConfig) or isinstance(getattr(obj, "transformer", None), TransformerConfig)


def transformer_config(config):
    """The megatron-core ``TransformerConfig`` itself (``GPTModelConfig.transformer`` when wrapped)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    inner = getattr(config, "transformer", None)
    if not isinstance(config, TransformerConfig) and isinstance(inner, TransformerConfig):
        return inner
    return config


def _config_value(config, field):
    v = getattr(config, field, None)
    if v is None or (field in _DEFAULTS and v == _DEFAULTS[field]):
        return None
    return v


def hf_checkpoint_path(args) -> Optional[str]:
    """``args.hf_checkpoint`` (slime / miles) or ``args.hf`` (this project's launchers)."""
    for name in ("hf_checkpoint", "hf"):
        v = getattr(args, name, None) if args is not None else None
        if v:
            return str(v)
    return None


def read_hf_config(path: str) -> dict:
    """The HF config as a dict: ``PATH/config.json`` when PATH is a folder (or a config.json
    itself), else ``transformers.AutoConfig.from_pretrained(PATH)``."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if f.is_file():
        return json.loads(f.read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).to_dict()


def _overrides(args) -> dict:
    """This project's launchers' ``--card-override FIELD=VALUE`` (JSON values), applied to either source."""
    out = {}
    for item in getattr(args, "card_override", None) or []:
        k, _, v = item.partition("=")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _sources(config, args) -> list[tuple[str, dict, dict]]:
    """[(label, geometry, shape)] in precedence order."""
    cfg_geo = {f: _config_value(config, f) for f, _ in DSA_GEOMETRY_KEYS}
    out = [("megatron-core config", {k: v for k, v in cfg_geo.items() if v is not None}, {})]
    hf = hf_checkpoint_path(args)
    if hf is not None:
        d, label = read_hf_config(hf), f"HF config of {hf}"
    elif getattr(args, "card", None):
        from ..checkpoints import cards

        d, label = cards.load_card(args.card), f"model card {args.card!r}"
    else:
        return out
    over = _overrides(args)
    if over:
        d, label = {**d, **over}, label + " with --card-override"
    out.append((label, dsa_geometry(d), {f: d[k] for f, k in SHAPE_FIELDS if d.get(k) is not None}))
    return out


def resolve_geometry(config, args=None) -> dict:
    """Set the DSA geometry fields on ``config`` (a ``TransformerConfig``) from the sources above;
    returns ``{field: source label}``. Raises ``ValueError`` on a conflict or a missing field."""
    sources = _sources(config, args)
    chosen, where = {}, {}
    for label, geo, _ in sources:
        for field, v in geo.items():
            if field not in chosen:
                chosen[field], where[field] = v, label
            elif v != chosen[field]:
                raise ValueError(
                    f"glm5_dsa_plugin.spec: {field} conflicts between sources: {where[field]} says {chosen[field]!r}, "
                    f"{label} says {v!r}; make them agree (or drop one of them)")
    for label, _, shape in sources[1:]:
        for field, v in shape.items():
            mine = getattr(config, field, None)
            if mine is not None and mine != v:
                raise ValueError(
                    f"glm5_dsa_plugin.spec: {field} conflicts between sources: megatron-core config says {mine!r}, "
                    f"{label} says {v!r}")
    missing = [f for f, _ in DSA_GEOMETRY_KEYS if f not in chosen and f not in _DEFAULTS]
    if missing:
        raise ValueError(
            f"glm5_dsa_plugin.spec: config lacks {missing} and no source provides them: pass --dsa-indexer-n-heads / "
            f"--dsa-indexer-head-dim / --dsa-indexer-topk (upstream Megatron-LM), --hf-checkpoint PATH (slime, miles), "
            f"or a model card (args.card); glm5_dsa_plugin.checkpoints.cards builds a full config from a card or an HF config")
    for field, v in chosen.items():
        setattr(config, field, v)
    _log_once(where, chosen)
    return where


def _log_once(where: dict, chosen: dict) -> None:
    by_source: dict[str, list[str]] = {}
    for field, label in where.items():
        by_source.setdefault(label, []).append(f"{field}={chosen[field]}")
    msg = "glm5_dsa_plugin.spec: DSA geometry " + "; ".join(f"from the {label}: {', '.join(fields)}"
                                                            for label, fields in by_source.items())
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        logger.info(msg)


def apply_client_flags(config, args) -> None:
    """``--allgather-cp`` -> ``config.cp_comm_type = "all_gather"`` and ``config.glm5_dsa_cp_layout =
    "contiguous"`` (see the module docstring for the layout); ``args`` may be None."""
    if not getattr(args, "allgather_cp", False):
        return
    current = getattr(config, "cp_comm_type", None)
    values = current if isinstance(current, list) else [current]
    from megatron.core.transformer.experimental_attention_variant.dsa_layout import normalize_cp_comm_type

    # None and "p2p" (megatron-training's default for --cp-comm-type) are taken as unset; megatron-core's
    # own normalisation reads "all_gather" and "allgather" alike
    wrong = sorted({v for v in values if normalize_cp_comm_type(v) not in ("p2p", "allgather")})
    if wrong:
        raise ValueError(f"glm5_dsa_plugin.spec: --allgather-cp needs cp_comm_type 'all_gather', but the config has "
                         f"cp_comm_type={current!r} (from --cp-comm-type); drop one of the two flags")
    config.cp_comm_type = "all_gather"
    setattr(config, CP_LAYOUT_FIELD, ALLGATHER_CP_LAYOUT)


def check_local_path(config) -> None:
    """The local path (``transformer_impl='local'``) on a machine without Apex's CUDA extensions:
    megatron-core's ColumnParallelLinear / RowParallelLinear refuse ``gradient_accumulation_fusion``
    (megatron-training's default) without ``fused_weight_gradient_mlp_cuda``; say so at spec build
    time with the flag to pass. (``persist_layer_norm``, the other Apex-only default, is harmless
    here: the spec's local norms ignore it.)"""
    if getattr(config, "transformer_impl", "transformer_engine") != "local":
        return
    if not getattr(config, "gradient_accumulation_fusion", False):
        return
    from megatron.core.tensor_parallel import layers

    if not getattr(layers, "_grad_accum_fusion_available", True):
        raise ValueError(
            "glm5_dsa_plugin.spec: --transformer-impl local with gradient_accumulation_fusion=True needs Apex's "
            "fused_weight_gradient_mlp_cuda extension, which does not import here; pass "
            "--no-gradient-accumulation-fusion (config.gradient_accumulation_fusion=False)")
