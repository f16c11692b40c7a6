"""exp75: how much of small-H deterministic time is the host's per-chunk launches.

exp74's profiles of W2 H8 / H16 deterministic (row groups) show about 3.6 ms of GPU idle per call:
ten chunks of 56 (H8) or 113 (H16) groups under the 2 GiB slot buffer, each a handful of
launches the host issues more slowly than the GPU runs them. Through the op, fwd+bwd, same rounds:
  det_2g   TileLangBackend(deterministic=True)                       (the tree)
  det_4g   the same with slot_buffer_bytes = 4 GiB (half the chunks)
  det_8g   8 GiB (a quarter)
  default  the atomic backward
Checks: each deterministic variant bitwise equal over 3 runs. Writes $OUT/exp75.json; a table last."""
import json
import os
import time

import torch

from common import DV, SCALE, alternating, workload
from exp73 import by_kernel
from glm5_dsa_plugin.ops import backends, sparse_mla
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend

VARIANTS = {"det_2g": 2 << 30, "det_4g": 4 << 30, "det_8g": 8 << 30, "default": None}


def main():
    for name, size in VARIANTS.items():
        opts = {} if size is None else dict(slot_buffer_bytes=size)
        backends.register_backend(f"exp75_{name}", lambda opts=opts: TileLangBackend(**opts), replace=True)
    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "workloads": {}}
    for wl, H in (("W2", 8), ("W2", 16)):
        q, kv, idx, g = workload(wl, H, seed=75)
        qq, kk = q[0].clone().requires_grad_(True), kv[0].clone().requires_grad_(True)
        idx, g = idx[0], g[0]

        def step(name):
            def run():
                qq.grad = kk.grad = None
                sparse_mla(qq, kk, idx, SCALE, d_v=DV, backend=f"exp75_{name}",
                           deterministic=name != "default")[0].backward(g)
            return run

        runs = {name: step(name) for name in VARIANTS}
        res = {}
        for name, fn in runs.items():
            got = []
            for _ in range(3 if name != "default" else 1):
                fn()
                got.append((qq.grad.clone(), kk.grad.clone()))
            res[f"{name} bitwise_3_runs"] = all(torch.equal(a, got[0][0]) and torch.equal(b, got[0][1])
                                                for a, b in got[1:])
        times, med = alternating(runs, rounds=4)
        res["median_ms"], res["rounds_ms"] = med, times
        for name in ("det_2g", "det_8g"):
            res[f"{name} gpu_us_by_kernel"] = by_kernel(runs[name])
        key = f"{wl}_H{H}"
        result["workloads"][key] = res
        print(key, json.dumps(med), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "exp75.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\nexp75 summary (fwd+bwd through the op, ms)")
    for key, res in result["workloads"].items():
        med = res["median_ms"]
        for name in VARIANTS:
            bits = "" if name == "default" else f"  bitwise3={res[f'{name} bitwise_3_runs']}"
            print(f"{key:7s} {name:8s} {med[name]:8.3f}  {med[name] / med['default']:6.3f}x of default{bits}")
        for name in ("det_2g", "det_8g"):
            print(f"{key} {name} by kernel (us/call): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in res[f"{name} gpu_us_by_kernel"].items()))


if __name__ == "__main__":
    main()
