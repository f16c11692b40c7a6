"""exp83 (session 28): what the tree's backward spends where, and the dKV atomics' own ceiling.

Part A, ablations of the tree's warp-specialised backward (``make_exp83.py``; timing only, the
ablated variants' dq / dkv are wrong by design), 8 alternating rounds through TileLangBackend at
W2 / W1 H64: the tree; without the drain's atomics; without the dKV^T chunks' staging stores;
without both; with every block gathering kv rows 0..31 (hot in L1 / L2) instead of its keys.

Part B, floors: kernels that only move the backward's dKV contributions, with the backward's
indices, extents and row order (one CTA per query row, last rows first, each valid slot's 576 fp32
columns in 64-column chunks of 16-byte pieces, 16 threads per slot row, from a shared-memory
buffer): ``red.global.add.v4.f32`` atomics (T.atomic_addx4, as the drain) or plain 16-byte stores
(racy, timing only). With ``pin`` a CTA takes 200 KB of shared memory (one per SM, as the
backward), else as many as fit. ``threads`` 128 (the drain's warpgroup alone) or 384.
Bytes = valid slots x 2304; the rate is bytes / median time."""
import json, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from concurrent.futures import ThreadPoolExecutor
import functools

import tilelang
import torch
from tilelang import language as T

from common import DV, SCALE, alternating, backward_ab, bench, workload
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp83 as e83
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
from exp83_floor import floor_kernel

OUT = os.environ.get("OUT", ".")
PATH = os.path.join(OUT, "exp83.json")
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, tilelang=tilelang.__version__,
           date=time.strftime("%Y-%m-%d"), rows={})
k83 = e83.sparse_mla_bwd_ws_kernel
BWD = {"tree": tk.sparse_mla_bwd_ws_kernel,
       "no_atomics": functools.partial(k83, skip_atomics=True),
       "no_stage": functools.partial(k83, skip_stage=True),
       "no_stage_no_atomics": functools.partial(k83, skip_stage=True, skip_atomics=True),
       "hot_gather": functools.partial(k83, hot_gather=True)}


FLOORS = {f"{mode}_t{th}_{'pin' if pin else 'free'}": (mode, th, pin)
          for mode in ("atomic", "store") for th in (128, 384) for pin in (True, False)}

t0 = time.time()
jobs = [lambda f=f: f(64, DV, 64, 2048, 1, float(SCALE)) for f in BWD.values()]
jobs += [lambda a=a: floor_kernel(2048, *a) for a in FLOORS.values()]
with ThreadPoolExecutor(len(jobs)) as pool:
    built = list(pool.map(lambda j: j(), jobs))
floors = dict(zip(FLOORS, built[len(BWD):]))
print(f"built in {time.time() - t0:.0f} s", flush=True)

for wl in ("W2", "W1"):
    row = res["rows"][f"{wl} H64 backward ablations"] = backward_ab(BWD, wl, seed=41, H=64)
    med = row["median_ms"]
    print(f"{wl} H64 backward: " + " ".join(f"{n} {med[n]:.3f} ({med[n] / med['tree']:.3f}x)" for n in BWD), flush=True)
    json.dump(res, open(PATH, "w"), indent=1)

for wl in ("W2", "W1"):
    q, kv, idx, g = workload(wl, 64, seed=41)
    _, _, saved = TileLangBackend().forward_saving(q, kv, idx, SCALE, DV)
    kv_k, ind, ext = saved[:3]
    n_valid = int(((ind >= 0) & (ind < kv.shape[1])).sum())
    dkv = torch.zeros(kv_k.shape, dtype=torch.float32, device="cuda")
    runs = {n: (lambda k=k: k(ind, ext, dkv)) for n, k in floors.items()}
    _, med = alternating(runs, rounds=4)
    gb = n_valid * 2304 / 1e9
    row = res["rows"][f"{wl} floors"] = dict(median_ms=med, valid_slots=n_valid, contribution_gb=gb,
                                            tb_per_s={n: gb / med[n] for n in med})
    print(f"{wl} floors ({gb:.1f} GB of contributions): " + " ".join(f"{n} {med[n]:.3f} ms ({gb / med[n]:.2f} TB/s)"
                                                                     for n in med), flush=True)
    json.dump(res, open(PATH, "w"), indent=1)

print("\nexp83 summary (ms)")
for key, row in res["rows"].items():
    med = row["median_ms"]
    base = med.get("tree")
    for n, v in med.items():
        extra = f" {v / base:.3f}x of tree" if base else f" {row['tb_per_s'][n]:.2f} TB/s"
        print(f"{key:28s} {n:22s} {v:8.3f}{extra}")
