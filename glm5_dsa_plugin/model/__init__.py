"""The GLM-5 DSA attention built on megatron-core: core attention and indexer modules
(:mod:`.attention`), the indexer's math (:mod:`.indexer`), the value up-projection
(:mod:`.value_projection`), context-parallel layouts (:mod:`.cp_layout`) and the contiguous-layout
MLA (:mod:`.contiguous_cp_mla`), and which megatron-core DSA fields the layer honours
(:mod:`.dsa_fields`). Imports :mod:`glm5_dsa_plugin.ops`, nothing above it."""
