"""The benchmark / test workloads of the kernels issue, built in one place (indices [T, 1, topk] int32)."""

from __future__ import annotations

import torch

__all__ = ["w1_indices", "w2_indices"]


def w1_indices(T: int, T_kv: int, topk: int, gen: torch.Generator, device="cuda") -> torch.Tensor:
    """W1: every slot valid, distinct random keys in [0, T_kv)."""
    return torch.rand(T, T_kv, generator=gen, device=device).topk(topk, dim=-1).indices.to(torch.int32)[:, None, :]


def w2_indices(T: int, topk: int, gen: torch.Generator, empty_rows=(0, 7, 2000), device="cuda") -> torch.Tensor:
    """W2 (the RL shape): row t holds a random permutation of min(t+1, topk) keys in [0, t], then -1;
    ``empty_rows`` (those < T) are all -1."""
    r = torch.rand(T, T, generator=gen, device=device)
    causal = torch.arange(T, device=device)[None, :] <= torch.arange(T, device=device)[:, None]
    vals, idx = r.masked_fill(~causal, -1.0).topk(min(topk, T), dim=-1)
    idx = idx.masked_fill(vals < 0, -1).to(torch.int32)
    if topk > T:
        idx = torch.nn.functional.pad(idx, (0, topk - T), value=-1)
    rows = [t for t in empty_rows if t < T]
    if rows:
        idx[rows] = -1
    return idx[:, None, :].contiguous()
