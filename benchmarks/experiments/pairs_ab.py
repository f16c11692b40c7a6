"""What exp77-exp81 share (session 27): backward variants (name -> builder of
``sparse_mla_bwd_ws_kernel``'s signature; "tree" first) built in parallel, timed against the tree's
through TileLangBackend (``common.backward_ab``), and checked / timed in deterministic mode. Each
function adds rows to ``res`` and rewrites ``path`` (JSON) after every row. (exp77.py's log was
written before this module took its loops: it printed the same figures in its own words.) Since
session 29 also the race check of exp95-exp97 (``spread_rows``)."""
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from common import DV, SCALE, alternating, backward_ab, workload


def new_result() -> dict:
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})


def build(builders: dict, configs) -> None:
    """Every builder at every (H, R, dkv_per_slot) of ``configs``, in parallel threads."""
    jobs = [(f, H, R, ps) for f in builders.values() for H, R, ps in configs]
    t0 = time.time()
    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(lambda a: a[0](a[1], DV, 64, 2048, 1, float(SCALE), rows_per_block=a[2], dkv_per_slot=a[3]),
                      jobs))
    print(f"built in {time.time() - t0:.0f} s", flush=True)


def timed_rows(builders: dict, shapes, res: dict, path: str) -> None:
    """``backward_ab`` (8 alternating rounds) at each (workload, H) of ``shapes``."""
    for wl, H in shapes:
        row = res["rows"][f"{wl} H{H} backward"] = backward_ab(builders, wl, seed=41, H=H)
        med = row["median_ms"]
        print(f"{wl} H{H} backward: tree {med['tree']:.4f} " + " ".join(
            f"{n} {med[n]:.4f} ({med[n] / med['tree']:.4f}x, dq bitwise {row[n + ' dq_bitwise']}, "
            f"dkv {row[n + ' dkv_rel']:.1e})" for n in builders if n != "tree"), flush=True)
        json.dump(res, open(path, "w"), indent=1)


def winner(builders: dict, res: dict, regs: dict, path: str) -> str:
    """The variant of ``regs`` (name -> "mma,producer") with dq bitwise everywhere and 1% or more
    faster than the tree at W2 and W1 H64, the fastest over all rows; its registers go to ``path``
    ("" for none)."""
    rows = res["rows"]
    ok = [n for n in regs if all(r[f"{n} dq_bitwise"] for r in rows.values())
          and all(rows[f"{wl} H64 backward"]["median_ms"][n] <= 0.99 * rows[f"{wl} H64 backward"]["median_ms"]["tree"]
                  for wl in ("W2", "W1"))]
    best = min(ok, key=lambda n: sum(r["median_ms"][n] for r in rows.values())) if ok else ""
    open(path, "w").write(regs.get(best, ""))
    print("winner:", best or "none", flush=True)
    return best


def four_shapes(builders: dict, name: str, out: str, extra_configs=()) -> tuple[dict, str]:
    """``builders`` (name -> builder, "tree" first) built at H64, H16 R4 and H8 R8 (and
    ``extra_configs``, e.g. deterministic mode's ``(64, 1, True)``), then timed by ``timed_rows``
    at W2 / W1 H64 and W2 H16 / H8 into ``{out}/{name}.json``. -> (the result, its path), for the
    rows a script adds after these (sessions 29-31: exp96 / exp97, exp101, exp103-exp107)."""
    build(builders, ((64, 1, False), (16, 4, False), (8, 8, False), *extra_configs))
    res, path = new_result(), os.path.join(out, f"{name}.json")
    timed_rows(builders, (("W2", 64), ("W1", 64), ("W2", 16), ("W2", 8)), res, path)
    return res, path


def four_shapes_with_gate(builders: dict, name: str, out: str, candidates=None, deterministic=()) -> dict:
    """``four_shapes``, then ``deterministic_rows`` at the (workload, H) shapes of ``deterministic``
    (H = 64 only: built as the extra config), then the gate's ``winner`` among ``candidates``
    (default: every variant) named in ``{out}/{name}_winner`` (sessions 31-32: exp103-exp111)."""
    assert all(H == 64 for _, H in deterministic)
    res, path = four_shapes(builders, name, out, extra_configs=((64, 1, True),) if deterministic else ())
    if deterministic:
        deterministic_rows(builders, deterministic, res, path)
    names = candidates or [n for n in builders if n != "tree"]
    winner(builders, res, {n: n for n in names}, os.path.join(out, f"{name}_winner"))
    return res


def deterministic_rows(builders: dict, shapes, res: dict, path: str) -> None:
    """Deterministic mode at each (workload, H): each variant bitwise over 3 runs, dq / dkv against
    the tree's, then 4 alternating rounds."""
    from glm5_dsa_plugin.ops import tilelang_kernels as tk
    from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend

    original = tk.sparse_mla_bwd_ws_kernel
    try:
        for wl, H in shapes:
            q, kv, idx, g = workload(wl, H, seed=43)
            be = TileLangBackend(deterministic=True)
            out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
            grads, row = {}, {}
            for name, f in builders.items():
                tk.sparse_mla_bwd_ws_kernel = f
                runs = [be.backward_saved(q, saved, out, lse, g, SCALE, DV) for _ in range(3)]
                row[f"{name} bitwise_3_runs"] = all(torch.equal(r[0], runs[0][0]) and torch.equal(r[1], runs[0][1])
                                                    for r in runs[1:])
                grads[name] = runs[0]
            for n in builders:
                if n != "tree":
                    row[f"{n} dq_bitwise"] = bool(torch.equal(grads["tree"][0], grads[n][0]))
                    d = grads[n][1].double() - grads["tree"][1].double()
                    row[f"{n} dkv_rel"] = float(d.norm() / grads["tree"][1].double().norm())
            times, med = alternating({k: (lambda: be.backward_saved(q, saved, out, lse, g, SCALE, DV)) for k in builders},
                                     rounds=4, before=lambda n: setattr(tk, "sparse_mla_bwd_ws_kernel", builders[n]))
            row.update(median_ms=med, rounds=times)
            res["rows"][f"{wl} H{H} deterministic backward"] = row
            print(f"{wl} H{H} deterministic: tree {med['tree']:.4f} (bitwise {row['tree bitwise_3_runs']}) " + " ".join(
                f"{n} {med[n]:.4f} ({med[n] / med['tree']:.4f}x, bitwise {row[n + ' bitwise_3_runs']}, "
                f"dq bitwise {row[n + ' dq_bitwise']}, dkv {row[n + ' dkv_rel']:.1e})" for n in builders if n != "tree"),
                  flush=True)
            json.dump(res, open(path, "w"), indent=1)
    finally:
        tk.sparse_mla_bwd_ws_kernel = original


def spread_rows(builders: dict, shapes, res: dict, path: str, runs: int = 6, seed: int = 47) -> None:
    """Race check (session 29, exp95-exp97): at each (workload, H), each variant's backward ``runs``
    times on the same inputs; per kv row, the largest distance of a run's dkv from the runs' fp64
    mean relative to the row's norm (the atomics' order alone moves rows by up to about 1e-3; a
    chunk buffer overwritten before the drain read it would move whole rows), and whether dq is
    bitwise the same over the runs and across the variants."""
    from glm5_dsa_plugin.ops import tilelang_kernels as tk
    from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend

    original = tk.sparse_mla_bwd_ws_kernel
    try:
        for wl, H in shapes:
            q, kv, idx, g = workload(wl, H, seed=seed)
            be = TileLangBackend()
            out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
            row, dqs = {}, {}
            for name, f in builders.items():
                tk.sparse_mla_bwd_ws_kernel = f
                grads = [be.backward_saved(q, saved, out, lse, g, SCALE, DV) for _ in range(runs)]
                dkv = torch.stack([r[1].double() for r in grads])
                mean = dkv.mean(0)
                norm = mean.flatten(0, 2).norm(dim=-1)
                live = norm > 0
                dev = (dkv - mean).abs().amax(0).flatten(0, 2).amax(-1)[live] / norm[live]
                row[name] = dict(dq_bitwise_runs=all(torch.equal(r[0], grads[0][0]) for r in grads[1:]),
                                 rows=int(live.sum()), max_row_rel=float(dev.max()),
                                 p999_row_rel=float(dev.quantile(0.999)), median_row_rel=float(dev.median()),
                                 rows_above_1e_4=int((dev > 1e-4).sum()))
                dqs[name] = grads[0][0]
            first = next(iter(builders))
            row["dq_bitwise_across"] = all(torch.equal(dqs[first], d) for d in dqs.values())
            res["rows"][f"{wl} H{H} race check"] = row
            print(wl, H, "race check", json.dumps(row), flush=True)
            json.dump(res, open(path, "w"), indent=1)
    finally:
        tk.sparse_mla_bwd_ws_kernel = original
