"""exp56 (session 22): how much of the warp-specialised forward (one row per block) is per-CTA
fixed cost. make_exp56.py's kernel (run it first, from the repository root) runs ``repeat`` passes
over each row's blocks in one CTA; raw launches of repeat = 1, 2, 3 and the tree's kernel, in
alternating rounds, at W2 / W1 H64. With T(r) = F + r W, F = 2 T(1) - T(2) is what the CTAs'
prologues, epilogues, launches and drains cost in all (nothing overlaps them: one CTA per SM),
the most a persistent schedule that hides them could save; T(3) - T(2) checks the line. Checks:
repeat 2's out equals the tree's (the same softmax over each slot twice) to bf16 rounding and its
lse is the tree's + ln 2."""
import json, math, os, statistics, sys, time
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, bench, workload
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp56 as ex
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend, _kernel_lists
OUT = os.environ.get("OUT", ".")
args = (64, DV, 64, 2048, 1, float(SCALE))
kernels = {"tree": tk.sparse_mla_fwd_ws_kernel(*args, rows_per_block=1)}
kernels.update({f"r{r}": ex.sparse_mla_fwd_ws_kernel(*args, rows_per_block=1, repeat=r) for r in (1, 2, 3)})
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})
for wl in ("W2", "W1"):
    q, kv, idx, _ = workload(wl, 64, seed=29)
    _, _, saved = TileLangBackend().forward_saving(q, kv, idx, SCALE, DV)
    _, keys, members, ext = _kernel_lists(saved)
    T = q.shape[1]
    outs = {k: (torch.empty(1, T, 64, DV, dtype=q.dtype, device="cuda"), torch.empty(1, T, 64, device="cuda"))
            for k in kernels}
    for k, f in kernels.items():
        f(q, saved[0], keys, ext, members, *outs[k])
    torch.cuda.synchronize()
    o_t, l_t = outs["tree"]
    o_2, l_2 = outs["r2"]
    fin = torch.isfinite(l_t) & (l_t > -1e29)
    chk = dict(r1_out_bitwise=bool(torch.equal(outs["r1"][0], o_t)),
               r2_out_rel=float((o_2.double() - o_t.double()).norm() / o_t.double().norm()),
               r2_lse_minus_ln2_maxdiff=float((l_2[fin] - l_t[fin] - math.log(2)).abs().max()))
    times = {k: [] for k in kernels}
    for rnd in range(4):
        for k in (list(kernels) if rnd % 2 == 0 else list(kernels)[::-1]):
            times[k].append(bench(lambda: kernels[k](q, saved[0], keys, ext, members, *outs[k])))
    med = {k: statistics.median(v) for k, v in times.items()}
    W = med["r2"] - med["r1"]
    F = med["r1"] - W
    res["rows"][f"{wl} H64"] = dict(median_ms=med, rounds=times, per_pass_ms=W, fixed_ms=F,
                                    fixed_share=F / med["r1"], linearity_r3_minus_r2=med["r3"] - med["r2"], **chk)
    print(f"{wl} H64: {({k: round(v, 4) for k, v in med.items()})} W {W:.4f} F {F:.4f} ({F / med['r1']:.3f} of r1) "
          f"r3-r2 {med['r3'] - med['r2']:.4f} {chk}", flush=True)
    json.dump(res, open(os.path.join(OUT, "exp56.json"), "w"), indent=1)
