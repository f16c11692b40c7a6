#!/usr/bin/env python
"""PPO update of GLM-5 over rollout batches (packed THD; log-probs through our DSA attention).

    python scripts/train_ppo.py --card tiny --rollouts tests/fixtures/rollouts_tiny.pt --steps 3
"""

import sys

from glm5_dsa_plugin.train import cli, ppo

if __name__ == "__main__":
    sys.exit(cli.launch(ppo.main))
