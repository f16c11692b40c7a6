"""exp55 (session 22): the spread of the W2 H64 forward against the issue's 1.6 ms goal. Through
the op without grad (flags deferred, as the bench's ``W2_H64_fwd_ms_forward_flags=deferred``:
q [4096, 64, 576], W2 indices, ``sparse_mla`` under ``torch.no_grad()``) and as raw launches of
the warp-specialised kernel, interleaved, 12 rounds of ``common.bench``; per round and summary
(min / median / max, rounds at or below 1.6 ms). Nothing is compared: this says how often the
goal holds on one machine in one call."""
import json, os, statistics, sys, time
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DV, SCALE, bench
from glm5_dsa_plugin.ops import configure, sparse_mla
from glm5_dsa_plugin.ops import tilelang_kernels as tk
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend, _kernel_lists
from glm5_dsa_plugin.ops.workloads import w2_indices
OUT = os.environ.get("OUT", ".")

gen = torch.Generator(device="cuda").manual_seed(23)
idx = w2_indices(4096, 2048, gen)
q = torch.randn(4096, 64, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
kv = torch.randn(4096, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
configure(forward_flags="deferred")


def op_forward():
    with torch.no_grad():
        sparse_mla(q, kv, idx, SCALE, d_v=DV, backend="tilelang")


_, _, saved = TileLangBackend().forward_saving(q[None], kv[None], idx[None], SCALE, DV)
_, keys, members, ext = _kernel_lists(saved)
kernel = tk.sparse_mla_fwd_ws_kernel(64, DV, 64, 2048, 1, float(SCALE), rows_per_block=1)
o = torch.empty(1, 4096, 64, DV, dtype=q.dtype, device="cuda")
l = torch.empty(1, 4096, 64, device="cuda")
times = {"op_deferred": [], "raw_kernel": []}
for rnd in range(12):
    times["op_deferred"].append(bench(op_forward))
    times["raw_kernel"].append(bench(lambda: kernel(q[None], saved[0], keys, ext, members, o, l)))
    print(rnd, {k: round(v[-1], 4) for k, v in times.items()}, flush=True)
configure(forward_flags="eager")
summary = {k: dict(min=min(v), median=statistics.median(v), max=max(v), rounds_le_1p6=sum(x <= 1.6 for x in v))
           for k, v in times.items()}
print(summary, flush=True)
json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
               rounds=times, summary=summary), open(os.path.join(OUT, "exp55.json"), "w"), indent=1)
