"""What the experiment scripts share: the W1 / W2 workloads at T = 4096 and the timing call."""
import statistics

import torch
import triton.testing

from glm5_dsa_plugin.ops.workloads import w1_indices, w2_indices

SCALE, DV = 256**-0.5, 512


def workload(name: str, H: int, seed: int, T: int = 4096):
    """-> q [1, T, H, 576], kv [1, T_kv, 1, 576], indices [1, T, 1, 2048] (contiguous), dO [1, T, H, 512];
    bf16 on cuda. W1: T_kv = 8192, every slot valid; W2: T_kv = T, causal rows with -1 padding."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    idx, T_kv = (w1_indices(T, 8192, 2048, gen)[None], 8192) if name == "W1" else (w2_indices(T, 2048, gen)[None], T)
    q = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1, T, H, DV, generator=gen, device="cuda", dtype=torch.bfloat16)
    return q, kv, idx.contiguous(), g


def bench(fn, rep: int = 120) -> float:
    """Median ms of ``fn`` (triton.testing.do_bench, 5 warm-up runs)."""
    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


def alternating(runs: dict, rounds: int = 6, before=None) -> tuple[dict, dict]:
    """``bench`` of each of ``runs`` (name -> fn) in ``rounds`` rounds, the order reversed every
    other round (drift hits all alike); ``before(name)`` (e.g. patching a kernel builder) runs
    before each timing. -> (times per round, medians), ms."""
    times = {name: [] for name in runs}
    for rnd in range(rounds):
        for name in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
            if before is not None:
                before(name)
            times[name].append(bench(runs[name]))
    return times, {name: statistics.median(ts) for name, ts in times.items()}
