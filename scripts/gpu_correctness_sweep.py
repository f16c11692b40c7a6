#!/usr/bin/env python
"""Correctness sweep of the TileLang backend against the fp32 reference, at sizes past the GPU unit
tests: heads per kv group 8-128 (row groups of R = 8, 4, 2 rows and one-row tiles), one and two
kv groups, topk 128 / 2048, random keys over a long and a short context, causal rows, and random
-1 padding with empty rows. Every case runs fwd+bwd with the shipped default (``row_groups``
"auto") and, below 64 heads per group, with row groups off. A fault that gives wrong but finite results only on long contexts (such as
the R = 2 key-list race fixed in 0.1.0, see CHANGELOG.md) reaches no unit test: this is the net
for that kind of fault. Needs an sm_90 GPU.

Writes ``$OUT/gpu_correctness_sweep.json``; prints one line per case and run; exits 1 when any run
misses the bound (rel L2 3e-3 for out, dq, dkv; 1e-3 absolute for lse; exact zeros for empty
rows)."""

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bench_sparse_mla import D_V, SCALE, rel  # noqa: E402  (the bench's scale, width and rel L2)
from glm5_dsa_plugin.ops import reference as ref  # noqa: E402
from glm5_dsa_plugin.ops.contract import problem_of  # noqa: E402
from glm5_dsa_plugin.ops.workloads import w1_indices, w2_indices  # noqa: E402

REL_BOUND, LSE_BOUND = 3e-3, 1e-3
HEAD_LAYOUTS = [(8, 1), (16, 1), (24, 1), (32, 1), (48, 1), (64, 1), (128, 1), (32, 2), (64, 2)]  # (H, G)
CONTEXTS = ("random_long", "random_short", "causal", "padded")
DEVICE = "cuda"


def make_indices(context: str, T: int, topk: int, G: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """-> (indices [1, T, G, topk] int32, T_kv) for one context."""
    if context == "causal":
        per_group = [w2_indices(T, topk, gen) for _ in range(G)]
        return torch.cat(per_group, dim=1)[None], T
    T_kv = 32768 if context == "random_long" else max(2048, topk)
    idx = torch.cat([w1_indices(T, T_kv, topk, gen) for _ in range(G)], dim=1)[None]
    if context == "padded":
        idx[torch.rand(idx.shape, generator=gen, device=idx.device) < 0.3] = -1
        idx[:, 5:9] = -1  # empty rows (a whole group of 4 at R = 4)
    return idx.contiguous(), T_kv


def run_case(case: dict) -> list[dict]:
    """fwd+bwd of every variant of one case against the reference -> one result row per variant."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    H, G, topk, context, T = case["H"], case["G"], case["topk"], case["context"], case["T"]
    gen = torch.Generator(device=DEVICE).manual_seed(case["seed"])
    idx, T_kv = make_indices(context, T, topk, G, gen)
    q = torch.randn(1, T, H, D_V + 64, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    kv = torch.randn(1, T_kv, G, D_V + 64, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    g = torch.randn(1, T, H, D_V, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    r_out, r_lse = ref.forward(q.float(), kv.float(), idx, SCALE, D_V)
    r_dq, r_dkv = ref.backward(q.float(), kv.float(), idx, g.float(), SCALE, D_V)
    empty = (idx < 0).all(-1).repeat_interleave(H // G, dim=-1)  # [1, T, H]
    variants = {"default": TileLangBackend()}
    if H // G < 64:
        variants["one_row"] = TileLangBackend(row_groups=False)
    rows = []
    for name, be in variants.items():
        for call in range(2):  # "auto" may switch paths once the first call's counts are in
            prob = problem_of(q, kv, idx, SCALE, D_V)
            out, lse, saved = be.forward_saving(q, kv, idx, prob)
            dq, dkv = be.backward_saved(q, saved, out, lse, g, prob)
            if q.is_cuda:
                torch.cuda.synchronize()
            row = dict(case, T_kv=T_kv, variant=name, call=call, row_groups=len(saved) > 3,
                       rel_out=rel(out, r_out), rel_dq=rel(dq, r_dq), rel_dkv=rel(dkv, r_dkv),
                       lse_err=float((lse - r_lse).abs().max()),
                       empty_rows_zero=bool((out[empty] == 0).all() and (dq[empty] == 0).all()),
                       finite=all(bool(torch.isfinite(x).all()) for x in (out, lse, dq, dkv)))
            row["ok"] = (max(row["rel_out"], row["rel_dq"], row["rel_dkv"]) <= REL_BOUND
                         and row["lse_err"] <= LSE_BOUND and row["empty_rows_zero"] and row["finite"])
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", type=int, default=512, help="query rows per case")
    ap.add_argument("--topk", default="128,2048")
    ap.add_argument("--threads", type=int, default=8, help="cases in flight (their kernels build in parallel)")
    ap.add_argument("--seed", type=int, default=int(time.time()), help="fresh inputs per run unless given")
    a = ap.parse_args()
    layouts = [(H, G, int(k), c) for H, G in HEAD_LAYOUTS for k in a.topk.split(",") for c in CONTEXTS]
    cases = [dict(H=H, G=G, topk=k, context=c, T=a.rows, seed=a.seed + i) for i, (H, G, k, c) in enumerate(layouts)]
    t0 = time.time()
    rows = []
    with ThreadPoolExecutor(a.threads) as pool:
        for case_rows in pool.map(run_case, cases):
            for r in case_rows:
                print(f"{'ok  ' if r['ok'] else 'FAIL'} H{r['H']:<3} G{r['G']} topk {r['topk']:<4} {r['context']:12} "
                      f"{r['variant']:7} call {r['call']} groups={r['row_groups']!s:5} out {r['rel_out']:.1e} "
                      f"dq {r['rel_dq']:.1e} dkv {r['rel_dkv']:.1e} lse {r['lse_err']:.1e}", flush=True)
            rows.extend(case_rows)
    bad = [r for r in rows if not r["ok"]]
    info = dict(gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, torch=torch.__version__,
                seed=a.seed, seconds=time.time() - t0,
                runs=len(rows), failed=len(bad), rows=rows)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gpu_correctness_sweep.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"{len(rows) - len(bad)} of {len(rows)} runs within bounds ({len(cases)} cases, {info['seconds']:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
