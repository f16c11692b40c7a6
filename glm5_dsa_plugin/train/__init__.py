"""The launchers: their shared core (:mod:`.core`) and command line (:mod:`.cli`), one module per
job (:mod:`.lora`, :mod:`.ppo`, :mod:`.mtp`), the HybridModel build (:mod:`.hybrid_model`) and the
dry-run planner (:mod:`.planner`) with its memory terms (:mod:`.memory`, the attention's in
:mod:`.attention_memory`). ``scripts/train_*.py`` call the jobs' ``main``."""

__all__ = ["attention_memory", "cli", "core", "hybrid_model", "lora", "memory", "mtp", "planner", "ppo"]
