"""exp70 (session 24): make_exp70.py's forward (warpgroup 0's next-block mask under its P0 V0)
against the tree's: out / lse bitwise equal on W2 / W1 H64, W2 H16 (row groups, R = 4) and the
ragged case (odd pair counts, an empty row, padding inside rows); then raw kernel launches (W2 /
W1 H64) and the backend's forward (W2 / W1 H64, W2 H16), 8 alternating rounds. If the raw kernel
is at least 1% faster at both W2 and W1 H64 and everything is bitwise equal, "exp70" goes to
$OUT/exp70_winner (the gate for a GPU-suite run with it; session 24's call 7: not met)."""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, alternating, ragged_workload, workload
from glm5_dsa_plugin.ops import _exp70
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend, _kernel_lists
OUT = os.environ.get("OUT", ".")
FWD = {"tree": tk.sparse_mla_fwd_ws_kernel, "exp70": _exp70.sparse_mla_fwd_ws_kernel}
builds = [(f, H, K, R) for f in FWD.values() for H, K, R in ((64, 2048, 1), (16, 2048, 4), (64, 512, 1))]
with ThreadPoolExecutor(len(builds)) as pool:
    list(pool.map(lambda a: a[0](a[1], DV, 64, a[2], 1, float(SCALE), rows_per_block=a[3]), builds))
res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})


def use(name):
    tk.sparse_mla_fwd_ws_kernel = FWD[name]


cases = [("W2", 64), ("W1", 64), ("W2", 16), ("ragged", 64)]
try:
    for wl, H in cases:
        q, kv, idx = ragged_workload(H) if wl == "ragged" else workload(wl, H, seed=43)[:3]
        be = TileLangBackend()
        got = {}
        for name in FWD:
            use(name)
            o, l, saved = be.forward_saving(q, kv, idx, SCALE, DV)
            got[name] = (o.clone(), l.clone(), saved)
        row = res["rows"][f"{wl} H{H} forward"] = dict(
            out_bitwise=bool(torch.equal(got["tree"][0], got["exp70"][0])),
            lse_bitwise=bool(torch.equal(got["tree"][1], got["exp70"][1])))
        if wl != "ragged":
            times, med = alternating({k: (lambda: be.forward_saving(q, kv, idx, SCALE, DV)) for k in FWD},
                                     rounds=8, before=use)
            row.update(median_ms=med, rounds=times)
        if H == 64 and wl != "ragged":
            saved = got["tree"][2]
            _, keys, members, ext = _kernel_lists(saved)
            o1 = torch.empty(1, q.shape[1], 64, DV, dtype=q.dtype, device="cuda")
            l1 = torch.empty(1, q.shape[1], 64, device="cuda")
            raw = {k: f(64, DV, 64, 2048, 1, float(SCALE), rows_per_block=1) for k, f in FWD.items()}
            times, med = alternating({k: (lambda k=k: raw[k](q, saved[0], keys, ext, members, o1, l1)) for k in raw},
                                     rounds=8)
            row.update(raw_median_ms=med, raw_rounds=times)
        print(f"{wl} H{H} forward: {json.dumps({k: v for k, v in row.items() if 'rounds' not in k})}", flush=True)
        json.dump(res, open(os.path.join(OUT, "exp70.json"), "w"), indent=1)
finally:
    use("tree")
rows = res["rows"].values()
win = all(r["out_bitwise"] and r["lse_bitwise"] for r in rows) and all(
    res["rows"][f"{wl} H64 forward"]["raw_median_ms"]["exp70"] <= 0.99 * res["rows"][f"{wl} H64 forward"]["raw_median_ms"]["tree"]
    for wl in ("W2", "W1"))
open(os.path.join(OUT, "exp70_winner"), "w").write("exp70" if win else "")
print("winner:", "exp70" if win else "none")
