"""exp49 (prepared in session 20, not run): the warp-specialised backward storing dq through the dead
Q tile (make_exp49.py; run it first, from the repository root) against the tree's kernel, through
TileLangBackend.backward_saved with the kernel builder patched in turn, alternating rounds, W2 H64
and W1 H64 (one row per block). dq must be bitwise equal (same values, another store path)."""
import json, os, statistics, sys, time
import torch, triton.testing
sys.path.insert(0, os.getcwd())
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp49 as ex
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
from glm5_dsa_plugin.ops.workloads import w1_indices, w2_indices
SCALE, DV = 256**-0.5, 512
OUT = os.environ.get("OUT", ".")
TREE = tk.sparse_mla_bwd_ws_kernel
VARIANTS = {"tree": TREE, "staged_dq": ex.sparse_mla_bwd_ws_kernel}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=120, return_mode="median")


res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})
for wl in ("W2", "W1"):
    gen = torch.Generator(device="cuda").manual_seed(11)
    T = 4096
    idx, T_kv = (w1_indices(T, 8192, 2048, gen)[None], 8192) if wl == "W1" else (w2_indices(T, 2048, gen)[None], T)
    q = torch.randn(1, T, 64, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1, T, 64, DV, generator=gen, device="cuda", dtype=torch.bfloat16)
    be = TileLangBackend()
    out, lse, saved = be.forward_saving(q, kv, idx.contiguous(), SCALE, DV)
    dqs = {}
    for name, builder in VARIANTS.items():
        tk.sparse_mla_bwd_ws_kernel = builder
        dqs[name] = be.backward_saved(q, saved, out, lse, g, SCALE, DV)[0].clone()
    chk = dict(dq_bitwise=bool(torch.equal(dqs["tree"], dqs["staged_dq"])))
    times = {name: [] for name in VARIANTS}
    for rnd in range(6):
        for name in (list(VARIANTS) if rnd % 2 == 0 else list(VARIANTS)[::-1]):
            tk.sparse_mla_bwd_ws_kernel = VARIANTS[name]
            times[name].append(bench(lambda: be.backward_saved(q, saved, out, lse, g, SCALE, DV)))
    tk.sparse_mla_bwd_ws_kernel = TREE
    med = {k: statistics.median(v) for k, v in times.items()}
    res["rows"][f"{wl} H64"] = dict(median_ms=med, rounds=times, **chk)
    print(f"{wl} H64 backward tree {med['tree']:.3f} staged dq {med['staged_dq']:.3f} "
          f"({med['staged_dq'] / med['tree']:.3f}x) {chk}", flush=True)
json.dump(res, open(os.path.join(OUT, "exp49.json"), "w"), indent=1)
