"""The single-warpgroup sparse-MLA forward kernel."""

import tilelang
from tilelang import language as T

from ..contract import EMPTY_ROW_LSE, LN2, LOG2E
from .compile import PASS_CONFIGS, built_once
from .shapes import BLOCK_TOPK, row_group_geometry
from .tiles import gather_row, members_dtype, row_group_access, slot_blocks, tile_row, valid_slot, exp_base

__all__ = ["in_bucket", "sparse_mla_fwd_kernel"]


def in_bucket(n_blocks, lo, hi, n_all):
    """Whether a row needing ``n_blocks`` belongs to the launch for (lo, hi]; the first bucket
    also takes rows with no valid slot. Static True for a single launch over all ``n_all`` blocks."""
    if lo == 0:
        return True if hi == n_all else n_blocks <= hi
    return (n_blocks > lo) & (n_blocks <= hi)


@built_once
def sparse_mla_fwd_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, safe=True, block_i=BLOCK_TOPK,
                          num_stages=2, threads=256, target="cuda", select_in_kernel=True, blocks=None,
                          rows_per_block=1):
    """Q [B,T,H,Dqk] bf16, KV [B,T_kv+1,G,Dqk] bf16 (last row zero; T_kv rows when not safe),
    Indices [B,T,G,topk] i32 (host-rewritten to [0, T_kv], T_kv = padding; -1 padding when not
    safe) -> Out [B,T,H,d_v] bf16, Lse [B,T,H] f32 (natural log).
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
    load_rows, _, attends = row_group_access(R, hg)

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
                        alpha[h] = T.exp2((m_prev[h] - exp_base(m[h])) * scale2)
                    for h, j in T.Parallel(h_blk, BI):
                        acc_s[h, j] = T.exp2(acc_s[h, j] * scale2 - exp_base(m[h]) * scale2)
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

                # the epilogue of finish_rows / store_rows / store_lse, kept inline here: through the
                # macros TileLang 0.1.15 assigns this kernel's reduction workspaces to other shared
                # memory slots (seen in the generated CUDA), a layout never run on the GPU
                if safe:
                    # empty rows (row_sum == 0): out 0, lse EMPTY_ROW_LSE; a NaN row sum stays NaN
                    # (``!= 0``, as in finish_rows)
                    # one reciprocal per row (alpha is dead after the loop), as in finish_rows
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
                        if tile_row(s, h, h0, R, hg)[0] < S:
                            Out[(b, *tile_row(s, h, h0, R, hg), d)] = acc_o[h, d]
                    for h in T.Parallel(h_blk):
                        if tile_row(s, h, h0, R, hg)[0] < S:
                            Lse[(b, *tile_row(s, h, h0, R, hg))] = row_sum[h]


    return tilelang.compile(fwd, pass_configs=PASS_CONFIGS, target=target)
