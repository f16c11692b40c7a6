"""Small-head forward check: 16-row head tiles (the default) vs heads padded to 32, row by row
against the reference on the configurations that once failed, then W2-like H=8/16 timing."""

import torch
import triton.testing

from glm5_dsa_plugin.ops import reference as ref
from glm5_dsa_plugin.ops.tilelang_backend import TileLangBackend
from glm5_dsa_plugin.ops.workloads import w2_indices


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
         (1, 300, 400, 8, 1, 320, 512), (2, 129, 300, 16, 1, 2048, 512), (1, 64, 100, 8, 1, 64, 512)]
T = 4096
w2 = w2_indices(T, 2048, torch.Generator(device="cuda").manual_seed(0))[None]
for min_heads in (16, 32):
    be = TileLangBackend(fwd_min_heads=min_heads)
    bad = [check(be, *c, seed=s) for c in cases for s in (0, 1, 2)]
    line = f"fwd min_heads={min_heads}: bad rows {sum(b for b, _ in bad)}, max rel {max(e for _, e in bad):.2e}"
    for H in (8, 16):
        q = torch.randn(1, T, H, 576, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(1, T, 1, 576, device="cuda", dtype=torch.bfloat16)
        ms = triton.testing.do_bench(lambda: be.forward(q, kv, w2, 0.0625, 512), return_mode="median")
        line += f", W2 H{H} fwd kernel {ms:.3f} ms"
    print(line, flush=True)
