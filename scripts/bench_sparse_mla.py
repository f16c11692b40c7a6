#!/usr/bin/env python
"""Check and time sparse MLA on one GPU: ours vs megatron-core 0.19.2's vendored SparseMLA vs the reference.

Workloads (bf16, Dqk=576, d_v=512, G=1, topk=2048):
  W1: T=4096, T_kv=8192, all slots valid.
  W2: T=T_kv=4096, row t = random permutation of min(t+1, 2048) keys in [0, t] then -1; rows 0, 7, 2000 empty.
Writes ``$OUT/bench_sparse_mla.json`` (rows: workload, H, impl, fwd_ms, fwd_bwd_ms, fwd_tflops,
bwd_tflops, peak_gib, call_peak_gib, rel errors) and a PNG chart when matplotlib is present; prints a table last.
Rows: ours (defaults), ours_novalidate, ours_classic (both directions on the single-warpgroup
kernels), ours_r1 (H < 64: one query row per block, no row groups), mcore, reference.
``--kernels-only``: the rows and the row groups' list figures only (``bench_sparse_mla_kernels.json``).
"""

from __future__ import annotations

import argparse
import statistics
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kernel_events

from glm5_dsa_plugin.ops import configure, sparse_mla  # noqa: E402
from glm5_dsa_plugin.ops import reference as ref  # noqa: E402
from glm5_dsa_plugin.ops.contract import check_indices, flops, problem_of  # noqa: E402
from glm5_dsa_plugin.ops.workloads import w1_indices, w2_indices  # noqa: E402

SCALE = 256**-0.5
D_V = 512


def bench(fn, warmup=25, rep=100):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def make_impls(has_mcore):
    impls = {
        "ours": lambda q, kv, i: sparse_mla(q, kv, i, SCALE, d_v=D_V, backend="tilelang"),
        "ours_novalidate": lambda q, kv, i: sparse_mla(q, kv, i, SCALE, d_v=D_V, backend="tilelang", validate=False),
    }
    # 64-row tiles (H64, and row groups at H8/H16) run the warp-specialised forward and backward by
    # default; "ours_classic" is the single-warpgroup kernels (H64 forward: the 64-row plan chosen
    # per call from row counts). < 64 heads: the default runs row groups (R = 64 / hg rows per
    # block over their keys' union); "ours_r1" is one query row per block. Both in the same run
    try:
        from glm5_dsa_plugin.ops.backends import register_backend
        from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

        register_backend("tilelang_classic",
                         lambda: TileLangBackend()._with_choices(fwd_warp_specialized=False,
                                                                 bwd_warp_specialized=False),
                         replace=True)
        register_backend("tilelang_r1", lambda: TileLangBackend(row_groups=False), replace=True)
        impls["ours_classic"] = lambda q, kv, i: sparse_mla(q, kv, i, SCALE, d_v=D_V, backend="tilelang_classic")
        impls["ours_r1"] = lambda q, kv, i: sparse_mla(q, kv, i, SCALE, d_v=D_V, backend="tilelang_r1")
    except Exception as exc:  # noqa: BLE001 - an option failing to load is a result, not a crash
        print(f"ours_classic / ours_r1 unavailable: {type(exc).__name__}: {exc}")
    if has_mcore:
        from megatron.core.transformer.experimental_attention_variant.ops.sparse_mla import SparseMLA

        impls["mcore"] = lambda q, kv, i: SparseMLA.apply(q, kv, i, SCALE)
    impls["reference"] = lambda q, kv, i: sparse_mla(q, kv, i, SCALE, d_v=D_V, backend="reference")
    return impls


def prebuild(impls, heads, extras=True):
    """Run every timed path once on tiny inputs (T=64, the benchmark's topk 2048), one thread per
    (impl, H), so their kernels compile in parallel (TileLang builds outside the GIL; on a cold
    kernel cache the serial builds alone outrun a 10-minute device call). Also builds the
    single-warpgroup forward's row-bucket plan (``ours_classic`` at H64 switches to it after its
    first call) and, with ``extras``, the deterministic and fix-cost paths. -> seconds taken."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend
    from glm5_dsa_plugin.ops.tilelang.plan import AUTO_BUCKETS_64

    def run(job):
        try:
            build(*job)
        except Exception as exc:  # noqa: BLE001 - the timed call reports (and builds) it again
            print(f"prebuild {job}: {type(exc).__name__}: {exc}")

    def build(name, H):
        g = torch.Generator(device="cuda").manual_seed(H)
        q = torch.randn(64, H, 576, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(64, 1, 576, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        idx = w2_indices(64, 2048, g)
        if name == "bucket_plan":  # (forward_kernels builds a plan's kernels in parallel itself)
            TileLangBackend().forward_kernels(H, D_V, 64, 2048, 1, SCALE, H, AUTO_BUCKETS_64)
            return
        if name == "deterministic":
            out = sparse_mla(q, kv, idx, SCALE, d_v=D_V, backend="tilelang", deterministic=True)[0]
        elif name == "unsafe":  # the fix-cost rows' kernels
            be = TileLangBackend()._with_choices(safe=False)
            prob = problem_of(q[None], kv[None], idx[None], SCALE, D_V)
            o, l = be.forward(q[None].detach(), kv[None].detach(), idx[None], prob)
            be.backward(q[None].detach(), kv[None].detach(), idx[None], o, l, torch.ones_like(o), prob)
            return
        else:
            out = impls[name](q, kv, idx)
            out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()

    jobs = [(n, H) for n in impls if n != "reference" for H in heads if not (n == "ours_r1" and H >= 64)]
    jobs += [("bucket_plan", 64)] if "ours_classic" in impls and 64 in heads else []
    jobs += [("deterministic", 64), ("deterministic", 16), ("deterministic", 8), ("unsafe", 64)] if extras else []
    t0 = time.time()
    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(run, jobs))
    torch.cuda.synchronize()
    return time.time() - t0


def fix_cost(gen, idx, T, T_kv, H=64):
    """W1 backend forward / backward ms: the shipped default, and safe vs unsafe kernels of the same
    (single-warpgroup) forward and backward, i.e. what the padding / bounds fixes cost."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    out = {}
    classic = TileLangBackend()._with_choices(fwd_warp_specialized=False, bwd_warp_specialized=False)
    for label, be in (("default", TileLangBackend()), ("safe=True", classic),
                      ("safe=False", TileLangBackend()._with_choices(safe=False))):
        q = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(1, T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(1, T, H, D_V, generator=gen, device="cuda", dtype=torch.bfloat16)
        prob = problem_of(q, kv, idx[None], SCALE, D_V)
        o, l = be.forward(q, kv, idx[None], prob)
        out[f"W1_H{H}_kernel_fwd_ms_{label}"] = bench(lambda: be.forward(q, kv, idx[None], prob))
        out[f"W1_H{H}_kernel_bwd_ms_{label}"] = bench(lambda: be.backward(q, kv, idx[None], o, l, g, prob))
    return out


def guard_repair_cost(gen, frac=0.01):
    """W1 H64 fwd+bwd: fast path vs the guarded call when 1% of the rows come back NaN."""
    import warnings

    from glm5_dsa_plugin.ops import backends
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    class OnePercentNaN(TileLangBackend):
        name = "tilelang_nan1pct"
        reports_nonfinite = False  # NaN is written after the kernels: the guard scans itself
        finite_out_lse_bound = None  # (out too: its lse stays usual)

        def forward_saving(self, q, kv, indices, prob, index_flag=None):
            out, lse, saved = super().forward_saving(q, kv, indices, prob, index_flag)
            out[:, bad_rows] = float("nan")
            return out, lse, saved

        def backward_saved(self, q, saved, out, lse, grad_out, prob):
            dq, dkv = super().backward_saved(q, saved, out, lse, grad_out, prob)
            dq[:, bad_rows] = float("nan")
            return dq, dkv

    try:
        T, T_kv, H = 4096, 8192, 64
        bad_rows = torch.randperm(T, generator=torch.Generator().manual_seed(0))[: int(T * frac)].cuda()
        backends.register_backend("tilelang_nan1pct", OnePercentNaN, replace=True)
        idx = w1_indices(T, T_kv, 2048, gen)
        q = torch.randn(T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(T, H, D_V, generator=gen, device="cuda", dtype=torch.bfloat16)
        res = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in ("tilelang", "tilelang_nan1pct"):
                def step():
                    q.grad = kv.grad = None
                    sparse_mla(q, kv, idx, SCALE, d_v=D_V, backend=name)[0].backward(g)
                step()
                res[f"W1_H64_fwd_bwd_ms_{'fast' if name == 'tilelang' else 'guarded_1pct_rows_bad'}"] = bench(
                    step, 5, 20)
        return res
    except Exception as exc:  # noqa: BLE001
        return {"guard_repair_error": f"{type(exc).__name__}: {exc}"}


def gpu_idle(step, calls=3, top=6):
    """Where the GPU waits on the host: ``calls`` calls of ``step`` under torch.profiler ->
    (GPU-idle microseconds per call between the first and last GPU activity, the ``top`` largest
    gaps as "us: kernel before -> kernel after", GPU microseconds per call by kernel name: the
    ``top`` largest and the rest summed)."""
    from kernel_events import kernel_events

    gpu = kernel_events(step, calls)
    gaps, end, prev = [], gpu[0][0], gpu[0][2]
    for start, stop, name in gpu:
        if start > end:
            gaps.append((start - end, prev, name))
        if stop > end:
            end, prev = stop, name
    short = lambda n: n.split("(")[0][:40]  # noqa: E731
    idle = sum(g for g, _, _ in gaps) / calls
    busy: dict[str, float] = {}
    for start, stop, name in gpu:
        busy[short(name)] = busy.get(short(name), 0.0) + (stop - start) / calls
    ranked = sorted(busy.items(), key=lambda item: -item[1])
    by_kernel = dict(ranked[:top]) | {"(rest)": sum(us for _, us in ranked[top:])}
    return idle, [f"{g:.0f}: {short(a)} -> {short(b)}" for g, a, b in sorted(gaps, reverse=True)[:top]], by_kernel


def alternating_medians(step, settings, apply, rounds=5):
    """ms of ``step`` under each of ``settings`` (``apply(setting)`` switches), the settings
    alternating within each of ``rounds`` rounds, median over the rounds (drift hits all alike)."""
    times = {setting: [] for setting in settings}
    for _ in range(rounds):
        for setting in settings:
            apply(setting)
            times[setting].append(bench(step, 5, 40))
    return {setting: statistics.median(ts) for setting, ts in times.items()}


def record_gpu_idle(extra, step, head, tail=""):
    """``gpu_idle(step)`` into ``extra`` as {head}_gpu_idle_us_per_call{tail}, {head}_largest_gaps_us{tail}
    and {head}_gpu_us_per_call_by_kernel{tail}."""
    idle, gaps, by_kernel = gpu_idle(step)
    extra[f"{head}_gpu_idle_us_per_call{tail}"] = idle
    extra[f"{head}_largest_gaps_us{tail}"] = gaps
    extra[f"{head}_gpu_us_per_call_by_kernel{tail}"] = by_kernel


def write_host_profile(q, kv, idx, g, path, calls=50):
    """cProfile of `calls` tiny no-grad forwards (flags read eagerly) and `calls` tiny fwd+bwd
    calls, each sorted by cumulative and by own time (host time: what a host sync exposes)."""
    import cProfile
    import io
    import pstats

    buf = io.StringIO()
    for label, fn in (("no-grad forward", lambda: sparse_mla(q.detach(), kv.detach(), idx, SCALE, backend="tilelang")),
                      ("fwd+bwd", lambda: sparse_mla(q, kv, idx, SCALE, backend="tilelang")[0].backward(g))):
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        prof.disable()
        buf.write(f"===== {calls} tiny {label} calls\n")
        for order, n in (("cumulative", 60), ("tottime", 30)):
            pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(n)
    with open(path, "w") as f:
        f.write(buf.getvalue())


def indexer_speed(gen, lengths: str):
    """Lightning indexer scores + top-k (2048) at GLM-5 sizes: ours vs megatron-core's naive path."""
    rows = []
    for T in [int(x) for x in lengths.split(",") if x]:
        try:
            from glm5_dsa_plugin.model import indexer, visibility

            Hi, Di, K = 32, 128, 2048
            q = torch.randn(T, Hi, Di, generator=gen, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(T, Di, generator=gen, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(T, Hi, generator=gen, device="cuda", dtype=torch.bfloat16)
            vis = visibility.Visibility.causal(T, device="cuda")
            ours = bench(lambda: indexer.select_topk(q, k, w, K, vis), 2, 10)
            row = dict(T=T, ours_ms=ours)
            try:
                from megatron.core.transformer.experimental_attention_variant.dsa import fused_qk_topk_naive

                mask = torch.full((T, T), float("-inf"), device="cuda").triu(1)
                row["mcore_ms"] = bench(lambda: fused_qk_topk_naive(q[:, None], k[:, None], w[:, None], K, mask), 2, 10)
            except Exception as exc:  # noqa: BLE001
                row["mcore_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            print("indexer", row)
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(T=T, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="64,16,8")
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--reference", default="W1:64,W2:8", help="workload:H pairs where the slow reference is timed")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--indexer-lengths", default="4096,16384", help="T for the indexer comparison ('' to skip)")
    ap.add_argument("--host-profile", action="store_true", help="also write $OUT/host_profile.txt (cProfile)")
    ap.add_argument("--guard-only", action="store_true",
                    help="only the guard's overhead and repair cost (writes bench_sparse_mla_guard.json)")
    ap.add_argument("--kernels-only", action="store_true",
                    help="only the workload rows (writes bench_sparse_mla_kernels.json)")
    args = ap.parse_args()

    gen = torch.Generator(device="cuda").manual_seed(1234)
    try:
        import megatron.core.transformer.experimental_attention_variant.ops.sparse_mla as m  # noqa: F401

        has_mcore = m.SparseMLA is not None
    except Exception as exc:  # noqa: BLE001
        print("megatron-core SparseMLA unavailable:", exc)
        has_mcore = False
    impls = make_impls(has_mcore)
    ref_pairs = {tuple(p.split(":")) for p in args.reference.split(",") if p}
    rows, extra = [], {}
    heads = [int(h) for h in args.heads.split(",")]
    extra["prebuild_s"] = (prebuild({"ours": impls["ours"]}, [64]) if args.guard_only
                           else prebuild(impls, heads, extras=not args.kernels_only))
    print(f"kernels built in {extra['prebuild_s']:.0f} s", flush=True)
    for wl in [] if args.guard_only else args.workloads.split(","):
        T, T_kv = (4096, 8192) if wl == "W1" else (4096, 4096)
        idx = w1_indices(T, T_kv, 2048, gen) if wl == "W1" else w2_indices(T, 2048, gen)
        n_valid = int((idx >= 0).sum())
        extra[f"{wl}_validate_ms"] = bench(lambda: check_indices(idx[None], T_kv))
        from glm5_dsa_plugin.ops.row_groups import group_keys
        from glm5_dsa_plugin.ops.tilelang.passes import prepare_indices

        kidx, _ = prepare_indices(idx[None], T_kv, 2048)
        for R in (8, 4):  # the row groups' key lists (part of every H8 / H16 call)
            ext = group_keys(kidx, T_kv, R)[2]
            extra[f"{wl}_group_keys_ms_R={R}"] = bench(lambda: group_keys(kidx, T_kv, R))
            extra[f"{wl}_group_entries_per_row_R={R}"] = float(ext.float().sum()) / T
        extra[f"{wl}_valid_slots_per_row"] = float((idx >= 0).sum()) / T
        for H in heads:
            q = torch.randn(T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
            kv = torch.randn(T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
            grad = torch.randn(T, H, D_V, generator=gen, device="cuda", dtype=torch.bfloat16)
            f_fwd, f_bwd = flops(n_valid, H, 576, D_V)
            base = None
            for name, fn in impls.items():
                if name == "reference" and (wl, str(H)) not in ref_pairs:
                    continue
                if name == "ours_r1" and H >= 64:
                    continue
                qq, kk = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)

                def fwd():
                    with torch.no_grad():
                        return fn(qq, kk, idx)

                def fwd_bwd():
                    qq.grad = kk.grad = None
                    out, _ = fn(qq, kk, idx)
                    out.backward(grad)

                try:
                    torch.cuda.synchronize()
                    live = torch.cuda.memory_allocated()  # inputs, and whatever earlier rows keep
                    torch.cuda.reset_peak_memory_stats()
                    fwd_bwd()
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    call_peak = peak - live / 2**30  # the fwd+bwd's own: independent of the impls' order
                    o, _ = fwd()
                    res = (o.float(), qq.grad.float(), kk.grad.float())
                    fast = name == "reference"
                    t_f = bench(fwd, *((1, 3) if fast else (25, 100)))
                    t_fb = bench(fwd_bwd, *((1, 3) if fast else (25, 100)))
                except Exception as exc:  # noqa: BLE001 - a failing peer is a result, not a crash
                    print(f"{wl} H{H} {name}: FAILED {type(exc).__name__}: {exc}")
                    rows.append(dict(workload=wl, H=H, impl=name, error=f"{type(exc).__name__}: {exc}"))
                    continue
                t_b = t_fb - t_f
                row = dict(workload=wl, H=H, impl=name, fwd_ms=t_f, fwd_bwd_ms=t_fb,
                           fwd_tflops=f_fwd / t_f / 1e9, bwd_tflops=f_bwd / t_b / 1e9 if t_b > 0 else None,
                           peak_gib=peak, call_peak_gib=call_peak, n_valid=n_valid,
                           finite=all(bool(torch.isfinite(x).all()) for x in res))
                if name == "ours":
                    base = res
                elif base is not None:
                    row["rel_vs_ours"] = [rel(a, b) for a, b in zip(res, base)]
                rows.append(row)
                del qq, kk, res
            # exact check of ours against the fp32 reference, chunked (fresh inputs per H)
            if base is not None:
                r_out, _ = ref.forward(q[None], kv[None], idx[None], SCALE, D_V)
                r_dq, r_dkv = ref.backward(q[None], kv[None], idx[None], grad[None], SCALE, D_V)
                errs = [rel(base[0], r_out[0]), rel(base[1], r_dq[0]), rel(base[2], r_dkv[0])]
                # (freed here: alive, they counted in the next H's first peak_gib, 0.53 GiB after H64;
                # peak_gib counts all live memory, call_peak_gib only what the fwd+bwd adds)
                del r_out, r_dq, r_dkv, base
                for r in rows:
                    if r["workload"] == wl and r["H"] == H and r["impl"] == "ours":
                        r["rel_l2_vs_reference"] = errs
        # what the fixes cost: same kernels, fixes compiled out (fully valid W1 only). The
        # warp-specialised forward needs the sentinel rewrite (safe only), so both sides run the
        # single-warpgroup forward; "default" is the backend as shipped
        if wl == "W1" and not args.kernels_only:
            extra.update(fix_cost(gen, idx, T, T_kv))
    indexer_rows = []
    if not args.kernels_only:  # guard, deterministic, host time, repair cost, indexer
        # guard overhead at W2 H64
        idx = w2_indices(4096, 2048, gen)
        q = torch.randn(4096, 64, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(4096, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(4096, 64, D_V, generator=gen, device="cuda", dtype=torch.bfloat16)
        for validate in (True, False):
            def step():
                q.grad = kv.grad = None
                sparse_mla(q, kv, idx, SCALE, d_v=D_V, backend="tilelang", validate=validate)[0].backward(grad)

            policies = ("off", "fallback")
            for pol, ms in alternating_medians(step, policies, lambda pol: configure(policy=pol)).items():
                extra[f"W2_H64_fwd_bwd_ms_guard={pol}" + ("" if validate else "_novalidate")] = ms
            if validate:  # where the GPU idles, per policy (profiled calls, so slower than the timings)
                for pol in policies:
                    configure(policy=pol)
                    record_gpu_idle(extra, step, "W2_H64", f"_guard={pol}")
        configure(policy="fallback")

        # forward without grad: its flags read before it returns (default) or deferred to a later
        # call (configure(forward_flags="deferred")); alternating rounds, medians
        def fwd_only():
            with torch.no_grad():
                sparse_mla(q, kv, idx, SCALE, d_v=D_V, backend="tilelang")

        modes = ("eager", "deferred")
        for mode, ms in alternating_medians(fwd_only, modes, lambda mode: configure(forward_flags=mode)).items():
            extra[f"W2_H64_fwd_ms_forward_flags={mode}"] = ms
        for mode in modes:  # the forward's GPU time by kernel and its idle, per mode
            configure(forward_flags=mode)
            record_gpu_idle(extra, fwd_only, "W2_H64_fwd", f"_forward_flags={mode}")
        configure(forward_flags="eager")
        # W2 H16 (row groups): the default call's GPU time by kernel and its idle
        q16 = torch.randn(4096, 16, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad16 = torch.randn(4096, 16, D_V, generator=gen, device="cuda", dtype=torch.bfloat16)

        def step16():
            q16.grad = kv.grad = None
            sparse_mla(q16, kv, idx, SCALE, d_v=D_V, backend="tilelang")[0].backward(grad16)

        record_gpu_idle(extra, step16, "W2_H16")
        del q16, grad16
        # the guard's GPU work alone: one finiteness launch per direction (W2 H64 out+lse, dq+dkv)
        from glm5_dsa_plugin.ops.guard.device_checks import flag_nonfinite

        flags = torch.zeros(2, dtype=torch.int32, device="cuda")
        o_, l_ = sparse_mla(q.detach(), kv.detach(), idx, SCALE, d_v=D_V, backend="tilelang")
        extra["W2_H64_guard_scan_fwd_ms"] = bench(lambda: flag_nonfinite(o_, flags, 1, l_))
        # what the guard runs for the TileLang backend (kv clean: lse read, out rows only if unusual)
        from glm5_dsa_plugin.ops import EMPTY_ROW_LSE
        from glm5_dsa_plugin.ops.guard import FLAG_SLOTS, Flag
        from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend
        from glm5_dsa_plugin.ops.guard.device_checks import check_forward

        gated = torch.zeros(FLAG_SLOTS, dtype=torch.int32, device="cuda")
        bound = TileLangBackend().finite_out_lse_bound(problem_of(q, kv, idx, SCALE, D_V))
        ext_ = (idx >= 0).any(-1).to(torch.int32)  # (as row_extent: > 0 where a row has a valid slot)
        extra["W2_H64_guard_check_fwd_gated_ms"] = bench(
            lambda: check_forward(o_, l_, gated, Flag.NONFINITE, Flag.KV_SUSPECT, bound, EMPTY_ROW_LSE, ext_,
                                  l_.shape[-1] // ext_.shape[-1]))
        assert gated.tolist() == [0] * FLAG_SLOTS
        dq_, dkv_ = torch.randn_like(q), torch.randn_like(kv)
        extra["W2_H64_guard_scan_bwd_ms"] = bench(lambda: flag_nonfinite(dq_, flags, 1, dkv_))
        extra["host_sync_us"] = bench(lambda: flags.tolist()) * 1e3
        del o_, l_, dq_, dkv_

        # deterministic backward (dKV reduced per kv row in a fixed order): cost and 5-run reproducibility
        def step_det(keep=True):  # (timed without keeping: the clones are 0.18 ms of copies)
            q.grad = kv.grad = None
            sparse_mla(q, kv, idx, SCALE, d_v=D_V, backend="tilelang", deterministic=True)[0].backward(grad)
            return (q.grad.clone(), kv.grad.clone()) if keep else None

        try:
            if args.guard_only:
                raise RuntimeError("skipped (--guard-only)")
            first = step_det()
            extra["W2_H64_deterministic_bitwise_5_runs"] = all(
                torch.equal(a, b) for _ in range(4) for a, b in zip(step_det(), first))
            extra["W2_H64_fwd_bwd_ms_deterministic"] = bench(lambda: step_det(keep=False), 5, 20)
            # its GPU time by kernel (the sum, the sort)
            record_gpu_idle(extra, lambda: step_det(keep=False), "W2_H64_deterministic")
            # at 16 and 8 heads (row groups: one contribution per entry of a group's key list)
            for h in (16, 8):
                qh = torch.randn(4096, h, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                gh = torch.randn(4096, h, D_V, generator=gen, device="cuda", dtype=torch.bfloat16)

                def step_small_det():
                    qh.grad = kv.grad = None
                    sparse_mla(qh, kv, idx, SCALE, d_v=D_V, backend="tilelang", deterministic=True)[0].backward(gh)

                extra[f"W2_H{h}_fwd_bwd_ms_deterministic"] = bench(step_small_det, 5, 20)
                del qh, gh
        except Exception as exc:  # noqa: BLE001
            extra["deterministic_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"

        # host time per call (tiny problem, so the GPU never waits on itself): what a host sync exposes
        import time

        tq = torch.randn(64, 64, 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        tkv = torch.randn(64, 1, 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        tidx = torch.randint(-1, 64, (64, 1, 64), device="cuda", dtype=torch.int32)
        tg = torch.randn(64, 64, D_V, device="cuda", dtype=torch.bfloat16)
        for label, fn in () if args.guard_only else (("fwd", lambda: sparse_mla(tq.detach(), tkv.detach(), tidx, SCALE, backend="tilelang")),
                          ("fwd_bwd", lambda: sparse_mla(tq, tkv, tidx, SCALE, backend="tilelang")[0].backward(tg))):
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            extra[f"host_us_per_call_{label}"] = (time.perf_counter() - t0) / 200 * 1e6
            # GPU time by kernel of the same tiny call: host-bound if it is far below the time per call
            idle, _, by_kernel = gpu_idle(fn, calls=20)
            extra[f"tiny_{label}_gpu_idle_us_per_call"] = idle
            extra[f"tiny_{label}_gpu_us_per_call_by_kernel"] = by_kernel
        if args.host_profile:
            write_host_profile(tq, tkv, tidx, tg, os.path.join(args.out, "host_profile.txt"))

        extra.update(guard_repair_cost(gen))
        indexer_rows = [] if args.guard_only else indexer_speed(gen, args.indexer_lengths)

    import importlib.metadata as md

    def ver(p):
        try:
            return md.version(p)
        except Exception:  # noqa: BLE001
            return None

    result = dict(
        gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
        versions=dict(torch=torch.__version__, cuda=torch.version.cuda, tilelang=ver("tilelang"),
                      megatron_core=ver("megatron-core"), triton=ver("triton")),
        rows=rows, extra=extra, indexer_rows=indexer_rows,
    )
    os.makedirs(args.out, exist_ok=True)
    name = ("bench_sparse_mla_guard.json" if args.guard_only else
            "bench_sparse_mla_kernels.json" if args.kernels_only else "bench_sparse_mla.json")
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ok = [r for r in rows if "fwd_bwd_ms" in r and r["impl"] in ("ours", "mcore")]
        labels = [f"{r['workload']} H{r['H']} {r['impl']}" for r in ok]
        plt.figure(figsize=(10, 4))
        plt.barh(labels, [r["fwd_bwd_ms"] for r in ok])
        plt.xlabel("fwd+bwd ms (lower is better)")
        plt.tight_layout()
        plt.savefig(os.path.join(args.out, "bench_sparse_mla.png"))
    except Exception as exc:  # noqa: BLE001
        print("no chart:", exc)

    print(f"\n{result['gpu']}  {result['versions']}")
    for k, v in extra.items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    print(f"{'wl':3} {'H':>3} {'impl':16} {'fwd ms':>8} {'f+b ms':>8} {'fwdTF':>6} {'bwdTF':>6} {'callGiB':>7}  "
          "rel(out,dq,dkv)")
    for r in rows:
        if "error" in r:
            print(f"{r['workload']:3} {r['H']:>3} {r['impl']:16} ERROR {r['error'][:60]}")
            continue
        errs = r.get("rel_l2_vs_reference") or r.get("rel_vs_ours") or []
        print(f"{r['workload']:3} {r['H']:>3} {r['impl']:16} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f} "
              f"{r['fwd_tflops']:6.0f} {(r['bwd_tflops'] or 0):6.0f} {r['call_peak_gib']:7.2f}  "
              + " ".join(f"{e:.1e}" for e in errs) + ("" if r["finite"] else "  NONFINITE"))


if __name__ == "__main__":
    main()
