#!/usr/bin/env python
"""Fill a TileLang kernel cache on a machine without a GPU, for a device call to carry.

TileLang's disk-cache key is the kernel's TIR, the target string, the pass configs, the execution
backend and TileLang's version + platform. On the H200, target "cuda" normalises to
{"kind": "cuda", "arch": "sm_90a", ...}; with torch's arch detection pinned to sm_90a here the
builds get the same keys, so the device loads them instead of compiling (0.3 s instead of 7-8 s
a kernel; benchmarks/NOTES.md, session 13).

    TILELANG_CACHE_DIR=/tmp/tlc python benchmarks/prebuild_kernel_cache.py SCRIPT [ARGS...]

runs SCRIPT with BUILD_ONLY=1 in its environment (a script that honours it exits after building
its kernels) and at most ``--threads`` build threads (default 2). Pack the cache for the device
with ``tar -cJf .gpu/tlc.tar.xz -C /tmp/tlc .``; on the device unpack it and export
TILELANG_CACHE_DIR before Python starts.
"""
import argparse
import concurrent.futures as cf
import os
import runpy
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="build threads (ThreadPoolExecutor workers)")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if "TILELANG_CACHE_DIR" not in os.environ:
        sys.exit("set TILELANG_CACHE_DIR to the cache directory to fill")
    import tilelang.cuda.target as cuda_target

    cuda_target._detect_torch_cuda_arch = lambda: "sm_90a"  # what the H200's "cuda" normalises to
    pool = cf.ThreadPoolExecutor
    cf.ThreadPoolExecutor = lambda max_workers=None, *a, **k: pool(min(max_workers or args.threads, args.threads), *a, **k)
    os.environ["BUILD_ONLY"] = "1"
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
