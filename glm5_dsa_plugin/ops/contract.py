"""The sparse-MLA contract: shapes, dtypes, index rules and the lse convention.

Every backend (reference, TileLang, test-only fault injectors) receives inputs that
went through :func:`canonicalize` and returns results in the convention described here.
Nothing in this module knows about Megatron.

Shapes (after canonicalisation to the batched form)
    q        [B, T, H, Dqk]      Dqk = d_v + d_tail (GLM-5 absorbed MLA: 512 + 64)
    kv       [B, T_kv, G, Dqk]   H % G == 0; head h reads group h // (H // G)
    indices  [B, T, G, topk]     int32; -1 is padding; every other value in [0, T_kv)
    out      [B, T, H, d_v]      dtype of q
    lse      [B, T, H]           float32, natural log, non-differentiable

lse convention
    lse[b, t, h] = log(sum_j exp(sm_scale * q[b,t,h] . kv[b, idx_j, g]))  over valid slots j.
    Rows with no valid slot have ``out == 0`` exactly, ``dq == 0`` exactly and
    ``lse == EMPTY_ROW_LSE`` (a finite stand-in for -inf: exp(lse) == 0 in fp32, so
    merging such a row with another partial softmax gives it zero weight).
    Kernels may work in log2 internally; what crosses the fwd -> bwd boundary and what
    users see is natural-log lse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["PAD_INDEX", "EMPTY_ROW_LSE", "LOG2E", "LN2", "FLOAT_DTYPES", "SparseMLAInputError", "Problem",
           "canonicalize", "problem_of", "index_violation_flag", "check_indices", "flops"]

PAD_INDEX = -1
EMPTY_ROW_LSE = -1.0e30
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class SparseMLAInputError(ValueError):
    """Raised when an input violates the sparse-MLA contract (names tensor, position, value)."""


@dataclass(frozen=True)
class Problem:
    """One canonicalised call, as every backend receives it (built once, by :func:`canonicalize`).

    Sizes of the batched inputs: q [batch, seq_len, heads, d_qk], kv [batch, seq_len_kv,
    kv_groups, d_qk], indices [batch, seq_len, kv_groups, topk]; ``d_v`` leading channels of kv
    are the values. ``sm_scale`` is the softmax scale as a finite Python float > 0 (the one cast
    of the caller's value). ``batched_input``: whether the caller passed the batched form (the
    op squeezes the batch back otherwise). Backends read sizes and the scale from here, not from
    the tensors' shapes: a backend's prepared tensors may be padded (topk, heads, a sentinel kv
    row) while the problem is not.
    """

    batch: int
    seq_len: int
    seq_len_kv: int
    heads: int
    kv_groups: int
    topk: int
    d_qk: int
    d_v: int
    sm_scale: float
    batched_input: bool = True

    @property
    def d_tail(self) -> int:
        return self.d_qk - self.d_v

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.kv_groups


def _fail(msg: str) -> None:
    raise SparseMLAInputError(msg)


def canonicalize(q, kv, indices, sm_scale, d_v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Problem]:
    """Check shapes/dtypes/scale and return batched views ``(q, kv, indices, problem)``.

    Does not look at index values (see :func:`check_indices`).
    """
    for name, t in (("q", q), ("kv", kv), ("indices", indices)):
        if not isinstance(t, torch.Tensor):
            _fail(f"sparse_mla: {name} must be a torch.Tensor, got {type(t).__name__}")
    if sm_scale is None:
        _fail(
            "sparse_mla: sm_scale is required (no default). For absorbed MLA use the un-absorbed "
            "qk head dim: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, e.g. 256 ** -0.5 for GLM-5, "
            "not Dqk ** -0.5."
        )
    if isinstance(sm_scale, torch.Tensor):
        _fail("sparse_mla: sm_scale must be a Python float, not a tensor")
    sm_scale = float(sm_scale)
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        _fail(f"sparse_mla: sm_scale must be finite and > 0, got {sm_scale}")
    if q.dim() not in (3, 4):
        _fail(f"sparse_mla: q must be [T, H, Dqk] or [B, T, H, Dqk], got shape {tuple(q.shape)}")
    batched = q.dim() == 4
    want = 4 if batched else 3
    for name, t in (("kv", kv), ("indices", indices)):
        if t.dim() != want:
            _fail(
                f"sparse_mla: {name} must have {want} dims like q ({'batched' if batched else 'packed'}), "
                f"got shape {tuple(t.shape)}"
            )
    if not batched:
        q, kv, indices = q.unsqueeze(0), kv.unsqueeze(0), indices.unsqueeze(0)
    if q.dtype not in FLOAT_DTYPES:
        _fail(f"sparse_mla: q dtype {q.dtype} unsupported (one of {FLOAT_DTYPES})")
    if kv.dtype != q.dtype:
        _fail(f"sparse_mla: kv dtype {kv.dtype} must equal q dtype {q.dtype}")
    if indices.dtype != torch.int32:
        _fail(f"sparse_mla: indices must be int32, got {indices.dtype}")
    if q.device != kv.device or q.device != indices.device:
        _fail(f"sparse_mla: q, kv, indices on different devices ({q.device}, {kv.device}, {indices.device})")
    B, T, H, Dqk = q.shape
    Bk, T_kv, G, Dk = kv.shape
    Bi, Ti, Gi, topk = indices.shape
    if Bk != B or Bi != B:
        _fail(f"sparse_mla: batch mismatch q={B}, kv={Bk}, indices={Bi}")
    if Dk != Dqk:
        _fail(f"sparse_mla: kv last dim {Dk} != q last dim {Dqk}")
    if Ti != T:
        _fail(f"sparse_mla: indices has {Ti} rows, q has {T}")
    if Gi != G:
        _fail(f"sparse_mla: indices has {Gi} kv groups, kv has {G}")
    if G < 1 or H % G != 0:
        _fail(f"sparse_mla: heads H={H} must be a multiple of kv groups G={G}")
    if T_kv < 1:
        _fail("sparse_mla: kv has no rows (T_kv == 0)")
    if topk < 1:
        _fail("sparse_mla: indices has topk == 0")
    d_v = int(d_v)
    if not 0 < d_v <= Dqk:
        _fail(f"sparse_mla: d_v={d_v} must satisfy 0 < d_v <= Dqk={Dqk}")
    prob = Problem(B, T, T_kv, H, G, topk, Dqk, d_v, sm_scale, batched)
    return q, kv, indices, prob


def problem_of(q, kv, indices, sm_scale, d_v) -> Problem:
    """The :class:`Problem` of a call (:func:`canonicalize`'s checks included), for code that
    drives a backend directly rather than through :func:`~glm5_dsa_plugin.ops.sparse_mla`."""
    return canonicalize(q, kv, indices, sm_scale, d_v)[3]


def _bad_index_mask(indices: torch.Tensor, seq_len_kv: int) -> torch.Tensor:
    """bool, same shape: entries outside {-1} U [0, T_kv) (the one index rule)."""
    return (indices < PAD_INDEX) | (indices >= seq_len_kv)


def index_violation_flag(indices: torch.Tensor, seq_len_kv: int) -> torch.Tensor:
    """int32 [1] on the indices' device, nonzero when some index is outside {-1} U [0, T_kv).

    No host sync: a backend whose kernels are memory-safe for any index value reads this flag
    together with its own checks after the kernel (one sync per call instead of two) and then
    calls :func:`check_indices` for the message; every other backend validates before running."""
    return _bad_index_mask(indices, seq_len_kv).any().to(torch.int32).view(1)


def check_indices(indices: torch.Tensor, seq_len_kv: int, name: str = "indices") -> None:
    """Raise :class:`SparseMLAInputError` naming the first index outside {-1} U [0, T_kv).

    indices [B, T, G, topk] int32. One fused device reduction and a single host read of a flag.
    """
    bad = _bad_index_mask(indices, seq_len_kv)
    if not bool(bad.any()):
        return
    pos = bad.flatten().nonzero()[0].item()
    B, T, G, K = indices.shape
    b, rem = divmod(pos, T * G * K)
    t, rem = divmod(rem, G * K)
    g, j = divmod(rem, K)
    val = int(indices[b, t, g, j])
    n_bad = int(bad.sum())
    what = f"index {val} >= capacity T_kv={seq_len_kv}" if val >= seq_len_kv else f"index {val} < -1 (only -1 is padding)"
    _fail(
        f"sparse_mla: {name}[batch={b}, row={t}, group={g}, slot={j}] = {val}: {what}; "
        f"{n_bad} bad entr{'y' if n_bad == 1 else 'ies'} in total"
    )


def flops(n_valid_slots: int, heads: int, d_qk: int, d_v: int) -> tuple[float, float]:
    """(forward, backward) FLOPs over valid slots.

    fwd: QK^T (Dqk) + PV (d_v) = 2*H*n*(Dqk + d_v)  (GLM-5: 2*H*n*1088)
    bwd: recomputed QK^T, dO V^T, dS K (dq), dS^T Q and P^T dO (dkv) = 2*H*n*(3*Dqk + 2*d_v)  (2*H*n*2752)
    """
    fwd = 2.0 * heads * n_valid_slots * (d_qk + d_v)
    bwd = 2.0 * heads * n_valid_slots * (3 * d_qk + 2 * d_v)
    return fwd, bwd
