#!/usr/bin/env python
"""Language-model training with one MTP layer (mtp_num_layers=1); the MTP block uses our attention.

    python scripts/train_mtp.py --card tiny --steps 5
"""

import sys

from glm5_dsa_plugin.train import cli, mtp

if __name__ == "__main__":
    sys.exit(cli.launch(mtp.main))
