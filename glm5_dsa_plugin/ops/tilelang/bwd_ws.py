"""The warp-specialised sparse-MLA backward kernel (64-row tiles)."""

import math
from types import SimpleNamespace

import tilelang
from tilelang import language as T

from ..contract import LOG2E
from .compile import EXPLICIT_FENCES_ATTR, PASS_CONFIGS, built_once
from .shapes import row_group_geometry
from .tiles import (DELTA_COLS, gather_row, members_dtype, row_delta, row_group_access, slot_blocks, store_rows,
                    valid_slot)

__all__ = ["vector_rows", "sparse_mla_bwd_ws_kernel"]


@T.macro
def _flag_nonfinite(Flags, acc, h_blk, width):
    """Flags[0] = 1 when the fragment acc [h_blk, width] holds a NaN or +-inf (each thread tests its
    own entries: no cross-thread step, so no barrier among warp-specialised warpgroups). The
    guard's nonfinite check for what the kernel is about to store, in place of a pass over the
    stored tensor; a value finite in fp32 that rounds to inf in bf16 (within 0.2% of bf16's
    largest) is not flagged. Used by the backward for dq, where it costs far less than the scan
    it replaces; in the warp-specialised forward's epilogue the same test costs more than the
    guard's own scan of out and lse, so the forward has none."""
    for h, d in T.Parallel(h_blk, width):
        if T.isnan(acc[h, d]) | T.isinf(acc[h, d]):
            Flags[0] = 1


def vector_rows(rows: int, width: int, threads: int, vec: int = 8) -> int:
    """The leading rows of a [rows, width] tile that a ``T.Parallel`` copy by ``threads`` threads
    moves in whole ``vec``-element vectors (their element count a multiple of threads * vec).
    TileLang 0.1.15 vectorises a copy whose elements do not divide evenly among the threads
    only 2 or 1 elements wide: 64 x 512 by 384 threads became 43 predicated 4-byte loads per
    thread; the rows this leaves are loaded in whole vectors first."""
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


@built_once
def sparse_mla_bwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda",
                             mma_regs=224, producer_regs=56, dkv_per_slot=False, head_probs=False):
    """Warp-specialised backward for 64-row tiles; the same tensors and results as
    ``sparse_mla_bwd_kernel`` (safe mode, atomic dKV), plus ``Flags`` (set when dq holds NaN /
    inf). 384 threads in three warpgroups. ``dkv_per_slot`` (deterministic mode): no atomics; dKV
    is [B, T, G * nh, topk, Dqk] fp32 (R = 1, as ``sparse_mla_bwd_kernel(dkv_per_slot=True)`` lays
    it out) or [B, NG, G, KS, Dqk] (row groups, nh = 1: one entry per key of the group's list, the sum
    over its member rows; KS, at least the longest list's extent, is the caller's) and receives
    each valid slot's contribution (the drain stores the staged chunk rows; slots past a row's
    (group's) last valid one, and padding slots, are not written).

    ``head_probs`` (R = 1): one more output, ``HeadProbs`` [B, T, G, topk] fp32, zero-filled by the
    caller: HeadProbs[b, t, g, j] = sum over the group's heads of P = exp(scale * q . kv[idx_j] - lse)
    at every slot of the row's slot blocks (0 at padding), the indexer loss's target. The gather
    warpgroup sums the columns of the fp32 P that warpgroup 0 stages for dS (right after it issues
    the next block's gather), so the target needs no S recomputation and no kv gathers of its own;
    warpgroup 0 rewrites P only after it, too, arrived at the step's barrier.

    Per 32-slot block, the two MMA warpgroups split the score side: warpgroup 0 computes
    S = Q K^T and P, warpgroup 1 dP = dO V^T and then dS from P (handed over in fp32 through
    shared memory), so each reads Q or dO once per step. Both then add dS K to their half of dQ's
    columns and compute dKV^T for the block 64 features at a time on wgmma (A = Q^T / dO^T read
    from shared memory, B = dS / P): warpgroup 0 the first half of the d_v features, warpgroup 1
    the rest and the rope tail. Warpgroup 1 computes block i's rope-tail chunk (Q_tail^T dS)
    during block i + 1, after its dP GEMM, where it would otherwise wait for P (dp_s keeps block
    i's dS until warpgroup 1 itself rewrites it; the last block's tail runs after the loop). Each
    chunk's [32 slots, 64] fp32 rows go to one of the warpgroup's two chunk buffers, in the same
    order either way; warpgroup 2 drains them with vector fp32 atomics as they come (each chunk's
    values into registers, its buffer freed, then the atomics), and gathers the next block's kv
    rows with cp.async as soon as the dQ MMAs are done with the buffer. The chunks are
    software-pipelined: each MMA warpgroup has two chunk accumulators, issues its first chunk
    right behind its dQ GEMMs and every next chunk before it stages the previous one, so the
    staging stores run under GEMMs; and the warpgroups do not meet at the end of a step:
    warpgroup 0 runs its next score GEMM and exp2 first and only then waits for both to be done
    with the block's P / dS, which it is about to overwrite. Shared memory: Q and dO (139 KB) + kv
    (37 KB) + chunk buffers (35 KB) + P (bf16 and fp32), dS. Registers per thread: 224 / 224 / 56
    (the second accumulators need 224: at 216 ptxas serialises the wgmma; the drain's atomics and
    the gathers need more than 40). Prologue (nothing overlaps it: one CTA per SM): block 0's
    gather is issued first, the Q / dO tiles load in 16-byte vectors (``vector_rows``), and Delta
    reads dO from its shared tile. R = 1 stores dq through the dead Q tile in 16-byte stores.
    Rows (groups) run last first, as in the forward: under a causal mask the longest lists start
    first instead of trailing the launch. Warpgroup 0 keeps its rows' lse in registers, read
    once, and GEMM pairs that need nothing from each other (a chunk's two, dQ's two, dP and the
    deferred tail chunk) share one wgmma wait. docs/kernels.md gives what each of these choices
    measured against its alternative."""
    R = rows_per_block
    assert heads % kv_group == 0 and d_tail == 64 and d_v % 128 == 0
    assert not head_probs or R == 1, "head_probs: one query row per block"
    hg = heads // kv_group
    h_blk, nh = row_group_geometry(hg, R)
    assert h_blk == 64, "the warp-specialised backward runs 64-row tiles"
    BS = 32  # slots per step
    K = topk * R
    assert K % BS == 0
    D, DT, NS = d_v, d_tail, K // BS
    # one tile: Q and each kv block as [rows, D + DT] shared tiles, one score GEMM (R = 1). Row
    # groups keep Q / kv split at D: one-tiled they spill registers and run slower.
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
    load_rows, load_lse, attends = row_group_access(R, hg)
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
        # the previous chunk's (not its own, nor none: a relaxed free)
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
    def head_prob_block(w, blk):
        # warpgroup 2: column sums of block blk's fp32 P (warpgroup 0 staged it before p_ready and
        # rewrites it only after step_done, which these threads' arrivals complete). Warp k sums
        # rows [16k, 16k + 16) of every column (16 independent loads), the four partial sums
        # meet in shared memory (double-buffered by block), and the first warp adds and stores them.
        tp = w.tx - 256
        col, part = tp % BS, tp // BS
        T.barrier_wait(w.p_ready, blk & 1)
        w.col_sum[0] = 0.0
        for r in T.unroll(h_blk // 4):
            w.col_sum[0] = w.col_sum[0] + w.p32_s[part * (h_blk // 4) + r, col]
        w.part_s[blk % 2, part, col] = w.col_sum[0]
        T.barrier_arrive(w.step_done)
        T.barrier_arrive(w.parts_ready)
        if tp < BS:
            T.barrier_wait(w.parts_ready, blk & 1)
            w.HeadProbs[w.b, w.s, w.g, blk * BS + tp] = (w.part_s[blk % 2, 0, tp] + w.part_s[blk % 2, 1, tp]
                                                         + w.part_s[blk % 2, 2, tp] + w.part_s[blk % 2, 3, tp])

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
        HeadProbs: T.Tensor([B, S, kv_group, K] if head_probs else [1], acc),
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
            # (with head_probs, warpgroup 2 reads P too, and arrives)
            step_done = T.alloc_barrier(arrive_count=256 + (128 if head_probs else 0))
            col_sum = T.alloc_local([1], acc)  # head_probs: a thread's partial column sum of P
            part_s = T.alloc_shared([2, 4, BS], acc) if head_probs else None  # the partial sums by warp
            parts_ready = T.alloc_barrier(arrive_count=128) if head_probs else None
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
                                step_done=step_done, drain_keys=drain_keys, drain_vals=drain_vals,
                                HeadProbs=HeadProbs, col_sum=col_sum, part_s=part_s, parts_ready=parts_ready)
            # the gather warpgroup starts block 0's kv rows before the prologue loads
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
                row_delta(w, od, od_sum, delta, S, load_rows, h_blk, D, do_from_shared=True, unrolled=one_tile)
                if tx < 128:
                    # read once (a load after each step's score GEMM sits behind a wgmma wait)
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
                    # forward stores out (dq bitwise the same). Each warpgroup writes its own
                    # columns; TileLang's 256-thread barriers fall between the last GEMM that reads
                    # the tile and these stores, and before the read-back
                    # (tests/ops/test_tilelang_compile.py checks both).
                    T.copy(acc_dq, q_s[0:h_blk, 0:D])
                    T.copy(q_s[0:h_blk, 0:D], dQ[b, s, h0:h0 + h_blk, 0:D])
                else:
                    store_rows(dQ, acc_dq, b, s, h0, 0, S, R, hg, h_blk, D)
                store_rows(dQ, acc_dqt, b, s, h0, D, S, R, hg, h_blk, DT)
            else:
                # 3 x 168 registers per thread at launch: the three warpgroups' counts must sum to at
                # most 504, or setmaxnreg.inc waits forever
                T.set_max_nreg(producer_regs, 0)
                for i in T.serial(nb):
                    if i + 1 < nb:
                        T.barrier_wait(kv_free, i & 1)
                        gather(w, i + 1)
                    if head_probs:
                        head_prob_block(w, i)
                    for k in T.unroll(N_OWN[1]):
                        if k < N_OWN[0]:
                            drain_chunk(w, i, 0, k)
                        drain_chunk(w, i, 1, k)

    # every fence its wgmma reads need is explicit: after the P and dS stores, and after the
    # prologue's tile stores; the chunk stores for the drain need none
    return tilelang.compile(bwd.with_attr(EXPLICIT_FENCES_ATTR, True), pass_configs=PASS_CONFIGS, target=target)
