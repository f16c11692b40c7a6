#!/usr/bin/env python
"""Convert a slime / miles GLM-5 checkpoint's parameter names and indexer layout to ours.

    python scripts/convert_slime_checkpoint.py SRC DST --hf-config /path/to/GLM-5.2   # or --card glm5.2

SRC: a torch_dist checkpoint folder (e.g. ``$SAVE/iter_0000100``) or a ``torch.save`` state dict.
DST: a folder (torch.distributed.checkpoint format) or a ``.pt`` file. The HF config (or card) gives
the indexer head dim, the RoPE dim and the index-sharing schedule. What changes:
glm5_dsa_plugin.checkpoints.slime_names (and docs/migration.md).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.checkpoints import slime_names as sc  # noqa: E402
from glm5_dsa_plugin.megatron.config_source import read_hf_config  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-config", help="HF checkpoint folder or config.json of the model")
    src.add_argument("--card", help="model card name or path (glm5, glm5.1, glm5.2, ...)")
    args = ap.parse_args(argv)
    cfg = read_hf_config(args.hf_config) if args.hf_config else cards.load_card(args.card)
    geo = sc.geometry(cfg)
    keys = "torch_dist" if Path(args.src).is_dir() else "module"
    state, report = sc.convert_state(sc.read_checkpoint(args.src), **geo, keys=keys)
    sc.write_checkpoint(state, args.dst, like=args.src)
    print(json.dumps({"tensors": len(state), "renamed": report["renamed"], "rotated": len(report["rotated"]),
                      "dropped": report["dropped"], **geo}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
