"""PyTorch reference for sparse MLA: the definition of the right answer.

Gather-based (repeated indices count once per slot), fp32 accumulation (fp64 for fp64
inputs), chunked over query rows so that forward and backward peak memory is
O(chunk * G * topk * Dqk) instead of O(T * T_kv * H). Runs on CPU and CUDA.
All functions take the canonical batched layout of :mod:`.contract`.
"""

from __future__ import annotations

import torch

from .contract import EMPTY_ROW_LSE

__all__ = ["forward", "backward", "live_slot_columns", "slot_probs"]

# Elements of fp32 scratch per chunk (gathered kv + scores); ~256 MiB.
_CHUNK_BUDGET = 1 << 26


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_chunk(G: int, H: int, K: int, Dqk: int) -> int:
    per_row = G * K * Dqk + 4 * H * K + H * Dqk
    return max(1, _CHUNK_BUDGET // per_row)


def live_slot_columns(indices: torch.Tensor) -> torch.Tensor | None:
    """Positions (int64) along the last axis of ``indices`` [..., K] holding an index (>= 0) in
    some row, or None if every column does; an all-padding ``indices`` keeps column 0.

    A column that is padding (-1) in every row adds nothing to any row (its probability, logit
    gradient and kv gradient are fixed), so the references compute only the others: a top-k wider
    than the visible keys (2048 slots over a few hundred keys) is mostly such columns."""
    live = (indices >= 0).reshape(-1, indices.shape[-1]).any(0)
    if bool(live.all()):
        return None
    live[:1] |= ~live.any()  # keep one column: empty rows stay empty rows
    return live.nonzero().squeeze(1)


def _live_slots(idx: torch.Tensor) -> torch.Tensor:
    """idx [C, G, K] without its all-padding slot columns (:func:`live_slot_columns`)."""
    cols = live_slot_columns(idx)
    return idx if cols is None else idx[..., cols]


def _gather(kv_b: torch.Tensor, idx: torch.Tensor, cdt: torch.dtype):
    """kv_b [T_kv, G, D], idx [C, G, K] -> (kv_sel [G, C, K, D] with padding slots zeroed, valid [G, C, K])."""
    G = kv_b.shape[1]
    valid = (idx >= 0).permute(1, 0, 2)
    safe = idx.clamp(min=0).long().permute(1, 0, 2)
    kv_g = kv_b.permute(1, 0, 2)  # [G, T_kv, D]
    sel = kv_g[torch.arange(G, device=kv_b.device)[:, None, None], safe]  # [G, C, K, D]
    sel = sel.to(cdt).masked_fill(~valid[..., None], 0)
    return sel, valid


def _softmax_parts(q_c, sel, valid, sm_scale):
    """q_c [G, C, Hg, D]; returns (p normalised [G,C,Hg,K], lse [G,C,Hg], empty [G,C,1 or Hg])."""
    s = torch.einsum("gchd,gckd->gchk", q_c, sel) * sm_scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    empty = m == float("-inf")  # no valid slot in the row (a +inf max is an inf input, not an empty row)
    m = torch.where(empty, torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(empty, torch.ones_like(l), l)
    lse = torch.where(empty, torch.full_like(m, EMPTY_ROW_LSE), m + torch.log(l)).squeeze(-1)
    return p, lse


def _chunks(T: int, G: int, H: int, K: int, Dqk: int):
    c = _row_chunk(G, H, K, Dqk)
    for t0 in range(0, T, c):
        yield t0, min(T, t0 + c)


def forward(q, kv, indices, sm_scale: float, d_v: int):
    """q [B,T,H,Dqk], kv [B,T_kv,G,Dqk], indices [B,T,G,K] -> (out [B,T,H,d_v] q.dtype, lse [B,T,H] fp32)."""
    B, T, H, Dqk = q.shape
    G, K = kv.shape[2], indices.shape[-1]
    Hg = H // G
    cdt = _compute_dtype(q.dtype)
    out = torch.empty(B, T, H, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    for b in range(B):
        for t0, t1 in _chunks(T, G, H, K, Dqk):
            sel, valid = _gather(kv[b], _live_slots(indices[b, t0:t1]), cdt)
            q_c = q[b, t0:t1].to(cdt).view(t1 - t0, G, Hg, Dqk).permute(1, 0, 2, 3)
            p, lse_c = _softmax_parts(q_c, sel, valid, sm_scale)
            o = torch.einsum("gchk,gckd->gchd", p, sel[..., :d_v])
            out[b, t0:t1] = o.permute(1, 0, 2, 3).reshape(t1 - t0, H, d_v).to(q.dtype)
            lse[b, t0:t1] = lse_c.permute(1, 0, 2).reshape(t1 - t0, H).float()
    return out, lse


def backward(q, kv, indices, grad_out, sm_scale: float, d_v: int, rows: torch.Tensor | None = None):
    """Gradients of ``sum(out * grad_out)``: returns (dq [B,T,H,Dqk], dkv [B,T_kv,G,Dqk]) in q.dtype.

    The softmax is recomputed per chunk (not read from a saved lse). ``rows`` (optional, int64
    [N, 2] of (batch, row)) restricts the work to those query rows: dq is zero elsewhere and dkv
    holds only their contributions — the guard's row-granular repair uses this.
    """
    B, T, H, Dqk = q.shape
    T_kv, G = kv.shape[1], kv.shape[2]
    K = indices.shape[-1]
    Hg = H // G
    cdt = _compute_dtype(q.dtype)
    dq = torch.zeros(B, T, H, Dqk, dtype=cdt, device=q.device)
    dkv = torch.zeros(B, T_kv, G, Dqk, dtype=cdt, device=q.device)
    for b in range(B):
        if rows is None:
            row_sets = [torch.arange(t0, t1, device=q.device) for t0, t1 in _chunks(T, G, H, K, Dqk)]
        else:
            sel_rows = rows[rows[:, 0] == b, 1].to(q.device)
            c = _row_chunk(G, H, K, Dqk)
            row_sets = [sel_rows[i : i + c] for i in range(0, sel_rows.numel(), c)]
        for r in row_sets:
            C = r.numel()
            if C == 0:
                continue
            idx = _live_slots(indices[b, r])
            sel, valid = _gather(kv[b], idx, cdt)
            q_c = q[b, r].to(cdt).view(C, G, Hg, Dqk).permute(1, 0, 2, 3)
            do_c = grad_out[b, r].to(cdt).view(C, G, Hg, d_v).permute(1, 0, 2, 3)
            p, _ = _softmax_parts(q_c, sel, valid, sm_scale)
            dp = torch.einsum("gchd,gckd->gchk", do_c, sel[..., :d_v])
            delta = (p * dp).sum(dim=-1, keepdim=True)
            ds = p * (dp - delta) * sm_scale
            dq_c = torch.einsum("gchk,gckd->gchd", ds, sel)
            dq[b, r] = dq_c.permute(1, 0, 2, 3).reshape(C, H, Dqk)
            dsel = torch.einsum("gchk,gchd->gckd", ds, q_c)
            dsel[..., :d_v] += torch.einsum("gchk,gchd->gckd", p, do_c)
            dsel = dsel.masked_fill(~valid[..., None], 0)
            # scatter-add per slot (multiset semantics) into the flattened [G * T_kv] rows
            flat = (idx.clamp(min=0).long().permute(1, 0, 2) + torch.arange(G, device=q.device)[:, None, None] * T_kv)
            acc = dkv[b].permute(1, 0, 2).reshape(G * T_kv, Dqk).clone()
            acc.index_add_(0, flat.reshape(-1), dsel.reshape(-1, Dqk))
            dkv[b] = acc.view(G, T_kv, Dqk).permute(1, 0, 2)
    return dq.to(q.dtype), dkv.to(kv.dtype)


def slot_probs(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor,
               sm_scale: float) -> torch.Tensor:
    """fp32 [B, T, G, K]: at each slot, the attention probability exp(sm_scale * q . kv[idx] - lse)
    summed over the kv group's heads; 0 at padding. q [B, T, H, Dqk], kv [B, T_kv, G, Dqk],
    indices [B, T, G, K], lse [B, T, H] (the forward's, natural log). A row whose slots all
    hold keys sums to its group's head count."""
    B, T, H, D = q.shape
    G, K = kv.shape[2], indices.shape[-1]
    hg, cdt = H // G, _compute_dtype(q.dtype)
    out = torch.zeros(B, T, G, K, dtype=torch.float32, device=q.device)
    chunk = _row_chunk(G, H, K, D)
    with torch.no_grad():
        for b in range(B):
            for t0 in range(0, T, chunk):
                t1 = min(T, t0 + chunk)
                sel, valid = _gather(kv[b], indices[b, t0:t1], cdt)  # [G, C, K, D], [G, C, K]
                qg = q[b, t0:t1].to(cdt).view(t1 - t0, G, hg, D).permute(1, 0, 2, 3)  # [G, C, hg, D]
                s = torch.einsum("gchd,gckd->gchk", qg, sel) * sm_scale
                norm = lse[b, t0:t1].to(cdt).view(t1 - t0, G, hg).permute(1, 0, 2)[..., None]
                p = torch.exp(s - norm).masked_fill(~valid[:, :, None, :], 0).sum(2)  # [G, C, K]
                out[b, t0:t1] = p.permute(1, 0, 2).float()
    return out
