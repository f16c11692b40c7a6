"""exp77 (session 27): exp77_kernel's backward (dKV per pair of 32-slot blocks as [64 slots, 64
features] chunks, added with 8-byte atomics from the MMA registers; no chunk staging, no drain)
against the tree's, through TileLangBackend with the builder patched in turn, 8 alternating rounds:
W2 / W1 H64, W2 H16 (R = 4), W2 H8 (R = 8). dq must be bitwise equal to the tree's; dkv sums its
atomics in another order (relative difference reported). Then deterministic mode at W2 H64 and
H16: bitwise over 3 runs, dkv against the tree's deterministic dkv, and the time."""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, alternating, backward_ab, workload
import exp77_kernel
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
OUT = os.environ.get("OUT", ".")
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp77": exp77_kernel.sparse_mla_bwd_ws_kernel}
builds = [(f, H, R, ps) for f in BWD.values() for H, R, ps in ((64, 1, False), (16, 4, False), (8, 8, False),
                                                                 (64, 1, True), (16, 4, True))]
t0 = time.time()
with ThreadPoolExecutor(len(builds)) as pool:
    list(pool.map(lambda a: a[0](a[1], DV, 64, 2048, 1, float(SCALE), rows_per_block=a[2], dkv_per_slot=a[3]), builds))
print(f"built in {time.time() - t0:.0f} s", flush=True)
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})
for wl, H in (("W2", 64), ("W1", 64), ("W2", 16), ("W2", 8)):
    row = res["rows"][f"{wl} H{H} backward"] = backward_ab(BWD, wl, seed=41, H=H)
    med = row["median_ms"]
    print(f"{wl} H{H} backward: tree {med['tree']:.4f} exp77 {med['exp77']:.4f} ({med['exp77'] / med['tree']:.4f}x, "
          f"dq bitwise {row['exp77 dq_bitwise']}, dkv {row['exp77 dkv_rel']:.1e})", flush=True)
    json.dump(res, open(os.path.join(OUT, "exp77.json"), "w"), indent=1)
original = tk.sparse_mla_bwd_ws_kernel
try:
    for wl, H in (("W2", 64), ("W2", 16)):
        q, kv, idx, g = workload(wl, H, seed=43)
        be = TileLangBackend(deterministic=True)
        out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
        grads, row = {}, {}
        for name, f in BWD.items():
            tk.sparse_mla_bwd_ws_kernel = f
            runs = [be.backward_saved(q, saved, out, lse, g, SCALE, DV) for _ in range(3)]
            row[f"{name} bitwise_3_runs"] = all(torch.equal(r[0], runs[0][0]) and torch.equal(r[1], runs[0][1])
                                                for r in runs[1:])
            grads[name] = runs[0]
        row["exp77 dq_bitwise"] = bool(torch.equal(grads["tree"][0], grads["exp77"][0]))
        d = grads["exp77"][1].double() - grads["tree"][1].double()
        row["exp77 dkv_rel"] = float(d.norm() / grads["tree"][1].double().norm())
        times, med = alternating({k: (lambda: be.backward_saved(q, saved, out, lse, g, SCALE, DV)) for k in BWD},
                                 rounds=4, before=lambda n: setattr(tk, "sparse_mla_bwd_ws_kernel", BWD[n]))
        row.update(median_ms=med, rounds=times)
        res["rows"][f"{wl} H{H} deterministic backward"] = row
        print(f"{wl} H{H} deterministic: tree {med['tree']:.4f} exp77 {med['exp77']:.4f} "
              f"({med['exp77'] / med['tree']:.4f}x, bitwise {row['tree bitwise_3_runs']} / {row['exp77 bitwise_3_runs']}, "
              f"dq bitwise {row['exp77 dq_bitwise']}, dkv {row['exp77 dkv_rel']:.1e})", flush=True)
        json.dump(res, open(os.path.join(OUT, "exp77.json"), "w"), indent=1)
finally:
    tk.sparse_mla_bwd_ws_kernel = original
