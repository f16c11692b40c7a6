"""Weights and model descriptions: model cards -> HF / megatron-core configs (:mod:`.cards`),
HF <-> Megatron parameter conversion (:mod:`.hf_megatron`), block-FP8 checkpoints
(:mod:`.block_fp8`), slime / miles parameter names (:mod:`.slime_names`), and megatron-core's
hybrid stack: its layer pattern (:mod:`.hybrid_pattern`) and parameter names (:mod:`.hybrid_names`)."""

__all__ = ["block_fp8", "cards", "hf_megatron", "hybrid_names", "hybrid_pattern", "slime_names"]
