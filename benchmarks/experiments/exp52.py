"""exp52 (session 21): the guard's forward check as landed (``check_forward``: lse read, rows the
kernels cannot vouch for marked, out read only when kv is suspect) against the full scan of out +
lse it replaced, raw launches at W2 / W1 H64; and through the op, alternating rounds, W2 H64:
the no-grad forward (eager / deferred flags) and fwd+bwd with the guard off / ``fallback``."""
import json, os, statistics, sys, time
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, bench, workload
from glm5_dsa_plugin.ops import EMPTY_ROW_LSE, configure, sparse_mla
from glm5_dsa_plugin.ops.guard import FLAG_SLOTS, KV_SUSPECT_SLOT
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
from glm5_dsa_plugin.ops.triton_helpers import check_forward, flag_nonfinite
OUT = os.environ.get("OUT", ".")

res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"), rows={})
be = TileLangBackend()
for wl in ("W2", "W1"):
    q, kv, idx, g = workload(wl, 64, seed=21)
    out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
    ext, bound = be.row_extent(saved), be.finite_out_lse_bound(SCALE, idx.shape[-1])
    flags = torch.zeros(FLAG_SLOTS, dtype=torch.int32, device="cuda")
    times = {"full_scan_us": [], "check_us": []}
    for rnd in range(6):
        times["full_scan_us"].append(bench(lambda: flag_nonfinite(out, flags, 1, lse), rep=50) * 1e3)
        times["check_us"].append(bench(lambda: check_forward(out, lse, flags, 1, KV_SUSPECT_SLOT, bound, EMPTY_ROW_LSE,
                                                             ext, 64), rep=50) * 1e3)
    assert flags.tolist() == [0] * FLAG_SLOTS and torch.isfinite(lse).all()
    res["rows"][f"{wl} H64 guard pass"] = {k: statistics.median(v) for k, v in times.items()} | {"rounds": times}
    print(wl, "H64", {k: round(statistics.median(v), 1) for k, v in times.items()}, flush=True)

q, kv, idx, g = workload("W2", 64, seed=22)
q, kv, idx, g = q[0], kv[0], idx[0], g[0]
qg = q.clone().requires_grad_(True)


def fwd():
    with torch.no_grad():
        sparse_mla(q, kv, idx, SCALE, d_v=DV, backend="tilelang")


def fwd_bwd():
    qg.grad = None
    sparse_mla(qg, kv, idx, SCALE, d_v=DV, backend="tilelang")[0].backward(g)


times = {k: [] for k in ("fwd_eager", "fwd_deferred", "fb_off", "fb_fallback")}
for rnd in range(5):
    for name in (list(times) if rnd % 2 == 0 else list(times)[::-1]):
        configure(policy="off" if name == "fb_off" else "fallback",
                  forward_flags="deferred" if name == "fwd_deferred" else "eager")
        times[name].append(bench(fwd if name.startswith("fwd") else fwd_bwd, rep=60))
configure(policy="fallback", forward_flags="eager")
med = {k: statistics.median(v) for k, v in times.items()}
res["rows"]["W2 H64 op ms"] = med | {"rounds": times}
print("W2 H64 op ms", {k: round(v, 3) for k, v in med.items()}, flush=True)
json.dump(res, open(os.path.join(OUT, "exp52.json"), "w"), indent=1)
