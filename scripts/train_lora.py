#!/usr/bin/env python
"""LoRA fine-tuning of GLM-5 through our spec (Megatron-Bridge PEFT LoRA on the MLA projections).

    python scripts/train_lora.py --card tiny --steps 5 --save runs/lora
    python scripts/train_lora.py --card glm5.2 --dry-run --tp 4 --pp 8 --ep 16 --cp 4
"""

import sys

from glm5_dsa_plugin.train import cli, lora

if __name__ == "__main__":
    sys.exit(cli.launch(lora.main))
