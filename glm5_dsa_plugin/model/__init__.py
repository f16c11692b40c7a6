"""The GLM-5 DSA attention built on megatron-core: core attention and indexer modules
(:mod:`.attention`), the indexer's math (:mod:`.indexer`), the value up-projection
(:mod:`.value_projection`), context-parallel layouts (:mod:`.cp_layout`) and the contiguous-layout
MLA (:mod:`.contiguous_cp_mla`), which megatron-core DSA fields the layer honours
(:mod:`.dsa_fields`), a call's switches (:mod:`.switches`), the rollout-matched numerics
(:mod:`.rollout_numerics`), indexer replay for RL (:mod:`.indexer_replay`), the HybridModel
layer-pattern grammar (:mod:`.layer_pattern`) and the layer's FLOPs (:mod:`.flops`). Imports
:mod:`glm5_dsa_plugin.ops`, nothing above it."""

__all__ = ["attention", "contiguous_cp_mla", "cp_layout", "dsa_fields", "flops", "indexer", "indexer_replay",
           "layer_pattern", "rollout_numerics", "switches", "value_projection"]
