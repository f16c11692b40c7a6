"""exp74: row groups in deterministic mode (16 and 8 heads).

Before: deterministic=True turned row groups off, so below 64 heads per group the backward ran the
single-warpgroup kernel with one query row per block and one fp32 contribution per valid slot
(1536 per row at W2, 14.5 GB). Now the forward runs row groups as in the default mode and the
backward runs ``sparse_mla_bwd_ws_kernel(rows_per_block=R, dkv_per_slot=True)``: one
contribution per entry of a group's key list (at W2 about 504 per row at H16, 256 at H8), summed
per kv row as before. Through the op, fwd+bwd, W2 and W1, same rounds:
  det_groups   TileLangBackend(deterministic=True)                      (the tree: row groups)
  det_one_row  TileLangBackend(deterministic=True, row_groups=False)    (as before)
  default      TileLangBackend() (atomic dKV, row groups)
Checks: each deterministic variant bitwise equal over 5 runs; dq / dkv against the fp32 reference.
A profile by kernel of det_groups. Writes $OUT/exp74.json; a table last."""
import json
import os
import time

import torch

from common import DV, SCALE, alternating, workload
from exp73 import by_kernel, rel
from glm5_dsa_plugin.ops import backends, reference as ref, sparse_mla
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend

VARIANTS = {
    "det_groups": dict(),
    "det_one_row": dict(row_groups=False),
    "default": dict(),
}


def main():
    for name, opts in VARIANTS.items():
        backends.register_backend(f"exp74_{name}", lambda opts=opts: TileLangBackend(**opts), replace=True)
    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "workloads": {}}
    for wl, H in (("W2", 16), ("W2", 8), ("W1", 16)):
        q, kv, idx, g = workload(wl, H, seed=74)
        q, kv, idx, g = q[0], kv[0], idx[0], g[0]
        qq, kk = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)

        def step(name):
            def run():
                qq.grad = kk.grad = None
                sparse_mla(qq, kk, idx, SCALE, d_v=DV, backend=f"exp74_{name}",
                           deterministic=name != "default")[0].backward(g)
            return run

        runs = {name: step(name) for name in VARIANTS}
        res, grads = {}, {}
        for name, fn in runs.items():
            got = []
            for _ in range(5 if name != "default" else 1):
                fn()
                got.append((qq.grad.clone(), kk.grad.clone()))
            grads[name] = got[0]
            res[f"{name} bitwise_5_runs"] = all(torch.equal(a, got[0][0]) and torch.equal(b, got[0][1])
                                                for a, b in got[1:])
        r_dq, r_dkv = ref.backward(q.float()[None], kv.float()[None], idx[None], g.float()[None], SCALE, DV)
        for name, (dq, dkv) in grads.items():
            res[f"{name} rel_dq"] = rel(dq, r_dq[0])
            res[f"{name} rel_dkv"] = rel(dkv, r_dkv[0])
        del r_dq, r_dkv, grads
        times, med = alternating(runs, rounds=4)
        res["median_ms"], res["rounds_ms"] = med, times
        res["det_groups gpu_us_by_kernel"] = by_kernel(runs["det_groups"])
        key = f"{wl}_H{H}"
        result["workloads"][key] = res
        print(key, json.dumps(med), {k: v for k, v in res.items() if "ms" not in k}, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "exp74.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\nexp74 summary (fwd+bwd through the op, ms)")
    for key, res in result["workloads"].items():
        med = res["median_ms"]
        for name in VARIANTS:
            print(f"{key:7s} {name:11s} {med[name]:8.3f}  {med[name] / med['default']:6.3f}x of default  "
                  f"bitwise5={res[f'{name} bitwise_5_runs']}  rel dq {res[f'{name} rel_dq']:.2e} "
                  f"dkv {res[f'{name} rel_dkv']:.2e}")
        print(f"{key} det_groups by kernel (us/call): "
              + ", ".join(f"{k} {v:.0f}" for k, v in res["det_groups gpu_us_by_kernel"].items()))


if __name__ == "__main__":
    main()
