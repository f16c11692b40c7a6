"""Wiring into Megatron clients: the layer spec (:mod:`.spec`) and megatron-core's hybrid stack
spec (:mod:`.hybrid_spec`), where the DSA geometry and client flags come from
(:mod:`.config_source`), the upstream Megatron-LM entry (:mod:`.upstream`),
Megatron-Bridge (:mod:`.bridge`) and running without TransformerEngine (:mod:`.te_compat`).
``glm5_dsa_plugin.spec``, ``glm5_dsa_plugin.bridge`` and ``glm5_dsa_plugin.megatron_lm`` are the
names users type; they hand on these modules."""

__all__ = ["bridge", "config_source", "hybrid_spec", "spec", "te_compat", "upstream"]
