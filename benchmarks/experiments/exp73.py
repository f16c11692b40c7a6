"""exp73: the deterministic backward's segment sum reads whole rows; int32 sort keys.

v27's profile of the deterministic W2 H64 step (session 26, call 1): the backward kernel 7.77 ms,
``_segment_sum_kernel`` 5.64 ms (14.5 GB of fp32 contributions read: 2.6 TB/s), the radix sort
1.19 ms (int64 keys, 11 chunks of 811K). The tree's sum now runs one program per kv row over all
576 columns (each contribution read as one 2304 B row instead of nine 256 B pieces by nine
programs), reads the next block's positions while it sums the current one, leaves rows no entry
names unread; the keys are int32. Through the op, fwd+bwd, deterministic, H64, same rounds:
  v27         v27's kernel (64 columns, 16 positions per program, every row read and written) and
              int64 keys (cast here: one extra small launch per chunk)
  tree        the tree (all columns, 8 positions, 4 warps, int32 keys)
  tree_i64    the tree's kernel with int64 keys (the sort's share)
  bd64        the tree's kernel over 64 columns, 16 positions (what skip + prefetch alone give)
  bp16_w8     all columns, 16 positions, 8 warps
  bp4         all columns, 4 positions, 4 warps
  default     the atomic backward (the cost of determinism)
Checks: each variant bitwise equal over 5 runs; dq / dkv against the fp32 reference for v27 and
tree. A profile by kernel of v27 and tree. Writes $OUT/exp73.json; a table last."""
import json
import os
import time

import torch
import triton
import triton.language as tl
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from common import DV, SCALE, alternating, workload
from glm5_dsa_plugin.ops import backends, reference as ref, sparse_mla, triton_helpers

TREE_SUM = triton_helpers.segment_sum_rows


@triton.jit
def _v27_segment_sum_kernel(C, SRC, SEG_START, SEG_ROW, OUT, D: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr):
    # v27's kernel, kept here as the baseline: programs (row, 64-column piece), no prefetch
    seg = tl.program_id(0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < D
    start = tl.load(SEG_START + seg)
    end = tl.load(SEG_START + seg + 1)
    acc = tl.zeros([BD], dtype=tl.float32)
    p0 = start
    while p0 < end:
        p = p0 + tl.arange(0, BP)
        pmask = p < end
        src = tl.load(SRC + p, mask=pmask, other=0)
        x = tl.load(C + src[:, None] * D + cols[None, :], mask=pmask[:, None] & cmask[None, :], other=0.0)
        acc += tl.sum(x, axis=0)
        p0 += BP
    row = tl.load(SEG_ROW + seg)
    optr = OUT + row * D + cols
    tl.store(optr, tl.load(optr, mask=cmask, other=0.0) + acc, mask=cmask)


def v27_sum(contrib, keys, out, src=None, block_p=16, n_keys=None):
    keys = keys.long()
    sorted_keys, order = torch.sort(keys, stable=True)
    seg_rows = torch.arange(n_keys + 1, dtype=torch.int64, device=keys.device)
    seg_start = torch.searchsorted(sorted_keys, seg_rows)
    D = contrib.shape[1]
    _v27_segment_sum_kernel[(n_keys, triton.cdiv(D, 64))](contrib, order, seg_start, seg_rows[:n_keys], out,
                                                          D=D, BP=16, BD=64)


SUMS = {
    "v27": v27_sum,
    "tree": TREE_SUM,
    "tree_i64": lambda c, k, o, n_keys=None: TREE_SUM(c, k.long(), o, n_keys=n_keys),
    "bd64": lambda c, k, o, n_keys=None: TREE_SUM(c, k, o, n_keys=n_keys, block_d=64, block_p=16),
    "bp16_w8": lambda c, k, o, n_keys=None: TREE_SUM(c, k, o, n_keys=n_keys, block_p=16, num_warps=8),
    "bp4": lambda c, k, o, n_keys=None: TREE_SUM(c, k, o, n_keys=n_keys, block_p=4),
    "default": TREE_SUM,
}


def patch_for(name):
    triton_helpers.segment_sum_rows = SUMS[name]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def by_kernel(fn, calls=3):
    """GPU microseconds per call by kernel name (the 6 largest and the rest) and GPU idle per call."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    gpu = sorted((e.time_range.start, e.time_range.end, e.name.split("(")[0][:40]) for e in prof.events()
                 if e.device_type == DeviceType.CUDA)
    busy, idle, end = {}, 0.0, gpu[0][0]
    for start, stop, name in gpu:
        busy[name] = busy.get(name, 0.0) + (stop - start) / calls
        idle += max(0.0, start - end) / calls
        end = max(end, stop)
    ranked = sorted(busy.items(), key=lambda kv: -kv[1])
    return dict(ranked[:6]) | {"(rest)": sum(us for _, us in ranked[6:]), "(idle)": idle}


def main():
    from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend

    backends.register_backend("exp73_det", lambda: TileLangBackend(deterministic=True), replace=True)
    backends.register_backend("exp73_default", lambda: TileLangBackend(), replace=True)
    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "workloads": {}}
    for wl in ("W2", "W1"):
        q, kv, idx, g = workload(wl, 64, seed=73)
        q, kv, idx, g = q[0], kv[0], idx[0], g[0]
        qq, kk = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)

        def step(name):
            def run():
                qq.grad = kk.grad = None
                det = name != "default"
                sparse_mla(qq, kk, idx, SCALE, d_v=DV, backend="exp73_det" if det else "exp73_default",
                           deterministic=det)[0].backward(g)
            return run

        runs = {name: step(name) for name in SUMS}
        res, grads = {}, {}
        for name, fn in runs.items():
            patch_for(name)
            got = []
            for _ in range(5 if name != "default" else 1):
                fn()
                got.append((qq.grad.clone(), kk.grad.clone()))
            grads[name] = got[0]
            res[f"{name} bitwise_5_runs"] = all(torch.equal(a, got[0][0]) and torch.equal(b, got[0][1])
                                                for a, b in got[1:])
        r_dq, r_dkv = ref.backward(q.float()[None], kv.float()[None], idx[None], g.float()[None], SCALE, DV)
        for name in ("v27", "tree", "default"):
            res[f"{name} rel_dq"] = rel(grads[name][0], r_dq[0])
            res[f"{name} rel_dkv"] = rel(grads[name][1], r_dkv[0])
        res["tree vs tree_i64 bitwise"] = torch.equal(grads["tree"][1], grads["tree_i64"][1])
        res["dq v27 vs tree bitwise"] = torch.equal(grads["tree"][0], grads["v27"][0])
        del r_dq, r_dkv, grads
        times, med = alternating(runs, rounds=4, before=patch_for)
        res["median_ms"], res["rounds_ms"] = med, times
        for name in ("v27", "tree"):
            patch_for(name)
            res[f"{name} gpu_us_by_kernel"] = by_kernel(runs[name])
        patch_for("tree")
        result["workloads"][wl] = res
        print(wl, json.dumps(med), {k: v for k, v in res.items() if "ms" not in k}, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "exp73.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\nexp73 summary (deterministic fwd+bwd through the op, H64, ms)")
    for wl, res in result["workloads"].items():
        med = res["median_ms"]
        for name in SUMS:
            print(f"{wl} {name:9s} {med[name]:8.3f}  {med[name] / med['v27']:6.3f}x of v27  "
                  f"bitwise5={res[f'{name} bitwise_5_runs']}")
        for name in ("v27", "tree"):
            print(f"{wl} {name} by kernel (us/call): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in res[f"{name} gpu_us_by_kernel"].items()))


if __name__ == "__main__":
    main()
