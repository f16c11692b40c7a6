"""exp54 (session 22): make_exp54.py's kernels (run it first, from the repository root) against the
tree's, through TileLangBackend with the builders patched in turn, alternating rounds, W2 / W1 H64
(one row per block): the warp-specialised forward with an L2 prefetch of the Q tile of the block
``prefetch_ahead`` = 132 launches later ("pf"), and the warp-specialised backward with rows last
first ("lf") and also with the prefetch of that block's Q, dO and O tiles ("lfpf"). out / lse / dq
must be bitwise equal (the same per-row arithmetic); dkv sums its atomics in another order. As
run in session 22 (call 2, on 4c7c161); "lf" landed (1c7ad98), so make_exp54.py no longer
applies to the tree (the line it rewrites changed)."""
import functools, json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, alternating, workload
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp54 as ex
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend, _kernel_lists
OUT = os.environ.get("OUT", ".")
FWD = {"tree": tk.sparse_mla_fwd_ws_kernel, "pf": functools.partial(ex.sparse_mla_fwd_ws_kernel, prefetch_ahead=132)}
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel,
       "lf": functools.partial(ex.sparse_mla_bwd_ws_kernel, last_first=True, prefetch_ahead=0),
       "lfpf": functools.partial(ex.sparse_mla_bwd_ws_kernel, last_first=True, prefetch_ahead=132)}
args = (64, DV, 64, 2048, 1, float(SCALE))
with ThreadPoolExecutor(4) as pool:  # build the new kernels at once
    list(pool.map(lambda f: f(*args, rows_per_block=1), [FWD["pf"], BWD["lf"], BWD["lfpf"]]))


def save():
    json.dump(res, open(os.path.join(OUT, "exp54.json"), "w"), indent=1)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def rounds(variants, patch, fn, n=6):
    """``common.alternating`` of ``fn`` with ``patch(variants[name])`` before each timing."""
    return alternating({name: fn for name in variants}, rounds=n, before=lambda name: patch(variants[name]))


def set_fwd(f):
    tk.sparse_mla_fwd_ws_kernel = f


def set_bwd(f):
    tk.sparse_mla_bwd_ws_kernel = f


res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})
for wl in ("W2", "W1"):
    q, kv, idx, g = workload(wl, 64, seed=19)
    be = TileLangBackend()
    got = {}
    for name, f in FWD.items():
        set_fwd(f)
        o, l, saved = be.forward_saving(q, kv, idx, SCALE, DV)
        got[name] = (o.clone(), l.clone())
    chk = dict(out_bitwise=bool(torch.equal(got["tree"][0], got["pf"][0])),
               lse_bitwise=bool(torch.equal(got["tree"][1], got["pf"][1])))
    times, med = rounds(FWD, set_fwd, lambda: be.forward_saving(q, kv, idx, SCALE, DV))
    set_fwd(FWD["tree"])
    res["rows"][f"{wl} H64 forward"] = dict(median_ms=med, rounds=times, **chk)
    print(f"{wl} H64 forward: tree {med['tree']:.4f} pf {med['pf']:.4f} ({med['pf'] / med['tree']:.4f}x) {chk}",
          flush=True)
    save()
    # raw forward launches
    _, keys, members, ext = _kernel_lists(saved)
    T = q.shape[1]
    o1 = torch.empty(1, T, 64, DV, dtype=q.dtype, device="cuda")
    l1 = torch.empty(1, T, 64, device="cuda")
    raw = {k: f(*args, rows_per_block=1) for k, f in FWD.items()}
    times, med = alternating({name: (lambda k=k: k(q, saved[0], keys, ext, members, o1, l1))
                              for name, k in raw.items()})
    res["rows"][f"{wl} H64 raw forward kernel"] = dict(median_ms=med, rounds=times)
    print(f"{wl} H64 raw forward kernel: tree {med['tree']:.4f} pf {med['pf']:.4f} ({med['pf'] / med['tree']:.4f}x)",
          flush=True)
    save()
    out, lse = got["tree"]
    grads = {}
    for name, f in BWD.items():
        set_bwd(f)
        dq, dkv = be.backward_saved(q, saved, out, lse, g, SCALE, DV)
        grads[name] = (dq.clone(), dkv.clone())
    chk = {f"dq_bitwise_{k}": bool(torch.equal(grads["tree"][0], grads[k][0])) for k in ("lf", "lfpf")}
    chk.update({f"dkv_rel_{k}": rel(grads[k][1], grads["tree"][1]) for k in ("lf", "lfpf")})
    times, med = rounds(BWD, set_bwd, lambda: be.backward_saved(q, saved, out, lse, g, SCALE, DV))
    set_bwd(BWD["tree"])
    res["rows"][f"{wl} H64 backward"] = dict(median_ms=med, rounds=times, **chk)
    print(f"{wl} H64 backward: tree {med['tree']:.4f} lf {med['lf']:.4f} ({med['lf'] / med['tree']:.4f}x) "
          f"lfpf {med['lfpf']:.4f} ({med['lfpf'] / med['tree']:.4f}x) {chk}", flush=True)
    save()
save()
