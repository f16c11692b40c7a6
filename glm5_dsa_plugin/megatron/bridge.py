"""Megatron-Bridge 0.6.2 bridge: ``AutoBridge`` builds GLM-5 with our spec (our DSA attention).

Usage (import this module after ``megatron.bridge``, or alone: it imports megatron.bridge first)::

    import megatron.bridge, glm5_dsa_plugin.bridge   # registers GLM5DSAPluginBridge
    provider = AutoBridge.from_hf_pretrained(path).to_megatron_provider()   # GPTModel

    glm5_dsa_plugin.bridge.register_bridge(model="hybrid")   # from here on: HybridModel
    provider = AutoBridge.from_hf_pretrained(path).to_megatron_provider()

``register_bridge(model=...)`` picks the Megatron model ``AutoBridge`` builds, as Megatron-Bridge's
``register_bridge(target=...)`` does: ``"gpt"`` (the default, :class:`GLM5DSAPluginBridge`, an
``MLAModelProvider`` with our layer spec) or ``"hybrid"`` (:class:`GLM5DSAPluginHybridBridge`, a
:class:`GLM5DSAHybridModelProvider` building megatron-core's ``HybridModel`` from
``glm5_dsa_hybrid_stack_spec`` and the checkpoint's ``glm5_hybrid_layer_pattern``). Weights follow
the model they are loaded into or exported from, whichever bridge is registered: a ``HybridModel``
gets the hybrid parameter names (:mod:`glm5_dsa_plugin.checkpoints.hybrid_names` renames each one to
its GPTModel name, whose mapping is the built-in GLM-5 one), anything else the GPTModel names.

Registration is for the ``transformers.GlmMoeDsaForCausalLM`` class itself: in 0.6.2's dispatch a
string key loses to the built-in class key, and the last registration for a class wins, so this
module must be imported after ``megatron.bridge`` has registered its own GLM-5 bridge (importing
it imports ``megatron.bridge`` first, which guarantees that). Weight mappings are the built-in
GLM-5 ones (our parameter names are megatron-core's DSA names); only the provider changes.
On a machine without TransformerEngine the :mod:`glm5_dsa_plugin.megatron.te_compat` guard is installed
before ``megatron.bridge`` is imported.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch

from ..checkpoints import block_fp8
from ..checkpoints import hybrid_names
from ..checkpoints.hybrid_pattern import glm5_hybrid_layer_pattern, split_pattern
from . import te_compat

__all__ = ["glm5_bridge_layer_spec", "glm5_bridge_hybrid_stack_spec", "MODELS", "GLM5DSAHybridModelProvider",
           "megatron_names", "HybridNamesMappingRegistry", "GLM5DSAPluginBridge", "GLM5DSAPluginHybridBridge",
           "register_bridge"]

te_compat.install()

try:
    import megatron.bridge  # noqa: F401
    from megatron.bridge.models.glm_moe_dsa.glm5_bridge import GLM5Bridge
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.bridge.models.conversion.utils import unwrap_model
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider
    from megatron.bridge.models.mla_provider import MLAModelProvider
    from megatron.bridge.models.transformer_config import MLATransformerConfig
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"glm5_dsa_plugin.bridge needs Megatron-Bridge 0.6.2 ({exc}). Install it with the dependencies it needs at "
        f"import: pip install --no-deps megatron-bridge==0.6.2 omegaconf einops (see README)."
    ) from exc

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.enums import AttnBackend
from transformers import GlmMoeDsaForCausalLM

from .hybrid_spec import glm5_dsa_hybrid_stack_spec
from .spec import get_glm5_dsa_spec

# the local (non-TE) path's duplicated indexer linears and torch LayerNorm are replicated over TP
from megatron.bridge.models.conversion.param_mapping import AutoMapping  # noqa: E402

for _name in ("Linear", "LayerNorm"):
    AutoMapping.register_module_type(_name, "replicated")


def glm5_bridge_layer_spec(config, vp_stage: Optional[int] = None):
    """Provider hook: Megatron-Bridge calls ``transformer_layer_spec(provider, vp_stage=...)``."""
    return get_glm5_dsa_spec(None, config, vp_stage=vp_stage)


def glm5_bridge_hybrid_stack_spec(config=None):
    """Provider hook: ``HybridModelProvider`` calls ``hybrid_stack_spec(provider)``; a named function (not
    the ``ModuleSpec`` itself) so the provider serialises as Megatron-Bridge's own hybrid providers do."""
    return glm5_dsa_hybrid_stack_spec


MODELS = ("gpt", "hybrid")


@dataclasses.dataclass
class GLM5DSAHybridModelProvider(HybridModelProvider, MLATransformerConfig):
    """Megatron-Bridge's ``HybridModelProvider`` with the MLA fields our DSA attention reads (as
    ``MLAModelProvider`` adds them to ``GPTModelProvider``): builds megatron-core's ``HybridModel``
    from ``hybrid_stack_spec`` (ours) and ``hybrid_layer_pattern``.

    ``num_layers`` comes from the pattern (two per GLM layer). ``mtp_hybrid_override_pattern`` (``"DE"``,
    one GLM MTP layer) is appended once per ``mtp_num_layers``, as upstream's hybrid providers do; with
    ``mtp_num_layers`` unset the model has no MTP, as on the GPTModel path.

    Fields both providers have default as on the GPTModel path (``MLAModelProvider``) where
    ``HybridModelProvider`` chose otherwise, so the two paths differ in the model class only; megatron-core's
    DSA config refuses RoPE fusion either way."""

    attention_backend: AttnBackend = AttnBackend.auto
    apply_rope_fusion: bool = False
    attention_dropout: float = 0.1
    bias_dropout_fusion: bool = False
    cross_entropy_loss_fusion: bool = False
    deallocate_pipeline_outputs: bool = False
    gradient_accumulation_fusion: bool = False
    mtp_num_layers: Optional[int] = None

    def finalize(self) -> None:
        mtp_pattern = self.mtp_hybrid_override_pattern
        if not self.mtp_num_layers:
            self.mtp_hybrid_override_pattern = None  # upstream would append an empty MTP depth
        try:
            super().finalize()
        finally:
            self.mtp_hybrid_override_pattern = mtp_pattern


def megatron_names(megatron_model) -> str:
    """``"hybrid"`` for a (wrapped) megatron-core ``HybridModel`` or a list of them, else ``"gpt"``."""
    models = megatron_model if isinstance(megatron_model, list) else [megatron_model]
    return "hybrid" if isinstance(unwrap_model(models)[0], HybridModel) else "gpt"


class HybridNamesMappingRegistry(MegatronMappingRegistry):
    """A GPTModel-named ``MegatronMappingRegistry`` looked up with HybridModel names: each hybrid name is
    renamed to its GPTModel name (:func:`glm5_dsa_plugin.checkpoints.hybrid_names.hybrid_to_gpt_name`),
    looked up, and the mapping found is rebuilt (its own class, its HF names) under the hybrid name,
    which Megatron-Bridge then uses for the module, the tensor-parallel split and pipeline broadcasts.
    A name no GLM-5.x pattern produces (attention on an odd layer) raises."""

    def __init__(self, gpt_registry: MegatronMappingRegistry):
        # no super().__init__: the patterns are the GPTModel registry's, which answers every lookup
        self.gpt_registry = gpt_registry
        self.mappings = gpt_registry.mappings
        self._pg_collection = gpt_registry._pg_collection

    def set_process_groups_from_pg_collection(self, pg_collection) -> None:
        self._pg_collection = pg_collection
        self.gpt_registry.set_process_groups_from_pg_collection(pg_collection)

    def _renamed(self, mapping, megatron_param: str):
        if mapping is None or mapping.megatron_param == megatron_param:
            return mapping
        twin = copy.copy(mapping)
        twin.megatron_param = megatron_param
        return self._prepare_mapping(twin.resolve(()))  # a fresh mapping of the same class and HF names

    def megatron_to_hf_lookup(self, megatron_param_name: str):
        found = self.gpt_registry.megatron_to_hf_lookup(hybrid_names.hybrid_to_gpt_name(megatron_param_name))
        return self._renamed(found, megatron_param_name)

    def hf_to_megatron_lookup(self, hf_param_name: str):
        found = self.gpt_registry.hf_to_megatron_lookup(hf_param_name)
        return None if found is None else self._renamed(found, hybrid_names.gpt_to_hybrid_name(found.megatron_param))

    def __repr__(self) -> str:
        return f"HybridNamesMappingRegistry({self.gpt_registry!r})"


@MegatronModelBridge.register_bridge(
    source=GlmMoeDsaForCausalLM, target=GPTModel, provider=MLAModelProvider, model_type="glm_moe_dsa"
)
class GLM5DSAPluginBridge(GLM5Bridge):
    """The built-in GLM-5 bridge with our layer spec and our indexer conventions; builds GPTModel."""

    MEGATRON_MODEL = "gpt"  # what provider_bridge builds; weights follow the model they meet

    def provider_bridge(self, hf_pretrained):
        cfg = getattr(hf_pretrained, "config", hf_pretrained)
        if not hasattr(cfg, "indexer_rope_interleave"):
            # the built-in bridge reads this field, which GlmMoeDsaConfig only carries when config.json has
            # it; without it, transformers (>= 5.13) rotates the indexer interleaved (cards.indexer_rope_interleave)
            cfg.indexer_rope_interleave = True
        if getattr(cfg, "rope_interleave", True) is not True:
            raise ValueError(f"rope_interleave={cfg.rope_interleave!r}: GLM-5's MLA attention rotates interleaved "
                             f"pairs; no other layout exists in megatron-core's MLA or transformers' GlmMoeDsa")
        provider = super().provider_bridge(hf_pretrained)  # an instance of self.PROVIDER_CLASS
        # our indexer: HF layout (RoPE on the first channels), the RoPE convention passed through from the
        # HF config (the built-in bridge copies indexer_rope_interleave), sparse KL loss over the selected slots
        provider.dsa_indexer_rope_interleaved = bool(cfg.indexer_rope_interleave)
        provider.dsa_indexer_scoring_relu = True
        provider.dsa_indexer_use_sparse_loss = True
        if self.MEGATRON_MODEL == "hybrid":
            return self._hybrid(provider, cfg)
        provider.transformer_layer_spec = glm5_bridge_layer_spec
        return provider

    @staticmethod
    def _hybrid(provider, cfg):
        vars(provider).pop("transformer_layer_spec", None)  # the built-in bridge's GPT block spec hook
        provider.hybrid_stack_spec = glm5_bridge_hybrid_stack_spec
        provider.hybrid_layer_pattern = glm5_hybrid_layer_pattern(cfg, mtp=False)  # D- x dense, DE x MoE
        provider.mtp_hybrid_override_pattern = "DE"  # per MTP layer, once mtp_num_layers is set
        provider.num_layers = None  # from the pattern at finalize: two per GLM layer
        provider.moe_layer_freq = 1  # the E symbols place the MoE layers
        provider.is_hybrid_model = True
        provider.position_embedding_type = "none"  # MLA applies its own RoPE, as on the GPTModel path
        return provider

    @classmethod
    def megatron_to_hf_config(cls, provider) -> dict:
        """A hybrid provider's HF config is the GPTModel one: GLM layers, not pattern symbols."""
        pattern = getattr(provider, "hybrid_layer_pattern", None)
        if not pattern:
            return super().megatron_to_hf_config(provider)
        segments, _ = split_pattern(pattern)
        main = "".join(segments)
        gpt_view = copy.copy(provider)
        gpt_view.num_layers = main.count("D")
        gpt_view.moe_layer_freq = [1 if main[2 * i + 1] == "E" else 0 for i in range(gpt_view.num_layers)]
        return super().megatron_to_hf_config(gpt_view)

    def _names_for_conversion(self, megatron_model) -> None:
        self._megatron_names = megatron_names(megatron_model)

    def mapping_registry(self) -> MegatronMappingRegistry:
        registry = super().mapping_registry()
        if getattr(self, "_megatron_names", self.MEGATRON_MODEL) == "hybrid":
            return HybridNamesMappingRegistry(registry)
        return registry

    def build_conversion_tasks(self, hf_pretrained, megatron_model, *args, **kwargs):
        """Load, export: the registry follows the model (HybridModel names or GPTModel names)."""
        self._names_for_conversion(megatron_model)
        return super().build_conversion_tasks(hf_pretrained, megatron_model, *args, **kwargs)

    def build_export_fp8_tasks(self, hf_pretrained, megatron_model, *args, **kwargs):
        self._names_for_conversion(megatron_model)
        return super().build_export_fp8_tasks(hf_pretrained, megatron_model, *args, **kwargs)

    def maybe_modify_loaded_hf_weight(self, hf_param, hf_state_dict):
        """Block-FP8 checkpoints (published GLM-5.x-FP8): each weight read with its ``weight_scale_inv`` is
        dequantised to bf16 (:mod:`glm5_dsa_plugin.checkpoints.block_fp8`); Megatron-Bridge 0.6.2's GLM-5 bridge would cast
        the FP8 codes to bf16 without their scales."""
        weights = super().maybe_modify_loaded_hf_weight(hf_param, hf_state_dict)
        if isinstance(weights, dict):
            return {k: self._dequantised(t, hf_param[k], hf_state_dict) for k, t in weights.items()}
        return self._dequantised(weights, hf_param, hf_state_dict)

    def _dequantised(self, weight, name: str, hf_state_dict):
        if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return weight
        qc = getattr(self.hf_config, "quantization_config", None)
        if qc is not None and not isinstance(qc, dict):
            qc = qc.to_dict()
        quant = block_fp8.parse_quantization_config(qc, where=f"{type(self.hf_config).__name__}")
        if quant is None:
            raise ValueError(f"{name} is {weight.dtype} but the HF config has no quantization_config")
        scale = hf_state_dict.get(name + block_fp8.SCALE_SUFFIX)
        if scale is None:
            raise ValueError(f"{name} is {weight.dtype} but the checkpoint has no {name}{block_fp8.SCALE_SUFFIX} to "
                             f"dequantise it with")
        return block_fp8.dequantize(weight, scale, quant.block, name=name)


class GLM5DSAPluginHybridBridge(GLM5DSAPluginBridge):
    """:class:`GLM5DSAPluginBridge` building megatron-core's ``HybridModel`` (``register_bridge(model="hybrid")``)."""

    MEGATRON_MODEL = "hybrid"
    PROVIDER_CLASS = GLM5DSAHybridModelProvider


_BRIDGES = {"gpt": (GLM5DSAPluginBridge, GPTModel, MLAModelProvider),
            "hybrid": (GLM5DSAPluginHybridBridge, HybridModel, GLM5DSAHybridModelProvider)}


def register_bridge(model: str = "gpt"):
    """Register our bridge for ``GlmMoeDsaForCausalLM`` with the Megatron model ``AutoBridge`` builds:
    ``"gpt"`` (GPTModel, what importing this module registers) or ``"hybrid"`` (HybridModel). As in
    Megatron-Bridge, the last registration for the class wins; returns the bridge class registered."""
    if model not in _BRIDGES:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    bridge_class, target, provider = _BRIDGES[model]
    return MegatronModelBridge.register_bridge(source=GlmMoeDsaForCausalLM, target=target, provider=provider,
                                               model_type="glm_moe_dsa")(bridge_class)
