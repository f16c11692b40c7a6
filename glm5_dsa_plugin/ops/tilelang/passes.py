"""The TileLang backend's device passes before and after its kernels (no Megatron here).

* ``prepare_indices(indices, n_kv, k_pad, flags, kv, kv_flag)``: the kernels' inputs in one
  launch: every slot outside [0, n_kv) -> n_kv (the zero sentinel row), topk padded to ``k_pad``,
  each row's extent (1 + position of its last valid slot), optionally ``flags[0] = 1`` when an
  entry breaks the index rule (outside {-1} U [0, n_kv)), optionally kv with the sentinel row,
  and then optionally ``kv_flag[0] = 1`` when a kv entry is NaN, +-inf or at least
  ``KV_SUSPECT_BOUND`` in magnitude.
* ``finish_backward(dkv32, n_rows, dtype, dq, flags)``: the backward's last pass: dKV (fp32
  accumulator with a sentinel row) -> the caller's dtype without the sentinel, and, in the same
  launch, ``flags[0] = 1`` when that dKV or ``dq`` (unless None) holds a NaN or +-inf (the
  guard's check).

All run under ``TRITON_INTERPRET=1`` on CPU (how CI tests them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..guard.device_checks import _any_nonfinite, _has_nonfinite

__all__ = ["KV_SUSPECT_BOUND", "finish_backward", "prepare_indices"]

# kv entries at or above this magnitude (or NaN / inf) make kv "suspect" (prepare_indices'
# kv_flag). Below it, a softmax-weighted mean of at most 2^27 kv rows stays far inside bf16 / fp32
# range (tilelang.backend.TileLangBackend.finite_out_lse_bound says when that is enough).
KV_SUSPECT_BOUND = 2.0**100


@triton.jit
def _finish_backward_kernel(DKV32, DKV, per_batch_in, per_batch_out, n_conv, DQ, n_dq, FLAGS, CHECK: tl.constexpr,
                            BLOCK: tl.constexpr):
    """Programs [0, B * cdiv(per_batch_out, BLOCK)) convert dKV batch by batch (the sentinel rows
    sit at each batch's end of DKV32 and are dropped); the rest only scan dQ."""
    pid = tl.program_id(0).to(tl.int64)
    nb = tl.cdiv(per_batch_out, BLOCK)
    if pid < n_conv:
        b = pid // nb
        offs = (pid % nb) * BLOCK + tl.arange(0, BLOCK)
        m = offs < per_batch_out
        x = tl.load(DKV32 + b * per_batch_in + offs, mask=m, other=0.0).to(DKV.dtype.element_ty)
        tl.store(DKV + b * per_batch_out + offs, x, mask=m)
        if CHECK:
            bad = _has_nonfinite(x)
    else:
        if CHECK:
            bad = _any_nonfinite(DQ, (pid - n_conv) * BLOCK, n_dq, BLOCK)
    if CHECK:
        if bad > 0:
            tl.atomic_max(FLAGS, 1)


def finish_backward(dkv32: torch.Tensor, n_rows: int, dtype: torch.dtype, dq: torch.Tensor | None,
                    flags: torch.Tensor | None = None, block: int = 8192) -> torch.Tensor:
    """dkv32 [B, R, ...] fp32 (contiguous) -> dkv [B, n_rows, ...] in ``dtype`` (rows >= n_rows dropped).
    With ``flags`` (int32 [1], device): ``flags[0]`` becomes 1 when the converted dkv or ``dq``
    holds NaN/inf, in the same launch (no host sync); ``dq`` None: dkv only (the kernel that
    wrote dq checked it)."""
    if not dkv32.is_contiguous() or dkv32.dtype != torch.float32:
        raise ValueError("finish_backward: contiguous fp32 dkv expected")
    B, R = dkv32.shape[:2]
    row = dkv32[0, 0].numel() if B and R else 0
    out = torch.empty(B, n_rows, *dkv32.shape[2:], dtype=dtype, device=dkv32.device)
    per_in, per_out = R * row, n_rows * row
    n_conv = B * triton.cdiv(per_out, block)
    dqc = out if dq is None else dq.contiguous()  # (None: a placeholder pointer, n_dq = 0, never read)
    n_dq = dqc.numel() if flags is not None and dq is not None else 0
    grid = n_conv + triton.cdiv(n_dq, block)
    if grid:
        _finish_backward_kernel[(grid,)](dkv32, out, per_in, per_out, n_conv, dqc.view(-1), n_dq,
                                         out if flags is None else flags, CHECK=flags is not None, BLOCK=block)
    return out


@triton.jit
def _prepare_indices_kernel(IDX, OUT, EXT, FLAGS, K, K_PAD, n_kv, n_rows, KV, KVK, per_batch_in, per_batch_out,
                            COUNTS, block, KV_FLAG, kv_bound, CHECK: tl.constexpr, COUNT: tl.constexpr,
                            REWRITE: tl.constexpr, CHECK_KV: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """Programs [0, n_rows): one index row each (with COUNT: COUNTS[ceil(extent / block)] += 1;
    without REWRITE no OUT is written).
    The rest (when KV is given): copy kv batch by batch into KVK, whose extra last row per batch
    reads as zeros (the sentinel); with CHECK_KV, KV_FLAG[0] = 1 when a copied entry is NaN, +-inf
    or >= kv_bound in magnitude."""
    row = tl.program_id(0).to(tl.int64)
    if row < n_rows:
        ext = tl.zeros([BK], dtype=tl.int32)
        bad = tl.zeros([BK], dtype=tl.int32)
        c0 = 0
        while c0 < K_PAD:
            cols = c0 + tl.arange(0, BK)
            x = tl.load(IDX + row * K + cols, mask=cols < K, other=-1)
            ok = (x >= 0) & (x < n_kv)
            bad = tl.maximum(bad, ((x < -1) | (x >= n_kv)).to(tl.int32))
            if REWRITE:
                tl.store(OUT + row * K_PAD + cols, tl.where(ok, x, n_kv), mask=cols < K_PAD)
            ext = tl.maximum(ext, tl.where(ok, cols + 1, 0))
            c0 += BK
        extent = tl.max(ext, axis=0)
        tl.store(EXT + row, extent)
        if COUNT:
            tl.atomic_add(COUNTS + (extent + block - 1) // block, 1)
        if CHECK:
            if tl.max(bad, axis=0) > 0:
                tl.atomic_max(FLAGS, 1)
    else:
        c = row - n_rows
        nb = tl.cdiv(per_batch_out, BC)
        b = c // nb
        offs = (c % nb) * BC + tl.arange(0, BC)
        x = tl.load(KV + b * per_batch_in + offs, mask=offs < per_batch_in, other=0.0)
        tl.store(KVK + b * per_batch_out + offs, x, mask=offs < per_batch_out)
        if CHECK_KV:
            # (not |x| < bound): NaN fails the comparison too
            if tl.max((~(tl.abs(x.to(tl.float32)) < kv_bound)).to(tl.int32), axis=0) > 0:
                tl.atomic_max(KV_FLAG, 1)


def prepare_indices(indices: torch.Tensor, n_kv: int, k_pad: int, flags: torch.Tensor | None = None,
                    kv: torch.Tensor | None = None, block_counts: torch.Tensor | None = None, block: int = 64,
                    rewrite: bool = True, kv_flag: torch.Tensor | None = None):
    """indices [..., K] int32 -> (kernel indices [..., k_pad] int32 in [0, n_kv], extent [...] int32)
    and, when ``kv`` [B, n_kv, ...] is given, also kv with one zero row appended per batch
    ([B, n_kv + 1, ...], the sentinel the rewritten slots read) as a third result.
    ``rewrite=False`` (K == k_pad): the first result is ``indices`` itself, for kernels that map
    invalid slots to the sentinel themselves; nothing index-sized is written.

    Kernel indices: slot j < K keeps its index if it lies in [0, n_kv), else becomes ``n_kv``;
    slots K..k_pad-1 are ``n_kv``. Extent: 1 + the last position holding a valid index (0: none).
    ``flags`` (int32, device): ``flags[0]`` is set to 1 when some entry lies outside {-1} U [0, n_kv).
    ``block_counts`` (int32 [k_pad // block + 1], device, zero): entry c counts the rows whose
    valid slots end in block c (``ceil(extent / block)``; 0 for rows without any).
    ``kv_flag`` (int32, device; only with ``kv``): ``kv_flag[0]`` is set to 1 when some kv entry is
    NaN, +-inf or at least ``KV_SUSPECT_BOUND`` in magnitude (read in the copy, no extra pass).
    One launch, no host sync."""
    if indices.dtype != torch.int32:
        raise ValueError(f"prepare_indices: int32 indices expected, got {indices.dtype}")
    if k_pad < indices.shape[-1]:
        raise ValueError(f"prepare_indices: k_pad={k_pad} < topk={indices.shape[-1]}")
    idx = indices.contiguous()
    K = idx.shape[-1]
    if not rewrite and k_pad != K:
        raise ValueError(f"prepare_indices: rewrite=False needs topk == k_pad, got {K} and {k_pad}")
    out = torch.empty(*idx.shape[:-1], k_pad, dtype=torch.int32, device=idx.device) if rewrite else idx
    ext = torch.empty(idx.shape[:-1], dtype=torch.int32, device=idx.device)
    n_rows = ext.numel()
    BC = 4096
    with_kv = kv is not None
    if with_kv:
        if kv.shape[1] != n_kv:
            raise ValueError(f"prepare_indices: kv has {kv.shape[1]} rows, n_kv={n_kv}")
        kv = kv.contiguous()
        kv_k = torch.empty(kv.shape[0], n_kv + 1, *kv.shape[2:], dtype=kv.dtype, device=kv.device)
        row = kv[0, 0].numel() if kv.shape[0] else 0
        per_in, per_out = n_kv * row, (n_kv + 1) * row
        n_copy = kv.shape[0] * triton.cdiv(per_out, BC)
    else:
        kv = kv_k = ext
        per_in = per_out = n_copy = 0
    if kv_flag is not None and (kv_flag.dtype != torch.int32 or not with_kv):
        raise ValueError("prepare_indices: kv_flag must be int32 and needs kv")
    if block_counts is not None and block_counts.numel() != k_pad // block + 1:
        raise ValueError(f"prepare_indices: block_counts needs {k_pad // block + 1} entries")
    if n_rows + n_copy:
        BK = min(1024, triton.next_power_of_2(k_pad))
        _prepare_indices_kernel[(n_rows + n_copy,)](idx, out, ext, ext if flags is None else flags, K, k_pad, n_kv,
                                                    n_rows, kv, kv_k, per_in, per_out,
                                                    ext if block_counts is None else block_counts, block,
                                                    ext if kv_flag is None else kv_flag, KV_SUSPECT_BOUND,
                                                    CHECK=flags is not None, COUNT=block_counts is not None,
                                                    REWRITE=rewrite, CHECK_KV=kv_flag is not None, BK=BK, BC=BC)
    return (out, ext, kv_k) if with_kv else (out, ext)
