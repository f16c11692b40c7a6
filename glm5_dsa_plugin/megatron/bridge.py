"""Megatron-Bridge 0.6.2 bridge: ``AutoBridge`` builds GLM-5 with our spec (our DSA attention).

Usage (import this module after ``megatron.bridge``, or alone: it imports megatron.bridge first)::

    import megatron.bridge, glm5_dsa_plugin.bridge   # registers GLM5DSAPluginBridge
    provider = AutoBridge.from_hf_pretrained(path).to_megatron_provider()

Registration is for the ``transformers.GlmMoeDsaForCausalLM`` class itself: in 0.6.2's dispatch a
string key loses to the built-in class key, and the last registration for a class wins, so this
module must be imported after ``megatron.bridge`` has registered its own GLM-5 bridge (importing
it imports ``megatron.bridge`` first, which guarantees that). Weight mappings are the built-in
GLM-5 ones (our parameter names are megatron-core's DSA names); only the provider changes.
On a machine without TransformerEngine the :mod:`glm5_dsa_plugin.megatron.te_compat` guard is installed
before ``megatron.bridge`` is imported.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..checkpoints import block_fp8
from . import te_compat

te_compat.install()

try:
    import megatron.bridge  # noqa: F401
    from megatron.bridge.models.glm_moe_dsa.glm5_bridge import GLM5Bridge
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.bridge.models.mla_provider import MLAModelProvider
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"glm5_dsa_plugin.bridge needs Megatron-Bridge 0.6.2 ({exc}). Install it with the dependencies it needs at "
        f"import: pip install --no-deps megatron-bridge==0.6.2 omegaconf einops (see README)."
    ) from exc

from megatron.core.models.gpt.gpt_model import GPTModel
from transformers import GlmMoeDsaForCausalLM

from .spec import get_glm5_dsa_spec

# the local (non-TE) path's duplicated indexer linears and torch LayerNorm are replicated over TP
from megatron.bridge.models.conversion.param_mapping import AutoMapping  # noqa: E402

for _name in ("Linear", "LayerNorm"):
    AutoMapping.register_module_type(_name, "replicated")


def glm5_bridge_layer_spec(config, vp_stage: Optional[int] = None):
    """Provider hook: Megatron-Bridge calls ``transformer_layer_spec(provider, vp_stage=...)``."""
    return get_glm5_dsa_spec(None, config, vp_stage=vp_stage)


@MegatronModelBridge.register_bridge(
    source=GlmMoeDsaForCausalLM, target=GPTModel, provider=MLAModelProvider, model_type="glm_moe_dsa"
)
class GLM5DSAPluginBridge(GLM5Bridge):
    """The built-in GLM-5 bridge with our layer spec and our indexer conventions."""

    def provider_bridge(self, hf_pretrained) -> MLAModelProvider:
        cfg = getattr(hf_pretrained, "config", hf_pretrained)
        if not hasattr(cfg, "indexer_rope_interleave"):
            # the built-in bridge reads this field, which GlmMoeDsaConfig only carries when config.json has
            # it; without it, transformers (>= 5.13) rotates the indexer interleaved (cards.indexer_rope_interleave)
            cfg.indexer_rope_interleave = True
        if getattr(cfg, "rope_interleave", True) is not True:
            raise ValueError(f"rope_interleave={cfg.rope_interleave!r}: GLM-5's MLA attention rotates interleaved "
                             f"pairs; no other layout exists in megatron-core's MLA or transformers' GlmMoeDsa")
        provider = super().provider_bridge(hf_pretrained)
        provider.transformer_layer_spec = glm5_bridge_layer_spec
        # our indexer: HF layout (RoPE on the first channels), the RoPE convention passed through from the
        # HF config (the built-in bridge copies indexer_rope_interleave), sparse KL loss over the selected slots
        provider.dsa_indexer_rope_interleaved = bool(cfg.indexer_rope_interleave)
        provider.dsa_indexer_scoring_relu = True
        provider.dsa_indexer_use_sparse_loss = True
        return provider

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
