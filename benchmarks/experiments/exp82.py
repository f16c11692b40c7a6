"""exp82 (session 27, CPU): what dS from bf16 P would cost in precision (the lead after session 27:
the backward's fp32 P hand-off takes 10 KB of shared memory). The kernels' arithmetic emulated in
torch on the CPU (bf16 inputs, fp32 products and sums, P and dS rounded to bf16 for the GEMMs that
read them) with dS = P (dP - Delta) scale from P in fp32 (the tree) or from P rounded to bf16,
against a float64 reference of the same inputs; relative L2 error of dq and dkv over a few seeds.
W2-like rows: 512 query rows, 64 heads, causal key lists of up to 512 of 1024 keys, -1 padding."""
import torch

D, DT, H, T, T_KV, K = 512, 64, 64, 512, 1024, 512
SCALE = (D + DT) ** -0.5


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D + DT, generator=g).bfloat16()
    kv = torch.randn(T_KV, D + DT, generator=g).bfloat16()
    do = torch.randn(T, H, D, generator=g).bfloat16()
    idx = torch.full((T, K), -1, dtype=torch.long)
    for t in range(T):
        n = min(K, 2 * t + 1)  # causal over T_KV = 2 T keys
        idx[t, :n] = torch.randperm(2 * t + 1, generator=g)[:n]
    return q, kv, do, idx


def backward(q, kv, do, idx, dtype, p_for_ds):
    """dq [T, H, D + DT], dkv [T_KV, D + DT] in ``dtype``; ``p_for_ds``: "fp32" (or "exact" in fp64)
    or "bf16" P in dS. P and dS go to the GEMMs as bf16 unless dtype is float64."""
    valid = idx >= 0
    keys = kv.to(dtype)[idx.clamp(min=0)]  # [T, K, D + DT]
    qd, dod = q.to(dtype), do.to(dtype)
    s = torch.einsum("thd,tkd->thk", qd, keys) * SCALE
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse)
    out = torch.einsum("thk,tkd->thd", p, keys[..., :D])
    delta = (out.to(torch.bfloat16).to(dtype) if dtype != torch.float64 else out) * dod
    delta = delta.sum(-1, keepdim=True)
    dp = torch.einsum("thd,tkd->thk", dod, keys[..., :D])
    low = dtype != torch.float64
    p_gemm = p.bfloat16().to(dtype) if low else p
    p_ds = p_gemm if p_for_ds == "bf16" else p
    ds = p_ds * (dp - delta) * SCALE
    ds_gemm = ds.bfloat16().to(dtype) if low else ds
    dq = torch.einsum("thk,tkd->thd", ds_gemm, keys)
    contrib = torch.einsum("thk,thd->tkd", ds_gemm, qd)
    contrib[..., :D] += torch.einsum("thk,thd->tkd", p_gemm, dod)
    dkv = torch.zeros(T_KV, D + DT, dtype=dtype)
    dkv.index_add_(0, idx.clamp(min=0)[valid], contrib[valid])
    return dq, dkv


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


if __name__ == "__main__":
    for seed in (1, 2, 3):
        q, kv, do, idx = inputs(seed)
        ref = backward(q, kv, do, idx, torch.float64, "exact")
        row = []
        for mode in ("fp32", "bf16"):
            dq, dkv = backward(q, kv, do, idx, torch.float32, mode)
            row.append(f"P {mode} in dS: dq {rel(dq, ref[0]):.3e} dkv {rel(dkv, ref[1]):.3e}")
        print(f"seed {seed}: " + "; ".join(row), flush=True)
