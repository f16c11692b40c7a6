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
from common import DV, SCALE, alternating, workload
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp57 as ex
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend, _kernel_lists
OUT = os.environ.get("OUT", ".")
TREE = tk.sparse_mla_fwd_ws_kernel
PERSISTENT = functools.partial(ex.sparse_mla_fwd_ws_kernel, persistent=torch.cuda.get_device_properties(0).multi_processor_count)
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
           sms=torch.cuda.get_device_properties(0).multi_processor_count, rows={})


def save():
    json.dump(res, open(os.path.join(OUT, "exp57.json"), "w"), indent=1)


def prepared(q, kv, idx):
    _, _, saved = TileLangBackend().forward_saving(q, kv, idx, SCALE, DV)
    _, keys, members, ext = _kernel_lists(saved)
    return saved[0], keys, ext, members


def launch(builder, H, topk, inputs, q):
    k = builder(H, DV, 64, topk, 1, float(SCALE), rows_per_block=1)
    o = torch.full((1, q.shape[1], H, DV), float("nan"), dtype=q.dtype, device="cuda")
    l = torch.full((1, q.shape[1], H), float("nan"), device="cuda")
    return k, o, l, lambda: k(q, inputs[0], inputs[1], inputs[2], inputs[3], o, l)


def ragged(H, T=1000, T_kv=3000, K=512):
    gen = torch.Generator(device="cuda").manual_seed(31)
    q = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(-1, T_kv, (1, T, 1, K), generator=gen, device="cuda", dtype=torch.int32)
    idx[0, 5] = -1
    idx[0, 600:, :, 100:] = -1
    return q, kv, idx


cases = [("W2 H64", lambda: workload("W2", 64, seed=37)[:3], 2048), ("W1 H64", lambda: workload("W1", 64, seed=37)[:3], 2048),
         ("W2 H128", lambda: workload("W2", 128, seed=37)[:3], 2048), ("ragged H64", lambda: ragged(64), 512)]
for name, make, topk in cases:
    q, kv, idx = make()
    H = q.shape[2]
    inputs = prepared(q, kv, idx)
    got = {}
    for label, builder in (("tree", TREE), ("persistent", PERSISTENT)):
        _, o, l, run = launch(builder, H, topk, inputs, q)
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
    inputs = prepared(q, kv, idx)
    runs = {label: launch(b, 64, 2048, inputs, q)[3] for label, b in (("tree", TREE), ("persistent", PERSISTENT))}
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
