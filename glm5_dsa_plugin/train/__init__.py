"""The launchers: their shared core (:mod:`.core`), one module per job (:mod:`.lora`, :mod:`.ppo`,
:mod:`.mtp`) and the dry-run memory planner (:mod:`.planner`). ``scripts/train_*.py`` call the
jobs' ``main``."""
