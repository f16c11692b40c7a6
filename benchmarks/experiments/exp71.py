"""exp71: the forward call's small launches, and the SM clock under each W2 H64 loop.

A. ``prepare_indices`` as the backend calls it for a one-row H64 forward (rewrite=False, kv copy
   with the sentinel row, flags, block counts, kv flag), against launch variants of the same
   Triton kernel (slots per pass BK, num_warps) and ``_prepare_rows_multi`` (ROWS index rows per
   program). Outputs compared exactly with the tree's (extent, counts, kv copy, both flags).
B. ``_mark_bad_out_rows`` with the flag clear (the deferred forward's every call): one program per
   query row (the tree) vs ROWS rows per program.
C. SM clock and power (nvidia-smi every 50 ms) while W2 H64 runs: the forward without grad
   (flags deferred, then eager), then forward + backward; the forward kernel's time in each.

Writes $OUT/exp71.json; prints a table last."""
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl

from common import SCALE, DV, alternating, workload
from glm5_dsa_plugin.ops import configure, sparse_mla
from glm5_dsa_plugin.ops.row_repair import _mark_bad_out_rows, _row_has_nonfinite
from glm5_dsa_plugin.ops.triton_helpers import KV_SUSPECT_BOUND, _prepare_indices_kernel, prepare_indices


@triton.jit
def _prepare_rows_multi(IDX, EXT, FLAGS, K: tl.constexpr, n_kv, n_rows, KV, KVK, per_batch_in, per_batch_out,
                        COUNTS, block, KV_FLAG, kv_bound, ROWS: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """As the tree's kernel with CHECK, COUNT, CHECK_KV and no REWRITE (K == K_PAD), ROWS index rows
    per program (the kv copy programs unchanged)."""
    pid = tl.program_id(0).to(tl.int64)
    n_prog = tl.cdiv(n_rows, ROWS)
    if pid < n_prog:
        bad = tl.zeros([BK], dtype=tl.int32)
        for rr in range(ROWS):
            row = pid * ROWS + rr
            if row < n_rows:
                ext = tl.zeros([BK], dtype=tl.int32)
                for c0 in range(0, K, BK):
                    cols = c0 + tl.arange(0, BK)
                    x = tl.load(IDX + row * K + cols, mask=cols < K, other=-1)
                    ok = (x >= 0) & (x < n_kv)
                    bad = tl.maximum(bad, ((x < -1) | (x >= n_kv)).to(tl.int32))
                    ext = tl.maximum(ext, tl.where(ok, cols + 1, 0))
                extent = tl.max(ext, axis=0)
                tl.store(EXT + row, extent)
                tl.atomic_add(COUNTS + (extent + block - 1) // block, 1)
        if tl.max(bad, axis=0) > 0:
            tl.atomic_max(FLAGS, 1)
    else:
        c = pid - n_prog
        nb = tl.cdiv(per_batch_out, BC)
        b = c // nb
        offs = (c % nb) * BC + tl.arange(0, BC)
        x = tl.load(KV + b * per_batch_in + offs, mask=offs < per_batch_in, other=0.0)
        tl.store(KVK + b * per_batch_out + offs, x, mask=offs < per_batch_out)
        if tl.max((~(tl.abs(x.to(tl.float32)) < kv_bound)).to(tl.int32), axis=0) > 0:
            tl.atomic_max(KV_FLAG, 1)


@triton.jit
def _mark_bad_out_rows_multi(OUT, LSE, BAD_Q, FLAGS, n_rows, O_ROW: tl.constexpr, L_ROW: tl.constexpr,
                             ROWS: tl.constexpr, BLOCK: tl.constexpr):
    if tl.load(FLAGS + 1) != 0:
        for rr in range(ROWS):
            r = tl.program_id(0).to(tl.int64) * ROWS + rr
            if r < n_rows:
                bad = tl.maximum(_row_has_nonfinite(OUT, r, O_ROW, BLOCK), _row_has_nonfinite(LSE, r, L_ROW, BLOCK))
                tl.store(BAD_Q + r, bad)
                if bad > 0:
                    tl.atomic_add(FLAGS + 3, 1)


def prepare_variants(kv, idx):
    """name -> launch closure writing into its own outputs; and name -> outputs."""
    n_kv, K = kv.shape[1], idx.shape[-1]
    n_rows = idx[..., 0].numel()
    row = kv[0, 0].numel()
    per_in, per_out = n_kv * row, (n_kv + 1) * row

    def outputs():
        return dict(ext=torch.empty(idx.shape[:-1], dtype=torch.int32, device=kv.device),
                    kv_k=torch.empty(1, n_kv + 1, *kv.shape[2:], dtype=kv.dtype, device=kv.device),
                    flags=torch.zeros(1, dtype=torch.int32, device=kv.device),
                    kv_flag=torch.zeros(1, dtype=torch.int32, device=kv.device),
                    counts=torch.zeros(K // 64 + 1, dtype=torch.int32, device=kv.device))

    outs, runs = {}, {}

    def tree():
        o = outs["tree"]
        o["counts"].zero_()
        _, ext, kv_k = prepare_indices(idx, n_kv, K, o["flags"], kv=kv, block_counts=o["counts"], block=64,
                                       rewrite=False, kv_flag=o["kv_flag"])
        o["ext"], o["kv_k"] = ext, kv_k

    outs["tree"], runs["tree"] = outputs(), tree

    def direct(name, bk, nw, bc=4096):
        o = outs[name] = outputs()
        n_copy = triton.cdiv(per_out, bc)

        def run():
            o["counts"].zero_()
            _prepare_indices_kernel[(n_rows + n_copy,)](idx, idx, o["ext"], o["flags"], K, K, n_kv, n_rows, kv,
                                                        o["kv_k"], per_in, per_out, o["counts"], 64, o["kv_flag"],
                                                        KV_SUSPECT_BOUND, CHECK=True, COUNT=True, REWRITE=False,
                                                        CHECK_KV=True, BK=bk, BC=bc, num_warps=nw)
        runs[name] = run

    def multi(name, rows, bk, nw, bc=4096):
        o = outs[name] = outputs()
        n_copy = triton.cdiv(per_out, bc)

        def run():
            o["counts"].zero_()
            _prepare_rows_multi[(triton.cdiv(n_rows, rows) + n_copy,)](
                idx, o["ext"], o["flags"], K, n_kv, n_rows, kv, o["kv_k"], per_in, per_out, o["counts"], 64,
                o["kv_flag"], KV_SUSPECT_BOUND, ROWS=rows, BK=bk, BC=bc, num_warps=nw)
        runs[name] = run

    direct("bk1024_w8", 1024, 8)
    direct("bk2048_w8", 2048, 8)
    direct("bk2048_w16", 2048, 16)
    direct("bk512_w4", 512, 4)
    direct("bk1024_w4_bc8192", 1024, 4, 8192)
    multi("rows4_bk2048_w8", 4, 2048, 8)
    multi("rows8_bk1024_w4", 8, 1024, 4)
    multi("rows16_bk2048_w8", 16, 2048, 8)
    return runs, outs


def _bits(x):
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def compare(outs):
    """name -> every output bitwise equal to the tree's."""
    ref = outs["tree"]
    return {name: all(torch.equal(_bits(o[k]), _bits(ref[k])) for k in ref) for name, o in outs.items()}


def graph_us(fn, flush: bool, n: int = 20, rounds: int = 5) -> float:
    """Median GPU us of one ``fn`` from CUDA-graph replays of n launches (no host in the timing);
    ``flush``: each launch after a 256 MB memset (cold L2), whose own graph's time is subtracted."""
    buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def capture(body):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            body()  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        return g

    def timed(g):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / n

    def body():
        for _ in range(n):
            if flush:
                buf.zero_()
            fn()

    g = capture(body)
    g0 = capture(lambda: [buf.zero_() for _ in range(n)]) if flush else None
    ts = [timed(g) - (timed(g0) if flush else 0.0) for _ in range(rounds)]
    return statistics.median(ts)


def part_a(result):
    for wl in ("W2", "W1"):
        _, kv, idx, _ = workload(wl, 1, seed=71)
        if wl == "W2":  # one bad index, one huge kv entry: the flags must agree too
            idx = idx.clone()
            idx[0, 100, 0, 5] = -7
            kv = kv.clone()
            kv[0, 9, 0, 3] = float("inf")
        runs, outs = prepare_variants(kv, idx)
        for fn in runs.values():
            fn()
        torch.cuda.synchronize()
        same = compare(outs)
        for o in outs.values():
            o["flags"].zero_()
            o["kv_flag"].zero_()
        med = {}
        for flush in (False, True):
            for rnd in range(2):
                for name in (list(runs) if rnd == 0 else list(runs)[::-1]):
                    med.setdefault((flush, name), []).append(graph_us(runs[name], flush))
        warm = {name: statistics.median(med[(False, name)]) for name in runs}
        cold = {name: statistics.median(med[(True, name)]) for name in runs}
        result[f"A_{wl}"] = {"graph_us_warm_l2": warm, "graph_us_cold_l2": cold, "equal_to_tree": same}
        print(wl, "warm", {k: f"{v:.2f}" for k, v in warm.items()}, "cold", {k: f"{v:.2f}" for k, v in cold.items()},
              same, flush=True)


def part_b(result):
    T, H = 4096, 64
    out = torch.randn(1, T, H, DV, device="cuda", dtype=torch.bfloat16)
    lse = torch.randn(1, T, H, device="cuda")
    flags = torch.zeros(8, dtype=torch.int32, device="cuda")
    bad_q = torch.empty(T, dtype=torch.int32, device="cuda")
    runs = {"tree": lambda: _mark_bad_out_rows[(T,)](out, lse, bad_q, flags, O_ROW=H * DV, L_ROW=H, BLOCK=1024)}
    for rows in (2, 4, 16):
        runs[f"rows{rows}"] = (lambda rows=rows: _mark_bad_out_rows_multi[(triton.cdiv(T, rows),)](
            out, lse, bad_q, flags, T, O_ROW=H * DV, L_ROW=H, ROWS=rows, BLOCK=1024))
    # with the flag set (the rare repair path): both mark the same rows
    out[0, 17, 3, 9] = float("nan")
    lse[0, 2000, 5] = float("inf")
    flags[1] = 1
    marks = {}
    for name, fn in runs.items():
        bad_q.fill_(-1)
        fn()
        marks[name] = bad_q.clone()
    same = {name: torch.equal(m, marks["tree"]) for name, m in marks.items()}
    med_set = {name: graph_us(fn, False, n=5, rounds=3) * 1e-3 for name, fn in runs.items()}
    flags.zero_()
    med = {name: graph_us(fn, False) * 1e-3 for name, fn in runs.items()}
    result["B_mark_bad_out_rows"] = {"flag_clear_median_ms": med, "flag_set_median_ms": med_set, "same_marks": same,
                                     "rows_marked": int((marks["tree"] == 1).sum())}
    print("B clear", {k: f"{v * 1e3:.2f} us" for k, v in med.items()}, "set",
          {k: f"{v * 1e3:.1f} us" for k, v in med_set.items()}, same, flush=True)


def part_c(result, seconds=4.0):
    q, kv, idx, g = workload("W2", 64, seed=72)
    qg = q.clone().requires_grad_(True)
    kvg = kv.clone().requires_grad_(True)

    def fwd():
        with torch.no_grad():
            sparse_mla(q[0], kv[0], idx[0], SCALE, d_v=DV, backend="tilelang")

    def fwd_bwd():
        qg.grad = kvg.grad = None
        sparse_mla(qg[0], kvg[0], idx[0], SCALE, d_v=DV, backend="tilelang")[0].backward(g[0])

    phases = [("fwd_deferred", "deferred", fwd), ("fwd_eager", "eager", fwd), ("fwd_bwd", "eager", fwd_bwd)]
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    marks = []
    try:
        time.sleep(1.0)
        for name, mode, fn in phases:
            configure(forward_flags=mode)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0, n = time.time(), 0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            while time.time() - t0 < seconds:
                fn()
                n += 1
                if n % 20 == 0:
                    torch.cuda.synchronize()
            end.record()
            torch.cuda.synchronize()
            marks.append((name, t0, time.time(), start.elapsed_time(end) / n))
            time.sleep(1.0)
    finally:
        configure(forward_flags="eager")
        smi.terminate()
        text = smi.communicate()[0]
    samples = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float(
                "0." + parts[0].split(".")[1])
            samples.append((stamp, float(parts[1]), float(parts[2]), float(parts[3])))
        except (ValueError, IndexError):
            continue
    res = {}
    for name, t0, t1, ms in marks:
        inside = [s for s in samples if t0 + 0.5 <= s[0] <= t1]
        clocks = [s[1] for s in inside]
        power = [s[2] for s in inside]
        res[name] = {"ms_per_call": ms, "samples": len(inside),
                     "sm_clock_mhz_median": statistics.median(clocks) if clocks else None,
                     "sm_clock_mhz_min": min(clocks) if clocks else None,
                     "power_w_median": statistics.median(power) if power else None,
                     "temp_c_last": inside[-1][3] if inside else None}
    result["C_clock"] = res
    for name, r in res.items():
        print("C", name, r, flush=True)


def main():
    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "versions": {"torch": torch.__version__, "triton": triton.__version__}}
    parts = os.environ.get("EXP71_PARTS", "abc")
    for part in [p for key, p in zip("abc", (part_a, part_b, part_c)) if key in parts]:
        part(result)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "exp71.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\nexp71 summary")
    for wl in ("W2", "W1"):
        r = result.get(f"A_{wl}")
        if r is None:
            continue
        w, c = r["graph_us_warm_l2"], r["graph_us_cold_l2"]
        for name in w:
            print(f"A {wl} {name:20s} warm L2 {w[name]:7.2f} us {w[name] / w['tree']:6.3f}x  cold {c[name]:7.2f} us "
                  f"{c[name] / c['tree']:6.3f}x  equal={r['equal_to_tree'][name]}")
    r = result.get("B_mark_bad_out_rows", {"flag_clear_median_ms": {}})
    for name, ms in r["flag_clear_median_ms"].items():
        print(f"B {name:8s} clear {ms * 1e3:6.2f} us  set {r['flag_set_median_ms'][name] * 1e3:8.1f} us  "
              f"same={r['same_marks'][name]}")
    for name, c in result.get("C_clock", {}).items():
        print(f"C {name:13s} {c['ms_per_call']:.3f} ms/call  SM {c['sm_clock_mhz_median']} MHz (min "
              f"{c['sm_clock_mhz_min']})  {c['power_w_median']} W  {c['temp_c_last']} C")


if __name__ == "__main__":
    sys.exit(main())
