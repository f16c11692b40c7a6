"""Device-side row repair of a sparse-MLA call (the guard's ``fallback`` on CUDA), no host sync.

The guard's host-side repair must read the nonfinite flag before it returns, and that read
drains the GPU queue on every call. These launches instead sit behind the kernels on their
stream and do nothing but read the flag when it is zero (the happy path); when it is set they
rebuild, in fp32 and the reference's math, exactly what the host-side repair rebuilds.

Backward (``repair_backward_rows``, three launches):

1. ``_mark_bad_rows``: per kv row (b, s): ``bad_kv[b, s] = dkv[b, s]`` holds NaN/inf (any
   group, any channel); a bad row's fp32 accumulator is zeroed; ``Flag.KV_ROWS_REPAIRED``
   counts them.
   Per query row (b, t): ``bad_q[b, t] = dq[b, t]`` holds NaN/inf (any head);
   ``Flag.ROWS_REPAIRED`` counts them.
2. ``_repair_query_rows``: per query row (b, t) and block of heads of one group (rows in
   blocks of ``ROWS_PER_PROGRAM`` per program): the row is recomputed when its dq is nonfinite
   anywhere (all heads) or when one of its slots selects a bad kv row. Three passes over its
   slots (softmax max/denominator, Delta = sum p * dp, then
   dS = p * (dp - Delta) * sm_scale): dq for a bad row is overwritten (every head: the
   host repair's row granularity), and each slot that selects a bad kv row atomically adds its
   contribution (dS^T q, plus p^T dO on the value channels) to that row's accumulator. So a bad
   kv row is rebuilt from *every* query row that selected it, not patched.
3. ``_write_bad_kv_rows``: bad kv rows of dkv <- their accumulators.

Forward (``repair_forward_rows``, two launches): ``_mark_bad_out_rows`` marks the query rows
whose out or lse holds NaN/inf (any head; ``Flag.ROWS_REPAIRED`` counts them), then
``_repair_forward_rows`` recomputes out and lse of every head of those rows (two passes over the
slots: softmax max/denominator, then sum p * v), the contract's values for a row with no valid
slot included (out 0, lse ``EMPTY_ROW_LSE``).

Flags: the guard's int32 buffer on the device (``slots.Flag``): the launches run only when
``Flag.NONFINITE`` is set (by the call's check); ``Flag.STILL_NONFINITE`` is set when a repaired
value is still nonfinite (the inputs themselves are bad). Slots are valid iff 0 <= idx < T_kv,
so a backend's prepared indices (padding rewritten to a sentinel row index T_kv) are read as
they are.
Math in fp32 accumulators on the tensor cores: bf16 inputs multiply as they are (exact
products), fp32 factors (p, dS) as hi + lo bf16 halves (about 16 mantissa bits); other input
dtypes as three TF32 products. Outputs in the dtype of the repaired tensor. Runs under
``TRITON_INTERPRET=1`` on CPU (how CI tests it).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..contract import EMPTY_ROW_LSE
from .device_checks import _any_nonfinite, _has_nonfinite
from .slots import Flag

__all__ = ["HEADS_PER_PROGRAM", "SLOTS_PER_STEP", "ROWS_PER_PROGRAM", "DOT_PRECISION", "repair_backward_rows",
           "repair_forward_rows"]

# the guard's flag slots as compile-time constants of the kernels
_NONFINITE = tl.constexpr(int(Flag.NONFINITE))
_STILL_NONFINITE = tl.constexpr(int(Flag.STILL_NONFINITE))
_ROWS_REPAIRED = tl.constexpr(int(Flag.ROWS_REPAIRED))
_KV_ROWS_REPAIRED = tl.constexpr(int(Flag.KV_ROWS_REPAIRED))

HEADS_PER_PROGRAM = 16  # rows of each tl.dot (its minimum M)
SLOTS_PER_STEP = 32
# query rows per program: with the flag clear every program only reads it, so fewer programs
# mean fewer waves of a kernel that fits one or two per SM
ROWS_PER_PROGRAM = 32
# dots of inputs other than bf16 (and under TRITON_INTERPRET): fp32 operands as three TF32
# products on the tensor cores, about fp32 accuracy ("ieee": plain FMA)
DOT_PRECISION = "tf32x3"


@triton.jit
def _row_has_nonfinite(X, r, ROW: tl.constexpr, BLOCK: tl.constexpr):
    """1 if row r of X (rows of ROW contiguous elements) holds NaN/inf, else 0."""
    bad = 0
    for c in range(0, ROW, BLOCK):
        bad = tl.maximum(bad, _any_nonfinite(X + r * ROW, c, ROW, BLOCK))
    return bad


@triton.jit
def _mark_bad_rows(DKV, BAD_KV, ACC, n_kv_rows, DQ, BAD_Q, FLAGS, KV_ROW: tl.constexpr, Q_ROW: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Programs [0, n_kv_rows): kv row r of DKV; the rest: query row r - n_kv_rows of DQ."""
    if tl.load(FLAGS + _NONFINITE) != 0:
        r = tl.program_id(0).to(tl.int64)
        if r < n_kv_rows:
            bad = _row_has_nonfinite(DKV, r, KV_ROW, BLOCK)
            tl.store(BAD_KV + r, bad)
            if bad > 0:
                for c in range(0, KV_ROW, BLOCK):
                    offs = c + tl.arange(0, BLOCK)
                    tl.store(ACC + r * KV_ROW + offs, tl.zeros([BLOCK], tl.float32), mask=offs < KV_ROW)
                tl.atomic_add(FLAGS + _KV_ROWS_REPAIRED, 1)
        else:
            r -= n_kv_rows
            bad = _row_has_nonfinite(DQ, r, Q_ROW, BLOCK)
            tl.store(BAD_Q + r, bad)
            if bad > 0:
                tl.atomic_add(FLAGS + _ROWS_REPAIRED, 1)


@triton.jit
def _write_bad_kv_rows(DKV, BAD_KV, ACC, FLAGS, row_elems: tl.constexpr, BLOCK: tl.constexpr):
    if tl.load(FLAGS + _NONFINITE) != 0:
        r = tl.program_id(0).to(tl.int64)
        if tl.load(BAD_KV + r) != 0:
            still = 0
            for c in range(0, row_elems, BLOCK):
                offs = c + tl.arange(0, BLOCK)
                m = offs < row_elems
                x = tl.load(ACC + r * row_elems + offs, mask=m, other=0.0).to(DKV.dtype.element_ty)
                tl.store(DKV + r * row_elems + offs, x, mask=m)
                still = tl.maximum(still, _has_nonfinite(x))
            if still > 0:
                tl.atomic_max(FLAGS + _STILL_NONFINITE, 1)


@triton.jit
def _mm(a, b, BF16: tl.constexpr, PREC: tl.constexpr):
    """a @ b, fp32 result. BF16 (a, b bf16, or a fp32 and b bf16): on bf16 tensor cores, exact
    products in fp32 accumulators; an fp32 ``a`` goes as hi + lo bf16 halves (about 16
    mantissa bits). Else fp32 operands at PREC."""
    if BF16:
        if a.dtype == tl.float32:
            hi = a.to(tl.bfloat16)
            lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
            return tl.dot(hi, b) + tl.dot(lo, b)
        else:
            return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _slot_block(KV, IDX, i_base, kv_base, s0, K, T_kv, s_ks, D_V: tl.constexpr, D_T: tl.constexpr,
                BV: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr):
    """Slots [s0, s0 + BS) of one row -> (valid [BS], kv rows int64 [BS], value channels [BS, BV],
    tail channels [BS, BT]) in kv's dtype, zero where invalid."""
    so = s0 + tl.arange(0, BS)
    i = tl.load(IDX + i_base + so, mask=so < K, other=-1)
    valid = (i >= 0) & (i < T_kv)
    rows = tl.where(valid, i, 0).to(tl.int64)
    ptr = KV + kv_base + rows[:, None] * s_ks
    ov, ot = tl.arange(0, BV), tl.arange(0, BT)
    k_v = tl.load(ptr + ov[None, :], mask=valid[:, None] & (ov < D_V)[None, :], other=0.0)
    k_t = tl.load(ptr + D_V + ot[None, :], mask=valid[:, None] & (ot < D_T)[None, :], other=0.0)
    return valid, rows, k_v, k_t


@triton.jit
def _scores(q_v, q_t, k_v, k_t, valid, sm_scale, BF16: tl.constexpr, PREC: tl.constexpr):
    """sm_scale * q . k for one slot block -> [HB, BS] fp32, -inf at invalid slots."""
    s = (_mm(q_v, tl.trans(k_v), BF16, PREC) + _mm(q_t, tl.trans(k_t), BF16, PREC)) * sm_scale
    return tl.where(valid[None, :], s, float("-inf"))


@triton.jit
def _row_softmax(q_v, q_t, KV, IDX, i_base, kv_base, K, T_kv, s_ks, sm_scale, D_V: tl.constexpr, D_T: tl.constexpr,
                 BV: tl.constexpr, BT: tl.constexpr, HB: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr,
                 BF16: tl.constexpr):
    """One pass over a row's slots -> (empty [HB]: no valid slot; lse [HB], natural log, 0 for an
    empty row; m [HB], the row max (0 for an empty row); inv_l [HB], 1 / the softmax sum taken
    against m). A slot's p is exp(score - m) * inv_l: 0 at every slot of an empty row, and exact
    where exp(score - lse) is not (|lse| ~ 1e7 and more, where lse's rounding is several units:
    exp of it would scale every p). Empty means a zero softmax sum, not a -inf max: a row whose
    scores are all NaN keeps a -inf max (the max ignores NaN) and is not empty; its sum, and so
    its lse and p, are NaN."""
    m_i = tl.full([HB], float("-inf"), tl.float32)
    l_i = tl.zeros([HB], tl.float32)
    for s0 in range(0, K, BS):
        valid, rows, k_v, k_t = _slot_block(KV, IDX, i_base, kv_base, s0, K, T_kv, s_ks, D_V, D_T, BV, BT, BS)
        s = _scores(q_v, q_t, k_v, k_t, valid, sm_scale, BF16, PREC)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
        m_i = m_new
    empty = l_i == 0
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    return empty, tl.where(empty, 0.0, m_i + tl.log(tl.where(empty, 1.0, l_i))), m_safe, 1.0 / tl.where(empty, 1.0, l_i)


@triton.jit
def _load_head_block(Q, row, g, hb, H: tl.constexpr, HG: tl.constexpr, D_V: tl.constexpr, D_T: tl.constexpr,
                     BV: tl.constexpr, BT: tl.constexpr, HB: tl.constexpr):
    """Heads [hb * HB, (hb + 1) * HB) of group g in query row ``row`` of Q [rows, H, D_V + D_T]
    (contiguous) -> (h [HB] heads, mh [HB] heads that exist, qrow [HB, 1] their offsets in Q,
    q_v [HB, BV], q_t [HB, BT]; zero outside)."""
    ov, ot = tl.arange(0, BV), tl.arange(0, BT)
    hl = hb * HB + tl.arange(0, HB)  # head within the group
    mh = hl < HG
    h = g * HG + hl
    qrow = (row * H + h[:, None]) * (D_V + D_T)
    q_v = tl.load(Q + qrow + ov[None, :], mask=mh[:, None] & (ov < D_V)[None, :], other=0.0)
    q_t = tl.load(Q + qrow + D_V + ot[None, :], mask=mh[:, None] & (ot < D_T)[None, :], other=0.0)
    return h, mh, qrow, q_v, q_t


@triton.jit
def _repair_query_rows(Q, KV, IDX, DO, DQ, BAD_KV, BAD_Q, ACC, FLAGS, n_rows, T, T_kv, H: tl.constexpr, HG: tl.constexpr,
                       G: tl.constexpr, K: tl.constexpr, sm_scale,
                       s_kb, s_ks, s_kg, s_ib, s_it, s_ig,
                       D_V: tl.constexpr, D_T: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                       HB: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr, ROWS: tl.constexpr,
                       BF16: tl.constexpr):
    """Program (block of ROWS query rows b * T + t, g * cdiv(HG, HB) + head block). Q/DQ
    [B, T, H, D_V + D_T], DO [B, T, H, D_V] and ACC [B, T_kv, G, D_V + D_T] contiguous; KV and
    IDX strided. Rows are marked bad (BAD_Q) by an earlier launch: a head block must not judge
    its row from dq that another block of the same row may already have repaired."""
    if tl.load(FLAGS + _NONFINITE) != 0:
        n_hb = tl.cdiv(HG, HB)
        g, hb = tl.program_id(1) // n_hb, tl.program_id(1) % n_hb
        for rr in range(ROWS):
            row = tl.program_id(0).to(tl.int64) * ROWS + rr
            if row < n_rows:
                _repair_one_row(Q, KV, IDX, DO, DQ, BAD_KV, BAD_Q, ACC, FLAGS, row, g, hb, T, T_kv, H, HG, G, K,
                                sm_scale, s_kb, s_ks, s_kg, s_ib, s_it, s_ig, D_V, D_T, BV, BT, HB, BS, PREC, BF16)


@triton.jit
def _repair_one_row(Q, KV, IDX, DO, DQ, BAD_KV, BAD_Q, ACC, FLAGS, row, g, hb, T, T_kv, H: tl.constexpr,
                    HG: tl.constexpr, G: tl.constexpr, K: tl.constexpr, sm_scale, s_kb, s_ks, s_kg, s_ib, s_it, s_ig,
                    D_V: tl.constexpr, D_T: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, HB: tl.constexpr,
                    BS: tl.constexpr, PREC: tl.constexpr, BF16: tl.constexpr):
    """Query row ``row`` = b * T + t, heads [hb * HB, (hb + 1) * HB) of group g (see _repair_query_rows)."""
    b, t = row // T, row % T
    D: tl.constexpr = D_V + D_T
    ov, ot = tl.arange(0, BV), tl.arange(0, BT)
    mv, mt = ov < D_V, ot < D_T
    bad_q = tl.load(BAD_Q + row)
    # does one of its slots (this group) select a bad kv row?
    i_base = b * s_ib + t * s_it + g * s_ig
    kv_base = b * s_kb + g * s_kg
    sel_bad = 0
    if tl.load(FLAGS + _KV_ROWS_REPAIRED) != 0:
        for s0 in range(0, K, BS):
            so = s0 + tl.arange(0, BS)
            i = tl.load(IDX + i_base + so, mask=so < K, other=-1)
            valid = (i >= 0) & (i < T_kv)
            hit = tl.load(BAD_KV + b * T_kv + tl.where(valid, i, 0).to(tl.int64), mask=valid, other=0)
            sel_bad = tl.maximum(sel_bad, tl.max(hit))
    if (bad_q + sel_bad) > 0:
        h, mh, qrow, q_v, q_t = _load_head_block(Q, row, g, hb, H, HG, D_V, D_T, BV, BT, HB)
        do = tl.load(DO + (row * H + h[:, None]) * D_V + ov[None, :], mask=mh[:, None] & mv[None, :], other=0.0)
        # pass 1: row max and softmax denominator per head
        _, _, m, inv_l = _row_softmax(q_v, q_t, KV, IDX, i_base, kv_base, K, T_kv, s_ks, sm_scale, D_V, D_T, BV, BT,
                                      HB, BS, PREC, BF16)
        # pass 2: Delta = sum_j p_j * dp_j
        delta = tl.zeros([HB], tl.float32)
        for s0 in range(0, K, BS):
            valid, rows, k_v, k_t = _slot_block(KV, IDX, i_base, kv_base, s0, K, T_kv, s_ks, D_V, D_T, BV, BT, BS)
            # 0 where invalid
            p = tl.exp(_scores(q_v, q_t, k_v, k_t, valid, sm_scale, BF16, PREC) - m[:, None]) * inv_l[:, None]
            dp = _mm(do, tl.trans(k_v), BF16, PREC)
            delta += tl.sum(p * dp, 1)
        # pass 3: dS, dq, and the contributions to bad kv rows
        dq_v = tl.zeros([HB, BV], tl.float32)
        dq_t = tl.zeros([HB, BT], tl.float32)
        for s0 in range(0, K, BS):
            valid, rows, k_v, k_t = _slot_block(KV, IDX, i_base, kv_base, s0, K, T_kv, s_ks, D_V, D_T, BV, BT, BS)
            # 0 where invalid
            p = tl.exp(_scores(q_v, q_t, k_v, k_t, valid, sm_scale, BF16, PREC) - m[:, None]) * inv_l[:, None]
            dp = _mm(do, tl.trans(k_v), BF16, PREC)
            ds = p * (dp - delta[:, None]) * sm_scale
            dq_v += _mm(ds, k_v, BF16, PREC)
            dq_t += _mm(ds, k_t, BF16, PREC)
            if sel_bad > 0:
                hit = tl.load(BAD_KV + b * T_kv + rows, mask=valid, other=0) != 0
                dk_v = _mm(tl.trans(ds), q_v, BF16, PREC) + _mm(tl.trans(p), do, BF16, PREC)
                dk_t = _mm(tl.trans(ds), q_t, BF16, PREC)
                arow = ACC + ((b * T_kv + rows) * G + g)[:, None] * D
                tl.atomic_add(arow + ov[None, :], dk_v, mask=hit[:, None] & mv[None, :])
                tl.atomic_add(arow + D_V + ot[None, :], dk_t, mask=hit[:, None] & mt[None, :])
        if bad_q > 0:
            x_v = dq_v.to(DQ.dtype.element_ty)
            x_t = dq_t.to(DQ.dtype.element_ty)
            tl.store(DQ + qrow + ov[None, :], x_v, mask=mh[:, None] & mv[None, :])
            tl.store(DQ + qrow + D_V + ot[None, :], x_t, mask=mh[:, None] & mt[None, :])
            if tl.maximum(tl.max(_has_nonfinite(x_v)), tl.max(_has_nonfinite(x_t))) > 0:
                tl.atomic_max(FLAGS + _STILL_NONFINITE, 1)


def _check_repair_args(fn: str, repaired: dict, kv: torch.Tensor, indices: torch.Tensor, flags: torch.Tensor) -> None:
    """The launch preconditions shared by both repairs: the repaired tensors contiguous (written in
    place), kv / indices with unit last stride, flags int32 with the slots the kernels use."""
    for name, x in repaired.items():
        if not x.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous (repaired in place)")
    if kv.stride(-1) != 1 or indices.stride(-1) != 1:
        raise ValueError(f"{fn}: kv and indices need unit stride in their last dim")
    if flags.dtype != torch.int32 or flags.numel() <= Flag.KV_ROWS_REPAIRED:
        raise ValueError(f"{fn}: flags must be int32 with >= {Flag.KV_ROWS_REPAIRED + 1} slots (guard.Flag)")


def _query_row_launch(q, kv, indices, d_v, precision, slots_per_step, rows_per_program, bf16_dots):
    """What the two query-row kernels are launched with besides their tensors and sizes: the grid
    (blocks of ``rows_per_program`` query rows x head blocks of HEADS_PER_PROGRAM per kv group),
    kv's and the indices' strides (b, t, g) and the compile-time constants."""
    B, T, H, D = q.shape
    G = kv.shape[2]
    grid = (triton.cdiv(B * T, rows_per_program), G * triton.cdiv(H // G, HEADS_PER_PROGRAM))
    strides = (kv.stride(0), kv.stride(1), kv.stride(2), indices.stride(0), indices.stride(1), indices.stride(2))
    consts = dict(D_V=d_v, D_T=D - d_v, BV=triton.next_power_of_2(d_v), BT=max(16, triton.next_power_of_2(D - d_v)),
                  HB=HEADS_PER_PROGRAM, BS=slots_per_step, PREC=precision, ROWS=rows_per_program, BF16=bf16_dots)
    return grid, strides, consts


def _bf16_dots(*tensors: torch.Tensor) -> bool:
    """bf16 tensor-core dots when every input is bf16; not under TRITON_INTERPRET (its bf16 tl.dot
    is wrong in Triton 3.6), where the fp32 path computes the same values."""
    return (all(t.dtype == torch.bfloat16 for t in tensors)
            and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))


def repair_backward_rows(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, grad_out: torch.Tensor,
                         sm_scale: float, d_v: int, dq: torch.Tensor, dkv: torch.Tensor,
                         flags: torch.Tensor, precision: str = DOT_PRECISION, slots_per_step: int = SLOTS_PER_STEP,
                         num_warps: int = 8, rows_per_program: int = ROWS_PER_PROGRAM,
                         bf16: bool | None = None) -> None:
    """Repair dq [B,T,H,Dqk] and dkv [B,T_kv,G,Dqk] (contiguous) in place when
    ``flags[Flag.NONFINITE] != 0`` (module docstring); q [B,T,H,Dqk], grad_out [B,T,H,d_v], kv
    [B,T_kv,G,Dqk] and indices [B,T,G,K] as the call saw them (kv and indices may be strided
    views). ``flags``: the guard's int32 buffer, on the device. Three launches, no host sync;
    with ``flags[Flag.NONFINITE] == 0`` they only read it. ``precision`` / ``slots_per_step`` /
    ``num_warps`` / ``rows_per_program``: the query-row kernel's fp32 dot precision ("tf32x3" or
    "ieee"), slots per step, warps and rows per program; ``bf16=False`` forces fp32 dots for bf16
    inputs (scripts/bench_row_repair.py times them)."""
    B, T, H, D = q.shape
    T_kv, G, K = kv.shape[1], kv.shape[2], indices.shape[-1]
    _check_repair_args("repair_backward_rows", {"dq": dq, "dkv": dkv}, kv, indices, flags)
    q, grad_out = q.contiguous(), grad_out.contiguous()
    HG = H // G
    row_elems = G * D
    n_kv_rows = B * T_kv
    if n_kv_rows == 0 or B * T == 0:
        return
    bad_kv = torch.empty(n_kv_rows, dtype=torch.int32, device=q.device)
    bad_q = torch.empty(B * T, dtype=torch.int32, device=q.device)
    acc = torch.empty(B, T_kv, G, D, dtype=torch.float32, device=q.device)
    block = 1024
    _mark_bad_rows[(n_kv_rows + B * T,)](dkv, bad_kv, acc, n_kv_rows, dq, bad_q, flags, KV_ROW=row_elems, Q_ROW=H * D,
                                         BLOCK=block)
    grid, strides, consts = _query_row_launch(q, kv, indices, d_v, precision, slots_per_step, rows_per_program,
                                              bf16 is not False and _bf16_dots(q, kv, grad_out))
    _repair_query_rows[grid](q, kv, indices, grad_out, dq, bad_kv, bad_q, acc, flags, B * T, T, T_kv, H, HG, G, K,
                             sm_scale, *strides, **consts, num_warps=num_warps)
    _write_bad_kv_rows[(n_kv_rows,)](dkv, bad_kv, acc, flags, row_elems, BLOCK=block)


@triton.jit
def _mark_bad_out_rows(OUT, LSE, BAD_Q, FLAGS, O_ROW: tl.constexpr, L_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Program r: query row r (b * T + t) is bad when its out (O_ROW entries) or lse (L_ROW) holds NaN/inf."""
    if tl.load(FLAGS + _NONFINITE) != 0:
        r = tl.program_id(0).to(tl.int64)
        bad = tl.maximum(_row_has_nonfinite(OUT, r, O_ROW, BLOCK), _row_has_nonfinite(LSE, r, L_ROW, BLOCK))
        tl.store(BAD_Q + r, bad)
        if bad > 0:
            tl.atomic_add(FLAGS + _ROWS_REPAIRED, 1)


@triton.jit
def _repair_forward_rows(Q, KV, IDX, OUT, LSE, BAD_Q, FLAGS, n_rows, T, T_kv, H: tl.constexpr, HG: tl.constexpr,
                         K: tl.constexpr, sm_scale, s_kb, s_ks, s_kg, s_ib, s_it, s_ig,
                         D_V: tl.constexpr, D_T: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                         HB: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr, ROWS: tl.constexpr,
                         BF16: tl.constexpr, EMPTY_LSE: tl.constexpr):
    """Program (block of ROWS query rows b * T + t, g * cdiv(HG, HB) + head block): out / lse of
    the block's heads recomputed for rows marked in BAD_Q. Q [B, T, H, D_V + D_T], OUT [B, T, H, D_V]
    and LSE [B, T, H] contiguous; KV and IDX strided."""
    if tl.load(FLAGS + _NONFINITE) != 0:
        n_hb = tl.cdiv(HG, HB)
        g, hb = tl.program_id(1) // n_hb, tl.program_id(1) % n_hb
        ov = tl.arange(0, BV)
        mv = ov < D_V
        for rr in range(ROWS):
            row = tl.program_id(0).to(tl.int64) * ROWS + rr
            if row < n_rows:
                if tl.load(BAD_Q + row) != 0:
                    b, t = row // T, row % T
                    i_base = b * s_ib + t * s_it + g * s_ig
                    kv_base = b * s_kb + g * s_kg
                    h, mh, _, q_v, q_t = _load_head_block(Q, row, g, hb, H, HG, D_V, D_T, BV, BT, HB)
                    empty, lse, m, inv_l = _row_softmax(q_v, q_t, KV, IDX, i_base, kv_base, K, T_kv, s_ks, sm_scale,
                                                        D_V, D_T, BV, BT, HB, BS, PREC, BF16)
                    o = tl.zeros([HB, BV], tl.float32)
                    for s0 in range(0, K, BS):
                        valid, rows, k_v, k_t = _slot_block(KV, IDX, i_base, kv_base, s0, K, T_kv, s_ks, D_V, D_T, BV,
                                                            BT, BS)
                        s = _scores(q_v, q_t, k_v, k_t, valid, sm_scale, BF16, PREC)
                        p = tl.exp(s - m[:, None]) * inv_l[:, None]
                        o += _mm(p, k_v, BF16, PREC)
                    x = o.to(OUT.dtype.element_ty)  # a row with no valid slot: p == 0, out exactly 0
                    lse = tl.where(empty, EMPTY_LSE, lse)
                    tl.store(OUT + (row * H + h[:, None]) * D_V + ov[None, :], x, mask=mh[:, None] & mv[None, :])
                    tl.store(LSE + row * H + h, lse, mask=mh)
                    if tl.maximum(tl.max(_has_nonfinite(x)), _has_nonfinite(lse)) > 0:
                        tl.atomic_max(FLAGS + _STILL_NONFINITE, 1)


def repair_forward_rows(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int,
                        out: torch.Tensor, lse: torch.Tensor, flags: torch.Tensor, precision: str = DOT_PRECISION,
                        slots_per_step: int = SLOTS_PER_STEP, num_warps: int = 8,
                        rows_per_program: int = ROWS_PER_PROGRAM) -> None:
    """Repair out [B,T,H,d_v] and lse [B,T,H] fp32 (contiguous) in place when
    ``flags[Flag.NONFINITE] != 0``: every head of a query row whose out or lse holds NaN/inf is
    recomputed (module docstring); ``Flag.ROWS_REPAIRED`` counts those rows,
    ``Flag.STILL_NONFINITE`` is set when a recomputed value is still nonfinite. q [B,T,H,Dqk]; kv
    [B,T_kv,G,Dqk] and indices [B,T,G,K] as the call saw them (may be strided views; a slot
    outside [0, T_kv) counts as padding). ``flags``: the guard's int32 buffer, on the device. Two
    launches, no host sync; with ``flags[Flag.NONFINITE] == 0`` they only read it."""
    B, T, H, _ = q.shape
    T_kv, G, K = kv.shape[1], kv.shape[2], indices.shape[-1]
    _check_repair_args("repair_forward_rows", {"out": out, "lse": lse}, kv, indices, flags)
    if B * T == 0:
        return
    q = q.contiguous()
    HG = H // G
    bad_q = torch.empty(B * T, dtype=torch.int32, device=q.device)
    _mark_bad_out_rows[(B * T,)](out, lse, bad_q, flags, O_ROW=H * d_v, L_ROW=H, BLOCK=1024)
    grid, strides, consts = _query_row_launch(q, kv, indices, d_v, precision, slots_per_step, rows_per_program,
                                              _bf16_dots(q, kv))
    _repair_forward_rows[grid](q, kv, indices, out, lse, bad_q, flags, B * T, T, T_kv, H, HG, K, sm_scale,
                               *strides, **consts, EMPTY_LSE=EMPTY_ROW_LSE, num_warps=num_warps)
