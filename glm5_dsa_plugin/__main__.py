"""``python -m glm5_dsa_plugin doctor``: an input error is one line and exit status 2 (``--debug``:
the traceback), as for the launchers."""

import argparse
import sys


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm5_dsa_plugin")
    sub = ap.add_subparsers(dest="cmd", required=True)
    doctor = sub.add_parser("doctor", help="versions, GPU, backend choice, call switches, known-bad TileLang, "
                                           "kernel self-check")
    doctor.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    args = ap.parse_args(argv)
    if args.cmd == "doctor":
        from .model.switches import describe, resolve_switches
        from .ops.doctor import run

        status = run()
        # the switches a DSA attention built now would run with (no config: defaults, then the
        # environment overrides; a config's fields sit between the two, see model.switches)
        print("  call switches (no config)")
        for line in describe(resolve_switches()):
            print(f"    {line}")
        return status
    return 2


def main(argv=None) -> int:
    from .train.cli import launch

    return launch(_main, argv, prog="python -m glm5_dsa_plugin")


if __name__ == "__main__":
    sys.exit(main())
