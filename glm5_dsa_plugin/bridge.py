"""``import megatron.bridge, glm5_dsa_plugin.bridge``: registers our Megatron-Bridge bridge for HF
``GlmMoeDsaForCausalLM`` checkpoints (built in :mod:`glm5_dsa_plugin.megatron.bridge`), building
GPTModel; ``register_bridge(model="hybrid")`` makes ``AutoBridge`` build megatron-core's HybridModel."""

from .megatron.bridge import (
    GLM5DSAHybridModelProvider,
    GLM5DSAPluginBridge,
    GLM5DSAPluginHybridBridge,
    register_bridge,
)

__all__ = ["GLM5DSAHybridModelProvider", "GLM5DSAPluginBridge", "GLM5DSAPluginHybridBridge", "register_bridge"]
