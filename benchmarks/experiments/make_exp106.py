"""Writes glm5_dsa_plugin/ops/_exp106a.py / _exp106b.py (ignored by git), session 31: the warp-specialised forward
without the GEMMs of a row's masked odd block. The forward takes 64-slot blocks in pairs (block
2i for warpgroup 0's scores, 2i + 1 for warpgroup 1's; both warpgroups multiply both P by their
half of V), so a row with an odd block count ends on a pair whose second block is past the row:
its gathers read the zero sentinel row, its scores are all masked (-inf), its P is 0, and its
score GEMM and both P1 V1 GEMMs add nothing (-inf + 0 = -inf; 0 * 0 = 0), at the tensor-core cost
of a whole block. W2 has about 1020 such rows against 99,294 blocks (at most ~1% of its forward;
W1 none). Here the pair loop runs the row's whole pairs, then, for an odd count, one pair built
with those three GEMMs left out (a static flag, so no wgmma sits under a runtime branch); every
barrier wait and arrival, the mask, the max and the softmax stay, so out and lse should be
bitwise the tree's (a). b: the tree's loop with the three GEMMs under a runtime test instead.
Run from the repository root."""
from patching import replace_once

SRC = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
src = replace_once(SRC, '''    def score_part(w, c, part, i):
        # acc_s += Q K^T over column part `part` (0: [0, d_v / 2), 1: the rest) of buffer c, once
        # it has landed; not waited for
        lo, hi = (0, DH) if part == 0 else (DH, D + DT)
        kv = w.kv[c]
        T.barrier_wait(w.full[c][part], i & 1)
        T.gemm(''', '''    def score_part(w, c, part, i, past=False):
        # acc_s += Q K^T over column part `part` (0: [0, d_v / 2), 1: the rest) of buffer c, once
        # it has landed; not waited for (past, exp106: the block is past the row, no GEMM)
        lo, hi = (0, DH) if part == 0 else (DH, D + DT)
        kv = w.kv[c]
        T.barrier_wait(w.full[c][part], i & 1)
        if not past:
            T.gemm(''')
src = replace_once(src, '''               policy=T.GemmWarpPolicy.FullRow, annotations={"wg_wait": -1})

    @T.macro
    def scores(w, c, i):''', '''                   policy=T.GemmWarpPolicy.FullRow, annotations={"wg_wait": -1})

    @T.macro
    def scores(w, c, i, past=False):''')
src = replace_once(src, '''        score_part(w, c, first, i)
        if c == 0:''', '''        score_part(w, c, first, i, past)
        if c == 0:''')
src = replace_once(src, '''        score_part(w, c, second, i)
        T.wait_wgmma(0)''', '''        score_part(w, c, second, i, past)
        T.wait_wgmma(0)''')
src = replace_once(src, '''    def pair0(w, i):
        scores(w, 0, i)''', '''    def pair0(w, i, odd=False):
        scores(w, 0, i)''')
src = replace_once(src, '''        T.barrier_wait(w.p_ready[1], i & 1)
        T.gemm(w.p_s, w.kv[1][0:BI, 0:DH], w.acc_o, policy=T.GemmWarpPolicy.FullRow,
               annotations={"wg_wait": -1})''', '''        T.barrier_wait(w.p_ready[1], i & 1)
        if not odd:
            T.gemm(w.p_s, w.kv[1][0:BI, 0:DH], w.acc_o, policy=T.GemmWarpPolicy.FullRow,
                   annotations={"wg_wait": -1})''')
src = replace_once(src, '''    def pair1(w, i):
        scores(w, 1, i)''', '''    def pair1(w, i, odd=False):
        scores(w, 1, i, odd)''')
src = replace_once(src, '''        T.gemm(w.p, w.kv[1][0:BI, DH:D], w.acc_o, policy=T.GemmWarpPolicy.FullRow,
               annotations={"wg_wait": -1})
        T.barrier_wait(w.p_ready[0], i & 1)''', '''        if not odd:
            T.gemm(w.p, w.kv[1][0:BI, DH:D], w.acc_o, policy=T.GemmWarpPolicy.FullRow,
                   annotations={"wg_wait": -1})
        T.barrier_wait(w.p_ready[0], i & 1)''')
src = replace_once(src, '''        for i in T.serial((w.nb + 1) // 2):
            if c == 0:
                pair0(w, i)
            else:
                pair1(w, i)''', '''        for i in T.serial(w.nb // 2):
            if c == 0:
                pair0(w, i)
            else:
                pair1(w, i)
        if w.nb % 2 == 1:  # exp106: the last pair's second block is past the row
            if c == 0:
                pair0(w, w.nb // 2, True)
            else:
                pair1(w, w.nb // 2, True)''')
open("glm5_dsa_plugin/ops/_exp106a.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp106a.py")

# b: the tree's loop, the three GEMMs under a runtime test of the pair's second block (a's
# second copy of the pair code made ptxas serialise every wgmma for want of registers, C7511)
src = SRC
src = replace_once(src, '''        T.barrier_wait(w.full[c][part], i & 1)
        T.gemm(w.q_s[0:h_blk, lo:hi], kv[0:BI, lo:hi], w.acc_s, transpose_B=True,
               policy=T.GemmWarpPolicy.FullRow, annotations={"wg_wait": -1})''', '''        T.barrier_wait(w.full[c][part], i & 1)
        if c == 0 or i * 2 + 1 < w.nb:  # exp106b: warpgroup 1's block past the row, no GEMM
            T.gemm(w.q_s[0:h_blk, lo:hi], kv[0:BI, lo:hi], w.acc_s, transpose_B=True,
                   policy=T.GemmWarpPolicy.FullRow, annotations={"wg_wait": -1})''')
src = replace_once(src, '''        T.barrier_wait(w.p_ready[1], i & 1)
        T.gemm(w.p_s, w.kv[1][0:BI, 0:DH], w.acc_o, policy=T.GemmWarpPolicy.FullRow,
               annotations={"wg_wait": -1})''', '''        T.barrier_wait(w.p_ready[1], i & 1)
        if i * 2 + 1 < w.nb:
            T.gemm(w.p_s, w.kv[1][0:BI, 0:DH], w.acc_o, policy=T.GemmWarpPolicy.FullRow,
                   annotations={"wg_wait": -1})''')
src = replace_once(src, '''        T.gemm(w.p, w.kv[1][0:BI, DH:D], w.acc_o, policy=T.GemmWarpPolicy.FullRow,
               annotations={"wg_wait": -1})
        T.barrier_wait(w.p_ready[0], i & 1)''', '''        if i * 2 + 1 < w.nb:
            T.gemm(w.p, w.kv[1][0:BI, DH:D], w.acc_o, policy=T.GemmWarpPolicy.FullRow,
                   annotations={"wg_wait": -1})
        T.barrier_wait(w.p_ready[0], i & 1)''')
open("glm5_dsa_plugin/ops/_exp106b.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp106b.py")
