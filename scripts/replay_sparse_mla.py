#!/usr/bin/env python
"""Replay a sparse-MLA guard dump: ``python scripts/replay_sparse_mla.py DUMP [--device cpu|cuda]``.

Prints per-row nonfinite counts and max abs/rel diffs (finite overlap) of the recorded outputs
and of a rerun of the dump's backend (where it runs here) against the reference; exits 1 when
any of them disagrees."""

import argparse
import sys

import torch

from glm5_dsa_plugin.ops.replay import replay


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump")
    ap.add_argument("--device", default=None)
    ap.add_argument("--rtol", type=float, default=None)
    args = ap.parse_args(argv)
    dump = torch.load(args.dump, map_location="cpu", weights_only=False)
    print(f"dump: {args.dump} kind={dump.get('kind')} backend={dump.get('backend')} env={dump.get('env')}")
    results = replay(dump, device=args.device, rtol=args.rtol)
    for r in results:
        print(r.line())
    bad = [r for r in results if not r.ok]
    print("DISAGREE" if bad else "AGREE")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
