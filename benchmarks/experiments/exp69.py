"""exp69 (session 24): make_exp69.py's backward variants ("chain": one wgmma wait per GEMM pair;
"lse": chain + lse in registers) against the tree's, through TileLangBackend with the builder
patched in turn, 8 alternating rounds: W2 / W1 H64 and W2 H16 (row groups, R = 4). dq must be
bitwise equal to the tree's (the arithmetic and its order are unchanged); dkv sums its atomics in
another order (relative difference reported). Then, if a variant is at least 1% faster than the
tree at both W2 and W1 H64 and bitwise equal everywhere, the fastest such variant's name goes to $OUT/$NAME_winner for
the GPU suite (``exp69_plugin``). ``VARIANTS`` (default "chain,lse") picks the variants, ``NAME`` (default
exp69) the output files; call 4 ran VARIANTS=lse,lseonly NAME=exp69b, call 5 VARIANTS=lse,lsevalid NAME=exp69c."""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, backward_ab
import importlib
from glm5_dsa_plugin.ops import tilelang_kernels as tk
OUT = os.environ.get("OUT", ".")
NAME = os.environ.get("NAME", "exp69")
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel}
for v in os.environ.get("VARIANTS", "chain,lse").split(","):
    BWD[v] = importlib.import_module(f"glm5_dsa_plugin.ops._exp69_{v}").sparse_mla_bwd_ws_kernel
builds = [(f, H, R) for f in BWD.values() for H, R in ((64, 1), (16, 4))]
with ThreadPoolExecutor(len(builds)) as pool:
    list(pool.map(lambda a: a[0](a[1], DV, 64, 2048, 1, float(SCALE), rows_per_block=a[2]), builds))
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})
for wl, H in (("W2", 64), ("W1", 64), ("W2", 16)):
    row = res["rows"][f"{wl} H{H} backward"] = backward_ab(BWD, wl, seed=41, H=H)
    med = row["median_ms"]
    print(f"{wl} H{H} backward: tree {med['tree']:.4f} " + " ".join(
        f"{n} {med[n]:.4f} ({med[n] / med['tree']:.4f}x, dq bitwise {row[n + ' dq_bitwise']}, dkv {row[n + ' dkv_rel']:.1e})"
        for n in BWD if n != "tree"), flush=True)
    json.dump(res, open(os.path.join(OUT, NAME + ".json"), "w"), indent=1)
ok = {n: all(r[f"{n} dq_bitwise"] and r[f"{n} dkv_rel"] < 1e-4 for r in res["rows"].values())
      and all(res["rows"][f"{wl} H64 backward"]["median_ms"][n] <= 0.99 * res["rows"][f"{wl} H64 backward"]["median_ms"]["tree"]
              for wl in ("W2", "W1")) for n in BWD if n != "tree"}
winners = [n for n in ok if ok[n]]
best = min(winners, key=lambda n: sum(r["median_ms"][n] for r in res["rows"].values())) if winners else ""
open(os.path.join(OUT, NAME + "_winner"), "w").write(best)
print("winner:", best or "none", "of", winners)
