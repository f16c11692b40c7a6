"""``import megatron.bridge, glm5_dsa_plugin.bridge``: registers our Megatron-Bridge bridge for HF
``GlmMoeDsaForCausalLM`` checkpoints (built in :mod:`glm5_dsa_plugin.megatron.bridge`)."""

from .megatron.bridge import GLM5DSAPluginBridge

__all__ = ["GLM5DSAPluginBridge"]
