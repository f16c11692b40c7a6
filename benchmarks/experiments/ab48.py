"""v22 (the tree) against session 19's package (HEAD ecc27e9 as glm5_dsa_plugin_s19), same process,
alternating rounds, through TileLangBackend: backward_saved and forward_saving per workload; dq
bitwise and out compared between the two."""
import json, os, statistics, sys, time
import torch, triton.testing
sys.path.insert(0, os.getcwd()); # the older package: `git archive <commit> glm5_dsa_plugin` unpacked and renamed glm5_dsa_plugin_s19
sys.path.insert(0, os.environ.get("OLD_PKG_DIR", os.path.join(os.getcwd(), ".gpu/oldpkg")))
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend as New
from glm5_dsa_plugin_s19.ops.tilelang_backend import TileLangBackend as Old
from glm5_dsa_plugin.ops.workloads import w1_indices, w2_indices
SCALE, DV = 256**-0.5, 512
OUT = os.environ.get("OUT", ".")

def case(name, H, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed + H)
    T = 4096
    idx, T_kv = (w1_indices(T, 8192, 2048, gen)[None], 8192) if name == "W1" else (w2_indices(T, 2048, gen)[None], T)
    q = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1, T, H, DV, generator=gen, device="cuda", dtype=torch.bfloat16)
    return q, kv, idx.contiguous(), g

def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=120, return_mode="median")

res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})
t0 = time.time()
CASES = [("W2", 64, "auto"), ("W1", 64, "auto"), ("W2", 8, True), ("W2", 16, True), ("W1", 8, True), ("W1", 16, False), ("W2", 16, False)]
for wl, H, groups in CASES:
    q, kv, idx, g = case(wl, H)
    bes = {"s19": Old(row_groups=groups), "v22": New(row_groups=groups)}
    state, outs = {}, {}
    for name, be in bes.items():
        out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
        dq, dkv = be.backward_saved(q, saved, out, lse, g, SCALE, DV)
        torch.cuda.synchronize()
        state[name] = (out, lse, saved)
        outs[name] = (out.clone(), lse.clone(), dq.clone(), dkv.clone())
    o, n = outs["s19"], outs["v22"]
    chk = dict(out_entries_differ=int((o[0] != n[0]).sum()), out_maxdiff=float((o[0].float() - n[0].float()).abs().max()),
               lse_bitwise=bool(torch.equal(o[1], n[1])), dq_bitwise=bool(torch.equal(o[2], n[2])),
               dkv_rel=float((o[3] - n[3]).norm() / o[3].norm()),
               finite=all(bool(torch.isfinite(x).all()) for x in n))
    times = {f"{k}_{d}": [] for k in bes for d in ("fwd", "bwd")}
    for rnd in range(5):
        for name in (["s19", "v22"] if rnd % 2 == 0 else ["v22", "s19"]):
            be = bes[name]
            out, lse, saved = state[name]
            times[f"{name}_fwd"].append(bench(lambda: be.forward_saving(q, kv, idx, SCALE, DV)))
            times[f"{name}_bwd"].append(bench(lambda: be.backward_saved(q, saved, out, lse, g, SCALE, DV)))
    key = f"{wl} H{H} groups={groups}"
    med = {k: statistics.median(v) for k, v in times.items()}
    res["rows"][key] = dict(median_ms=med, rounds=times, **chk)
    print(f"{key:22} fwd s19 {med['s19_fwd']:.3f} v22 {med['v22_fwd']:.3f} ({med['v22_fwd']/med['s19_fwd']:.3f}x)  "
          f"bwd s19 {med['s19_bwd']:.3f} v22 {med['v22_bwd']:.3f} ({med['v22_bwd']/med['s19_bwd']:.3f}x)  {chk}  {time.time()-t0:.0f}s", flush=True)
    del q, kv, idx, g, state, outs, bes
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(OUT, "ab48.json"), "w"), indent=1)
