"""Run a test script with Triton's interpreter (``TRITON_INTERPRET=1``) in a fresh process: the
flag is read when Triton is imported, so the CPU tests of our Triton kernels run out of process."""

import os
import subprocess
import sys


def run_interpreted(script: str, timeout: int = 600) -> None:
    """Run ``script`` (it prints "OK" when its checks pass) and fail with its output otherwise."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", script], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
