"""Megatron-Bridge 0.6.2 bridge: ``AutoBridge`` builds GLM-5 with our spec (our DSA attention).

Usage (import this module after ``megatron.bridge``, or alone: it imports megatron.bridge first)::

    import megatron.bridge, glm5_dsa_plugin.bridge   # registers GLM5DSAPluginBridge
    provider = AutoBridge.from_hf_pretrained(path).to_megatron_provider()

Registration is for the ``transformers.GlmMoeDsaForCausalLM`` class itself: in 0.6.2's dispatch a
string key loses to the built-in class key, and the last registration for a class wins, so this
module must be imported after ``megatron.bridge`` has registered its own GLM-5 bridge (importing
it imports ``megatron.bridge`` first, which guarantees that). Weight mappings are the built-in
GLM-5 ones (our parameter names are megatron-core's DSA names); only the provider changes.
On a machine without TransformerEngine the :mod:`glm5_dsa_plugin.te_compat` guard is installed
before ``megatron.bridge`` is imported.
"""

from __future__ import annotations

from typing import Optional

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
