"""Writes glm5_dsa_plugin/ops/_exp70.py (ignored by git), session 24: the tree's warp-specialised
forward with warpgroup 0's next-block mask set while its P0 V0 GEMM runs. In pair0 the mask
(index loads from global memory, then acc_s := 0 / -inf) comes after the wait for P0 V0 and the
out rescale, just before warpgroup 0 waits for P1, so the loads' latency is in warpgroup 0's chain;
warpgroup 1 already sets its mask between its two PV waits. acc_s is dead once P0 is published, so
the mask moves right after that (no extra registers). The lesson of exp69 (the backward's lse,
loaded after each score GEMM: 2-3%). Run from the repository root."""
from patching import replace_once

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
src = replace_once(src, '''        T.barrier_arrive(w.p_ready[0])
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(w.acc_o, num_regs=h_blk * DH // 128)
        T.barrier_arrive(w.free[0][0])
        for h, d in T.Parallel(h_blk, DH):
            w.acc_o[h, d] = w.acc_o[h, d] * w.alpha[h]
        mask_block(w, i * 2 + 2)
        T.barrier_wait(w.p_ready[1], i & 1)''', '''        T.barrier_arrive(w.p_ready[0])
        mask_block(w, i * 2 + 2)  # exp70: under P0 V0
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(w.acc_o, num_regs=h_blk * DH // 128)
        T.barrier_arrive(w.free[0][0])
        for h, d in T.Parallel(h_blk, DH):
            w.acc_o[h, d] = w.acc_o[h, d] * w.alpha[h]
        T.barrier_wait(w.p_ready[1], i & 1)''')
open("glm5_dsa_plugin/ops/_exp70.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp70.py")
