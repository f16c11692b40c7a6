"""Debug helper: where (rows, heads) does the TileLang forward disagree with the reference?"""
import sys
import torch
from glm5_dsa_plugin.ops import sparse_mla

def case(B, T, T_kv, H, G, topk, d_v, seed, pad=0.3):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, d_v + 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(B, T_kv, G, d_v + 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, T_kv, (B, T, G, topk), generator=gen, device="cuda", dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=gen, device="cuda") < pad] = -1
    o, l = sparse_mla(q, kv, idx, 0.0625, d_v=d_v, backend="tilelang")
    r, rl = sparse_mla(q.float(), kv.float(), idx, 0.0625, d_v=d_v, backend="reference")
    err = (o.float() - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-6)  # [B,T,H]
    bad = err > 1e-2
    print(f"B{B} T{T} Tkv{T_kv} H{H} G{G} k{topk} dv{d_v} pad{pad} seed{seed}: rel={((o.float()-r).norm()/r.norm()).item():.2e} "
          f"bad rows={bad.any(-1).sum().item()}/{B*T} bad heads={bad.any(0).any(0).nonzero().flatten().tolist()[:40]} "
          f"lse maxdiff={(l-rl).abs().max().item():.2e}")
    if bad.any():
        rows = bad.any(-1).nonzero()[:5].tolist()
        print("   first bad (b,t):", rows)

for args in [(1,200,512,32,2,192,512), (1,200,512,32,1,192,512), (1,200,512,16,1,192,512), (1,160,300,16,1,128,256),
             (1,160,300,16,1,128,512), (1,160,300,64,1,128,256), (1,200,512,64,2,192,512), (1,200,512,128,1,192,512)]:
    for seed in (0, 1):
        case(*args, seed)
    case(*args, 5, pad=0.0)
