"""``python -m glm5_dsa_plugin doctor``: an input error is one line and exit status 2 (``--debug``:
the traceback), as for the launchers."""

import argparse
import sys


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm5_dsa_plugin")
    sub = ap.add_subparsers(dest="cmd", required=True)
    doctor = sub.add_parser("doctor", help="versions, GPU, backend choice, known-bad TileLang, kernel self-check")
    doctor.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    args = ap.parse_args(argv)
    if args.cmd == "doctor":
        from .ops.doctor import run

        return run()
    return 2


def main(argv=None) -> int:
    from .train.cli import launch

    return launch(_main, argv, prog="python -m glm5_dsa_plugin")


if __name__ == "__main__":
    sys.exit(main())
