"""Weights and model descriptions: model cards -> HF / megatron-core configs (:mod:`.cards`),
HF <-> Megatron parameter conversion (:mod:`.hf_megatron`), block-FP8 checkpoints
(:mod:`.block_fp8`) and slime / miles parameter names (:mod:`.slime_names`)."""
