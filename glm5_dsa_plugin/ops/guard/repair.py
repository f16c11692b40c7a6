"""The guard's host-side repair, after a flag read said some output is nonfinite.

  * forward: the query rows (b, t) whose out or lse holds a nonfinite value are recomputed with
    the reference and written back; every other row is left bit for bit.
  * backward, dq: the query rows whose dq is nonfinite are recomputed with the reference.
  * backward, dkv: a kv row (b, s) with a nonfinite entry is rebuilt from scratch as the sum of
    the reference contributions of *every* query row that selected it (found from the indices),
    so the repaired row is the exact reference value, not a patch on a poisoned sum.
Good rows are untouched. A repaired value that is still nonfinite means the inputs themselves
are bad: ``FloatingPointError`` naming the dump. ``row_repair`` computes the same on the device.
"""

from __future__ import annotations

import torch

from .. import reference
from . import events
from .checks import all_finite, bad_rows

__all__ = ["repair_forward", "repair_backward"]


def repair_forward(backend, q, kv, indices, prob, out, lse, stacklevel: int):
    """-> (out, lse) with the nonfinite rows recomputed (copies when there are any); ``prob``:
    the call's ``contract.Problem``."""
    sm_scale, d_v = prob.sm_scale, prob.d_v
    rows = (bad_rows(out) | bad_rows(lse)).nonzero()
    if rows.shape[0] == 0:
        return out, lse
    path = events.event("forward", backend, dict(q=q, kv=kv, indices=indices, sm_scale=sm_scale, d_v=d_v),
                        dict(out=out, lse=lse), rows.shape[0])
    out, lse = out.clone(), lse.clone()
    for b in rows[:, 0].unique().tolist():
        r = rows[rows[:, 0] == b, 1]
        o_r, l_r = reference.forward(q[b : b + 1, r], kv[b : b + 1], indices[b : b + 1, r], sm_scale, d_v)
        out[b, r], lse[b, r] = o_r[0], l_r[0]
    if not all_finite(out, lse):
        raise FloatingPointError(
            f"sparse_mla forward is nonfinite even in the reference: inputs are bad (dump: {path})")
    events.warn_repaired("forward", backend, rows.shape[0], path, stacklevel=stacklevel + 1)
    events.counters.rows_repaired += rows.shape[0]
    return out, lse


def repair_backward(backend, q, kv, indices, grad_out, prob, dq, dkv, stacklevel: int):
    """-> (dq, dkv) with the nonfinite dq rows and dkv rows recomputed (copies when there are any);
    ``kv`` and ``indices`` as the caller passed them, ``prob`` the call's ``contract.Problem``."""
    sm_scale, d_v = prob.sm_scale, prob.d_v
    bad_q = bad_rows(dq)  # [B, T]
    bad_kv = bad_rows(dkv)  # [B, T_kv]
    # query rows that selected any bad kv row (in any group) contribute to it
    sel_bad = torch.zeros_like(bad_q)
    for b in bad_kv.any(-1).nonzero().flatten().tolist():
        idx = indices[b].long()
        hit = bad_kv[b][idx.clamp(min=0)] & (idx >= 0)
        sel_bad[b] = hit.flatten(1).any(-1)
    rows = (bad_q | sel_bad).nonzero()
    if rows.shape[0] == 0:
        return dq, dkv
    path = events.event("backward", backend,
                        dict(q=q, kv=kv, indices=indices, grad_out=grad_out, sm_scale=sm_scale, d_v=d_v),
                        dict(dq=dq, dkv=dkv), int(bad_q.sum()) + int(bad_kv.sum()))
    ref_dq, ref_dkv = reference.backward(q, kv, indices, grad_out, sm_scale, d_v, rows=rows)
    dq, dkv = dq.clone(), dkv.clone()
    dq[bad_q] = ref_dq[bad_q]
    dkv[bad_kv] = ref_dkv[bad_kv]
    if not all_finite(dq, dkv):
        raise FloatingPointError(
            f"sparse_mla backward is nonfinite even in the reference: inputs are bad (dump: {path})")
    events.warn_repaired("backward", backend, int(bad_q.sum()) + int(bad_kv.sum()), path, stacklevel=stacklevel + 1)
    events.counters.rows_repaired += int(bad_q.sum())
    events.counters.kv_rows_repaired += int(bad_kv.sum())
    return dq, dkv
