"""Small-head forward experiment: 16-row head tiles (fwd_min_heads=16) with other launch shapes,
checked row by row against the reference on the configurations that failed with 256 threads."""

import torch
import triton.testing

from glm5_dsa_plugin.ops import reference as ref
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend


def check(be, B, T, T_kv, H, G, topk, d_v, seed, pad=0.3):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, d_v + 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(B, T_kv, G, d_v + 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, T_kv, (B, T, G, topk), generator=gen, device="cuda", dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=gen, device="cuda") < pad] = -1
    o, _ = be.forward(q, kv, idx, 0.0625, d_v)
    r, _ = ref.forward(q.float(), kv.float(), idx, 0.0625, d_v)
    err = ((o.float() - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-6))
    return int((err > 1e-2).sum()), ((o.float() - r).norm() / r.norm()).item()


cases = [(1, 200, 512, 32, 2, 192, 512), (1, 200, 512, 16, 1, 192, 512), (1, 160, 300, 16, 1, 128, 256),
         (1, 300, 400, 8, 1, 320, 512), (2, 129, 300, 16, 1, 2048, 512)]
for threads, block in [(256, 64), (128, 64), (128, 128)]:
    be = TileLangBackend(fwd_min_heads=16, fwd_threads_16=threads, fwd_block_16=block)
    bad = [check(be, *c, seed=s) for c in cases for s in (0, 1)]
    n_bad = sum(b for b, _ in bad)
    # W2-like timing at H=8 (padded to 16)
    T = 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, T, 8, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, T, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, T, (1, T, 1, 2048), generator=gen, device="cuda", dtype=torch.int32)
    ms = triton.testing.do_bench(lambda: be.forward(q, kv, idx, 0.0625, 512), return_mode="median")
    print(f"fwd 16-row tile threads={threads} block={block}: bad rows {n_bad}, max rel "
          f"{max(e for _, e in bad):.2e}, H8 fwd {ms:.3f} ms")
be = TileLangBackend()
ms = triton.testing.do_bench(lambda: be.forward(q, kv, idx, 0.0625, 512), return_mode="median")
print(f"fwd default (heads padded to 32): H8 fwd {ms:.3f} ms")

# W2 fwd+bwd through autograd at H=8/16: 16-row tile (128 threads) vs default vs megatron-core, same run
from glm5_dsa_plugin.ops import backends, sparse_mla  # noqa: E402
from glm5_dsa_plugin.ops.workloads import w2_indices  # noqa: E402

try:
    from megatron.core.transformer.experimental_attention_variant.ops.sparse_mla import SparseMLA
except Exception:  # noqa: BLE001
    SparseMLA = None
T = 4096
w2 = w2_indices(T, 2048, torch.Generator(device="cuda").manual_seed(0))
variant = TileLangBackend(fwd_min_heads=16, fwd_threads_16=128, fwd_block_16=64)
backends.register_backend("tilelang_tile16", lambda: variant, replace=True)
for H in (8, 16):
    q = torch.randn(T, H, 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(T, 1, 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, H, 512, device="cuda", dtype=torch.bfloat16)
    impls = {"ours_default": lambda: sparse_mla(q, kv, w2, 0.0625, backend="tilelang")[0],
             "ours_tile16_128thr": lambda: sparse_mla(q, kv, w2, 0.0625, backend="tilelang_tile16")[0]}
    if SparseMLA is not None:
        impls["mcore"] = lambda: SparseMLA.apply(q, kv, w2, 0.0625)[0]
    outs = {}
    for name, fn in impls.items():
        def fb():
            q.grad = kv.grad = None
            fn().backward(g)
        fb()
        outs[name] = (fn().detach().float(), q.grad.float().clone())
        ms = triton.testing.do_bench(fb, return_mode="median")
        print(f"W2 H{H} {name:20s} fwd+bwd {ms:.3f} ms")
    a, b = outs["ours_tile16_128thr"], outs["ours_default"]
    print(f"W2 H{H} tile16 vs default: out rel {((a[0]-b[0]).norm()/b[0].norm()).item():.2e} "
          f"dq rel {((a[1]-b[1]).norm()/b[1].norm()).item():.2e}")
