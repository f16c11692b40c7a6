"""Small memory-bound Triton kernels around the sparse-MLA call (no Megatron here).

* ``flag_nonfinite(x, flags, slot, y=None)``: sets ``flags[slot] = 1`` (int32, device) when ``x``
  (or ``y``) holds a NaN or +-inf, one launch, no host sync; several checks share one flags
  buffer so a caller reads all of them with one small device-to-host copy.
* ``check_forward(out, lse, flags, slot, gate, lse_bound, empty_lse, extent)``: the same for a
  forward's outputs from a backend that vouches for its rows within a bound: lse read always,
  out only when ``flags[gate]`` is set; rows outside the bound get lse NaN (and the flag).
* ``prepare_indices(indices, n_kv, k_pad, flags, kv, kv_flag)``: the TileLang kernels' inputs in
  one launch: every slot outside [0, n_kv) -> n_kv (the zero sentinel row), topk padded to
  ``k_pad``, each row's extent (1 + position of its last valid slot), optionally ``flags[0] = 1``
  when an entry breaks the index rule (outside {-1} U [0, n_kv)), optionally kv with the sentinel
  row, and then optionally ``kv_flag[0] = 1`` when a kv entry is NaN, +-inf or at least
  ``KV_SUSPECT_BOUND`` in magnitude.
* ``finish_backward(dkv32, n_rows, dtype, dq, flags)``: the backward's last pass: dKV (fp32
  accumulator with a sentinel row) -> the caller's dtype without the sentinel, and, in the same
  launch, ``flags[0] = 1`` when that dKV or ``dq`` (unless None) holds a NaN or +-inf (the
  guard's check).
* ``segment_sum_rows(contrib, keys, out, src)``: deterministic scatter-add (the deterministic
  backward's dKV reduction), one program per destination row, fixed summation order.
All run under ``TRITON_INTERPRET=1`` on CPU (how CI tests them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# kv entries at or above this magnitude (or NaN / inf) make kv "suspect" (prepare_indices'
# kv_flag). Below it, a softmax-weighted mean of at most 2^27 kv rows stays far inside bf16 / fp32
# range (tilelang.backend.TileLangBackend.finite_out_lse_bound says when that is enough).
KV_SUSPECT_BOUND = 2.0**100


@triton.jit
def _has_nonfinite(x):
    y = x.to(tl.float32)
    return tl.max(((y - y) != 0).to(tl.int32), axis=0)  # y - y is NaN exactly for NaN and +-inf


@triton.jit
def _any_nonfinite(X, start, n, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    return _has_nonfinite(tl.load(X + offs, mask=offs < n, other=0.0))


@triton.jit
def _nonfinite_kernel(X, nx, Y, ny, FLAGS, slot, BLOCK: tl.constexpr):
    """Programs [0, cdiv(nx, BLOCK)) scan X, the rest scan Y (one launch for two tensors)."""
    pid = tl.program_id(0).to(tl.int64)
    nbx = tl.cdiv(nx, BLOCK)
    if pid < nbx:
        bad = _any_nonfinite(X, pid * BLOCK, nx, BLOCK)
    else:
        bad = _any_nonfinite(Y, (pid - nbx) * BLOCK, ny, BLOCK)
    if bad > 0:
        tl.atomic_max(FLAGS + slot, 1)


def flag_nonfinite(x: torch.Tensor, flags: torch.Tensor, slot: int, y: torch.Tensor | None = None,
                   block: int = 8192) -> None:
    """Set ``flags[slot] = 1`` if ``x`` (or ``y``; any float dtypes) holds NaN/inf; one launch, no host sync."""
    if flags.dtype != torch.int32:
        raise ValueError("flags must be int32")
    x = x.contiguous()
    y = x[:0] if y is None else y.contiguous()
    nx, ny = x.numel(), y.numel()
    grid = triton.cdiv(nx, block) + triton.cdiv(ny, block)
    if grid:
        _nonfinite_kernel[(grid,)](x.view(-1), nx, y.view(-1) if ny else x.view(-1), ny, flags, slot, BLOCK=block)


@triton.jit
def _check_forward_kernel(LSE, n_rows, OUT, row_len, FLAGS, slot, gate, lse_bound, empty_lse, EXT, heads_per_group,
                          WITH_EXT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Program p: lse rows [p * ROWS, (p + 1) * ROWS). Doubtful rows (|lse| > lse_bound other than
    exactly empty_lse; with WITH_EXT also empty_lse where EXT[row // heads_per_group] > 0) get lse
    NaN; FLAGS[slot] = 1 when a row is doubtful or nonfinite, or, only read when FLAGS[gate] is
    set (written earlier on the stream), when the chunk's out entries (row_len per row) are."""
    r0 = tl.program_id(0).to(tl.int64) * ROWS
    rows = r0 + tl.arange(0, ROWS)
    in_range = rows < n_rows
    lse = tl.load(LSE + rows, mask=in_range, other=0.0)
    doubtful = (tl.abs(lse) > lse_bound) & (lse != empty_lse)  # (NaN compares false: it is bad below)
    if WITH_EXT:
        ext = tl.load(EXT + rows // heads_per_group, mask=in_range & (lse == empty_lse), other=0)
        doubtful = doubtful | ((lse == empty_lse) & (ext > 0))
    doubtful = doubtful & in_range
    tl.store(LSE + rows, tl.full([ROWS], float("nan"), tl.float32), mask=doubtful)
    bad = tl.maximum(tl.max(((lse - lse) != 0).to(tl.int32), axis=0), tl.max(doubtful.to(tl.int32), axis=0))
    if (tl.load(FLAGS + gate) > 0) & (bad == 0):
        end = tl.minimum(r0 + ROWS, n_rows) * row_len
        start = r0 * row_len
        while start < end:  # (a while loop: the CPU interpreter runs it too)
            bad = tl.maximum(bad, _any_nonfinite(OUT, start, end, BLOCK))
            start += BLOCK
    if bad > 0:
        tl.atomic_max(FLAGS + slot, 1)


def check_forward(out: torch.Tensor, lse: torch.Tensor, flags: torch.Tensor, slot: int, gate: int,
                  lse_bound: float, empty_lse: float, extent: torch.Tensor | None = None, heads_per_group: int = 1,
                  rows: int = 1024, block: int = 4096) -> None:
    """The guard's forward check for a backend that vouches for its rows within a bound
    (``TileLangBackend.finite_out_lse_bound``): reads lse [...] (fp32, contiguous: written in
    place) and out [..., d_v] only where it must. A row is doubtful when its lse is larger than
    ``lse_bound`` in magnitude (other than exactly ``empty_lse``) or, with ``extent`` (int32,
    one entry per ``heads_per_group`` consecutive lse rows: > 0 when that query row has a valid
    slot), when it came out empty although it has a valid slot; a doubtful row's lse becomes NaN,
    so the guard's repair recomputes it. ``flags[slot] = 1`` when some row is doubtful, some lse
    is NaN / inf, or, read only when ``flags[gate]`` is nonzero by the time the launch runs, out
    is (in chunks of ``rows`` rows: a doubtful or nonfinite lse skips its chunk's read). The
    backend's promise makes this flag set whenever ``flag_nonfinite(out, ..., lse)``'s would be,
    from a read of lse alone (1 / d_v of out's entries) while the gate is clear. One launch, no
    host sync."""
    if flags.dtype != torch.int32 or not 0 <= gate < flags.numel() or not 0 <= slot < flags.numel():
        raise ValueError(f"check_forward: int32 flags with slots {slot} and {gate} expected")
    if lse.dtype != torch.float32 or not lse.is_contiguous() or out.shape[:-1] != lse.shape:
        raise ValueError(f"check_forward: contiguous fp32 lse {tuple(lse.shape)} with out {tuple(out.shape)} "
                         "[..., d_v] expected")
    if extent is not None and (extent.dtype != torch.int32 or extent.numel() * heads_per_group != lse.numel()):
        raise ValueError(f"check_forward: int32 extent with {lse.numel()} / {heads_per_group} entries expected, "
                         f"got {extent.dtype} {tuple(extent.shape)}")
    out = out.contiguous()
    n_rows = lse.numel()
    if n_rows:
        ext = lse if extent is None else extent.contiguous().view(-1)
        _check_forward_kernel[(triton.cdiv(n_rows, rows),)](lse.view(-1), n_rows, out.view(-1), out.shape[-1], flags,
                                                             slot, gate, float(lse_bound), float(empty_lse), ext,
                                                             heads_per_group, WITH_EXT=extent is not None, ROWS=rows,
                                                             BLOCK=block)


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


@triton.jit
def _segment_sum_kernel(C, SRC, SEG_START, SEG_ROW, OUT, D: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr):
    """Program (seg, c): OUT[SEG_ROW[seg], c*BD : (c+1)*BD] += the sum of C[SRC[p]] over the segment's
    positions p in [SEG_START[seg], SEG_START[seg + 1]), BP positions at a time in position order
    (each block reduced by a fixed tree). An empty segment leaves its row unread and unwritten."""
    seg = tl.program_id(0)
    start = tl.load(SEG_START + seg)
    end = tl.load(SEG_START + seg + 1)
    if end > start:
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        cmask = cols < D
        acc = tl.zeros([BD], dtype=tl.float32)
        p = start + tl.arange(0, BP)
        src = tl.load(SRC + p, mask=p < end, other=0)
        p0 = start
        while p0 < end:  # (a while loop: Triton's CPU interpreter cannot run range() over loaded bounds)
            pmask = p0 + tl.arange(0, BP) < end
            x = tl.load(C + src[:, None].to(tl.int64) * D + cols[None, :], mask=pmask[:, None] & cmask[None, :],
                        other=0.0)
            p0 += BP
            p = p0 + tl.arange(0, BP)
            src = tl.load(SRC + p, mask=p < end, other=0)  # the next block's rows, read under this one's
            acc += tl.sum(x, axis=0)
        optr = OUT + tl.load(SEG_ROW + seg) * D + cols
        tl.store(optr, tl.load(optr, mask=cmask, other=0.0) + acc, mask=cmask)


def segment_sum_rows(contrib: torch.Tensor, keys: torch.Tensor, out: torch.Tensor,
                     src: torch.Tensor | None = None, block_p: int = 8, n_keys: int | None = None,
                     block_d: int | None = None, num_warps: int = 4) -> None:
    """Deterministic scatter-add: ``out[keys[i]] += contrib[src[i]]`` for every i (src defaults to i).

    contrib [N, D] fp32, keys / src [M] int32 or int64, out [R, D] fp32. Entries are grouped by key
    with a stable sort and each key's group is summed by one program in position order (blocks of
    ``block_p`` rows reduced by a fixed tree): bitwise identical from run to run, unlike
    atomics. No two programs write the same row of ``out``; rows no entry names are not touched.
    ``block_d`` columns per program (default: all D, so each entry's row is read whole, 2304 B at
    D = 576). The bits follow ``block_p``, ``block_d`` and ``num_warps`` (the reduction tree).
    ``n_keys`` (= R): no host sync (one program per row of ``out``, segments found by
    ``searchsorted``), and entries whose key is outside [0, ``n_keys``) (e.g. the sentinel
    ``n_keys``, or -1 padding) are dropped (their contrib rows are never read). Without it the segments come from ``unique_consecutive``, which waits for
    the device."""
    if keys.numel() == 0:
        return
    D = contrib.shape[1]
    sorted_keys, order = torch.sort(keys, stable=True)  # (int32 keys: half the radix passes of int64)
    src = order if src is None else src[order]
    if n_keys is not None:
        if n_keys != out.shape[0]:
            raise ValueError(f"segment_sum_rows: n_keys={n_keys} but out has {out.shape[0]} rows")
        seg_rows = torch.arange(n_keys + 1, dtype=keys.dtype, device=keys.device)
        seg_start = torch.searchsorted(sorted_keys, seg_rows)
        seg_rows = seg_rows[:n_keys]
    else:
        seg_rows, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
        seg_start = torch.zeros(seg_rows.numel() + 1, dtype=torch.int64, device=keys.device)
        torch.cumsum(counts, 0, out=seg_start[1:])
    BD = triton.next_power_of_2(D) if block_d is None else block_d
    grid = (seg_rows.numel(), triton.cdiv(D, BD))
    _segment_sum_kernel[grid](contrib.contiguous(), src, seg_start, seg_rows, out, D=D, BP=block_p, BD=BD,
                              num_warps=num_warps)
