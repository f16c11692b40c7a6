"""``python -m glm5_dsa_plugin doctor``."""

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm5_dsa_plugin")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("doctor", help="versions, GPU, backend choice, known-bad TileLang, kernel self-check")
    args = ap.parse_args(argv)
    if args.cmd == "doctor":
        from .ops.doctor import run

        return run()
    return 2


if __name__ == "__main__":
    sys.exit(main())
