"""Writes glm5_dsa_plugin/ops/_exp85.py (ignored by git), session 28: exp84 (the dKV^T chunks
software-pipelined) with each MMA warpgroup's first chunk issued right behind its dQ GEMMs: the
dQ GEMMs no longer wait on their own; one wait leaves the first chunk's two groups running, then
dQ's accumulators are fenced and the kv buffer is freed for the next gather, as before. Runs
make_exp84.py first. Run from the repository root."""
import runpy

from patching import replace_once

runpy.run_path("benchmarks/experiments/make_exp84.py")
src = open("glm5_dsa_plugin/ops/_exp84.py").read()
src = replace_once(src, '''        T.gemm(w.dp_s, w.kv_parts[0], w.acc_dq, policy=T.GemmWarpPolicy.FullCol, annotations={"wg_wait": -1})
        T.gemm(w.dp_s, w.kv_parts[1], w.acc_dqt, policy=T.GemmWarpPolicy.FullCol)  # waits for both
        T.warpgroup_fence_operand(w.acc_dq, num_regs=h_blk * D // 256)
        T.barrier_arrive(w.kv_free)  # warpgroup 2 may gather the next block now
        dkv_by_chunks(w, blk)''', '''        T.gemm(w.dp_s, w.kv_parts[0], w.acc_dq, policy=T.GemmWarpPolicy.FullCol, annotations={"wg_wait": -1})
        T.gemm(w.dp_s, w.kv_parts[1], w.acc_dqt, policy=T.GemmWarpPolicy.FullCol, annotations={"wg_wait": -1})
        dkv_by_chunks(w, blk)  # (exp85: waits for the dQ GEMMs and frees the kv buffer itself)''')
src = replace_once(src, '''        a, b = w.acc_t[c], w.acc_t2[c]
        issue_chunk(w, f0, a)
        issue_chunk(w, f0 + 1, b)''', '''        a, b = w.acc_t[c], w.acc_t2[c]
        issue_chunk(w, f0, a)
        T.wait_wgmma(2)  # the dQ GEMMs are done (the first chunk's may run on)
        T.warpgroup_fence_operand(w.acc_dq, num_regs=h_blk * D // 256)
        T.barrier_arrive(w.kv_free)  # warpgroup 2 may gather the next block now
        issue_chunk(w, f0 + 1, b)''')
open("glm5_dsa_plugin/ops/_exp85.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp85.py")
