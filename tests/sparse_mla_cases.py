"""Shared helpers for sparse-MLA tests: an independent dense fp64 formula and input builders."""

import torch


def dense_sparse_mla(q, kv, indices, sm_scale, d_v):
    """Independent formula: multiplicity-weighted dense softmax. Batched layout, autograd-able.

    C[b,g,t,s] = number of slots j with indices[b,t,g,j] == s; p ~ C * exp(score).
    Returns (out, lse) with lse = log sum_s C exp(score) (EMPTY rows: out 0, lse -inf).
    """
    B, T, H, D = q.shape
    T_kv, G = kv.shape[1], kv.shape[2]
    Hg = H // G
    onehot = torch.zeros(B, T, G, T_kv + 1, dtype=q.dtype, device=q.device)
    idx = indices.long().clone()
    idx[idx < 0] = T_kv  # padding goes to a dropped column
    onehot.scatter_add_(3, idx, torch.ones_like(idx, dtype=q.dtype))
    counts = onehot[..., :T_kv]  # [B, T, G, T_kv]
    qg = q.view(B, T, G, Hg, D)
    score = torch.einsum("btghd,bsgd->btghs", qg, kv) * sm_scale
    logw = torch.log(counts)[:, :, :, None, :]  # -inf where count 0
    empty = (counts.sum(-1) == 0)[:, :, :, None].expand(B, T, G, Hg)
    z = torch.where(empty[..., None], torch.zeros_like(score), score + logw)  # no all--inf rows in logsumexp
    lse = torch.logsumexp(z, dim=-1)  # [B,T,G,Hg]
    p = torch.where(empty[..., None], torch.zeros_like(z), torch.exp(z - lse[..., None]))
    lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse)
    out = torch.einsum("btghs,bsgd->btghd", p, kv[..., :d_v])
    return out.reshape(B, T, H, d_v), lse.reshape(B, T, H)


def make_indices(B, T, G, topk, T_kv, gen, pad_frac=0.3, empty_rows=(), repeat=True):
    """Random int32 indices in [0, T_kv) with -1 padding, optional repeats, boundary values and empty rows."""
    idx = torch.randint(0, T_kv, (B, T, G, topk), generator=gen, dtype=torch.int64)
    if topk >= 2:
        idx[..., 0] = 0
        idx[..., 1] = T_kv - 1
    if repeat and topk >= 3:
        idx[..., 2] = idx[..., 1]
    pad = torch.rand(B, T, G, topk, generator=gen) < pad_frac
    idx[pad] = -1
    for t in empty_rows:
        idx[:, t] = -1
    return idx.to(torch.int32)
