"""Time the guard's device-side backward repair (``ops.guard.row_repair``) on the H200 and check it.

W1 H64 (T=4096, T_kv=8192, topk 2048, all valid): the three launches with the flag clear (the
happy path's cost), and with 1% of the query rows' dq poisoned, and with 4 kv rows' dkv
poisoned (every query row that selected them is recomputed), for each (precision, slots per
step, warps); the host-side reference repair of the same rows for comparison. Each variant's
repaired rows vs the fp32 reference (rel L2). Prints a table, writes $OUT/bench_row_repair.json.
"""

import argparse
import json
import os

import torch
from triton.testing import do_bench

from glm5_dsa_plugin.ops import reference as ref
from glm5_dsa_plugin.ops.guard import FLAG_SLOTS, Flag
from glm5_dsa_plugin.ops.guard.row_repair import repair_backward_rows
from glm5_dsa_plugin.ops.workloads import w1_indices


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="tf32x3:32:8:32:bf16,tf32x3:16:4:32:bf16,tf32x3:32:8:32:fp32",
                    help="fp32 precision:slots per step:warps:rows per program:bf16|fp32 dots, comma-separated")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    T, T_kv, H, K, DV = 4096, 8192, 64, 2048, 512
    scale = 256**-0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    idx = w1_indices(T, T_kv, K, gen)[None]
    q = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(1, T, H, DV, generator=gen, device="cuda", dtype=torch.bfloat16)
    bad_q = torch.randperm(T, generator=torch.Generator().manual_seed(0))[: T // 100].cuda()
    bad_kv = torch.tensor([11, 2000, 5000, 8000], device="cuda")
    dq0 = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    dkv0 = torch.randn(1, T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    rows_q = torch.stack([torch.zeros_like(bad_q), bad_q], 1)
    ref_dq, _ = ref.backward(q.float(), kv.float(), idx, do.float(), scale, DV, rows=rows_q)
    sel = (idx[0, :, 0, :, None] == bad_kv).any(-1).any(-1).nonzero().flatten()
    _, ref_dkv = ref.backward(q.float(), kv.float(), idx, do.float(), scale, DV,
                              rows=torch.stack([torch.zeros_like(sel), sel], 1))
    res = {"rows_selecting_bad_kv": int(sel.numel())}
    # the host-side repair (what the guard did before): reference on the bad rows
    res["host_reference_1pct_dq_ms"] = do_bench(
        lambda: ref.backward(q, kv, idx, do, scale, DV, rows=rows_q), warmup=5, rep=50)
    for v in args.variants.split(","):
        prec, bs, nw, rows, dots = v.split(":")
        kw = dict(precision=prec, slots_per_step=int(bs), num_warps=int(nw), rows_per_program=int(rows),
                  bf16=dots == "bf16")

        def run(poison):
            dq, dkv = dq0.clone(), dkv0.clone()
            flags = torch.zeros(FLAG_SLOTS, dtype=torch.int32, device="cuda")
            if poison == "dq":
                dq[0, bad_q, 3, 7] = float("nan")
            if poison == "dq1":
                dq[0, bad_q[:1], 3, 7] = float("nan")
            if poison == "dkv":
                dkv[0, bad_kv, 0, 9] = float("nan")
            flags[Flag.NONFINITE] = int(poison is not None)
            repair_backward_rows(q, kv, idx, do, scale, DV, dq, dkv, flags, **kw)
            return dq, dkv, flags

        try:
            dq, _, fl = run("dq")
            _, dkv, fl2 = run("dkv")
            res[v] = dict(
                clear_ms=do_bench(lambda: run(None), warmup=5, rep=50),
                dq_1row_ms=do_bench(lambda: run("dq1"), warmup=5, rep=100),
                dq_1pct_ms=do_bench(lambda: run("dq"), warmup=5, rep=100),
                dkv_4rows_ms=do_bench(lambda: run("dkv"), warmup=1, rep=1),
                rel_dq=rel(dq[0, bad_q], ref_dq[0, bad_q]), rel_dkv=rel(dkv[0, bad_kv], ref_dkv[0, bad_kv]),
                flags_dq=fl.tolist()[:5], flags_dkv=fl2.tolist()[:5])
            res[v]["copy_ms"] = do_bench(lambda: (dq0.clone(), dkv0.clone()), warmup=5, rep=50)
        except Exception as exc:  # noqa: BLE001 - a variant failing to build is a result
            res[v] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    os.makedirs(args.out, exist_ok=True)
    res["gpu"] = torch.cuda.get_device_name()
    with open(os.path.join(args.out, "bench_row_repair.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
