"""exp48 (prepared in session 20, run in session 21: not landed, see NOTES): the warp-specialised forward with its in-register
nonfinite test (make_exp48.py; run it first, from the repository root) against the tree's kernel,
raw launches in alternating rounds at W2 H64 and W1 H64 (one row per block), beside the guard's
Triton scan of out + lse that the test would replace. Checks: out / lse bitwise equal to the
tree's, Flags 0 on clean inputs, 1 with a NaN in q and with an inf in a selected kv row. The
test is worth landing only if its kernel cost is below the scan's (65 us at W2 H64 in v22)."""
import json, os, statistics, sys, time
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, bench, workload
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp48 as ex
from glm5_dsa_plugin.ops.guard import _flag_nonfinite
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend, _kernel_lists
OUT = os.environ.get("OUT", ".")


res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})
args = (64, DV, 64, 2048, 1, float(SCALE))
tree_k, flag_k = tk.sparse_mla_fwd_ws_kernel(*args, rows_per_block=1), ex.sparse_mla_fwd_ws_kernel(*args, rows_per_block=1)
for wl in ("W2", "W1"):
    q, kv, idx, _ = workload(wl, 64, seed=7)
    T = q.shape[1]
    be = TileLangBackend()
    _, _, saved = be.forward_saving(q, kv, idx, SCALE, DV)
    kv_k = saved[0]
    _, keys, members, ext = _kernel_lists(saved)
    o1, l1 = torch.empty(1, T, 64, DV, dtype=q.dtype, device="cuda"), torch.empty(1, T, 64, device="cuda")
    o2, l2 = torch.empty_like(o1), torch.empty_like(l1)
    flags = torch.zeros(1, dtype=torch.int32, device="cuda")
    scan_flags = torch.zeros(8, dtype=torch.int32, device="cuda")  # (guard.FLAG_SLOTS)
    tree_k(q, kv_k, keys, ext, members, o1, l1)
    flag_k(q, kv_k, keys, ext, members, o2, l2, flags)
    torch.cuda.synchronize()
    chk = dict(out_bitwise=bool(torch.equal(o1, o2)), lse_bitwise=bool(torch.equal(l1, l2)), flag_clean=int(flags.item()))
    for name, poison in (("nan_q", lambda q_, kv_: q_[0, 100, 3].__setitem__(7, float("nan"))),
                         ("inf_kv", lambda q_, kv_: kv_[0, int(idx[0, 3000, 0, 0])].__setitem__((0, 5), float("inf")))):
        qq, kk = q.clone(), kv_k.clone()
        poison(qq, kk)
        flags.zero_()
        flag_k(qq, kk, keys, ext, members, o2, l2, flags)
        torch.cuda.synchronize()
        chk[f"flag_{name}"] = int(flags.item())
        chk[f"nonfinite_{name}"] = bool((~torch.isfinite(o2)).any() or (~torch.isfinite(l2)).any())
    times = {"tree": [], "flag": [], "guard_scan": []}
    for rnd in range(6):
        order = ["tree", "flag"] if rnd % 2 == 0 else ["flag", "tree"]
        for v in order:
            if v == "tree":
                times[v].append(bench(lambda: tree_k(q, kv_k, keys, ext, members, o1, l1)))
            else:
                times[v].append(bench(lambda: flag_k(q, kv_k, keys, ext, members, o2, l2, flags)))
        times["guard_scan"].append(bench(lambda: _flag_nonfinite(scan_flags, 1, o1, l1)))
    med = {k: statistics.median(v) for k, v in times.items()}
    res["rows"][f"{wl} H64"] = dict(median_ms=med, rounds=times, **chk)
    print(f"{wl} H64 tree {med['tree']:.4f} flag {med['flag']:.4f} ({med['flag'] / med['tree']:.3f}x, "
          f"+{(med['flag'] - med['tree']) * 1e3:.0f} us) guard scan {med['guard_scan'] * 1e3:.0f} us {chk}", flush=True)
json.dump(res, open(os.path.join(OUT, "exp48.json"), "w"), indent=1)
