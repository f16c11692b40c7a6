"""exp109 (session 32): v32's kernels back to back against one launch at a time. exp108's Nsight
Compute launches (one at a time, clocks left alone) took the W1 H64 forward kernel 1.82 ms, where
the benches' back-to-back loops take 2.08-2.11. Here, per workload (W2 / W1 H64): the raw forward
kernel and the backend's backward (``backward_saved``), each (a) back to back (``common.bench``,
the benches' method) and (b) 12 launches each after 200 ms of idle GPU, timed with CUDA events
(median), with the SM clock read by nvidia-smi right after each spaced launch. Writes
``exp109.json`` under $OUT."""
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, bench, prepared_forward_inputs, raw_forward, workload  # noqa: E402

from glm5_dsa_plugin.ops import tilelang_kernels as tk  # noqa: E402
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend  # noqa: E402

OUT = os.environ.get("OUT", ".")


def sm_clock_mhz() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return int(out.split()[0])


def spaced(fn, n: int = 12, idle_s: float = 0.2) -> dict:
    """Median ms of ``fn`` over n launches, each after idle_s of idle GPU; the SM clock after each."""
    times, clocks = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        time.sleep(idle_s)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        clocks.append(sm_clock_mhz())
    return dict(median_ms=statistics.median(times), ms=times, sm_clock_mhz=clocks)


res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
for wl in ("W2", "W1"):
    q, kv, idx, g = workload(wl, 64, seed=41)
    _, _, _, forward = raw_forward(tk.sparse_mla_fwd_ws_kernel, 64, 2048, prepared_forward_inputs(q, kv, idx), q)
    be = TileLangBackend()
    out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
    backward = lambda: be.backward_saved(q, saved, out, lse, g, SCALE, DV)  # noqa: E731
    for name, fn in (("forward kernel", forward), ("backward", backward)):
        fn()
        row = dict(back_to_back_ms=bench(fn), spaced=spaced(fn), back_to_back_again_ms=bench(fn))
        res["rows"][f"{wl} H64 {name}"] = row
        print(f"{wl} H64 {name}: back to back {row['back_to_back_ms']:.3f} / {row['back_to_back_again_ms']:.3f} ms, "
              f"spaced {row['spaced']['median_ms']:.3f} ms (clocks {min(row['spaced']['sm_clock_mhz'])}-"
              f"{max(row['spaced']['sm_clock_mhz'])} MHz)", flush=True)
        json.dump(res, open(os.path.join(OUT, "exp109.json"), "w"), indent=1)
