"""exp76: row groups' deterministic slot buffer at the longest list's width.

exp74 / exp75 (v29): a row group's key list holds R * topk slots, mostly padding (W2 H8 about
2050 of 16384), and the slot buffer was sized for all of them, so 2 GiB held 56 groups at W2 H8
(113 at H16): chunks of under one wave of CTAs, ten of them, and the host's launches per chunk
left the GPU idle (W2 H8 with 8 GiB: 4.02 ms instead of 6.40). The tree reads the longest
extent once per call and gives each group only that many slots. Through the op, fwd+bwd:
  compact   TileLangBackend(deterministic=True)                       (the tree)
  full      the same with compact_group_slots = False                 (v29)
  default   the atomic backward
Checks: each deterministic variant bitwise equal over 3 runs; compact against the fp32 reference
(W2 H8) and against full. Writes $OUT/exp76.json; a table last."""
import json
import os
import time

import torch

from common import DV, SCALE, alternating, workload
from exp73 import by_kernel, rel
from glm5_dsa_plugin.ops import backends, reference as ref, sparse_mla
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend


def make(compact):
    be = TileLangBackend()
    be.compact_group_slots = compact
    return be


VARIANTS = {"compact": True, "full": False, "default": True}


def main():
    for name, compact in VARIANTS.items():
        backends.register_backend(f"exp76_{name}", lambda compact=compact: make(compact), replace=True)
    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "workloads": {}}
    for wl, H in (("W2", 8), ("W2", 16), ("W1", 16)):
        q, kv, idx, g = workload(wl, H, seed=76)
        q, kv, idx, g = q[0], kv[0], idx[0], g[0]
        qq, kk = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)

        def step(name):
            def run():
                qq.grad = kk.grad = None
                sparse_mla(qq, kk, idx, SCALE, d_v=DV, backend=f"exp76_{name}",
                           deterministic=name != "default")[0].backward(g)
            return run

        runs = {name: step(name) for name in VARIANTS}
        res, grads = {}, {}
        for name, fn in runs.items():
            got = []
            for _ in range(3 if name != "default" else 1):
                fn()
                got.append((qq.grad.clone(), kk.grad.clone()))
            grads[name] = got[0]
            res[f"{name} bitwise_3_runs"] = all(torch.equal(a, got[0][0]) and torch.equal(b, got[0][1])
                                                for a, b in got[1:])
        res["compact vs full rel_dkv"] = rel(grads["compact"][1], grads["full"][1])
        res["compact vs full dq bitwise"] = torch.equal(grads["compact"][0], grads["full"][0])
        if (wl, H) == ("W2", 8):
            r_dq, r_dkv = ref.backward(q.float()[None], kv.float()[None], idx[None], g.float()[None], SCALE, DV)
            res["compact rel_dq"], res["compact rel_dkv"] = rel(grads["compact"][0], r_dq[0]), rel(grads["compact"][1],
                                                                                                   r_dkv[0])
            del r_dq, r_dkv
        del grads
        times, med = alternating(runs, rounds=4)
        res["median_ms"], res["rounds_ms"] = med, times
        res["compact gpu_us_by_kernel"] = by_kernel(runs["compact"])
        key = f"{wl}_H{H}"
        result["workloads"][key] = res
        print(key, json.dumps(med), {k: v for k, v in res.items() if "ms" not in k}, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "exp76.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\nexp76 summary (fwd+bwd through the op, ms)")
    for key, res in result["workloads"].items():
        med = res["median_ms"]
        for name in VARIANTS:
            bits = "" if name == "default" else f"  bitwise3={res[f'{name} bitwise_3_runs']}"
            print(f"{key:7s} {name:8s} {med[name]:8.3f}  {med[name] / med['default']:6.3f}x of default{bits}")
        print(f"{key} compact by kernel (us/call): "
              + ", ".join(f"{k} {v:.0f}" for k, v in res["compact gpu_us_by_kernel"].items()))


if __name__ == "__main__":
    main()
