"""Writes glm5_dsa_plugin/ops/_exp103a.py / _exp103b.py / _exp103p.py (ignored by git), session 31:
warpgroup 0 defers its last chunk(s) of each block into the next block, as warpgroup 1 already
defers its rope-tail chunk (exp25). exp102: per block the drain idles while the MMA warpgroups
compute scores, dS and dQ (12% of its loop waiting for a staged chunk, 15% for the dQ GEMMs),
and the MMA warpgroups then wait for free chunk buffers (18% / 28%). P and dS of block i stay in
p_s / dp_s until warpgroup 0 writes block i + 1's P, so warpgroup 0 can compute chunk(s) of block
i after block i + 1's score GEMM and before that write: the drain gets work in the phase where it
idled, from operands already in shared memory. Chunk numbers and buffers are the tree's; the drain
takes block i's chunks computed after its dQ GEMMs (warpgroup 0's remaining ones and warpgroup 1's
four) alternately, then warpgroup 0's deferred chunk(s), then warpgroup 1's tail. a: one chunk deferred, its GEMMs issued
after the scores' exp2; b: one chunk, its GEMMs issued right behind the score GEMM (waited for
after exp2), the first block peeled out of the MMA warpgroups' loop (``peeled``); p: the tree
peeled alone (the control for b). Two deferred chunks spilled 136 bytes (ptxas, sm_90a) and were
not timed. Run from the repository root."""
from patching import replace_once

SRC = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()


def variant(deferred: int, with_scores: bool) -> str:
    src = SRC
    # the deferred chunks of block blk - 1: chunks HALF - deferred .. HALF - 1 of warpgroup 0
    src = replace_once(src, '''    def drain_slot(r, tp):''', f'''    def deferred_chunks(w, blk):
        # exp103: warpgroup 0's last {deferred} chunk(s) of block blk (P / dS still in p_s / dp_s);
        # the first one's GEMMs are in flight in acc_t[0]
        chunks_from(w, 0, HALF - {deferred}, blk * HALF + HALF - {deferred}, 0, {deferred}, w.acc_t[0], w.acc_t2[0])

    def drain_slot(r, tp):''')
    src = src.replace("    def deferred_chunks(w, blk):", "    @T.macro\n    def deferred_chunks(w, blk):", 1)
    if with_scores:
        src = replace_once(src, '''            T.gemm(w.q_s, w.kv_s, w.acc_sp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            if not one_tile:
                T.gemm(w.qt_s, w.kt_s, w.acc_sp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            for h, j in T.Parallel(h_blk, BS):
                w.acc_sp[h, j] = T.exp2(w.acc_sp[h, j] * scale2 - w.lse_log2[h])
''', f'''            T.gemm(w.q_s, w.kv_s, w.acc_sp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                   annotations={{"wg_wait": -1}})
            if not one_tile:
                T.gemm(w.qt_s, w.kt_s, w.acc_sp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                       annotations={{"wg_wait": -1}})
            if blk > 0:
                issue_chunk(w, HALF - {deferred}, w.acc_t[0])  # block blk - 1's first deferred chunk
                T.wait_wgmma(2)
            else:
                T.wait_wgmma(0)
            T.warpgroup_fence_operand(w.acc_sp, num_regs=h_blk * BS // 128)
            for h, j in T.Parallel(h_blk, BS):
                w.acc_sp[h, j] = T.exp2(w.acc_sp[h, j] * scale2 - w.lse_log2[h])
            if blk > 0:
                deferred_chunks(w, blk - 1)
''')
    else:
        src = replace_once(src, '''            for h, j in T.Parallel(h_blk, BS):
                w.acc_sp[h, j] = T.exp2(w.acc_sp[h, j] * scale2 - w.lse_log2[h])
''', f'''            for h, j in T.Parallel(h_blk, BS):
                w.acc_sp[h, j] = T.exp2(w.acc_sp[h, j] * scale2 - w.lse_log2[h])
            if blk > 0:
                issue_chunk(w, HALF - {deferred}, w.acc_t[0])  # block blk - 1's first deferred chunk
                deferred_chunks(w, blk - 1)
''')
    src = replace_once(src, "            dkv_by_chunks(w, 0, 0, N_OWN[0], blk * N_OWN[0])",
                       f"            dkv_by_chunks(w, 0, 0, N_OWN[0] - {deferred}, blk * N_OWN[0])")
    src = replace_once(src, '''                if tx >= 128:
                    if nb > 0:
                        tail_chunk(w, nb - 1)''', f'''                if tx >= 128:
                    if nb > 0:
                        tail_chunk(w, nb - 1)
                else:
                    if nb > 0:
                        issue_chunk(w, HALF - {deferred}, w.acc_t[0])
                        deferred_chunks(w, nb - 1)''')
    src = replace_once(src, '''                    for k in T.unroll(N_OWN[1]):
                        if k < N_OWN[0]:
                            drain_chunk(w, i, 0, k)
                        drain_chunk(w, i, 1, k)''', f'''                    for k in T.unroll(N_OWN[1] - 1):
                        if k < N_OWN[0] - {deferred}:
                            drain_chunk(w, i, 0, k)
                        drain_chunk(w, i, 1, k)
                    for k in T.unroll({deferred}):
                        drain_chunk(w, i, 0, N_OWN[0] - {deferred} + k)
                    drain_chunk(w, i, 1, N_OWN[1] - 1)''')
    return src


def peeled(src: str) -> str:
    """The MMA warpgroups' first block out of their loop, so that each ``if blk > 0`` of ``step`` is
    decided when the kernel is built (b's wgmma groups open across a runtime branch made ptxas
    serialise every wgmma: C7514, and with one wait after empty groups C7520)."""
    src = replace_once(src, "    def step(w, blk):", "    def step(w, blk, first):")
    assert src.count("            if blk > 0:") + src.count("                if blk > 0:") >= 2
    src = src.replace("            if blk > 0:\n", "            if not first:\n")
    src = replace_once(src, '''                for i in T.serial(nb):
                    step(w, i)''', '''                if nb > 0:
                    step(w, 0, True)
                for i in T.serial(nb - 1):
                    step(w, i + 1, False)''')
    return src


for tag, deferred, with_scores in (("a", 1, False), ("b", 1, True), ("p", 0, False)):
    src = variant(deferred, with_scores) if deferred else SRC
    open(f"glm5_dsa_plugin/ops/_exp103{tag}.py", "w").write(peeled(src) if tag in "bp" else src)
    print(f"wrote glm5_dsa_plugin/ops/_exp103{tag}.py")
