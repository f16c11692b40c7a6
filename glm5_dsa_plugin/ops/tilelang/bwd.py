"""The single-warpgroup sparse-MLA backward kernel."""

from types import SimpleNamespace

import tilelang
from tilelang import language as T

from ..contract import LOG2E
from .compile import PASS_CONFIGS, built_once
from .shapes import bwd_block_slots, row_group_geometry
from .tiles import (DELTA_COLS, gather_row, members_dtype, row_delta, row_group_access, slot_blocks, store_rows,
                    valid_slot)

__all__ = ["sparse_mla_bwd_kernel"]


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
    load_rows, load_lse, attends = row_group_access(R, hg)

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
            row_delta(w, od, od_sum, delta, S, load_rows, h_blk, D)
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

            store_rows(dQ, acc_dq, b, s, h0, 0, S, R, hg, h_blk, D)
            store_rows(dQ, acc_dqt, b, s, h0, D, S, R, hg, h_blk, DT)

    return tilelang.compile(bwd, pass_configs=PASS_CONFIGS, target=target)
