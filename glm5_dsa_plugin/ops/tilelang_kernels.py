"""TileLang 0.1.15 sparse-MLA forward/backward kernels (Hopper, bf16), parametrised by shape.

Fixes over the vendored copies (each applies when ``safe=True``, the only mode the backend uses;
``safe=False`` exists so the benchmark can measure what the fixes cost):
  * padding slots: the host appends one all-zero *sentinel* row to kv (row T_kv of a
    [B, T_kv + 1, G, Dqk] tensor) and, in the same pass that pads topk, rewrites every slot
    outside [0, T_kv) (-1 padding, and anything index validation would reject) to T_kv
    (``triton_helpers.prepare_indices``, one launch). The backward and the warp-specialised
    forward with one row per block also select the sentinel themselves for any index outside
    [0, T_kv) (``gather_row``, ``valid_slot`` in int64), so the backend may hand them the
    caller's indices as they are (no rewritten copy is then made); the single-warpgroup forward
    can (``select_in_kernel``), but by default trusts the rewrite. Every gather address
    is a real row, the padding key/value is exactly zero, and no data-dependent branch sits on
    the load itself (the gathers stay asynchronous copies).
    A slot outside [0, T_kv) scores -inf and issues no dKV atomic (its dKV rows are exact zeros);
  * rows with no valid slot: out = 0, lse = EMPTY_ROW_LSE (finite), hence P = 0 and dq = 0;
  * no reliance on TileLang's safe-memory legalisation (it is disabled below, on purpose):
    every global access is in bounds by construction (one query row per block, or a row group
    whose rows past the sequence are read as zeros and never written; heads padded and indices
    rewritten by the host wrapper, topk padded to a multiple of the block);
  * the aggressive shared-memory merge is explicitly off: in 0.1.9-0.1.10 it aliased the dKV
    staging buffer with the live Q tile and produced NaN dq/dkv from finite inputs;
  * the warp-specialised backward sets ``Flags[0]`` (int32 [1], its last argument) when dq holds
    a NaN / inf, tested in registers before the store: the guard's nonfinite check of dq without
    a pass over it (``_flag_nonfinite``).

Kernels: ``sparse_mla_fwd_kernel`` (one warpgroup; 16/32-row head tiles, row groups, and any tile
when asked), ``sparse_mla_fwd_ws_kernel`` (warp-specialised: a gather warpgroup feeding two MMA
warpgroups; the backend's default for every 64-row tile, row groups included),
``sparse_mla_bwd_kernel`` (16/32-row tiles, deterministic mode, safe=False) and
``sparse_mla_bwd_ws_kernel`` (warp-specialised: a warpgroup that gathers the next block and drains
the dKV atomics beside two MMA warpgroups; the default for every 64-row tile with atomic dKV).

Conventions: the kernels read/write natural-log lse [B, T, H] fp32 and use log2 internally.
Head layout: ``heads = G * Hg`` where ``Hg`` (heads per kv group) is 16, 32, 64 or a multiple of 64
(one query row per block), or 8, 16, 32 with ``rows_per_block`` = 64 / Hg (row groups: see
``row_group_geometry`` and ``row_groups.group_keys``). In a row group a slot masked for one row
still goes through the MMA, so a nonfinite kv row selected by one row of the group reaches the
other rows of its block as well (0 * NaN); the guard repairs them like any other bad row.
"""


import functools
import math
import threading
from types import SimpleNamespace

import tilelang
from tilelang import language as T

from .contract import EMPTY_ROW_LSE, LN2, LOG2E

_K = tilelang.PassConfigKey
PASS_CONFIGS = {
    _K.TL_DISABLE_TMA_LOWER: True,  # gathers are per-row; TMA tiles do not apply
    _K.TL_DISABLE_WARP_SPECIALIZED: True,
    _K.TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE: False,  # the 0.1.9/0.1.10 dq/dkv NaN miscompile
    _K.TL_DISABLE_SAFE_MEMORY_ACCESS: True,  # in-bounds by construction; never lean on the compiler
}

# A PrimFunc attribute: the kernel places every fence.proxy.async its generic shared-memory stores
# need before a wgmma reads them, so TileLang's InjectFenceProxy pass is skipped for it.
EXPLICIT_FENCES_ATTR = "glm5_dsa.explicit_proxy_fences"


def _install_selective_fence_pass() -> None:
    """TileLang's InjectFenceProxy puts a fence.proxy.async before a wgmma whenever generic
    shared-memory traffic may precede it in program order, loop back edges included, whether or
    not the wgmma reads what was stored: in the warp-specialised backward, 5 fences per step and
    MMA warpgroup after the fp32 dKV^T chunk stores that only the drain reads (1.5-2.4% of the W2
    H64 backward, 0.7-1.5% at W1: exp65 / exp66). TileLang 0.1.15 has no per-kernel switch, so the
    pass the lowering looks up (``tilelang.cuda.transform.InjectFenceProxy``, called for each
    compile) is wrapped once: a module holding a function with ``EXPLICIT_FENCES_ATTR`` skips it,
    every other module, ours or anyone else's, runs it unchanged. Idempotent; a TileLang that
    stopped looking the pass up there would leave the fences in (correct, slower; a compile test
    counts them)."""
    import tilelang.cuda.transform as tl_cuda_transform
    from tilelang import tvm

    original = tl_cuda_transform.InjectFenceProxy
    if getattr(original, "explicit_fences_aware", False):
        return

    def inject_fence_proxy():
        inner = original()

        def run(mod, _ctx):
            if any(f.attrs is not None and EXPLICIT_FENCES_ATTR in f.attrs for _, f in mod.functions.items()):
                return mod
            return inner(mod)

        # a module pass, as the original: callable on a module and usable in a pass sequence
        return tvm.transform.module_pass(run, opt_level=0, name="glm5_dsa.InjectFenceProxyUnlessExplicit")

    inject_fence_proxy.explicit_fences_aware = True
    tl_cuda_transform.InjectFenceProxy = inject_fence_proxy


_install_selective_fence_pass()

BLOCK_TOPK = 64  # topk is padded with -1 to a multiple of this
SUPPORTED_SPLITS = {(512, 64), (256, 64)}  # (d_v, d_tail): the splits proven on the H200


def built_once(builder):
    """Memoise a kernel builder per argument set, building each kernel once even when threads ask
    for it at the same time (``functools.lru_cache`` lets each of them build it). Concurrent
    TileLang compiles / cache loads of one kernel left one caller with a module that lacked its
    device function ("Cannot find function fwd_kernel in the imported modules", session 18's
    correctness sweep, 8 threads). Different kernels still build in parallel."""
    built: dict = {}
    locks: dict = {}
    locks_lock = threading.Lock()

    @functools.wraps(builder)
    def get(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key in built:
            return built[key]
        with locks_lock:
            lock = locks.setdefault(key, threading.Lock())
        with lock:
            if key not in built:
                built[key] = builder(*args, **kwargs)
        return built[key]

    return get


def check_split(d_v: int, d_tail: int) -> None:
    if (d_v, d_tail) not in SUPPORTED_SPLITS:
        raise ValueError(
            f"TileLang sparse-MLA supports (d_v, d_tail) in {sorted(SUPPORTED_SPLITS)}, got ({d_v}, {d_tail}); "
            f"use backend='reference' for other splits"
        )


def head_block(heads_per_group: int) -> int:
    return min(64, heads_per_group)


def bwd_block_slots(heads_per_group: int) -> int:
    """Slots per backward step: 8 warps split the [h_blk, BS] score tile along BS, >= 8 columns each."""
    return 32 if head_block(heads_per_group) == 64 else 64


def valid_slot(idx, n_rows):
    """A slot is valid iff its index is a real kv row (the same test in both modes). Compared in
    int64: with n_rows = kv_rows - 1 TVM rewrites ``idx < n_rows`` into ``idx + 1 < kv_rows``,
    which in int32 wrapped at 2**31 - 1 and passed that index (session 17, exp39)."""
    return (idx >= 0) & (T.cast(idx, "int64") < T.cast(n_rows, "int64"))


def slot_blocks(extent, block):
    """Blocks of ``block`` slots a row needs: ceil(extent / block)."""
    return (extent + block - 1) // block


def in_bucket(n_blocks, lo, hi, n_all):
    """Whether a row needing ``n_blocks`` belongs to the launch for (lo, hi]; the first bucket
    also takes rows with no valid slot. Static True for a single launch over all ``n_all`` blocks."""
    if lo == 0:
        return True if hi == n_all else n_blocks <= hi
    return (n_blocks > lo) & (n_blocks <= hi)


def row_group_geometry(hg: int, rows_per_block: int) -> tuple[int, int]:
    """(tile rows, head tiles per group) for ``hg`` heads per kv group and R = ``rows_per_block``.
    R = 1: the tile holds one query row's heads (``head_block``). R > 1 (small hg): it holds R
    consecutive query rows' hg heads, R * hg = 64, tile row h = (row h // hg, head h % hg): the
    rows attend the union of their keys (one gather and, in the backward, one dKV atomic per key
    of the group instead of one per row), each row masked to its own keys by member bits."""
    if rows_per_block == 1:
        h_blk = head_block(hg)
        assert hg % h_blk == 0 and h_blk >= 16
        return h_blk, hg // h_blk
    assert hg * rows_per_block == 64, (hg, rows_per_block)
    return 64, 1


def _tile_row(s, h, h0, R: int, hg: int):
    """(query row, head) that tile row h of block s holds (``row_group_geometry``): (s, h0 + h) for
    R = 1, else (s * R + h // hg, h0 + h % hg), a row that may lie past the sequence."""
    if R == 1:
        return s, h0 + h
    return s * R + h // hg, h0 + h % hg


def _row_group_access(R: int, hg: int):
    """(load_rows, load_lse, attends) for the tile layout of ``row_group_geometry``:
    load_rows(X, b, s, h0, h, d, S) reads X[b, row, head, d] for tile row h of block s (rows past
    the sequence read zero), load_lse(Lse, b, s, h0, h, S) reads Lse[b, row, head] (rows past the
    sequence read the last row's: their slots are all masked, P = 0); attends(valid, h, j) says
    whether tile row h attends slot j (R = 1: valid[j] bool; R > 1: bit h // hg of valid[j])."""
    if R == 1:
        return (lambda X, b, s, h0, h, d, S: X[b, s, h0 + h, d],
                lambda Lse, b, s, h0, h, S: Lse[b, s, h0 + h],
                lambda valid, h, j: valid[j])

    def load_rows(X, b, s, h0, h, d, S):
        row, head = _tile_row(s, h, h0, R, hg)
        return T.if_then_else(row < S, X[b, T.min(row, S - 1), head, d], T.cast(0, X.dtype))

    def load_lse(Lse, b, s, h0, h, S):
        row, head = _tile_row(s, h, h0, R, hg)
        return Lse[b, T.min(row, S - 1), head]

    return load_rows, load_lse, (lambda valid, h, j: ((valid[j] >> (h // hg)) & 1) == 1)


def members_dtype(R: int):
    """dtype of the Members tensor: uint8 member bits for row groups (R <= 8), else int32 (R = 1:
    not read; the caller passes the indices)."""
    return T.int32 if R == 1 else T.uint8


def gather_row(idx, n_rows, select):
    """Row of the sentinel-extended kv that a slot reads. The host already rewrote invalid slots
    to the sentinel (row ``n_rows``); with ``select`` the kernel also maps any index outside
    [0, n_rows) to the sentinel itself, so it stays in bounds even without the host rewrite.
    Without it (``safe=False``, or the forward's ``select_in_kernel=False``) the index is used as is."""
    if not select:
        return idx
    return T.if_then_else(valid_slot(idx, n_rows), idx, n_rows)


def _exp_base(m):
    """The running max m [fp32] as the exponents' base: m, or 0 while m is -inf (every slot so far
    masked), so that exp2(s * c - base * c) and the rescale exp2((m_old - base) * c) are 0, not
    NaN, for such a row. The running max starts at -inf: a finite start (-2^30 until session 22)
    underflowed every p of a row whose scores all lay 2048 or more below it (out 0 and an empty
    row's lse, silently: exp51)."""
    return T.if_then_else(m == -T.infinity(T.float32), T.float32(0), m)


@T.macro
def _finish_rows(acc_o, row_sum, m, inv, scale2, h_blk, width):
    """Forward epilogue on a tile (safe mode): acc_o [h_blk, width] *= 1 / row_sum (``inv`` [h_blk]
    holds the reciprocals: one division per row, not one per entry) and row_sum becomes the
    natural lse; empty rows (row_sum == 0) get out 0 and lse EMPTY_ROW_LSE. The test is ``!= 0``:
    a NaN row sum (NaN or inf among the row's inputs) fails ``> 0``, which made such rows empty
    rows, zeros the guard cannot see; with ``!= 0`` they stay NaN."""
    for h in T.Parallel(h_blk):
        inv[h] = T.if_then_else(row_sum[h] != 0, 1.0 / row_sum[h], 0)
    for h, d in T.Parallel(h_blk, width):
        acc_o[h, d] = T.if_then_else(row_sum[h] != 0, acc_o[h, d] * inv[h], 0)
    for h in T.Parallel(h_blk):
        row_sum[h] = T.if_then_else(row_sum[h] != 0, (T.log2(row_sum[h]) + m[h] * scale2) * LN2, EMPTY_ROW_LSE)


@T.macro
def _store_rows(Out, acc_o, b, s, h0, col0, seq_len, R, hg, h_blk, width):
    """Out[b, row, head, col0:col0 + width] = acc_o for the tile's rows (R > 1: rows past seq_len skipped)."""
    if R == 1:
        for h, d in T.Parallel(h_blk, width):
            Out[b, s, h0 + h, col0 + d] = acc_o[h, d]
    else:
        # (_tile_row called, not bound: a binding in a macro becomes a TIR let, a new cache key)
        for h, d in T.Parallel(h_blk, width):
            if _tile_row(s, h, h0, R, hg)[0] < seq_len:
                Out[(b, *_tile_row(s, h, h0, R, hg), col0 + d)] = acc_o[h, d]


@T.macro
def _store_lse(Lse, lse, b, s, h0, seq_len, R, hg, h_blk):
    if R == 1:
        for h in T.Parallel(h_blk):
            Lse[b, s, h0 + h] = lse[h]
    else:
        for h in T.Parallel(h_blk):  # (_tile_row called, not bound, as in _store_rows)
            if _tile_row(s, h, h0, R, hg)[0] < seq_len:
                Lse[(b, *_tile_row(s, h, h0, R, hg))] = lse[h]


@T.macro
def _flag_nonfinite(Flags, acc, h_blk, width):
    """Flags[0] = 1 when the fragment acc [h_blk, width] holds a NaN or +-inf (each thread tests its
    own entries: no cross-thread step, so no barrier among warp-specialised warpgroups). The
    guard's nonfinite check for what the kernel is about to store, in place of a pass over the
    stored tensor; a value finite in fp32 that rounds to inf in bf16 (within 0.2% of bf16's
    largest) is not flagged. Used by the backward for dq (exp41: +0.3% of the kernel, where the
    scan it replaces costs about 70 us at W2 H64); the same test in the warp-specialised
    forward's epilogue cost that kernel 10-12% (exp42, and exp38's other form), so the guard
    scans out and lse itself."""
    for h, d in T.Parallel(h_blk, width):
        if T.isnan(acc[h, d]) | T.isinf(acc[h, d]):
            Flags[0] = 1


DELTA_COLS = 64  # the backward sums Delta this many columns at a time


@T.macro
def _row_delta(w, od, od_sum, delta, seq_len, load_rows, h_blk, d_v, do_from_shared=False, unrolled=False):
    """Backward prologue: w.delta_s[h] = rowsum(O * dO) over the tile's rows, DELTA_COLS columns
    at a time (od [h_blk, DELTA_COLS]: a small fragment beside the dQ accumulator).
    ``do_from_shared``: dO from the tile already in w.do_s (the caller synchronised after
    loading it) instead of global memory; ``unrolled``: the column steps unrolled, so every
    step's O load can be in flight at once (the warp-specialised backward, exp47: -2.6% of the
    W2 H64 kernel with one-row tiles, +1.8% at H8 with row groups of 8, where it stays serial)."""
    T.clear(delta)
    for c in (T.unroll(d_v // DELTA_COLS) if unrolled else T.serial(d_v // DELTA_COLS)):
        for h, d in T.Parallel(h_blk, DELTA_COLS):
            od[h, d] = (T.cast(load_rows(w.O, w.b, w.s, w.h0, h, c * DELTA_COLS + d, seq_len), T.float32)
                        * (T.cast(w.do_s[h, c * DELTA_COLS + d], T.float32) if do_from_shared
                           else T.cast(load_rows(w.dO, w.b, w.s, w.h0, h, c * DELTA_COLS + d, seq_len), T.float32)))
        T.reduce_sum(od, od_sum, dim=1)
        for h in T.Parallel(h_blk):
            delta[h] = delta[h] + od_sum[h]
    # staged through shared memory: the block loop reads it in the gemm's own layout
    for h in T.Parallel(h_blk):
        w.delta_s[h] = delta[h]


def vector_rows(rows: int, width: int, threads: int, vec: int = 8) -> int:
    """The leading rows of a [rows, width] tile that a ``T.Parallel`` copy by ``threads`` threads
    moves in whole ``vec``-element vectors (their element count a multiple of threads * vec).
    TileLang 0.1.15 vectorises a copy whose elements do not divide evenly among the threads
    only 2 or 1 elements wide: 64 x 512 by 384 threads became 43 predicated 4-byte loads per
    thread (exp47: loading the dO tile's rows in whole vectors first, all but 4, took 4.0% off
    the W2 H64 backward kernel)."""
    step = threads * vec // math.gcd(threads * vec, width)
    return rows - rows % step


@T.macro
def _load_tile(dst, src, b, s, h0, seq_len, load_rows, rows, split, width, src_col0):
    """dst[h, d] = src row h, column src_col0 + d ([rows, width]) as two copies: rows [0, split)
    (whole vectors per thread, see ``vector_rows``) and [split, rows)."""
    for h, d in T.Parallel(split, width):
        dst[h, d] = load_rows(src, b, s, h0, h, src_col0 + d, seq_len)
    if split < rows:
        for h, d in T.Parallel(rows - split, width):
            dst[split + h, d] = load_rows(src, b, s, h0, split + h, src_col0 + d, seq_len)


@T.macro
def _load_q_do(Q, dO, q_s, qt_s, do_s, b, s, h0, seq_len, load_rows, h_blk, d_v, d_tail):
    """Backward prologue: the tile's Q (split at d_v into q_s / qt_s) and dO rows into shared memory."""
    for h, d in T.Parallel(h_blk, d_v):
        q_s[h, d] = load_rows(Q, b, s, h0, h, d, seq_len)
        do_s[h, d] = load_rows(dO, b, s, h0, h, d, seq_len)
    for h, d in T.Parallel(h_blk, d_tail):
        qt_s[h, d] = load_rows(Q, b, s, h0, h, d_v + d, seq_len)


@T.macro
def _block_ds_dq(w, kv_s, kt_s, scale, scale2, seq_len, load_lse, h_blk, block):
    """One backward block after its scores (w.acc_p = masked Q K^T, [h_blk, block] fp32):
    P = exp(scores - lse) -> w.p_s, dS = P * (dO V^T - Delta) * scale -> w.dp_s (bf16, shared),
    dQ += dS K into w.acc_dq / w.acc_dqt."""
    for h, j in T.Parallel(h_blk, block):
        w.acc_p[h, j] = T.exp2(w.acc_p[h, j] * scale2 - load_lse(w.Lse, w.b, w.s, w.h0, h, seq_len) * LOG2E)
    T.copy(w.acc_p, w.p_s)
    T.gemm(w.do_s, kv_s, w.acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
    for h, j in T.Parallel(h_blk, block):
        w.acc_dp[h, j] = w.acc_p[h, j] * (w.acc_dp[h, j] - w.delta_s[h]) * scale
    T.copy(w.acc_dp, w.dp_s)
    T.gemm(w.dp_s, kv_s, w.acc_dq, policy=T.GemmWarpPolicy.FullCol)
    T.gemm(w.dp_s, kt_s, w.acc_dqt, policy=T.GemmWarpPolicy.FullCol)

@built_once
def sparse_mla_fwd_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, safe=True, block_i=BLOCK_TOPK,
                          num_stages=2, threads=256, target="cuda", select_in_kernel=True, blocks=None,
                          rows_per_block=1):
    """Q [B,T,H,Dqk] bf16, KV [B,T_kv+1,G,Dqk] bf16 (last row zero; T_kv rows when not safe),
    Indices [B,T,G,topk] i32 (host-rewritten to [0, T_kv], T_kv = padding; -1 padding when not safe) -> Out [B,T,H,d_v] bf16, Lse [B,T,H] f32 (natural log).
    Extent [B,T,G] i32: 1 + position of the row's last valid slot (0: none; see ``slot_blocks``).
    ``select_in_kernel=False`` gathers the host-rewritten indices directly (no per-element select;
    in bounds only because ``prepare_indices`` ran).
    ``blocks=(lo, hi)``: this launch handles only the rows needing more than ``lo`` and at most
    ``hi`` slot blocks, and runs ``hi`` of them (a static, pipelined loop): the host launches one
    kernel per bucket so pure-padding tails are skipped (default: one launch, every block).
    ``rows_per_block`` R > 1 (see ``row_group_geometry``): Indices/Extent are a row group's key
    list [B, ceil(T/R), G, R*topk] and its length, plus Members [B, ceil(T/R), G, R*topk] u8
    (bit r: row r of the group attends that entry); the loop runs the group's blocks only."""
    R = rows_per_block
    assert topk % block_i == 0 and heads % kv_group == 0
    hg = heads // kv_group
    h_blk, rep = row_group_geometry(hg, R)
    D, DT, BI = d_v, d_tail, block_i
    K = topk * R  # slots (R > 1: entries) per list
    lo, NI = blocks or (0, K // block_i)
    assert 0 <= lo < NI <= K // block_i and (R == 1 or blocks is None)
    scale2 = float(sm_scale) * LOG2E
    dtype, acc = T.bfloat16, T.float32
    B, S, SKV1 = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("kv_rows")
    NG = S if R == 1 else T.dynamic("row_groups")
    n_kv = SKV1 - 1 if safe else SKV1  # real kv rows
    select = safe and select_in_kernel
    assert R == 1 or safe
    load_rows, _, attends = _row_group_access(R, hg)

    @T.prim_func
    def fwd(
        Q: T.Tensor([B, S, heads, D + DT], dtype),
        KV: T.Tensor([B, SKV1, kv_group, D + DT], dtype),
        Indices: T.Tensor([B, NG, kv_group, K], T.int32),
        Extent: T.Tensor([B, NG, kv_group], T.int32),
        Members: T.Tensor([B, NG, kv_group, K], members_dtype(R)),
        Out: T.Tensor([B, S, heads, D], dtype),
        Lse: T.Tensor([B, S, heads], acc),
    ):
        with T.Kernel(NG * rep, B, kv_group, threads=threads) as (bx, b, g):
            q_s = T.alloc_shared([h_blk, D], dtype)
            qt_s = T.alloc_shared([h_blk, DT], dtype)
            kv_s = T.alloc_shared([BI, D], dtype)
            kt_s = T.alloc_shared([BI, DT], dtype)
            p_s = T.alloc_shared([h_blk, BI], dtype)
            valid = T.alloc_fragment([BI], "bool" if R == 1 else T.int32)  # R > 1: member bits
            acc_o = T.alloc_fragment([h_blk, D], acc)
            acc_s = T.alloc_fragment([h_blk, BI], acc)
            row_sum = T.alloc_fragment([h_blk], acc)
            blk_sum = T.alloc_fragment([h_blk], acc)
            alpha = T.alloc_fragment([h_blk], acc)
            m = T.alloc_fragment([h_blk], acc)
            m_prev = T.alloc_fragment([h_blk], acc)

            # R > 1: the row group, last first (causal unions grow with the row: the largest
            # groups start first instead of trailing the launch)
            s = bx // rep if R == 1 else NG - 1 - bx
            if in_bucket(slot_blocks(Extent[b, s, g], BI), lo, NI, K // BI):
                T.fill(acc_o, 0)
                T.fill(row_sum, 0)
                T.fill(m, -T.infinity(acc))
                h0 = g * hg + (bx % rep) * h_blk
                for h, d in T.Parallel(h_blk, D):
                    q_s[h, d] = load_rows(Q, b, s, h0, h, d, S)
                for h, d in T.Parallel(h_blk, DT):
                    qt_s[h, d] = load_rows(Q, b, s, h0, h, D + d, S)

                for i in (T.Pipelined(NI, num_stages=num_stages) if R == 1
                          else T.serial(T.min(slot_blocks(Extent[b, s, g], BI), NI))):
                    for j in T.Parallel(BI):
                        valid[j] = (valid_slot(Indices[b, s, g, i * BI + j], n_kv) if R == 1
                                    else T.cast(Members[b, s, g, i * BI + j], T.int32))
                    for j, d in T.Parallel(BI, D):
                        kv_s[j, d] = KV[b, gather_row(Indices[b, s, g, i * BI + j], n_kv, select), g, d]
                    for j, d in T.Parallel(BI, DT):
                        kt_s[j, d] = KV[b, gather_row(Indices[b, s, g, i * BI + j], n_kv, select), g, D + d]

                    for h, j in T.Parallel(h_blk, BI):
                        acc_s[h, j] = T.if_then_else(attends(valid, h, j), 0, -T.infinity(acc))
                    T.gemm(q_s, kv_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    T.gemm(qt_s, kt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    T.copy(m, m_prev)
                    T.reduce_max(acc_s, m, dim=1, clear=False)
                    for h in T.Parallel(h_blk):
                        m[h] = T.max(m[h], m_prev[h])
                        alpha[h] = T.exp2((m_prev[h] - _exp_base(m[h])) * scale2)
                    for h, j in T.Parallel(h_blk, BI):
                        acc_s[h, j] = T.exp2(acc_s[h, j] * scale2 - _exp_base(m[h]) * scale2)
                    T.reduce_sum(acc_s, blk_sum, dim=1)
                    for h in T.Parallel(h_blk):
                        row_sum[h] = row_sum[h] * alpha[h] + blk_sum[h]
                    for h, d in T.Parallel(h_blk, D):
                        acc_o[h, d] = acc_o[h, d] * alpha[h]
                    if h_blk < 64:
                        # TileLang 0.1.15 places reduce_sum's cross-warp workspace at p_s's address for
                        # 16- and 32-row head tiles (mma path; the 64-row wgmma tile keeps them apart)
                        # and emits no barrier between the reduction's last workspace read and this
                        # write, so a fast warp can overwrite partial row sums a slow warp is still
                        # reading. Seen in the generated CUDA; matches the wrong rows 8..15 of 16-row
                        # tiles and the intermittent 32-row failures at topk 192.
                        T.sync_threads()
                    T.copy(acc_s, p_s)
                    T.gemm(p_s, kv_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

                # the epilogue of _finish_rows / _store_rows / _store_lse, kept inline here: through the
                # macros TileLang 0.1.15 assigns this kernel's reduction workspaces to other shared
                # memory slots (seen in the generated CUDA), a layout never run on the GPU
                if safe:
                    # empty rows (row_sum == 0): out 0, lse EMPTY_ROW_LSE; a NaN row sum stays NaN
                    # (``!= 0``, as in _finish_rows)
                    # one reciprocal per row (alpha is dead after the loop), as in _finish_rows
                    # (exp47: -1.5% of the 16-row one-row forward at W1 / W2)
                    for h in T.Parallel(h_blk):
                        alpha[h] = T.if_then_else(row_sum[h] != 0, 1.0 / row_sum[h], 0)
                    for h, d in T.Parallel(h_blk, D):
                        acc_o[h, d] = T.if_then_else(row_sum[h] != 0, acc_o[h, d] * alpha[h], 0)
                    for h in T.Parallel(h_blk):
                        row_sum[h] = T.if_then_else(
                            row_sum[h] != 0, (T.log2(row_sum[h]) + m[h] * scale2) * LN2, EMPTY_ROW_LSE
                        )
                else:
                    # (the same reciprocal, so both modes stay bitwise equal on fully valid rows)
                    for h in T.Parallel(h_blk):
                        alpha[h] = 1.0 / row_sum[h]
                    for h, d in T.Parallel(h_blk, D):
                        acc_o[h, d] = acc_o[h, d] * alpha[h]
                    for h in T.Parallel(h_blk):
                        row_sum[h] = (T.log2(row_sum[h]) + m[h] * scale2) * LN2
                if R == 1:
                    for h, d in T.Parallel(h_blk, D):
                        Out[b, s, h0 + h, d] = acc_o[h, d]
                    for h in T.Parallel(h_blk):
                        Lse[b, s, h0 + h] = row_sum[h]
                else:
                    for h, d in T.Parallel(h_blk, D):
                        if _tile_row(s, h, h0, R, hg)[0] < S:
                            Out[(b, *_tile_row(s, h, h0, R, hg), d)] = acc_o[h, d]
                    for h in T.Parallel(h_blk):
                        if _tile_row(s, h, h0, R, hg)[0] < S:
                            Lse[(b, *_tile_row(s, h, h0, R, hg))] = row_sum[h]


    return tilelang.compile(fwd, pass_configs=PASS_CONFIGS, target=target)


@built_once
def sparse_mla_fwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda"):
    """Warp-specialised forward for 64-row tiles (hg a multiple of 64, or row groups with
    R * hg = 64); the same tensors and results as ``sparse_mla_fwd_kernel`` in safe mode. With
    one row per block it takes any indices (every slot outside [0, T_kv) gathers the zero
    sentinel row T_kv and is masked; exp42: as fast as gathering rewritten indices); row groups
    read their key lists, which hold only [0, T_kv].

    384 threads in three warpgroups. Warpgroup 2 copies the Q tile (cp.async, its own mbarrier),
    then gathers blocks 2i and 2i + 1 of each pair into kv buffers 0 and 1, each buffer in two
    column parts, left [0, d_v / 2) and right [d_v / 2, d_v + d_tail), with a "full" and a "free"
    mbarrier per part. MMA warpgroup c scores block 2i + c (its buffer's parts in the order they
    are freed) and accumulates out[:, c*d_v/2:(c+1)*d_v/2] from both blocks. The running max is
    handed one way per pair: warpgroup 0 folds its block's max into the running max, publishes it
    and starts P0 V0 at once; warpgroup 1 folds its block's max into that (the pair's final max),
    publishes P1 (p_s) and runs P1 V1; warpgroup 0, while its P0 V0 runs, rescales P0 to the
    final max and publishes it in buffer 0's rope-tail columns (dead once its scores are done: a
    second P buffer without shared memory), then rescales its out and runs P1 V1, which is still
    running under the first half of its next score GEMM; warpgroup 1 runs P0 V0. A part is freed
    when its last reader is done: buffer 0's left part after warpgroup 0's P0 V0, so the next
    gather starts mid-pair. Row sums stay per warpgroup and are added at the end. Rows run last
    first (R = 1; row groups did already): under a causal mask the last rows hold the longest key
    lists. R = 1 stores out through the dead Q tile, coalesced. The loop runs the row's (group's)
    own blocks, a dynamic count, in pairs; the second block of an odd last pair gathers the block
    min(nb, NI - 1) again (in bounds) and is fully masked. (Session 15, exp28 / exp29: 10-16%
    faster than the exchanged max with one P buffer and whole-buffer barriers; exp31: publishing
    P0 during P0 V0, 5% at H16 R4, within noise elsewhere; session 16, exp32: the staged store,
    4% at W1.)"""
    R = rows_per_block
    assert heads % kv_group == 0 and topk % BLOCK_TOPK == 0 and d_tail == 64 and d_v % 128 == 0
    hg = heads // kv_group
    h_blk, rep = row_group_geometry(hg, R)
    assert h_blk == 64, "the warp-specialised forward runs 64-row tiles"
    D, DT, BI = d_v, d_tail, BLOCK_TOPK
    DH = D // 2
    UL, UA = DH // 64, (D + DT) // 64  # 64-column units: the left part, all
    K = topk * R  # slots (R > 1: entries) per list
    NI = K // BI
    scale2 = float(sm_scale) * LOG2E
    dtype, acc = T.bfloat16, T.float32
    B, S, SKV1 = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("kv_rows")
    NG = S if R == 1 else T.dynamic("row_groups")
    n_kv = SKV1 - 1
    _, _, attends = _row_group_access(R, hg)

    @T.macro
    def gather(w, blk, kv, u0, u1, full):
        # explicit cp.async of 64-column units [u0, u1) of block blk's rows, 8 threads per kv row
        # (16 bytes each), 16 rows per pass; the mbarrier arrival fires when this thread's copies
        # land. (A T.Parallel copy would make TileLang 0.1.15 insert partial barriers that reuse an
        # MMA warpgroup's barrier id.) An odd last block (blk == nb) re-reads block
        # min(blk, NI - 1), which is in bounds; the scores mask it.
        tp = w.tx - 256
        blk_c = T.min(blk, NI - 1)
        for rr in T.serial(BI // 16):
            e = rr * 16 + tp // 8
            key = gather_row(w.Indices[w.b, w.s, w.g, blk_c * BI + e], n_kv, R == 1)
            c = tp % 8 * 8
            for u in T.unroll(u0, u1):
                T.ptx_cp_async(T.access_ptr(kv[e, u * 64 + c], "w", 8),
                               T.access_ptr(w.KV[w.b, key, w.g, u * 64 + c], "r", 8), 8)
        T.cp_async_barrier_noinc(full)

    def q_row(w, h):
        # query row and head of tile row h; R > 1: rows past the sequence read the last row (their
        # slots are all masked and their outputs never stored)
        row, head = _tile_row(w.s, h, w.h0, R, hg)
        return (row, head) if R == 1 else (T.min(row, w.S - 1), head)

    @T.macro
    def load_q(w):
        # the Q tile by cp.async, laid out like a kv block
        tp = w.tx - 256
        for rr in T.serial(h_blk // 16):
            h = rr * 16 + tp // 8
            c = tp % 8 * 8
            for u in T.unroll(UA):
                T.ptx_cp_async(T.access_ptr(w.q_s[h, u * 64 + c], "w", 8),
                               T.access_ptr(w.Q[(w.b, *q_row(w, h), u * 64 + c)], "r", 8), 8)
        T.cp_async_barrier_noinc(w.q_full)

    @T.macro
    def mask_block(w, blk):
        # acc_s := 0 for the slots of block blk this tile attends, -inf for the others
        for j in T.Parallel(BI):
            if R == 1:
                w.valid[j] = (blk < w.nb) & valid_slot(w.Indices[w.b, w.s, w.g, T.min(blk, NI - 1) * BI + j], n_kv)
            else:
                w.valid[j] = T.if_then_else(
                    blk < w.nb, T.cast(w.Members[w.b, w.s, w.g, T.min(blk, NI - 1) * BI + j], T.int32), 0)
        for h, j in T.Parallel(h_blk, BI):
            w.acc_s[h, j] = T.if_then_else(attends(w.valid, h, j), 0, -T.infinity(acc))

    @T.macro
    def score_part(w, c, part, i):
        # acc_s += Q K^T over column part `part` (0: [0, d_v / 2), 1: the rest) of buffer c, once
        # it has landed; not waited for
        lo, hi = (0, DH) if part == 0 else (DH, D + DT)
        kv = w.kv[c]
        T.barrier_wait(w.full[c][part], i & 1)
        T.gemm(w.q_s[0:h_blk, lo:hi], kv[0:BI, lo:hi], w.acc_s, transpose_B=True,
               policy=T.GemmWarpPolicy.FullRow, annotations={"wg_wait": -1})

    @T.macro
    def scores(w, c, i):
        # warpgroup c: acc_s (masked by mask_block at the end of the previous pair) += Q K^T of
        # block 2i + c, its buffer's parts in the order they are freed (warpgroup 0: left first;
        # warpgroup 1: right first). Warpgroup 0's P1 V1 of the previous pair is still running
        # under the first half: buffer 1's left part is free once both are done. (Waiting for
        # that PV alone, wait_wgmma(1), makes ptxas serialise every wgmma of the kernel: C7514.)
        first, second = (0, 1) if c == 0 else (1, 0)
        score_part(w, c, first, i)
        if c == 0:
            T.wait_wgmma(0)
            if i > 0:
                T.barrier_arrive(w.free[1][0])
        score_part(w, c, second, i)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(w.acc_s, num_regs=h_blk * BI // 128)

    @T.macro
    def softmax(w):
        # acc_s -> P under the running max w.m (already folded with this block's max); row sums
        # and out rescaled by alpha (the previous max over the new one)
        for h, j in T.Parallel(h_blk, BI):
            w.acc_s[h, j] = T.exp2(w.acc_s[h, j] * scale2 - _exp_base(w.m[h]) * scale2)
        T.reduce_sum(w.acc_s, w.blk_sum, dim=1)
        for h in T.Parallel(h_blk):
            w.row_sum[h] = w.row_sum[h] * w.alpha[h] + w.blk_sum[h]
        for h, d in T.Parallel(h_blk, DH):
            w.acc_o[h, d] = w.acc_o[h, d] * w.alpha[h]

    @T.macro
    def fold_max(w, c):
        # the running max := max(the max so far, this block's max in m_blk), published in
        # max_s[c]: warpgroup 0 folds into its own running max (the previous pair's final max),
        # warpgroup 1 into warpgroup 0's just published one, which makes its result the pair's
        for h in T.Parallel(h_blk):
            w.m_blk[h] = T.max(w.m[h] if c == 0 else w.max_s[0, h], w.m_blk[h])
            w.alpha[h] = T.exp2((w.m[h] - _exp_base(w.m_blk[h])) * scale2)
            w.m[h] = w.m_blk[h]
            w.max_s[c, h] = w.m_blk[h]
        T.barrier_arrive(w.max_ready[c])

    @T.macro
    def pair0(w, i):
        scores(w, 0, i)
        T.reduce_max(w.acc_s, w.m_blk, dim=1, clear=True)
        fold_max(w, 0)
        softmax(w)
        T.copy(w.acc_s, w.p)
        T.gemm(w.p, w.kv[0][0:BI, 0:DH], w.acc_o, policy=T.GemmWarpPolicy.FullRow,
               annotations={"wg_wait": -1})
        # while P0 V0 runs: the pair's final max (warpgroup 1's), P0 rescaled to it and published
        # in buffer 0's rope-tail columns (acc_s, not the GEMM's operand p)
        T.barrier_wait(w.max_ready[1], i & 1)
        for h in T.Parallel(h_blk):
            w.alpha[h] = T.exp2((w.m[h] - _exp_base(w.max_s[1, h])) * scale2)
            w.m[h] = w.max_s[1, h]
            w.row_sum[h] = w.row_sum[h] * w.alpha[h]
        for h, j in T.Parallel(h_blk, BI):
            w.acc_s[h, j] = w.acc_s[h, j] * w.alpha[h]
        T.copy(w.acc_s, w.kv[0][0:BI, D:D + DT])
        T.fence_proxy_async()  # generic-proxy stores -> warpgroup 1's wgmma reads
        T.barrier_arrive(w.p_ready[0])
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(w.acc_o, num_regs=h_blk * DH // 128)
        T.barrier_arrive(w.free[0][0])
        for h, d in T.Parallel(h_blk, DH):
            w.acc_o[h, d] = w.acc_o[h, d] * w.alpha[h]
        mask_block(w, i * 2 + 2)
        T.barrier_wait(w.p_ready[1], i & 1)
        T.gemm(w.p_s, w.kv[1][0:BI, 0:DH], w.acc_o, policy=T.GemmWarpPolicy.FullRow,
               annotations={"wg_wait": -1})

    @T.macro
    def pair1(w, i):
        scores(w, 1, i)
        T.reduce_max(w.acc_s, w.m_blk, dim=1, clear=True)
        T.barrier_wait(w.max_ready[0], i & 1)
        fold_max(w, 1)
        softmax(w)
        T.copy(w.acc_s, w.p)
        T.copy(w.p, w.p_s)
        T.fence_proxy_async()
        T.barrier_arrive(w.p_ready[1])
        # both PV GEMMs in flight back to back; the next block's mask while they run
        T.gemm(w.p, w.kv[1][0:BI, DH:D], w.acc_o, policy=T.GemmWarpPolicy.FullRow,
               annotations={"wg_wait": -1})
        T.barrier_wait(w.p_ready[0], i & 1)
        T.gemm(w.kv[0][0:BI, D:D + DT], w.kv[0][0:BI, DH:D], w.acc_o, policy=T.GemmWarpPolicy.FullRow,
               annotations={"wg_wait": -1})
        T.wait_wgmma(1)
        T.barrier_arrive(w.free[1][1])
        mask_block(w, i * 2 + 3)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(w.acc_o, num_regs=h_blk * DH // 128)
        T.barrier_arrive(w.free[0][1])

    @T.macro
    def consume(w, c):
        T.set_max_nreg(232, 1)
        T.fill(w.acc_o, 0)
        T.fill(w.row_sum, 0)
        T.fill(w.m, -T.infinity(acc))
        mask_block(w, c)
        T.barrier_wait(w.q_full, 0)
        for i in T.serial((w.nb + 1) // 2):
            if c == 0:
                pair0(w, i)
            else:
                pair1(w, i)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(w.acc_o, num_regs=h_blk * DH // 128)
        for h in T.Parallel(h_blk):
            w.sum_s[c, h] = w.row_sum[h]
        T.barrier_arrive(w.sum_full)
        T.barrier_wait(w.sum_full, 0)
        for h in T.Parallel(h_blk):
            w.row_sum[h] = w.sum_s[0, h] + w.sum_s[1, h]
        _finish_rows(w.acc_o, w.row_sum, w.m, w.alpha, scale2, h_blk, DH)  # (alpha is dead: the reciprocals)
        if R == 1:
            # the Q tile is dead (both warpgroups' scores are done: sum_full): this warpgroup's
            # columns of out go through it as bf16, then out in 16-byte coalesced stores (a warp
            # writes 512 contiguous bytes) instead of 4-byte stores from the fragment, each warp
            # instruction touching 8 rows (exp32: 4% faster at W1, bitwise the same out)
            lo, hi = c * DH, (c + 1) * DH
            T.copy(w.acc_o, w.q_s[0:h_blk, lo:hi])
            T.copy(w.q_s[0:h_blk, lo:hi], w.Out[w.b, w.s, w.h0:w.h0 + h_blk, lo:hi])
        else:
            _store_rows(w.Out, w.acc_o, w.b, w.s, w.h0, c * DH, w.S, R, hg, h_blk, DH)
        if c == 0:
            _store_lse(w.Lse, w.row_sum, w.b, w.s, w.h0, w.S, R, hg, h_blk)

    @T.prim_func
    def fwd(
        Q: T.Tensor([B, S, heads, D + DT], dtype),
        KV: T.Tensor([B, SKV1, kv_group, D + DT], dtype),
        Indices: T.Tensor([B, NG, kv_group, K], T.int32),
        Extent: T.Tensor([B, NG, kv_group], T.int32),
        Members: T.Tensor([B, NG, kv_group, K], members_dtype(R)),
        Out: T.Tensor([B, S, heads, D], dtype),
        Lse: T.Tensor([B, S, heads], acc),
    ):
        with T.Kernel(NG * rep, B, kv_group, threads=384) as (bx, b, g):
            q_s = T.alloc_shared([h_blk, D + DT], dtype)
            kv0 = T.alloc_shared([BI, D + DT], dtype)
            kv1 = T.alloc_shared([BI, D + DT], dtype)
            p_s = T.alloc_shared([h_blk, BI], dtype)  # P1; P0 goes to kv0's rope-tail columns
            max_s = T.alloc_shared([2, h_blk], acc)
            sum_s = T.alloc_shared([2, h_blk], acc)
            # per MMA warpgroup (0 / 1): registers of its own
            valid0 = T.alloc_fragment([BI], "bool" if R == 1 else T.int32)  # R > 1: member bits
            valid1 = T.alloc_fragment([BI], "bool" if R == 1 else T.int32)
            acc_s0 = T.alloc_fragment([h_blk, BI], acc)
            acc_s1 = T.alloc_fragment([h_blk, BI], acc)
            p0 = T.alloc_fragment([h_blk, BI], dtype)
            p1 = T.alloc_fragment([h_blk, BI], dtype)
            acc_o0 = T.alloc_fragment([h_blk, DH], acc)
            acc_o1 = T.alloc_fragment([h_blk, DH], acc)
            row_sum0 = T.alloc_fragment([h_blk], acc)
            row_sum1 = T.alloc_fragment([h_blk], acc)
            blk_sum0 = T.alloc_fragment([h_blk], acc)
            blk_sum1 = T.alloc_fragment([h_blk], acc)
            alpha0 = T.alloc_fragment([h_blk], acc)
            alpha1 = T.alloc_fragment([h_blk], acc)
            m0 = T.alloc_fragment([h_blk], acc)
            m1 = T.alloc_fragment([h_blk], acc)
            m_blk0 = T.alloc_fragment([h_blk], acc)
            m_blk1 = T.alloc_fragment([h_blk], acc)
            full0l = T.alloc_barrier(arrive_count=128)  # the gatherers' cp.async of a part landed
            full0r = T.alloc_barrier(arrive_count=128)
            full1l = T.alloc_barrier(arrive_count=128)
            full1r = T.alloc_barrier(arrive_count=128)
            free0l = T.alloc_barrier(arrive_count=128)  # a part's last reader is done with it
            free0r = T.alloc_barrier(arrive_count=128)
            free1l = T.alloc_barrier(arrive_count=128)
            free1r = T.alloc_barrier(arrive_count=128)
            max_ready0 = T.alloc_barrier(arrive_count=128)  # max_s[0]: running max with block 2i's
            max_ready1 = T.alloc_barrier(arrive_count=128)  # max_s[1]: the pair's final max
            p_ready0 = T.alloc_barrier(arrive_count=128)  # kv0's rope-tail columns hold P0
            p_ready1 = T.alloc_barrier(arrive_count=128)  # p_s holds P1
            sum_full = T.alloc_barrier(arrive_count=256)  # sum_s holds both row sums
            q_full = T.alloc_barrier(arrive_count=128)  # the Q tile landed

            s = NG - 1 - bx // rep  # last rows (groups) first: under a causal mask the longest lists
            h0 = g * hg + (bx % rep) * h_blk
            nb = T.min(slot_blocks(Extent[b, s, g], BI), NI)
            pairs = (nb + 1) // 2
            tx = T.get_thread_binding()
            kv = (kv0, kv1)
            full = ((full0l, full0r), (full1l, full1r))
            free = ((free0l, free0r), (free1l, free1r))
            shared = dict(tx=tx, nb=nb, Indices=Indices, Members=Members, KV=KV, b=b, s=s, g=g, q_s=q_s,
                          kv=kv, p_s=p_s, max_s=max_s, full=full, free=free, max_ready=(max_ready0, max_ready1),
                          p_ready=(p_ready0, p_ready1), sum_s=sum_s, sum_full=sum_full,
                          Out=Out, Lse=Lse, h0=h0, S=S, Q=Q, q_full=q_full)
            if tx < 128:
                consume(SimpleNamespace(valid=valid0, acc_s=acc_s0, p=p0, acc_o=acc_o0, row_sum=row_sum0,
                                        blk_sum=blk_sum0, alpha=alpha0, m=m0, m_blk=m_blk0, **shared), 0)
            elif tx < 256:
                consume(SimpleNamespace(valid=valid1, acc_s=acc_s1, p=p1, acc_o=acc_o1, row_sum=row_sum1,
                                        blk_sum=blk_sum1, alpha=alpha1, m=m1, m_blk=m_blk1, **shared), 1)
            else:
                T.set_max_nreg(40, 0)
                w = SimpleNamespace(**shared)
                load_q(w)
                for i in T.serial(pairs):
                    # parts in the order their last readers free them
                    T.barrier_wait(free0l, (i & 1) ^ 1)
                    gather(w, i * 2, kv0, 0, UL, full0l)
                    T.barrier_wait(free1r, (i & 1) ^ 1)
                    gather(w, i * 2 + 1, kv1, UL, UA, full1r)
                    T.barrier_wait(free0r, (i & 1) ^ 1)
                    gather(w, i * 2, kv0, UL, UA, full0r)
                    T.barrier_wait(free1l, (i & 1) ^ 1)
                    gather(w, i * 2 + 1, kv1, 0, UL, full1l)

    return tilelang.compile(fwd, pass_configs=PASS_CONFIGS, target=target)


@built_once
def sparse_mla_bwd_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, safe=True, block_s=None, threads=256,
                          target="cuda", dkv_per_slot=False, rows_per_block=1):
    """Q [B,T,H,Dqk], KV [B,T_kv+1,G,Dqk] (as forward), dO [B,T,H,d_v] bf16, Indices [B,T,G,topk],
    Lse [B,T,H] f32 (natural), O [B,T,H,d_v] bf16 (the forward's out: each block computes its rows'
    Delta = rowsum(O*dO) itself, no preprocessing pass), Extent [B,T,G] i32 (as forward:
    1 + position of the last valid slot; the BS-slot blocks after it are skipped)
    -> dQ [B,T,H,Dqk] bf16 (written), dKV [B,T_kv+1,G,Dqk] f32 (accumulated atomically; caller zeroes).
    ``dkv_per_slot`` (deterministic mode): no atomics; instead dKV [B,T,G*nh,topk,Dqk] f32 receives each
    slot's contribution from each head block (nh = head blocks per group), written for the processed
    blocks only; the host reduces it per kv row in a fixed order.
    ``rows_per_block`` R > 1: as the forward (Indices/Extent/Members per row group; one dKV atomic
    per key of the group); not with ``dkv_per_slot``."""
    R = rows_per_block
    assert heads % kv_group == 0 and (R == 1 or (safe and not dkv_per_slot))
    hg = heads // kv_group
    h_blk, nh = row_group_geometry(hg, R)
    BS = block_s or bwd_block_slots(h_blk)
    K = topk * R
    assert K % BS == 0
    D, DT, NS = d_v, d_tail, K // BS
    split = BS // 16  # dKV staged 16 slot rows at a time
    SR = BS // split
    scale, scale2 = float(sm_scale), float(sm_scale) * LOG2E
    dtype, acc = T.bfloat16, T.float32
    B, S, SKV1 = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("kv_rows")
    NG = S if R == 1 else T.dynamic("row_groups")
    n_kv = SKV1 - 1 if safe else SKV1
    dkv_shape = [B, S, kv_group * nh, topk, D + DT] if dkv_per_slot else [B, SKV1, kv_group, D + DT]
    load_rows, load_lse, attends = _row_group_access(R, hg)

    @T.prim_func
    def bwd(
        Q: T.Tensor([B, S, heads, D + DT], dtype),
        KV: T.Tensor([B, SKV1, kv_group, D + DT], dtype),
        dO: T.Tensor([B, S, heads, D], dtype),
        Indices: T.Tensor([B, NG, kv_group, K], T.int32),
        Lse: T.Tensor([B, S, heads], acc),
        O: T.Tensor([B, S, heads, D], dtype),
        Extent: T.Tensor([B, NG, kv_group], T.int32),
        Members: T.Tensor([B, NG, kv_group, K], members_dtype(R)),
        dQ: T.Tensor([B, S, heads, D + DT], dtype),
        dKV: T.Tensor(dkv_shape, acc),
    ):
        with T.Kernel(NG, B, kv_group * nh, threads=threads) as (bx, b, bz):
            s = bx if R == 1 else NG - 1 - bx  # R > 1: last group first (as the forward)
            g = bz // nh
            h0 = g * hg + (bz % nh) * h_blk
            q_s = T.alloc_shared([h_blk, D], dtype)
            qt_s = T.alloc_shared([h_blk, DT], dtype)
            do_s = T.alloc_shared([h_blk, D], dtype)
            kv_s = T.alloc_shared([BS, D], dtype)
            kt_s = T.alloc_shared([BS, DT], dtype)
            p_s = T.alloc_shared([h_blk, BS], dtype)
            dp_s = T.alloc_shared([h_blk, BS], dtype)
            valid = T.alloc_fragment([BS], "bool" if R == 1 else T.int32)  # R > 1: member bits
            acc_p = T.alloc_fragment([h_blk, BS], acc)
            acc_dp = T.alloc_fragment([h_blk, BS], acc)
            acc_dq = T.alloc_fragment([h_blk, D], acc)
            acc_dqt = T.alloc_fragment([h_blk, DT], acc)
            acc_dkv = T.alloc_fragment([BS, D], acc)
            acc_dkvt = T.alloc_fragment([BS, DT], acc)
            dkv_s = T.alloc_shared([SR, D], acc)
            dkvt_s = T.alloc_shared([SR, DT], acc)
            delta_s = T.alloc_shared([h_blk], acc)

            _load_q_do(Q, dO, q_s, qt_s, do_s, b, s, h0, S, load_rows, h_blk, D, DT)
            T.clear(acc_dq)
            T.clear(acc_dqt)
            od = T.alloc_fragment([h_blk, DELTA_COLS], acc)
            od_sum = T.alloc_fragment([h_blk], acc)
            delta = T.alloc_fragment([h_blk], acc)
            w = SimpleNamespace(O=O, dO=dO, Lse=Lse, b=b, s=s, h0=h0, delta_s=delta_s, acc_p=acc_p, acc_dp=acc_dp,
                                acc_dq=acc_dq, acc_dqt=acc_dqt, do_s=do_s, p_s=p_s, dp_s=dp_s)
            _row_delta(w, od, od_sum, delta, S, load_rows, h_blk, D)
            # a reduction's shared workspace may alias buffers written next (see the forward)
            T.sync_threads()

            # blocks of pure padding after the row's last valid slot are skipped, not computed as zeros
            for i in T.serial(T.min(slot_blocks(Extent[b, s, g], BS), NS)):
                for j in T.Parallel(BS):
                    valid[j] = (valid_slot(Indices[b, s, g, i * BS + j], n_kv) if R == 1
                                else T.cast(Members[b, s, g, i * BS + j], T.int32))
                for j, d in T.Parallel(BS, D):
                    kv_s[j, d] = KV[b, gather_row(Indices[b, s, g, i * BS + j], n_kv, safe), g, d]
                for h, j in T.Parallel(h_blk, BS):
                    acc_p[h, j] = T.if_then_else(attends(valid, h, j), 0, -T.infinity(acc))
                T.gemm(q_s, kv_s, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for j, d in T.Parallel(BS, DT):
                    kt_s[j, d] = KV[b, gather_row(Indices[b, s, g, i * BS + j], n_kv, safe), g, D + d]
                T.gemm(qt_s, kt_s, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)

                _block_ds_dq(w, kv_s, kt_s, scale, scale2, S, load_lse, h_blk, BS)
                T.gemm(dp_s, q_s, acc_dkv, transpose_A=True, policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                T.gemm(p_s, do_s, acc_dkv, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(dp_s, qt_s, acc_dkvt, transpose_A=True, policy=T.GemmWarpPolicy.FullCol, clear_accum=True)

                if dkv_per_slot:
                    for j, d in T.Parallel(BS, D):
                        dKV[b, s, bz, i * BS + j, d] = acc_dkv[j, d]
                    for j, d in T.Parallel(BS, DT):
                        dKV[b, s, bz, i * BS + j, D + d] = acc_dkvt[j, d]
                else:
                    for part in range(split):
                        for j, d in T.Parallel(BS, D):
                            if j < SR:
                                dkv_s[j, d] = acc_dkv[j + part * SR, d]
                        for j, d in T.Parallel(BS, DT):
                            if j < SR:
                                dkvt_s[j, d] = acc_dkvt[j + part * SR, d]
                        # padding slots hold exact-zero dKV rows and issue no atomic: otherwise every one
                        # of them would serialise on the same (sentinel) address
                        for j, d in T.Parallel(SR, D // 4):
                            if valid_slot(Indices[b, s, g, i * BS + j + part * SR], n_kv):
                                T.atomic_addx4(
                                    dKV[b, gather_row(Indices[b, s, g, i * BS + j + part * SR], n_kv, safe), g, d * 4],
                                    dkv_s[j, d * 4],
                                )
                        for j, d in T.Parallel(SR, DT // 4):
                            if valid_slot(Indices[b, s, g, i * BS + j + part * SR], n_kv):
                                T.atomic_addx4(
                                    dKV[b, gather_row(Indices[b, s, g, i * BS + j + part * SR], n_kv, safe), g, D + d * 4],
                                    dkvt_s[j, d * 4],
                                )

            _store_rows(dQ, acc_dq, b, s, h0, 0, S, R, hg, h_blk, D)
            _store_rows(dQ, acc_dqt, b, s, h0, D, S, R, hg, h_blk, DT)

    return tilelang.compile(bwd, pass_configs=PASS_CONFIGS, target=target)


@built_once
def sparse_mla_bwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda",
                             mma_regs=224, producer_regs=56, dkv_per_slot=False):
    """Warp-specialised backward for 64-row tiles; the same tensors and results as
    ``sparse_mla_bwd_kernel`` (safe mode, atomic dKV), plus ``Flags`` (set when dq holds NaN /
    inf). 384 threads in three warpgroups. ``dkv_per_slot`` (deterministic mode): no atomics; dKV
    is [B, T, G * nh, topk, Dqk] fp32 (R = 1, as ``sparse_mla_bwd_kernel(dkv_per_slot=True)`` lays
    it out) or [B, NG, G, KS, Dqk] (row groups, nh = 1: one entry per key of the group's list, the sum
    over its member rows; KS, at least the longest list's extent, is the caller's) and receives
    each valid slot's contribution (the drain stores the staged chunk rows; slots past a row's
    (group's) last valid one, and padding slots, are not written).

    Per 32-slot block, the two MMA warpgroups split the score side: warpgroup 0 computes
    S = Q K^T and P, warpgroup 1 dP = dO V^T and then dS from P (handed over in fp32 through
    shared memory), so each reads Q or dO once per step (session 14, exp23: 8.7-10.3% faster than
    both computing both for half the slots). Both then add dS K to their half of dQ's columns and
    compute dKV^T for the block 64 features at a time on wgmma (A = Q^T / dO^T read from shared
    memory, B = dS / P): warpgroup 0 the first half of the d_v features, warpgroup 1 the rest and
    the rope tail. Warpgroup 1 computes block i's rope-tail chunk (Q_tail^T dS) during block
    i + 1, after its dP GEMM, where it would otherwise wait for P (exp25: 4% faster; dp_s keeps
    block i's dS until warpgroup 1 itself rewrites it; the last block's tail runs after the
    loop). Each chunk's [32 slots, 64] fp32 rows go to one of the warpgroup's two chunk buffers,
    in the same order either way; warpgroup 2 drains them with vector fp32 atomics as they come
    (each chunk's values into registers, its buffer freed, then the atomics: session 29, exp94, 2%
    faster at 64 heads than atomics straight from the buffer), and gathers the next block's kv rows
    with cp.async as soon as the dQ MMAs are done with the buffer. The chunks are
    software-pipelined: each MMA warpgroup has two chunk accumulators, issues its first chunk right
    behind its dQ GEMMs and every next chunk before it stages the previous one, so the staging
    stores run under GEMMs; and the warpgroups do not meet at the end of a step: warpgroup 0 runs
    its next score GEMM and exp2 first and only then waits for both to be done with the block's P /
    dS, which it is about to overwrite (session 28: the staging stores and the atomics each cost
    about 1.2 ms of W2 H64's 7.2, exp83; with both changes the backward takes 0.97x the time at W2 /
    W1 H64, 0.95x at H16, 0.93x at H8, exp84-exp86). Shared memory:
    Q and dO (139 KB) + kv (37 KB) + chunk buffers (35 KB) + P (bf16 and fp32), dS. Registers
    per thread: 224 / 224 / 56 (the second accumulators: at 216 ptxas serialises the wgmma, at 232 /
    40 the drain starves, 1.5% slower; exp24: the drain's atomics and the gathers want more than
    40). Prologue (nothing overlaps it: one CTA per SM): block 0's gather is issued first, the Q /
    dO tiles load in 16-byte vectors (``vector_rows``), and Delta reads dO from its shared tile
    (exp47: together 6.4% off the W2 H64 kernel, 4.9% at W1). R = 1 stores dq through the dead Q
    tile in 16-byte stores (exp49).
    Rows (groups) run last first, as in the forward: under a causal mask the longest lists start
    first instead of trailing the launch (exp54: W2 H64 0.992x, W1 0.995x; an L2 prefetch of the
    next wave's Q / dO / O tiles on top of it was 1% slower). Warpgroup 0 keeps its rows' lse in
    registers, read once (exp69: read from global memory after every score GEMM it cost W2 H64
    2.2-2.8%, W1 1.4-1.9%), and GEMM pairs that need nothing from each other (a chunk's two, dQ's
    two, dP and the deferred tail chunk) share one wgmma wait (alone: within noise)."""
    R = rows_per_block
    assert heads % kv_group == 0 and d_tail == 64 and d_v % 128 == 0
    hg = heads // kv_group
    h_blk, nh = row_group_geometry(hg, R)
    assert h_blk == 64, "the warp-specialised backward runs 64-row tiles"
    BS = 32  # slots per step
    K = topk * R
    assert K % BS == 0
    D, DT, NS = d_v, d_tail, K // BS
    # one tile: Q and each kv block as [rows, D + DT] shared tiles, one score GEMM (R = 1: 6%
    # faster, session 11). Row groups keep Q / kv split at D: one-tiled they spill 170-190 bytes
    # (vs 50) and ran 8% slower.
    one_tile = R == 1
    QW = D + DT if one_tile else D
    NCV = D // 64  # 64-feature chunks of d_v; warpgroup 0 runs HALF of them, warpgroup 1
    HALF = NCV // 2  # the other NCV - HALF and the rope tail (chunk index NCV)
    N_OWN = (HALF, NCV - HALF + 1)
    CP = 64 + 4  # chunk buffer row stride (floats): the fragment stores of 8 rows x 4 slot pairs hit 32 banks
    THREADS = 384  # two MMA warpgroups and the gather / drain warpgroup
    scale, scale2 = float(sm_scale), float(sm_scale) * LOG2E
    dtype, acc = T.bfloat16, T.float32
    B, S, SKV1 = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("kv_rows")
    NG = S if R == 1 else T.dynamic("row_groups")
    n_kv = SKV1 - 1
    load_rows, load_lse, attends = _row_group_access(R, hg)
    # row groups' per-entry dKV: slot_stride (>= the longest list) entries per group, not R * topk
    KS = T.dynamic("slot_stride") if R > 1 else K
    dkv_shape = [B, NG, kv_group * nh, KS, D + DT] if dkv_per_slot else [B, SKV1, kv_group, D + DT]

    @T.macro
    def gather(w, blk):
        # 8 threads per kv row, 16 bytes per copy, 16 rows per pass
        tp = w.tx - 256
        c = tp % 8 * 8
        for rr in T.unroll(BS // 16):
            e = rr * 16 + tp // 8
            key = gather_row(w.Indices[w.b, w.s, w.g, blk * BS + e], n_kv, True)
            for u in T.unroll(QW // 64):
                T.ptx_cp_async(T.access_ptr(w.kv_s[e, u * 64 + c], "w", 8),
                               T.access_ptr(w.KV[w.b, key, w.g, u * 64 + c], "r", 8), 8)
            if not one_tile:
                T.ptx_cp_async(T.access_ptr(w.kt_s[e, c], "w", 8), T.access_ptr(w.KV[w.b, key, w.g, D + c], "r", 8), 8)
        T.cp_async_barrier_noinc(w.full)

    @T.macro
    def wait_chunk_buffer(bars, n, flip):
        # buffer n % 2 of a warpgroup's two, phase (n // 2) & 1 (flip: the "free" side's first use passes)
        if n % 2 == 0:
            T.barrier_wait(bars[0], ((n // 2) & 1) ^ flip)
        else:
            T.barrier_wait(bars[1], ((n // 2) & 1) ^ flip)

    @T.macro
    def arrive_chunk_buffer(bars, n):
        if n % 2 == 0:
            T.barrier_arrive(bars[0])
        else:
            T.barrier_arrive(bars[1])

    @T.macro
    def stage_chunk(w, c, acc_c, n):
        # [64 features, BS slots] fp32 fragment acc_c -> chunk buffer n % 2 of warpgroup c as [slots, features]
        wait_chunk_buffer(w.ch_free[c], n, 1)
        for i, j in T.Parallel(64, BS):
            w.ch_s[c][n % 2, j, i] = acc_c[i, j]
        arrive_chunk_buffer(w.ch_full[c], n)

    @T.macro
    def issue_chunk(w, f, acc_c):
        # dKV^T[f * 64:(f + 1) * 64] = Q^T dS + dO^T P over this block's slots into acc_c: two wgmma
        # groups, no wait
        T.gemm(w.q_s[0:h_blk, f * 64:(f + 1) * 64], w.dp_s, acc_c, transpose_A=True,
               policy=T.GemmWarpPolicy.FullRow, clear_accum=True, annotations={"wg_wait": -1})
        T.gemm(w.do_s[0:h_blk, f * 64:(f + 1) * 64], w.p_s, acc_c, transpose_A=True,
               policy=T.GemmWarpPolicy.FullRow, annotations={"wg_wait": -1})

    @T.macro
    def chunks_from(w, c, f0, n0, k, count, a, b):
        # chunk k of count is in flight in accumulator a: issue chunk k + 1 (if any) into b, wait for
        # chunk k alone (k + 1's two groups run on) and stage it under k + 1's GEMMs (static recursion)
        more = k + 1 < count
        if more:
            issue_chunk(w, f0 + k + 1, b)
        T.wait_wgmma(2 if more else 0)
        T.warpgroup_fence_operand(a, num_regs=64 * BS // 128)
        stage_chunk(w, c, a, n0 + k)
        if more:
            chunks_from(w, c, f0, n0, k + 1, count, b, a)

    @T.macro
    def dkv_by_chunks(w, c, f0, count, n0):
        # warpgroup c's chunks f0 .. f0 + count - 1 of this block (numbers n0 ..), issued right behind
        # the dQ GEMMs, which are waited for here (the first chunk's two groups run on)
        issue_chunk(w, f0, w.acc_t[c])
        T.wait_wgmma(2)
        T.warpgroup_fence_operand(w.acc_dq, num_regs=h_blk * D // 256)
        T.barrier_arrive(w.kv_free)  # warpgroup 2 may gather the next block now
        chunks_from(w, c, f0, n0, 0, count, w.acc_t[c], w.acc_t2[c])

    @T.macro
    def tail_chunk(w, blk):
        # warpgroup 1: block blk's rope-tail chunk, Q_tail^T dS (dp_s still holds blk's dS)
        T.gemm(w.q_parts[1], w.dp_s, w.acc_t[1], transpose_A=True, policy=T.GemmWarpPolicy.FullRow,
               clear_accum=True)
        stage_chunk(w, 1, w.acc_t[1], blk * N_OWN[1] + N_OWN[1] - 1)

    def drain_slot(r, tp):
        # drain thread tp's r-th 16-byte piece of a chunk: its slot (row of the chunk buffer) ...
        return (r * 128 + tp) // 16

    def drain_col(r, tp):
        # ... and its first feature column within the chunk
        return (r * 128 + tp) % 16 * 4

    @T.macro
    def drain_chunk(w, blk, c, k):
        # warpgroup c's chunk k of this block: columns (c * HALF + k) * 64 + [0, 64), 16 bytes per
        # atomic. The thread's slot keys are read before the wait and its values into registers after
        # it; the buffer is freed before this chunk's atomics, so the free (a release) follows only
        # the previous chunk's (exp94: 2% faster than after its own; exp96: a relaxed free that
        # follows none was 3-5% slower)
        tp = w.tx - 256
        n = blk * N_OWN[c] + k
        for r in T.unroll(BS * 16 // 128):
            w.drain_keys[r] = w.Indices[w.b, w.s, w.g, blk * BS + drain_slot(r, tp)]
        wait_chunk_buffer(w.ch_full[c], n, 0)
        for r in T.unroll(BS * 16 // 128):
            for v in T.vectorized(4):
                w.drain_vals[r * 4 + v] = w.ch_s[c][n % 2, drain_slot(r, tp), drain_col(r, tp) + v]
        arrive_chunk_buffer(w.ch_free[c], n)
        for r in T.unroll(BS * 16 // 128):
            j, d = drain_slot(r, tp), drain_col(r, tp)
            if valid_slot(w.drain_keys[r], n_kv):
                if dkv_per_slot:
                    for v in T.vectorized(4):
                        w.dKV[w.b, w.s, w.bz, blk * BS + j, (c * HALF + k) * 64 + d + v] = w.drain_vals[r * 4 + v]
                else:
                    T.atomic_addx4(w.dKV[w.b, w.drain_keys[r], w.g, (c * HALF + k) * 64 + d], w.drain_vals[r * 4])

    @T.macro
    def step(w, blk):
        T.barrier_wait(w.full, blk & 1)
        if w.tx < 128:
            # warpgroup 0: masked scores, P = exp(S - lse); P to p32_s (fp32, for dS) and p_s (bf16)
            for j in T.Parallel(BS):
                if R == 1:
                    w.valid[j] = valid_slot(w.Indices[w.b, w.s, w.g, blk * BS + j], n_kv)
                else:
                    w.valid[j] = T.cast(w.Members[w.b, w.s, w.g, blk * BS + j], T.int32)
            for h, j in T.Parallel(h_blk, BS):
                w.acc_sp[h, j] = T.if_then_else(attends(w.valid, h, j), 0, -T.infinity(acc))
            T.gemm(w.q_s, w.kv_s, w.acc_sp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            if not one_tile:
                T.gemm(w.qt_s, w.kt_s, w.acc_sp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            for h, j in T.Parallel(h_blk, BS):
                w.acc_sp[h, j] = T.exp2(w.acc_sp[h, j] * scale2 - w.lse_log2[h])
            if blk > 0:
                T.barrier_wait(w.step_done, (blk - 1) & 1)  # both warpgroups are done with block blk - 1's P / dS
            T.copy(w.acc_sp, w.p32_s[0:h_blk, 0:BS])
            T.copy(w.acc_sp, w.p_s)
            T.fence_proxy_async()
            T.barrier_arrive(w.p_ready)
        else:
            # warpgroup 1: dP = dO V^T, the previous block's tail chunk, then dS = P (dP - Delta) * scale
            T.gemm(w.do_s, w.kv_parts[0], w.acc_ds, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                   clear_accum=True, annotations={"wg_wait": -1})
            if blk > 0:
                tail_chunk(w, blk - 1)  # its GEMM's wait covers dP's batch too
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(w.acc_ds, num_regs=h_blk * BS // 128)
            T.barrier_wait(w.p_ready, blk & 1)
            for h, j in T.Parallel(h_blk, BS):
                w.acc_ds[h, j] = w.p32_s[h, j] * (w.acc_ds[h, j] - w.delta_s[h]) * scale
            T.copy(w.acc_ds, w.dp_s)
            T.fence_proxy_async()
            T.barrier_arrive(w.ds_ready)
        T.barrier_wait(w.ds_ready, blk & 1)
        T.gemm(w.dp_s, w.kv_parts[0], w.acc_dq, policy=T.GemmWarpPolicy.FullCol, annotations={"wg_wait": -1})
        T.gemm(w.dp_s, w.kv_parts[1], w.acc_dqt, policy=T.GemmWarpPolicy.FullCol, annotations={"wg_wait": -1})
        if w.tx < 128:
            dkv_by_chunks(w, 0, 0, N_OWN[0], blk * N_OWN[0])
        else:
            dkv_by_chunks(w, 1, HALF, N_OWN[1] - 1, blk * N_OWN[1])
        # P and dS are rewritten by the next block: warpgroup 0 waits for both warpgroups' arrival
        # before it writes the next P (after its next score GEMM)
        T.barrier_arrive(w.step_done)

    @T.prim_func
    def bwd(
        Q: T.Tensor([B, S, heads, D + DT], dtype),
        KV: T.Tensor([B, SKV1, kv_group, D + DT], dtype),
        dO: T.Tensor([B, S, heads, D], dtype),
        Indices: T.Tensor([B, NG, kv_group, K], T.int32),
        Lse: T.Tensor([B, S, heads], acc),
        O: T.Tensor([B, S, heads, D], dtype),
        Extent: T.Tensor([B, NG, kv_group], T.int32),
        Members: T.Tensor([B, NG, kv_group, K], members_dtype(R)),
        dQ: T.Tensor([B, S, heads, D + DT], dtype),
        dKV: T.Tensor(dkv_shape, acc),
        Flags: T.Tensor([1], T.int32),
    ):
        with T.Kernel(NG, B, kv_group * nh, threads=THREADS) as (bx, b, bz):
            q_s = T.alloc_shared([h_blk, QW], dtype)
            qt_s = T.alloc_shared([h_blk, DT], dtype) if not one_tile else None
            do_s = T.alloc_shared([h_blk, D], dtype)
            kv_s = T.alloc_shared([BS, QW], dtype)
            kt_s = T.alloc_shared([BS, DT], dtype) if not one_tile else None
            p_s = T.alloc_shared([h_blk, BS], dtype)
            dp_s = T.alloc_shared([h_blk, BS], dtype)
            # rows padded by 8 floats: the MMA warps' fragment stores of 8 rows then fall in distinct banks
            p32_s = T.alloc_shared([h_blk, BS + 8], acc)
            ch_s0 = T.alloc_shared([2, BS, CP], acc)  # warpgroup 0's two chunk buffers
            ch_s1 = T.alloc_shared([2, BS, CP], acc)
            delta_s = T.alloc_shared([h_blk], acc)
            valid = T.alloc_fragment([BS], "bool" if R == 1 else T.int32)  # R > 1: member bits
            acc_sp = T.alloc_fragment([h_blk, BS], acc)  # warpgroup 0's scores, then P
            acc_ds = T.alloc_fragment([h_blk, BS], acc)  # warpgroup 1's dP, then dS
            acc_dq = T.alloc_fragment([h_blk, D], acc)
            acc_dqt = T.alloc_fragment([h_blk, DT], acc)
            lse_log2 = T.alloc_fragment([h_blk], acc)  # warpgroup 0: its rows' lse * log2(e)
            acc_t0 = T.alloc_fragment([64, BS], acc)  # dKV^T chunks: two accumulators per warpgroup
            acc_t1 = T.alloc_fragment([64, BS], acc)
            acc_t0b = T.alloc_fragment([64, BS], acc)
            acc_t1b = T.alloc_fragment([64, BS], acc)
            od = T.alloc_fragment([h_blk, DELTA_COLS], acc)
            od_sum = T.alloc_fragment([h_blk], acc)
            delta = T.alloc_fragment([h_blk], acc)
            full = T.alloc_barrier(arrive_count=128)  # the gatherers' cp.async landed
            kv_free = T.alloc_barrier(arrive_count=256)  # the MMA warpgroups are done with kv_s / kt_s
            p_ready = T.alloc_barrier(arrive_count=128)  # warpgroup 0 wrote P
            ds_ready = T.alloc_barrier(arrive_count=128)  # warpgroup 1 wrote dS
            # per MMA warpgroup and chunk buffer, staged / drained; both warpgroups done with P, dS
            ch_full00 = T.alloc_barrier(arrive_count=128)
            ch_full01 = T.alloc_barrier(arrive_count=128)
            ch_full10 = T.alloc_barrier(arrive_count=128)
            ch_full11 = T.alloc_barrier(arrive_count=128)
            ch_free00 = T.alloc_barrier(arrive_count=128)
            ch_free01 = T.alloc_barrier(arrive_count=128)
            ch_free10 = T.alloc_barrier(arrive_count=128)
            ch_free11 = T.alloc_barrier(arrive_count=128)
            step_done = T.alloc_barrier(arrive_count=256)
            drain_keys = T.alloc_local([BS * 16 // 128], T.int32)  # a drain thread's slot keys of a chunk
            drain_vals = T.alloc_local([BS * 16 // 32], acc)  # and its values of the chunk (4 x 16 bytes)

            s = NG - 1 - bx  # last rows (groups) first
            g = bz // nh
            h0 = g * hg + (bz % nh) * h_blk
            nb = T.min(slot_blocks(Extent[b, s, g], BS), NS)
            tx = T.get_thread_binding()
            # Q and the kv block as (first d_v columns, rope tail) GEMM operands
            q_parts = (q_s[0:h_blk, 0:D], q_s[0:h_blk, D:D + DT]) if one_tile else (q_s, qt_s)
            kv_parts = (kv_s[0:BS, 0:D], kv_s[0:BS, D:D + DT]) if one_tile else (kv_s, kt_s)
            w = SimpleNamespace(tx=tx, Indices=Indices, Members=Members, KV=KV, O=O, dO=dO, dKV=dKV, b=b, s=s, g=g,
                                bz=bz, h0=h0, valid=valid, lse_log2=lse_log2, acc_sp=acc_sp, acc_ds=acc_ds,
                                acc_dq=acc_dq, acc_dqt=acc_dqt,
                                q_s=q_s, qt_s=qt_s, q_parts=q_parts, do_s=do_s, kv_s=kv_s, kt_s=kt_s,
                                kv_parts=kv_parts, p_s=p_s, dp_s=dp_s, p32_s=p32_s, delta_s=delta_s,
                                full=full, kv_free=kv_free, p_ready=p_ready, ds_ready=ds_ready,
                                ch_s=(ch_s0, ch_s1), acc_t=(acc_t0, acc_t1), acc_t2=(acc_t0b, acc_t1b),
                                ch_full=((ch_full00, ch_full01), (ch_full10, ch_full11)),
                                ch_free=((ch_free00, ch_free01), (ch_free10, ch_free11)),
                                step_done=step_done, drain_keys=drain_keys, drain_vals=drain_vals)
            # the gather warpgroup starts block 0's kv rows before the prologue loads (exp47: -1.4%
            # of the W2 H64 kernel, -1.9% at H8)
            if tx >= 256:
                if nb > 0:
                    gather(w, 0)
            # Q and dO tiles by all threads, in whole 16-byte vectors where the split allows
            _load_tile(q_s, Q, b, s, h0, S, load_rows, h_blk, vector_rows(h_blk, QW, THREADS), QW, 0)
            if not one_tile:
                _load_tile(qt_s, Q, b, s, h0, S, load_rows, h_blk, vector_rows(h_blk, DT, THREADS), DT, D)
            _load_tile(do_s, dO, b, s, h0, S, load_rows, h_blk, vector_rows(h_blk, D, THREADS), D, 0)
            T.fence_proxy_async()  # the tiles' generic stores -> the MMA warpgroups' wgmma reads
            T.sync_threads()
            if tx < 256:
                T.set_max_nreg(mma_regs, 1)
                T.clear(acc_dq)
                T.clear(acc_dqt)
                _row_delta(w, od, od_sum, delta, S, load_rows, h_blk, D, do_from_shared=True, unrolled=one_tile)
                if tx < 128:
                    # read once: loaded after each step's score GEMM, it cost W2 H64 2-3%, W1 1-2% (exp69)
                    for h in T.Parallel(h_blk):
                        lse_log2[h] = load_lse(Lse, b, s, h0, h, S) * LOG2E
                for i in T.serial(nb):
                    step(w, i)
                if nb > 0:  # both warpgroups done with the last block (the epilogue rewrites the Q tile)
                    T.barrier_wait(step_done, (nb - 1) & 1)
                if tx >= 128:
                    if nb > 0:
                        tail_chunk(w, nb - 1)
                _flag_nonfinite(Flags, acc_dq, h_blk, D)
                _flag_nonfinite(Flags, acc_dqt, h_blk, DT)
                if one_tile:
                    # dq through the Q tile's first d_v columns, then 16-byte coalesced stores, as the
                    # forward stores out (exp49: 1.2-1.3% off the kernel at W1 / W2 H64, dq bitwise
                    # the same). Each warpgroup writes its own columns; TileLang's 256-thread barriers
                    # fall between the last GEMM that reads the tile and these stores, and before the
                    # read-back (tests/test_tilelang_compile.py checks both).
                    T.copy(acc_dq, q_s[0:h_blk, 0:D])
                    T.copy(q_s[0:h_blk, 0:D], dQ[b, s, h0:h0 + h_blk, 0:D])
                else:
                    _store_rows(dQ, acc_dq, b, s, h0, 0, S, R, hg, h_blk, D)
                _store_rows(dQ, acc_dqt, b, s, h0, D, S, R, hg, h_blk, DT)
            else:
                # 3 x 168 registers per thread at launch: the three warpgroups' counts must sum to at
                # most 504, or setmaxnreg.inc waits forever
                T.set_max_nreg(producer_regs, 0)
                for i in T.serial(nb):
                    if i + 1 < nb:
                        T.barrier_wait(kv_free, i & 1)
                        gather(w, i + 1)
                    for k in T.unroll(N_OWN[1]):
                        if k < N_OWN[0]:
                            drain_chunk(w, i, 0, k)
                        drain_chunk(w, i, 1, k)

    # every fence its wgmma reads need is explicit: after the P and dS stores, and after the
    # prologue's tile stores; the chunk stores for the drain need none
    return tilelang.compile(bwd.with_attr(EXPLICIT_FENCES_ATTR, True), pass_configs=PASS_CONFIGS, target=target)
