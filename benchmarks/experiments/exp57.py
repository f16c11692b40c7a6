"""exp57 (prepared in session 22; run in session 23, call 1: out bitwise, lse within one ulp, 5-7.5%
slower, `benchmarks/results/2026-12-01_h200_v24b_exp57_persistent_static.*`): make_exp57.py's
persistent warp-specialised forward (run it first, from the repository root; one row per block only)
against the tree's kernel. Raw launches with the same prepared inputs: out / lse must be bitwise
equal (each row's arithmetic is the tree's) at W2 / W1 H64, H128 (two head blocks per row) and a
ragged case (indices in [-1, T_kv), an empty row, T not a multiple of 132); then alternating rounds
of raw launches and of the backend's forward (builder patched) at W2 / W1 H64. exp56's yardstick:
the per-CTA fixed cost is about 0.21-0.25 ms of the W2 H64 forward and 0.13-0.16 ms at W1. Run it
under ``timeout``: a barrier-phase mistake hangs the kernel."""
import functools, json, os, sys, time
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, alternating, prepared_forward_inputs, ragged_workload, raw_forward, workload
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp57 as ex
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
OUT = os.environ.get("OUT", ".")
TREE = tk.sparse_mla_fwd_ws_kernel
PERSISTENT = functools.partial(ex.sparse_mla_fwd_ws_kernel, persistent=torch.cuda.get_device_properties(0).multi_processor_count)
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
           sms=torch.cuda.get_device_properties(0).multi_processor_count, rows={})


def save():
    json.dump(res, open(os.path.join(OUT, "exp57.json"), "w"), indent=1)


cases = [("W2 H64", lambda: workload("W2", 64, seed=37)[:3], 2048), ("W1 H64", lambda: workload("W1", 64, seed=37)[:3], 2048),
         ("W2 H128", lambda: workload("W2", 128, seed=37)[:3], 2048), ("ragged H64", lambda: ragged_workload(64), 512)]
for name, make, topk in cases:
    q, kv, idx = make()
    H = q.shape[2]
    inputs = prepared_forward_inputs(q, kv, idx)
    got = {}
    for label, builder in (("tree", TREE), ("persistent", PERSISTENT)):
        _, o, l, run = raw_forward(builder, H, topk, inputs, q)
        run()
        torch.cuda.synchronize()
        got[label] = (o, l)
    chk = dict(out_bitwise=bool(torch.equal(got["tree"][0], got["persistent"][0])),
               lse_bitwise=bool(torch.equal(got["tree"][1], got["persistent"][1])),
               persistent_finite=bool(torch.isfinite(got["persistent"][0]).all()))
    res["rows"][f"{name} check"] = chk
    print(name, chk, flush=True)
    save()

for wl in ("W2", "W1"):
    q, kv, idx, _ = workload(wl, 64, seed=41)
    inputs = prepared_forward_inputs(q, kv, idx)
    runs = {label: raw_forward(b, 64, 2048, inputs, q)[3] for label, b in (("tree", TREE), ("persistent", PERSISTENT))}
    times, med = alternating(runs)
    res["rows"][f"{wl} H64 raw"] = dict(median_ms=med, rounds=times)
    print(f"{wl} H64 raw: tree {med['tree']:.4f} persistent {med['persistent']:.4f} "
          f"({med['persistent'] / med['tree']:.4f}x)", flush=True)
    be = TileLangBackend()
    builders = {"tree": TREE, "persistent": PERSISTENT}
    forward = lambda: be.forward_saving(q, kv, idx, SCALE, DV)  # noqa: E731
    times, med = alternating({k: forward for k in builders},
                             before=lambda k: setattr(tk, "sparse_mla_fwd_ws_kernel", builders[k]))
    tk.sparse_mla_fwd_ws_kernel = TREE
    res["rows"][f"{wl} H64 backend forward"] = dict(median_ms=med, rounds=times)
    print(f"{wl} H64 backend forward: tree {med['tree']:.4f} persistent {med['persistent']:.4f} "
          f"({med['persistent'] / med['tree']:.4f}x)", flush=True)
    save()
