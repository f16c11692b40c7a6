"""Writes glm5_dsa_plugin/ops/_exp84.py (ignored by git), session 28: the tree's backward with its
dKV^T chunks software-pipelined in the MMA warpgroups. exp83 found the chunks' staging stores
worth as much as the drain's atomics (W2 H64: 7.15 ms, 5.93 without the stores, 5.92 without the
atomics, 4.63 without both): each warpgroup runs a chunk's two GEMMs, waits for them, then stores
the accumulator, so no GEMM runs under its stores. Here each MMA warpgroup has two chunk
accumulators and issues chunk k + 1's GEMMs before storing chunk k (one wgmma wait that leaves
k + 1's two groups running). The chunk order, buffers and barriers are the tree's; only the
issue order and the second accumulator (16 registers per thread) change. Run from the
repository root."""
from patching import replace_once

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
src = replace_once(src, '''    @T.macro
    def dkv_by_chunks(w, blk):
        if w.tx < 128:
            for k in T.unroll(N_OWN[0]):
                value_chunk(w, 0, k, blk * N_OWN[0] + k)
        else:
            for k in T.unroll(N_OWN[1] - 1):
                value_chunk(w, 1, HALF + k, blk * N_OWN[1] + k)''', '''    @T.macro
    def issue_chunk(w, f, acc_c):
        # dKV^T[f * 64:(f + 1) * 64] = Q^T dS + dO^T P into acc_c, two wgmma groups, no wait
        T.gemm(w.q_s[0:h_blk, f * 64:(f + 1) * 64], w.dp_s, acc_c, transpose_A=True,
               policy=T.GemmWarpPolicy.FullRow, clear_accum=True, annotations={"wg_wait": -1})
        T.gemm(w.do_s[0:h_blk, f * 64:(f + 1) * 64], w.p_s, acc_c, transpose_A=True,
               policy=T.GemmWarpPolicy.FullRow, annotations={"wg_wait": -1})

    @T.macro
    def store_chunk(w, c, acc_c, n, pending):
        # wait until at most ``pending`` wgmma groups run (the next chunk's), then stage acc_c as chunk n
        T.wait_wgmma(pending)
        T.warpgroup_fence_operand(acc_c, num_regs=64 * BS // 128)
        wait_chunk_buffer(w.ch_free[c], n, 1)
        for i, j in T.Parallel(64, BS):
            w.ch_s[c][n % 2, j, i] = acc_c[i, j]
        arrive_chunk_buffer(w.ch_full[c], n)

    @T.macro
    def pipelined_chunks(w, c, f0, n0):
        # four chunks f0 .. f0 + 3 (numbers n0 ..), accumulators alternating; chunk k + 1's GEMMs
        # run under chunk k's stores
        a, b = w.acc_t[c], w.acc_t2[c]
        issue_chunk(w, f0, a)
        issue_chunk(w, f0 + 1, b)
        store_chunk(w, c, a, n0, 2)
        issue_chunk(w, f0 + 2, a)
        store_chunk(w, c, b, n0 + 1, 2)
        issue_chunk(w, f0 + 3, b)
        store_chunk(w, c, a, n0 + 2, 2)
        store_chunk(w, c, b, n0 + 3, 0)

    @T.macro
    def dkv_by_chunks(w, blk):
        if w.tx < 128:
            pipelined_chunks(w, 0, 0, blk * N_OWN[0])
        else:
            pipelined_chunks(w, 1, HALF, blk * N_OWN[1])''')
src = replace_once(src, '''    HALF = NCV // 2  # the other NCV - HALF and the rope tail (chunk index NCV)
''', '''    HALF = NCV // 2  # the other NCV - HALF and the rope tail (chunk index NCV)
    assert HALF == 4 and NCV - HALF == 4, "exp84 pipelines exactly four chunks per warpgroup (d_v = 512)"
''')
src = replace_once(src, '''            acc_t1 = T.alloc_fragment([64, BS], acc)
''', '''            acc_t1 = T.alloc_fragment([64, BS], acc)
            acc_t0b = T.alloc_fragment([64, BS], acc)  # exp84: each warpgroup's second chunk accumulator
            acc_t1b = T.alloc_fragment([64, BS], acc)
''')
src = replace_once(src, '''ch_s=(ch_s0, ch_s1), acc_t=(acc_t0, acc_t1), ''', '''ch_s=(ch_s0, ch_s1), acc_t=(acc_t0, acc_t1), acc_t2=(acc_t0b, acc_t1b), ''')
open("glm5_dsa_plugin/ops/_exp84.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp84.py")
