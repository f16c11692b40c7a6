"""exp77 (session 27): the warp-specialised backward with dKV per pair of 32-slot blocks, not
transposed, added from the MMA registers.

The tree's kernel computes dKV^T per 32-slot block ([64 features, 32 slots] chunks, A = Q^T / dO^T
read from shared memory for every block), stages each chunk in shared memory, and a third
warpgroup drains the chunks with 16-byte atomics. Here P and dS of two consecutive blocks stay in
[64 heads, 64 slots] buffers, and after the second block each MMA warpgroup computes its chunks as
dKV[64 slots, 64 features] = dS^T Q[:, chunk] + P^T dO[:, chunk] (M = the pair's 64 slots), then
adds the accumulator to global memory with 8-byte atomics straight from its registers (each thread
holds column pairs of two slot rows). Per 32 slots: the A operands of the dKV GEMMs are read half
as often (64 slots per read), the 74 KB of chunk stores and the drain's 74 KB of reads are gone,
and the third warpgroup only gathers (40 registers; the MMA warpgroups get 232). An odd last block
leaves the pair's second half stale: its slots are masked at the atomics (key -1).
Same tensors and results as the tree's ``sparse_mla_bwd_ws_kernel`` (dq bitwise, dkv up to the
atomics' order)."""
from types import SimpleNamespace

import tilelang
from tilelang import language as T

from glm5_dsa_plugin.ops.tilelang_kernels import (
    DELTA_COLS, EXPLICIT_FENCES_ATTR, LOG2E, PASS_CONFIGS, _flag_nonfinite, _load_tile, _row_delta, _row_group_access,
    _store_rows, built_once, gather_row, members_dtype, row_group_geometry, slot_blocks, valid_slot, vector_rows)


@built_once
def sparse_mla_bwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda",
                             mma_regs=232, producer_regs=40, dkv_per_slot=False, skip_dkv_writes=False):
    """``skip_dkv_writes`` (exp79, an ablation: dkv comes out zero): the chunks' GEMMs run, their
    atomics / stores do not."""
    R = rows_per_block
    assert heads % kv_group == 0 and d_tail == 64 and d_v % 128 == 0
    hg = heads // kv_group
    h_blk, nh = row_group_geometry(hg, R)
    assert h_blk == 64, "the warp-specialised backward runs 64-row tiles"
    BS = 32  # slots per step
    PS = 2 * BS  # slots per pair: the dKV GEMMs' M
    K = topk * R
    assert K % BS == 0
    D, DT, NS = d_v, d_tail, K // BS
    one_tile = R == 1
    QW = D + DT if one_tile else D
    NCV = D // 64
    HALF = NCV // 2
    N_OWN = (HALF, NCV - HALF + 1)
    THREADS = 384
    scale, scale2 = float(sm_scale), float(sm_scale) * LOG2E
    dtype, acc = T.bfloat16, T.float32
    B, S, SKV1 = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("kv_rows")
    NG = S if R == 1 else T.dynamic("row_groups")
    n_kv = SKV1 - 1
    load_rows, load_lse, attends = _row_group_access(R, hg)
    KS = T.dynamic("slot_stride") if R > 1 else K
    dkv_shape = [B, NG, kv_group * nh, KS, D + DT] if dkv_per_slot else [B, SKV1, kv_group, D + DT]

    @T.macro
    def gather(w, blk):
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
    def add_chunk(w, c, col0, pair):
        # the pair's [64 slots, 64 features] chunk at columns col0: atomics (or per-slot stores) of
        # each thread's column pairs, slots whose key is -1 skipped
        for i, j in T.Parallel(PS, 64):
            if w.kf[c][i] >= (1 << 30 if skip_dkv_writes else 0):
                if dkv_per_slot:
                    w.dKV[w.b, w.s, w.bz, pair * PS + i, col0 + j] = w.acc_k[c][i, j]
                else:
                    T.atomic_add(w.dKV[w.b, w.kf[c][i], w.g, col0 + j], w.acc_k[c][i, j])

    @T.macro
    def value_chunk(w, c, f, pair):
        # dKV[pair slots, f * 64:(f + 1) * 64] = dS^T Q[:, f] + P^T dO[:, f]
        T.gemm(w.dp_s, w.q_s[0:h_blk, f * 64:(f + 1) * 64], w.acc_k[c], transpose_A=True,
               policy=T.GemmWarpPolicy.FullRow, clear_accum=True, annotations={"wg_wait": -1})
        T.gemm(w.p_s, w.do_s[0:h_blk, f * 64:(f + 1) * 64], w.acc_k[c], transpose_A=True,
               policy=T.GemmWarpPolicy.FullRow)
        add_chunk(w, c, f * 64, pair)

    @T.macro
    def dkv_by_chunks(w, pair):
        if w.tx < 128:
            for i in T.Parallel(PS):
                w.kf[0][i] = w.kidx_s[i]
            for k in T.unroll(N_OWN[0]):
                value_chunk(w, 0, k, pair)
        else:
            for i in T.Parallel(PS):
                w.kf[1][i] = w.kidx_s[i]
            for k in T.unroll(N_OWN[1] - 1):
                value_chunk(w, 1, HALF + k, pair)
        # P, dS and the keys are rewritten by the next pair: both warpgroups are done reading them
        T.barrier_arrive(w.step_done)
        T.barrier_wait(w.step_done, pair & 1)

    @T.macro
    def tail_chunk(w, pair):
        # warpgroup 1: the pair's rope-tail chunk, dS^T Q_tail (dp_s and kf[1] still hold the pair's)
        T.gemm(w.dp_s, w.q_parts[1], w.acc_k[1], transpose_A=True, policy=T.GemmWarpPolicy.FullRow,
               clear_accum=True)
        add_chunk(w, 1, D, pair)

    @T.macro
    def step(w, blk, u):
        # block blk = 2 * pair + u; its P and dS go to columns [u * BS, (u + 1) * BS) of p_s / dp_s
        T.barrier_wait(w.full, u)
        if w.tx < 128:
            for j in T.Parallel(BS):
                if R == 1:
                    w.valid[j] = valid_slot(w.Indices[w.b, w.s, w.g, blk * BS + j], n_kv)
                else:
                    w.valid[j] = T.cast(w.Members[w.b, w.s, w.g, blk * BS + j], T.int32)
            for j in T.Parallel(BS):
                w.kidx_s[u * BS + j] = T.if_then_else(valid_slot(w.Indices[w.b, w.s, w.g, blk * BS + j], n_kv),
                                                      w.Indices[w.b, w.s, w.g, blk * BS + j], -1)
                if u == 0:
                    if blk + 1 == w.nb:
                        w.kidx_s[BS + j] = -1  # an odd last block: the pair's second half is stale
            for h, j in T.Parallel(h_blk, BS):
                w.acc_sp[h, j] = T.if_then_else(attends(w.valid, h, j), 0, -T.infinity(acc))
            T.gemm(w.q_s, w.kv_s, w.acc_sp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            if not one_tile:
                T.gemm(w.qt_s, w.kt_s, w.acc_sp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            for h, j in T.Parallel(h_blk, BS):
                w.acc_sp[h, j] = T.exp2(w.acc_sp[h, j] * scale2 - w.lse_log2[h])
            T.copy(w.acc_sp, w.p32_s[0:h_blk, 0:BS])
            T.copy(w.acc_sp, w.p_s[0:h_blk, u * BS:(u + 1) * BS])
            T.fence_proxy_async()
            T.barrier_arrive(w.p_ready)
        else:
            T.gemm(w.do_s, w.kv_parts[0], w.acc_ds, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                   clear_accum=True, annotations={"wg_wait": -1})
            if u == 0:
                if blk > 0:
                    tail_chunk(w, blk // 2 - 1)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(w.acc_ds, num_regs=h_blk * BS // 128)
            T.barrier_wait(w.p_ready, u)
            for h, j in T.Parallel(h_blk, BS):
                w.acc_ds[h, j] = w.p32_s[h, j] * (w.acc_ds[h, j] - w.delta_s[h]) * scale
            T.copy(w.acc_ds, w.dp_s[0:h_blk, u * BS:(u + 1) * BS])
            T.fence_proxy_async()
            T.barrier_arrive(w.ds_ready)
        T.barrier_wait(w.ds_ready, u)
        T.gemm(w.dp_s[0:h_blk, u * BS:(u + 1) * BS], w.kv_parts[0], w.acc_dq, policy=T.GemmWarpPolicy.FullCol,
               annotations={"wg_wait": -1})
        T.gemm(w.dp_s[0:h_blk, u * BS:(u + 1) * BS], w.kv_parts[1], w.acc_dqt, policy=T.GemmWarpPolicy.FullCol)
        T.warpgroup_fence_operand(w.acc_dq, num_regs=h_blk * D // 256)
        T.barrier_arrive(w.kv_free)

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
            p_s = T.alloc_shared([h_blk, PS], dtype)  # the pair's P (bf16), block u in columns u * BS
            dp_s = T.alloc_shared([h_blk, PS], dtype)  # the pair's dS
            p32_s = T.alloc_shared([h_blk, BS + 8], acc)
            kidx_s = T.alloc_shared([PS], T.int32)  # the pair's kv rows, -1 where no atomic goes
            delta_s = T.alloc_shared([h_blk], acc)
            valid = T.alloc_fragment([BS], "bool" if R == 1 else T.int32)
            acc_sp = T.alloc_fragment([h_blk, BS], acc)
            acc_ds = T.alloc_fragment([h_blk, BS], acc)
            acc_dq = T.alloc_fragment([h_blk, D], acc)
            acc_dqt = T.alloc_fragment([h_blk, DT], acc)
            lse_log2 = T.alloc_fragment([h_blk], acc)
            acc_k0 = T.alloc_fragment([PS, 64], acc)  # a dKV chunk, per warpgroup
            acc_k1 = T.alloc_fragment([PS, 64], acc)
            kf0 = T.alloc_fragment([PS], T.int32)  # the pair's keys in the chunk's row layout
            kf1 = T.alloc_fragment([PS], T.int32)
            od = T.alloc_fragment([h_blk, DELTA_COLS], acc)
            od_sum = T.alloc_fragment([h_blk], acc)
            delta = T.alloc_fragment([h_blk], acc)
            full = T.alloc_barrier(arrive_count=128)
            kv_free = T.alloc_barrier(arrive_count=256)
            p_ready = T.alloc_barrier(arrive_count=128)
            ds_ready = T.alloc_barrier(arrive_count=128)
            step_done = T.alloc_barrier(arrive_count=256)

            s = NG - 1 - bx
            g = bz // nh
            h0 = g * hg + (bz % nh) * h_blk
            nb = T.min(slot_blocks(Extent[b, s, g], BS), NS)
            tx = T.get_thread_binding()
            q_parts = (q_s[0:h_blk, 0:D], q_s[0:h_blk, D:D + DT]) if one_tile else (q_s, qt_s)
            kv_parts = (kv_s[0:BS, 0:D], kv_s[0:BS, D:D + DT]) if one_tile else (kv_s, kt_s)
            w = SimpleNamespace(tx=tx, Indices=Indices, Members=Members, KV=KV, O=O, dO=dO, dKV=dKV, b=b, s=s, g=g,
                                bz=bz, h0=h0, nb=nb, valid=valid, lse_log2=lse_log2, acc_sp=acc_sp, acc_ds=acc_ds,
                                acc_dq=acc_dq, acc_dqt=acc_dqt, q_s=q_s, qt_s=qt_s, q_parts=q_parts, do_s=do_s,
                                kv_s=kv_s, kt_s=kt_s, kv_parts=kv_parts, p_s=p_s, dp_s=dp_s, p32_s=p32_s,
                                kidx_s=kidx_s, delta_s=delta_s, full=full, kv_free=kv_free, p_ready=p_ready,
                                ds_ready=ds_ready, acc_k=(acc_k0, acc_k1), kf=(kf0, kf1), step_done=step_done)
            if tx >= 256:
                if nb > 0:
                    gather(w, 0)
            _load_tile(q_s, Q, b, s, h0, S, load_rows, h_blk, vector_rows(h_blk, QW, THREADS), QW, 0)
            if not one_tile:
                _load_tile(qt_s, Q, b, s, h0, S, load_rows, h_blk, vector_rows(h_blk, DT, THREADS), DT, D)
            _load_tile(do_s, dO, b, s, h0, S, load_rows, h_blk, vector_rows(h_blk, D, THREADS), D, 0)
            T.fence_proxy_async()
            T.sync_threads()
            if tx < 256:
                T.set_max_nreg(mma_regs, 1)
                T.clear(acc_dq)
                T.clear(acc_dqt)
                _row_delta(w, od, od_sum, delta, S, load_rows, h_blk, D, do_from_shared=True, unrolled=one_tile)
                if tx < 128:
                    for h in T.Parallel(h_blk):
                        lse_log2[h] = load_lse(Lse, b, s, h0, h, S) * LOG2E
                for pi in T.serial((nb + 1) // 2):
                    step(w, pi * 2, 0)
                    if pi * 2 + 1 < nb:
                        step(w, pi * 2 + 1, 1)
                    dkv_by_chunks(w, pi)
                if tx >= 128:
                    if nb > 0:
                        tail_chunk(w, (nb - 1) // 2)
                _flag_nonfinite(Flags, acc_dq, h_blk, D)
                _flag_nonfinite(Flags, acc_dqt, h_blk, DT)
                if one_tile:
                    T.copy(acc_dq, q_s[0:h_blk, 0:D])
                    T.copy(q_s[0:h_blk, 0:D], dQ[b, s, h0:h0 + h_blk, 0:D])
                else:
                    _store_rows(dQ, acc_dq, b, s, h0, 0, S, R, hg, h_blk, D)
                _store_rows(dQ, acc_dqt, b, s, h0, D, S, R, hg, h_blk, DT)
            else:
                T.set_max_nreg(producer_regs, 0)
                for i in T.serial(nb):
                    if i + 1 < nb:
                        T.barrier_wait(kv_free, i & 1)
                        gather(w, i + 1)

    return tilelang.compile(bwd.with_attr(EXPLICIT_FENCES_ATTR, True), pass_configs=PASS_CONFIGS, target=target)
