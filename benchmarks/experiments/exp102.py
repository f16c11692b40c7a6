"""exp102 (session 30, for the next session): where v32's backward waits (``make_exp102.py``: cycle
counters around each wait, written to an extra ``Waits`` [NG, 3, 8] int64 argument). The
instrumented builder is wrapped so that TileLangBackend's call passes ``Waits``; one backward per
workload (W2 / W1 H64, W2 H16 / H8) after a warm-up, then per warpgroup the share of its loop's
cycles spent in each wait, summed over rows (groups), and 4 alternating rounds against the tree
(the counters' own cost). Run ``make_exp102.py`` from the repository root first."""
import functools, json, os, sys
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, workload
from pairs_ab import build, new_result, timed_rows
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops import _exp102
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
OUT = os.environ.get("OUT", ".")
CATS = ("full", "ch_free", "step_done / p_ready", "ds_ready", "ch_full", "kv_free")
WG = ("MMA 0", "MMA 1", "drain")


LAST = {}  # "waits": the counters of the last instrumented call, whichever kernel the backend chose


class WithWaits:
    """The instrumented kernel, called as the tree's is."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, *args):
        rows = args[3].shape[1]  # Indices [B, NG, G, K]
        LAST["waits"] = torch.zeros(rows, 3, 8, dtype=torch.int64, device=args[3].device)
        self.kernel(*args, LAST["waits"])


@functools.cache
def instrumented(*a, **kw):
    return WithWaits(_exp102.sparse_mla_bwd_ws_kernel(*a, **kw))


BWD = {"tree": tk.sparse_mla_bwd_ws_kernel, "exp102": instrumented}
build({"tree": tk.sparse_mla_bwd_ws_kernel, "exp102": _exp102.sparse_mla_bwd_ws_kernel},
      ((64, 1, False), (16, 4, False), (8, 8, False)))
res = new_result()
path = os.path.join(OUT, "exp102.json")
original = tk.sparse_mla_bwd_ws_kernel
for wl, H in (("W2", 64), ("W1", 64), ("W2", 16), ("W2", 8)):
    q, kv, idx, g = workload(wl, H, seed=41)
    be = TileLangBackend()
    out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)
    tk.sparse_mla_bwd_ws_kernel = instrumented
    try:
        for _ in range(3):
            be.backward_saved(q, saved, out, lse, g, SCALE, DV)
        torch.cuda.synchronize()
        w = LAST["waits"].double().sum(0)  # [3, 8]
    finally:
        tk.sparse_mla_bwd_ws_kernel = original
    row = {WG[i]: {"loop_cycles": float(w[i, 6]), **{c: float(w[i, j] / w[i, 6]) for j, c in enumerate(CATS)}}
           for i in range(3)}
    res["rows"][f"{wl} H{H} waits"] = row
    print(f"{wl} H{H} share of each warpgroup's loop cycles:", flush=True)
    for name, r in row.items():
        print(f"  {name}: " + ", ".join(f"{c} {v:.3f}" for c, v in r.items() if c != "loop_cycles" and v > 0), flush=True)
    json.dump(res, open(path, "w"), indent=1)
timed_rows(BWD, (("W2", 64), ("W1", 64)), res, path)
