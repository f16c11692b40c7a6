"""Layer-spec provider: ``--spec glm5_dsa_plugin.spec get_glm5_dsa_spec``.

One function for every caller, one object form:

* ``get_glm5_dsa_spec`` returns the decoder block spec of a pipeline stage
  (``first_k_dense_replace`` dense layers, then MoE layers) whichever way it is called: slime /
  miles ``(args, config, vp_stage)``, upstream Megatron-LM ``(model_config, vp_stage=...)``,
  Megatron-Bridge ``(provider, vp_stage=...)`` (:mod:`glm5_dsa_plugin.megatron.config_source` says what each
  passes, where the DSA geometry comes from and what ``--allgather-cp`` means);
  ``get_glm5_dsa_mtp_spec`` (same conventions) gives the MTP block with the same attention.
* ``glm5_dsa_layer_spec`` is a ``ModuleSpec`` of :class:`GLM5DSATransformerLayer`, which builds the
  right submodules for its own (global) layer number from the config.

Upstream Megatron-LM builds its MTP block from its own layer specs (megatron-core 0.19.2 has no
hook for a custom one): with ``--mtp-num-layers`` launch through
``python -m glm5_dsa_plugin.megatron_lm pretrain_gpt.py ...`` (:mod:`glm5_dsa_plugin.megatron_lm`);
without it the spec refuses to build, saying so.

``config.transformer_impl == "transformer_engine"`` selects TransformerEngine modules (imported
lazily, with a clear error when absent); ``"local"`` selects ColumnParallelLinear /
RowParallelLinear / torch norms. The core attention is always ours.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from ..model.cp_layout import layout_from_args
from ..model.dsa_fields import dsa_geometry
from . import config_source
from ..model.attention import GLM5DSAIndexer, GLM5DSAIndexerSubmodules, GLM5DSAttention, GLM5DSAttentionSubmodules

__all__ = ["get_glm5_dsa_spec", "get_glm5_dsa_mtp_spec", "glm5_dsa_layer_spec", "GLM5DSATransformerLayer",
           "mtp_hook_installed", "uses_transformer_engine"]

# the attribute glm5_dsa_plugin.megatron.upstream.install_mtp_hook sets on megatron-training's mtp_block_spec
MTP_HOOK_MARK = "_glm5_dsa_mtp_hook"


def mtp_hook_installed() -> bool:
    """Whether upstream Megatron-LM's MTP block is built from our spec (the wrapper's hook is in place)."""
    try:
        import megatron.training.models.gpt as gpt
    except ImportError:
        return False
    return hasattr(gpt.mtp_block_spec, MTP_HOOK_MARK)


class _LocalProvider(LocalSpecProvider):
    """megatron-core's local provider plus the duplicated ``linear`` the DSA modules need."""

    def linear(self):
        from megatron.core.post_training.modelopt.layers import Linear

        return Linear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        impl = super().layer_norm(rms_norm=rms_norm, for_qk=for_qk, has_residual=has_residual)
        return TorchNormIgnoringPersist if impl is WrappedTorchNorm else impl


class TorchNormIgnoringPersist:
    """megatron-core's ``WrappedTorchNorm`` (torch ``RMSNorm`` / ``LayerNorm``) without its refusal of
    ``config.persist_layer_norm``.

    ``persist_layer_norm`` (upstream's default, off with ``--no-persist-layer-norm``) only selects
    Apex's persistent LayerNorm kernel; the local spec's RMSNorm is torch's whichever way it is set,
    so the flag changes nothing here and is dropped for this module (the caller's config is left
    as it is). Every other check of ``WrappedTorchNorm`` stays."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        import copy

        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        if getattr(config, "persist_layer_norm", False):
            config = copy.copy(config)
            config.persist_layer_norm = False
        return WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=eps, **kwargs)


def uses_transformer_engine(config) -> bool:
    return getattr(config, "transformer_impl", "transformer_engine") == "transformer_engine"


def _backend(config):
    if not uses_transformer_engine(config):
        return _LocalProvider()
    try:
        import transformer_engine  # noqa: F401

        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    except ImportError as exc:
        raise ImportError(
            "glm5_dsa_plugin.spec: config.transformer_impl='transformer_engine' but TransformerEngine does not "
            f"import ({exc}). Install TransformerEngine, or run the local path with --transformer-impl local."
        ) from exc
    return TESpecProvider()


def _check_config(config) -> None:
    missing = [f for f in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "q_lora_rank",
                           "kv_lora_rank") if getattr(config, f, None) is None]
    if missing:
        raise ValueError(f"glm5_dsa_plugin.spec: config lacks {missing} (use an MLATransformerConfig with DSA "
                         f"fields; glm5_dsa_plugin.checkpoints.cards builds one from a model card or an HF config)")
    if not getattr(config, "multi_latent_attention", False):
        raise ValueError("glm5_dsa_plugin.spec: GLM-5 DSA needs multi_latent_attention=True")


def dsa_attention_spec(config, backend=None, cp_layout: str = "zigzag", mtp: bool = False) -> ModuleSpec:
    """:class:`~glm5_dsa_plugin.model.absorbed_mla.GLM5AbsorbedMLA` (megatron-core's
    AbsorbedMLASelfAttention with the query absorbed in place) whose core attention is
    :class:`GLM5DSAttention`; ``cp_layout`` is
    the allgather-CP layout (see :mod:`glm5_dsa_plugin.model.cp_layout`). With the contiguous
    layout and ``context_parallel_size > 1`` the self-attention module is
    :class:`~glm5_dsa_plugin.model.contiguous_cp_mla.ContiguousCPAbsorbedMLA` (megatron-core's MLA with
    RoPE at the contiguous layout's positions; same parameters), on either backend. ``mtp``: the
    MTP layer's attention (computes its own indices; indexer replay and recording skip it)."""
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttentionSubmodules

    from ..model.absorbed_mla import GLM5AbsorbedMLA

    backend = backend or _backend(config)
    rms = config.normalization == "RMSNorm"
    qk_norm = backend.layer_norm(rms_norm=rms, for_qk=True) if config.qk_layernorm else IdentityOp
    local = isinstance(backend, LocalSpecProvider)
    down = backend.column_parallel_linear() if local else backend.linear()
    core = ModuleSpec(
        module=GLM5DSAttention,
        params={"cp_layout": cp_layout, **({"is_mtp": True} if mtp else {})},
        submodules=GLM5DSAttentionSubmodules(
            indexer=ModuleSpec(
                module=GLM5DSAIndexer,
                submodules=GLM5DSAIndexerSubmodules(
                    linear_wq_b=backend.linear(),
                    linear_wk=backend.linear(),
                    k_norm=None if local else backend.layer_norm(rms_norm=False, for_qk=True),
                    linear_weights_proj=backend.linear(),
                ),
            )
        ),
    )
    mla = GLM5AbsorbedMLA
    if cp_layout == "contiguous" and (getattr(config, "context_parallel_size", 1) or 1) > 1:
        from ..model.contiguous_cp_mla import ContiguousCPAbsorbedMLA

        mla = ContiguousCPAbsorbedMLA
    return ModuleSpec(
        module=mla,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=AbsorbedMLASelfAttentionSubmodules(
            linear_q_proj=backend.column_parallel_linear(),
            linear_q_down_proj=down,
            linear_q_up_proj=backend.column_parallel_linear(),
            linear_kv_down_proj=down,
            linear_kv_up_proj=backend.column_parallel_linear(),
            core_attention=core,
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=qk_norm,
            kv_layernorm=qk_norm,
        ),
        metainfo={"fuse_input_layernorm": False},  # the indexer reads the normalised input: no fusion
    )


def _moe_pattern(config) -> list[int]:
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_moe_layer_pattern

    if config.num_moe_experts is None:
        return [0] * config.num_layers
    return get_moe_layer_pattern(config)


def layer_submodules(config, is_moe: bool, backend=None, cp_layout: str = "zigzag",
                     mtp: bool = False) -> TransformerLayerSubmodules:
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.torch_norm import L2Norm  # noqa: F401  (import check of the local stack)
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    backend = backend or _backend(config)
    rms = config.normalization == "RMSNorm"
    if is_moe:
        mlp = get_moe_module_spec_for_backend(backend=backend, num_experts=config.num_moe_experts,
                                              moe_grouped_gemm=config.moe_grouped_gemm,
                                              use_te_activation_func=config.use_te_activation_func)
    else:
        mlp = get_mlp_module_spec_for_backend(backend=backend, num_experts=None)
    # A dense MLP on a fusing backend (TE) normalises inside linear_fc1 (TELayerNormColumnParallelLinear),
    # so the layer's own pre-MLP norm is IdentityOp there, as in megatron-core's DSA block spec.
    pre_mlp_norm_fused = not is_moe and backend.fuse_layernorm_and_linear()
    return TransformerLayerSubmodules(
        input_layernorm=backend.layer_norm(rms_norm=rms, for_qk=False),
        self_attention=dsa_attention_spec(config, backend, cp_layout, mtp=mtp),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=IdentityOp if pre_mlp_norm_fused else backend.layer_norm(rms_norm=rms, for_qk=False),
        mlp=mlp,
        mlp_bda=get_bias_dropout_add,
    )


def _stage_layer_ids(config, vp_stage, pp_rank=None) -> list[int]:
    if getattr(config, "pipeline_model_parallel_layout", None) is not None:
        from megatron.core.transformer.enums import LayerType

        return list(config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)))


def check_index_sharing_split(config, layer_ids: list[int]) -> None:
    """The first layer of a stage must compute its own DSA indices (clear error otherwise)."""
    if layer_ids:
        dsa_geometry(config).check_stage_layers(layer_ids[0] + 1, layer_ids[-1] + 1)


def _cp_layout(args, config) -> str:
    """The allgather-CP layout the caller's arguments ask for: ``"contiguous"`` with slime's
    ``--allgather-cp`` (``args.allgather_cp``), else megatron-core's ``"zigzag"``. Under CP > 1 the
    contiguous layout also selects :class:`~glm5_dsa_plugin.model.contiguous_cp_mla.ContiguousCPAbsorbedMLA`
    (see :func:`dsa_attention_spec`), so q / k are rotated by the positions each rank holds."""
    return layout_from_args(args)


def _prepare(args, config, vp_stage, pp_rank, mtp: bool = False):
    """-> (args, TransformerConfig, vp_stage, pp_rank) with the DSA geometry and client flags set."""
    upstream_builder = config is None and args is not None and hasattr(args, "transformer")
    args, cfg, vp_stage, pp_rank = config_source.split_call(args, config, vp_stage, pp_rank)
    config_source.resolve_geometry(cfg, args)
    config_source.apply_client_flags(cfg, args)
    config_source.check_local_path(cfg)
    _check_config(cfg)
    if upstream_builder and not mtp and getattr(cfg, "mtp_num_layers", None):
        if not mtp_hook_installed():
            raise RuntimeError(
                "glm5_dsa_plugin.spec: --mtp-num-layers with upstream Megatron-LM: megatron-core 0.19.2 builds the "
                "MTP block from its own layer specs, not ours. Launch through the wrapper, which makes the MTP block "
                "use our spec: python -m glm5_dsa_plugin.megatron_lm path/to/pretrain_gpt.py <the same arguments>")
    return args, cfg, vp_stage, pp_rank


def get_glm5_dsa_spec(args=None, config=None, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
                      ) -> TransformerBlockSubmodules:
    """Decoder block spec of this pipeline stage, for every ``--spec`` calling convention.

    ``(args, config, vp_stage)`` (slime / miles), ``(config, vp_stage=...)`` (upstream Megatron-LM,
    whose config is a ``GPTModelConfig``; Megatron-Bridge). ``args`` may be None; when given, its
    ``hf_checkpoint`` / ``card`` supply DSA geometry the config lacks and its ``allgather_cp``
    selects the allgather CP layout (:mod:`glm5_dsa_plugin.megatron.config_source`). Sets the resolved DSA
    fields on the config."""
    args, config, vp_stage, pp_rank = _prepare(args, config, vp_stage, pp_rank)
    backend = _backend(config)
    cp_layout = _cp_layout(args, config)
    pattern = _moe_pattern(config)
    layer_ids = _stage_layer_ids(config, vp_stage, pp_rank)
    check_index_sharing_split(config, layer_ids)
    specs = {m: ModuleSpec(module=TransformerLayer, submodules=layer_submodules(config, bool(m), backend, cp_layout))
             for m in set(pattern[i] for i in layer_ids)}
    block = TransformerBlockSubmodules(
        layer_specs=[specs[pattern[i]] for i in layer_ids],
        layer_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False),
    )
    block.glm5_dsa = True  # read by glm5_dsa_plugin.megatron_lm's MTP hook (a stage may hold no layer)
    return block


def get_glm5_dsa_mtp_spec(args=None, config=None, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """MTP block spec (``mtp_num_layers``), same calling conventions as :func:`get_glm5_dsa_spec`;
    its transformer layer is the last decoder layer's spec (MoE + our DSA attention), its norms and
    projections come from the same backend. None when this stage builds no MTP layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend

    args, config, vp_stage, pp_rank = _prepare(args, config, vp_stage, pp_rank, mtp=True)
    if not getattr(config, "mtp_num_layers", None):
        return None
    backend = _backend(config)
    last_is_moe = bool(_moe_pattern(config)[-1])
    layer = ModuleSpec(module=TransformerLayer,
                       submodules=layer_submodules(config, last_is_moe, backend, cp_layout=_cp_layout(args, config),
                                                  mtp=True))
    return get_gpt_mtp_block_spec_for_backend(config=config, spec=layer, backend=backend, vp_stage=vp_stage,
                                              pp_rank=pp_rank)


class GLM5DSATransformerLayer(TransformerLayer):
    """A TransformerLayer that picks its own submodules (dense or MoE MLP, our DSA attention) from
    the config and its global layer number: the object form for upstream Megatron-LM's ``--spec``."""

    def __init__(self, config, submodules=None, layer_number: int = 1, hidden_dropout=None, pg_collection=None,
                 vp_stage=None, is_mtp_layer: bool = False, add_layer_offset: bool = True, pp_layer_offset=None,
                 name=None):
        config_source.resolve_geometry(config, None)
        _check_config(config)
        if is_mtp_layer or not add_layer_offset:
            global_number = layer_number
        else:
            from megatron.core.utils import get_pg_rank
            from megatron.core.process_groups_config import ProcessGroupCollection

            pgc = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
            global_number = layer_number + get_transformer_layer_offset(config, vp_stage, get_pg_rank(pgc.pp))
        pattern = _moe_pattern(config)
        is_moe = bool(pattern[-1] if is_mtp_layer else pattern[global_number - 1])
        if layer_number == 1 and not is_mtp_layer:
            dsa_geometry(config).check_stage_layers(global_number, global_number)
        super().__init__(config, layer_submodules(config, is_moe, mtp=is_mtp_layer), layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection, vp_stage=vp_stage,
                         is_mtp_layer=is_mtp_layer, add_layer_offset=add_layer_offset,
                         pp_layer_offset=pp_layer_offset, name=name)


glm5_dsa_layer_spec = ModuleSpec(module=GLM5DSATransformerLayer)
