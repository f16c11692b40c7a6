"""Writes glm5_dsa_plugin/ops/_exp59.py (ignored by git): exp58's persistent forward with rows
from the atomic counter (make_exp58.py, run first here), plus the next row's Q tile and first kv
block loaded under the current row's epilogue (session 23). The out tile leaves through kv
buffer 1 instead of the Q tile (same [64, 576] shape and layout: warpgroup 0's columns through
its left part, warpgroup 1's through its right part), so the Q tile is free as soon as both MMA
warpgroups' pair loops are done (``q_free`` arrives there) and the gather warpgroup loads the
next row's Q, then its block 0 into kv buffer 0 (freed as usual in the last pair), then block 1
into kv buffer 1 once each warpgroup has stored its out (the last pair's kv1 frees wait for that).
An empty row (no pairs) stores out from registers. The row sums are exchanged through two
buffers by row parity. Run from the repository root."""
import runpy

from patching import replace_once

runpy.run_path("benchmarks/experiments/make_exp58.py")
src = open("glm5_dsa_plugin/ops/_exp58.py").read()
src = replace_once(src, '''    assert R == 1, "exp58: one row per block only"''', '''    assert R == 1, "exp59: one row per block only"''')
# the last pair's kv1 right part is freed after warpgroup 1's out stores
src = replace_once(src, '''        T.wait_wgmma(1)
        T.barrier_arrive(w.free[1][1])''', '''        T.wait_wgmma(1)
        if i * 2 + 2 < w.nb:  # (the row's last pair: after the out stores through kv1)
            T.barrier_arrive(w.free[1][1])''')
src = replace_once(src, '''        T.wait_wgmma(0)
        T.warpgroup_fence_operand(w.acc_o, num_regs=h_blk * DH // 128)
        if c == 0:
            if w.nb > 0:
                T.barrier_arrive(w.free[1][0])  # the row's last P1 V1 is done
''', '''        T.barrier_arrive(w.q_free)  # this warpgroup's score GEMMs of the row are done
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(w.acc_o, num_regs=h_blk * DH // 128)
''')
src = replace_once(src, '''            lo, hi = c * DH, (c + 1) * DH
            T.copy(w.acc_o, w.q_s[0:h_blk, lo:hi])
            T.copy(w.q_s[0:h_blk, lo:hi], w.Out[w.b, w.s, w.h0:w.h0 + h_blk, lo:hi])
            T.barrier_arrive(w.q_free)''', '''            lo, hi = c * DH, (c + 1) * DH
            if w.nb > 0:  # out through kv1 (every GEMM of the row is done: sum_full), then kv1's part freed
                T.copy(w.acc_o, w.kv[1][0:h_blk, lo:hi])
                T.copy(w.kv[1][0:h_blk, lo:hi], w.Out[w.b, w.s, w.h0:w.h0 + h_blk, lo:hi])
                T.barrier_arrive(w.free[1][c])
            else:  # no pair: kv1 may already hold the next row's block
                _store_rows(w.Out, w.acc_o, w.b, w.s, w.h0, c * DH, w.S, R, hg, h_blk, DH)''')
src = replace_once(src, '''                        if pairs > 0:
                            produce_pair(w, 0, pb[0])
                        if jr[0] > 0:
                            T.barrier_wait(q_free, (jr[0] - 1) & 1)
                        load_q(w)
''', '''                        if jr[0] > 0:
                            T.barrier_wait(q_free, (jr[0] - 1) & 1)
                        load_q(w)
                        if pairs > 0:
                            produce_first_pair(w, pb[0])
''')
src = replace_once(src, '''    @T.macro
    def load_q(w):''', '''    @T.macro
    def produce_first_pair(w, ph):
        # a row's first pair: kv0 (freed in the previous row's last pair) before kv1 (freed after
        # its out stores), the right part of kv1 first (warpgroup 1 scores it first)
        T.barrier_wait(w.free[0][0], (ph & 1) ^ 1)
        gather(w, 0, w.kv[0], 0, UL, w.full[0][0])
        T.barrier_wait(w.free[0][1], (ph & 1) ^ 1)
        gather(w, 0, w.kv[0], UL, UA, w.full[0][1])
        T.barrier_wait(w.free[1][1], (ph & 1) ^ 1)
        gather(w, 1, w.kv[1], UL, UA, w.full[1][1])
        T.barrier_wait(w.free[1][0], (ph & 1) ^ 1)
        gather(w, 1, w.kv[1], 0, UL, w.full[1][0])

    @T.macro
    def load_q(w):''')
# the row sums' exchange in two buffers by row parity: q_free no longer comes after it, so after an
# empty row warpgroup 0 could write the next row's sum before warpgroup 1 has read this row's
src = replace_once(src, '''            w.sum_s[c, h] = w.row_sum[h]''', '''            w.sum_s[(j & 1) * 2 + c, h] = w.row_sum[h]''')
src = replace_once(src, '''            w.row_sum[h] = w.sum_s[0, h] + w.sum_s[1, h]''',
    '''            w.row_sum[h] = w.sum_s[(j & 1) * 2, h] + w.sum_s[(j & 1) * 2 + 1, h]''')
src = replace_once(src, '''            sum_s = T.alloc_shared([2, h_blk], acc)''', '''            sum_s = T.alloc_shared([4, h_blk], acc)''')
open("glm5_dsa_plugin/ops/_exp59.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp59.py")
