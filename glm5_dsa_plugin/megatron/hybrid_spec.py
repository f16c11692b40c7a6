"""HybridModel stack spec: ``--spec glm5_dsa_plugin.spec glm5_dsa_hybrid_stack_spec``.

megatron-core 0.19.2's ``HybridModel`` builds its decoder from a ``ModuleSpec`` of ``HybridStack``
and a ``--hybrid-layer-pattern`` (:mod:`glm5_dsa_plugin.checkpoints.hybrid_pattern`; GLM-5.x:
``D-`` x dense layers, ``DE`` x MoE layers, ``/DE`` per MTP layer). Megatron-LM's
``pretrain_hybrid.py`` imports the ``--spec`` object and uses it as it is (never calls it), so
:data:`glm5_dsa_hybrid_stack_spec` needs no config: each layer class below picks its submodules
from the config it is built with, on the backend ``config.transformer_impl`` names (TE or local
linears and norms, as :mod:`glm5_dsa_plugin.megatron.spec` does for GPTModel).

* ``D`` (``dsa_layer``): :class:`GLM5HybridDSALayer`, an attention-only ``TransformerLayer`` whose
  core attention is ours (:class:`GLM5HybridDSAttention`), numbered for index sharing by its DSA
  layer number (the n-th ``D`` of the pattern, see :mod:`~glm5_dsa_plugin.checkpoints.hybrid_pattern`);
* ``-`` / ``E``: megatron-core's ``MLPLayer`` / ``MoETransformerLayer`` with its own dense MLP / MoE;
* ``/``: megatron-core's MTP block; its inner stack reuses the slots above, its norms and
  ``eh_proj`` come from the config's backend;
* the stack (:class:`GLM5DSAHybridStack`) builds ``final_norm`` from that backend too (upstream
  hard-codes TransformerEngine's) and refuses symbols other than ``D - E | /`` and a ``|`` that
  starts a stage on a DSA layer reusing an earlier stage's indices, naming the layer.

The pattern itself is read from ``config.hybrid_layer_pattern`` (Megatron-Bridge's hybrid providers
carry it; :func:`hybrid_transformer_config` sets it), else from Megatron-LM's parsed arguments
(``--hybrid-layer-pattern``). The allgather-CP layout follows ``args.allgather_cp`` when Megatron-LM's
arguments carry it, else megatron-core's zigzag layout.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from ..checkpoints import cards
from ..checkpoints import hybrid_pattern as hp
from ..model import cp_layout
from ..model.attention import GLM5DSAttention
from ..model.dsa_fields import dsa_geometry
from . import config_source
from . import spec as gspec

__all__ = ["glm5_dsa_hybrid_stack_spec", "GLM5DSAHybridStack", "GLM5HybridDSALayer", "GLM5HybridDSAttention",
           "GLM5HybridMLPLayer", "GLM5HybridMoELayer", "hybrid_layer_pattern_of", "hybrid_transformer_config"]


def _training_args():
    """Megatron-LM's parsed arguments when its training entry has set them, else None."""
    try:
        from megatron.training import global_vars
    except ImportError:
        return None
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def hybrid_layer_pattern_of(config) -> str:
    """The model's ``--hybrid-layer-pattern``: ``config.hybrid_layer_pattern``, else Megatron-LM's argument."""
    pattern = getattr(config, "hybrid_layer_pattern", None)
    if pattern is None:
        pattern = getattr(_training_args(), "hybrid_layer_pattern", None)
    if not pattern:
        raise ValueError(
            "glm5_dsa_hybrid_stack_spec: the DSA layers' order (index sharing) needs the hybrid layer pattern, and "
            "neither config.hybrid_layer_pattern nor Megatron-LM's --hybrid-layer-pattern is set; set "
            "config.hybrid_layer_pattern to the pattern given to HybridModel "
            "(glm5_dsa_plugin.megatron.hybrid_spec.hybrid_transformer_config does)")
    return pattern


def _cp_layout() -> str:
    return cp_layout.layout_from_args(_training_args())


class GLM5HybridDSAttention(GLM5DSAttention):
    """:class:`GLM5DSAttention` numbered by its DSA layer number (``dsa_layer_number``, the n-th ``D``)
    instead of the hybrid layer number: index sharing, its holder, replay and the indexer-loss
    tracker all see the GPTModel numbering."""

    def __init__(self, config, submodules, layer_number: int, *args, dsa_layer_number: int, **kwargs):
        super().__init__(config, submodules, dsa_layer_number, *args, **kwargs)
        self.hybrid_layer_number = layer_number


class GLM5HybridDSALayer(TransformerLayer):
    """Pattern symbol ``D``: input norm + our DSA self-attention (``GLM5AbsorbedMLA``, megatron-core's absorbed
    MLA with the query absorbed in place), no MLP."""

    def __init__(self, config, submodules=None, layer_number: int = 1, hidden_dropout=None, pg_collection=None,
                 vp_stage=None, is_mtp_layer: bool = False, add_layer_offset: bool = False, pp_layer_offset=None,
                 name=None):
        config_source.resolve_geometry(config, None)
        gspec._check_config(config)
        dsa_number = hp.dsa_layer_number(hybrid_layer_pattern_of(config), layer_number, mtp=is_mtp_layer)
        backend = gspec._backend(config)
        # the MTP attention (is_mtp) computes its own indices: never replayed or recorded
        attention = gspec.dsa_attention_spec(config, backend, _cp_layout(), mtp=is_mtp_layer)
        core = attention.submodules.core_attention
        params = {**core.params, "dsa_layer_number": dsa_number}
        attention.submodules.core_attention = ModuleSpec(module=GLM5HybridDSAttention, params=params,
                                                         submodules=core.submodules)
        subs = TransformerLayerSubmodules(
            input_layernorm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False),
            self_attention=attention, self_attn_bda=get_bias_dropout_add)
        super().__init__(config, subs, layer_number=layer_number, hidden_dropout=hidden_dropout,
                         pg_collection=pg_collection, vp_stage=vp_stage, is_mtp_layer=is_mtp_layer,
                         add_layer_offset=add_layer_offset, pp_layer_offset=pp_layer_offset, name=name)


def _mlp_submodules(config, is_moe: bool) -> TransformerLayerSubmodules:
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    backend = gspec._backend(config)
    norm = backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)
    if is_moe:
        mlp = get_moe_module_spec_for_backend(backend=backend, num_experts=config.num_moe_experts,
                                              moe_grouped_gemm=config.moe_grouped_gemm,
                                              use_te_activation_func=config.use_te_activation_func)
    else:
        mlp = get_mlp_module_spec_for_backend(backend=backend, num_experts=None)
    # as in the GPT spec: a dense MLP on TE normalises inside linear_fc1
    fused = not is_moe and backend.fuse_layernorm_and_linear()
    return TransformerLayerSubmodules(pre_mlp_layernorm=IdentityOp if fused else norm, mlp=mlp,
                                      mlp_bda=get_bias_dropout_add)


class GLM5HybridMLPLayer(MLPLayer):
    """Pattern symbol ``-``: megatron-core's ``MLPLayer`` with its dense MLP on the config's backend."""

    def __init__(self, config, submodules=None, layer_number: int = 1, hidden_dropout=None, pg_collection=None,
                 add_layer_offset: bool = False, name=None):
        super().__init__(config, _mlp_submodules(config, is_moe=False), layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection,
                         add_layer_offset=add_layer_offset, name=name)


class GLM5HybridMoELayer(MoETransformerLayer):
    """Pattern symbol ``E``: megatron-core's ``MoETransformerLayer`` with its MoE on the config's backend."""

    def __init__(self, config, submodules=None, layer_number: int = 1, hidden_dropout=None, pg_collection=None,
                 add_layer_offset: bool = False, name=None):
        super().__init__(config, _mlp_submodules(config, is_moe=True), layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection,
                         add_layer_offset=add_layer_offset, name=name)


class _BackendNorm:
    """The config's backend norm (RMSNorm / LayerNorm as ``config.normalization`` says), chosen at build time."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        norm = gspec._backend(config).layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)
        return norm(config=config, hidden_size=hidden_size, eps=eps, **kwargs)


class _BackendColumnParallelLinear:
    """The config's backend column-parallel linear (MTP ``eh_proj``), chosen at build time."""

    def __new__(cls, *args, config, **kwargs):
        return gspec._backend(config).column_parallel_linear()(*args, config=config, **kwargs)


class GLM5DSAHybridStack(HybridStack):
    """megatron-core's ``HybridStack`` with ``final_norm`` from the config's backend and checks of the
    pattern: only ``D - E`` symbols, this stage's symbols are the pattern's, and every ``|`` keeps
    index sharing on one stage (:func:`~glm5_dsa_plugin.checkpoints.hybrid_pattern.check_index_sharing`)."""

    def __init__(self, config, submodules: HybridStackSubmodules, pre_process: bool = True,
                 layer_type_list: Optional[list[str]] = None, pp_layer_offset: int = 0, post_layer_norm: bool = True,
                 post_process: bool = True, device=None, dtype=None, pg_collection=None, is_mtp_layer: bool = False,
                 name: str | None = None):
        config_source.resolve_geometry(config, None)
        pattern = hybrid_layer_pattern_of(config)
        segments, _ = hp.split_pattern(pattern)
        stage = "".join(layer_type_list or [])
        main = "".join(segments)
        if not is_mtp_layer and main[pp_layer_offset:pp_layer_offset + len(stage)] != stage:
            raise ValueError(f"hybrid layer pattern {pattern!r}: this stage builds {stage!r} from layer "
                             f"{pp_layer_offset + 1}, which is not the pattern's (config.hybrid_layer_pattern differs "
                             f"from the pattern HybridModel was given?)")
        geometry = dsa_geometry(config)
        hp.check_index_sharing(pattern, geometry.topk_freq, geometry.skip_offset)
        super().__init__(config, submodules, pre_process=pre_process, layer_type_list=layer_type_list,
                         pp_layer_offset=pp_layer_offset, post_layer_norm=False, post_process=post_process,
                         device=device, dtype=dtype, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer,
                         name=name)
        self.post_layer_norm = post_layer_norm
        if post_process and post_layer_norm:
            self.final_norm = _BackendNorm(config=config, hidden_size=config.hidden_size,
                                           eps=config.layernorm_epsilon)


glm5_dsa_hybrid_stack_spec = ModuleSpec(
    module=GLM5DSAHybridStack,
    submodules=HybridStackSubmodules(
        dsa_layer=ModuleSpec(module=GLM5HybridDSALayer),
        mlp_layer=ModuleSpec(module=GLM5HybridMLPLayer),
        moe_layer=ModuleSpec(module=GLM5HybridMoELayer),
        mtp_block_spec=ModuleSpec(
            module=MultiTokenPredictionBlock,
            submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[ModuleSpec(
                module=MultiTokenPredictionLayer,
                submodules=MultiTokenPredictionLayerSubmodules(
                    enorm=_BackendNorm, hnorm=_BackendNorm, eh_proj=_BackendColumnParallelLinear,
                    mtp_model_layer=None, layer_norm=_BackendNorm))]),
        ),
    ),
)
"""``--spec glm5_dsa_plugin.spec glm5_dsa_hybrid_stack_spec`` with ``--hybrid-layer-pattern``: a config-free
``ModuleSpec`` of :class:`GLM5DSAHybridStack` whose layers configure themselves from the config."""


def hybrid_transformer_config(card: dict, pattern: Optional[str] = None, **overrides):
    """megatron-core config of a card for HybridModel: ``num_layers`` = the main pattern's symbols,
    ``mtp_num_layers`` = its ``/`` depths, ``moe_layer_freq=1`` (the ``E`` symbols place the MoE layers),
    ``config.hybrid_layer_pattern`` = ``pattern`` (default: the card's GLM-5.x pattern)."""
    pattern = pattern or hp.glm5_hybrid_layer_pattern(card)
    segments, depths = hp.split_pattern(pattern)
    kw = dict(num_layers=sum(len(s) for s in segments), mtp_num_layers=len(depths) or None, moe_layer_freq=1,
              is_hybrid_model=True)
    kw.update(overrides)
    config = cards.card_to_transformer_config(card, **kw)
    config.hybrid_layer_pattern = pattern
    return config
