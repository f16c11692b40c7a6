"""The warp-specialised sparse-MLA forward kernel (64-row tiles)."""

from types import SimpleNamespace

import tilelang
from tilelang import language as T

from ..contract import LOG2E
from .compile import PASS_CONFIGS, built_once
from .shapes import BLOCK_TOPK, row_group_geometry
from .tiles import (exp_base, finish_rows, gather_row, members_dtype, row_group_access, slot_blocks, store_lse,
                    store_rows, tile_row, valid_slot)

__all__ = ["sparse_mla_fwd_ws_kernel"]


@built_once
def sparse_mla_fwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda"):
    """Warp-specialised forward for 64-row tiles (hg a multiple of 64, or row groups with
    R * hg = 64); the same tensors and results as ``sparse_mla_fwd_kernel`` in safe mode. With
    one row per block it takes any indices (every slot outside [0, T_kv) gathers the zero
    sentinel row T_kv and is masked, at no cost against gathering rewritten indices); row groups
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
    gather starts mid-pair. Row sums stay per warpgroup and are added at the end. Rows (and row
    groups) run last first: under a causal mask the last rows hold the longest key lists. R = 1 stores out through the dead Q tile, coalesced. The loop runs the row's (group's)
    own blocks, a dynamic count, in pairs; the second block of an odd last pair gathers the block
    min(nb, NI - 1) again (in bounds) and is fully masked. docs/kernels.md gives what each of
    these choices measured against its alternative."""
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
    _, _, attends = row_group_access(R, hg)

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
        row, head = tile_row(w.s, h, w.h0, R, hg)
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
            w.acc_s[h, j] = T.exp2(w.acc_s[h, j] * scale2 - exp_base(w.m[h]) * scale2)
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
            w.alpha[h] = T.exp2((w.m[h] - exp_base(w.m_blk[h])) * scale2)
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
            w.alpha[h] = T.exp2((w.m[h] - exp_base(w.max_s[1, h])) * scale2)
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
        finish_rows(w.acc_o, w.row_sum, w.m, w.alpha, scale2, h_blk, DH)  # (alpha is dead: the reciprocals)
        if R == 1:
            # the Q tile is dead (both warpgroups' scores are done: sum_full): this warpgroup's
            # columns of out go through it as bf16, then out in 16-byte coalesced stores (a warp
            # writes 512 contiguous bytes) instead of 4-byte stores from the fragment, each warp
            # instruction touching 8 rows (bitwise the same out)
            lo, hi = c * DH, (c + 1) * DH
            T.copy(w.acc_o, w.q_s[0:h_blk, lo:hi])
            T.copy(w.q_s[0:h_blk, lo:hi], w.Out[w.b, w.s, w.h0:w.h0 + h_blk, lo:hi])
        else:
            store_rows(w.Out, w.acc_o, w.b, w.s, w.h0, c * DH, w.S, R, hg, h_blk, DH)
        if c == 0:
            store_lse(w.Lse, w.row_sum, w.b, w.s, w.h0, w.S, R, hg, h_blk)

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
