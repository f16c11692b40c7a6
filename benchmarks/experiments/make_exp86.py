"""Writes glm5_dsa_plugin/ops/_exp86.py (ignored by git), session 28: exp85 with warpgroup 0's score
GEMM of block i + 1 under warpgroup 1's last dKV^T chunks of block i. In the tree both MMA
warpgroups meet at the end of every step (step_done: P and dS are rewritten by the next block).
Here they only arrive there; warpgroup 0 waits for block i's step_done after its next score GEMM
and exp2, just before it overwrites P; warpgroup 1 needs no wait (it rewrites dS only after
warpgroup 0's p_ready of block i + 1, which comes after that wait). Both wait for the last
block's step_done after the loop (the epilogue stores dq through the Q tile). Runs
make_exp85.py first. Run from the repository root."""
import runpy

from patching import replace_once

runpy.run_path("benchmarks/experiments/make_exp85.py")
src = open("glm5_dsa_plugin/ops/_exp85.py").read()
src = replace_once(src, '''        T.barrier_arrive(w.step_done)
        T.barrier_wait(w.step_done, blk & 1)''', '''        T.barrier_arrive(w.step_done)  # (exp86: warpgroup 0 waits for it in the next step)''')
src = replace_once(src, '''                w.acc_sp[h, j] = T.exp2(w.acc_sp[h, j] * scale2 - w.lse_log2[h])
            T.copy(w.acc_sp, w.p32_s[0:h_blk, 0:BS])''', '''                w.acc_sp[h, j] = T.exp2(w.acc_sp[h, j] * scale2 - w.lse_log2[h])
            if blk > 0:
                T.barrier_wait(w.step_done, (blk - 1) & 1)  # both warpgroups are done with block blk - 1's P, dS
            T.copy(w.acc_sp, w.p32_s[0:h_blk, 0:BS])''')
src = replace_once(src, '''                for i in T.serial(nb):
                    step(w, i)
                if tx >= 128:''', '''                for i in T.serial(nb):
                    step(w, i)
                if nb > 0:
                    T.barrier_wait(step_done, (nb - 1) & 1)
                if tx >= 128:''')
open("glm5_dsa_plugin/ops/_exp86.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp86.py")
