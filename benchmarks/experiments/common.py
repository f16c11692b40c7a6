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


def prepared_forward_inputs(q, kv, idx):
    """The warp-specialised forward's inputs after the backend's preparation, for raw launches:
    (kv with its sentinel row, key lists, extents, member bits)."""
    from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend, _kernel_lists

    _, _, saved = TileLangBackend().forward_saving(q, kv, idx, SCALE, DV)
    _, keys, members, ext = _kernel_lists(saved)
    return saved[0], keys, ext, members


def raw_forward(builder, H, topk, inputs, q):
    """-> (kernel, out, lse, launch): one-row-per-block forward ``builder``'s kernel at H heads, out /
    lse poisoned with NaN, and a closure launching it on ``prepared_forward_inputs``."""
    k = builder(H, DV, 64, topk, 1, float(SCALE), rows_per_block=1)
    o = torch.full((1, q.shape[1], H, DV), float("nan"), dtype=q.dtype, device="cuda")
    l = torch.full((1, q.shape[1], H), float("nan"), device="cuda")
    return k, o, l, lambda: k(q, inputs[0], inputs[1], inputs[2], inputs[3], o, l)


def ragged_workload(H, T=1000, T_kv=3000, K=512):
    """q, kv, indices with indices in [-1, T_kv), row 5 all -1, the last 2/5 of the rows padded
    after slot 100 (seed 31)."""
    gen = torch.Generator(device="cuda").manual_seed(31)
    q = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(-1, T_kv, (1, T, 1, K), generator=gen, device="cuda", dtype=torch.int32)
    idx[0, 5] = -1
    idx[0, T * 3 // 5:, :, 100:] = -1
    return q, kv, idx


def backward_ab(builders: dict, wl: str, seed: int, rounds: int = 8, H: int = 64) -> dict:
    """Warp-specialised backward builders (name -> builder; the first is the baseline) through
    TileLangBackend, ``tilelang_kernels.sparse_mla_bwd_ws_kernel`` patched in turn (restored after)
    on one workload at H heads (below 64: the backend's row groups): dq bitwise and dkv's relative difference against the baseline, then
    ``alternating`` rounds. -> {"median_ms", "rounds", "<name> dq_bitwise", "<name> dkv_rel"}."""
    from glm5_dsa_plugin.ops import tilelang_kernels as tk
    from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend

    original = tk.sparse_mla_bwd_ws_kernel
    base = next(iter(builders))
    q, kv, idx, g = workload(wl, H, seed=seed)
    be = TileLangBackend()
    out, lse, saved = be.forward_saving(q, kv, idx, SCALE, DV)

    def use(name):
        tk.sparse_mla_bwd_ws_kernel = builders[name]

    try:
        grads = {}
        for name in builders:
            use(name)
            grads[name] = be.backward_saved(q, saved, out, lse, g, SCALE, DV)
        row = {}
        for name in builders:
            if name != base:
                d = (grads[name][1].double() - grads[base][1].double()).norm() / grads[base][1].double().norm()
                row[f"{name} dq_bitwise"] = bool(torch.equal(grads[base][0], grads[name][0]))
                row[f"{name} dkv_rel"] = float(d)
        times, med = alternating({k: (lambda: be.backward_saved(q, saved, out, lse, g, SCALE, DV)) for k in builders},
                                 rounds=rounds, before=use)
    finally:
        tk.sparse_mla_bwd_ws_kernel = original
    return dict(median_ms=med, rounds=times, **row)
