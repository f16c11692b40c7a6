"""Writes glm5_dsa_plugin/ops/_exp87.py (ignored by git), session 28: exp83's ablation switches on
v31's backward (the chunks software-pipelined): ``skip_atomics`` (the drain waits for and frees
every staged chunk but adds nothing) and ``skip_stage`` (the chunks' GEMMs run, their staging
stores do not; the drain adds the stale buffers). Timing only: dq / dkv wrong by design. With
neither set the kernel is the tree's. Run from the repository root."""
from patching import replace_once

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
src = replace_once(src, '''                             mma_regs=224, producer_regs=56, dkv_per_slot=False):''',
                   '''                             mma_regs=224, producer_regs=56, dkv_per_slot=False, skip_atomics=False,
                             skip_stage=False):''')
src = replace_once(src, '''        wait_chunk_buffer(w.ch_free[c], n, 1)
        for i, j in T.Parallel(64, BS):
            w.ch_s[c][n % 2, j, i] = acc_c[i, j]''', '''        wait_chunk_buffer(w.ch_free[c], n, 1)
        if not skip_stage:
            for i, j in T.Parallel(64, BS):
                w.ch_s[c][n % 2, j, i] = acc_c[i, j]''')
src = replace_once(src, '''                else:
                    T.atomic_addx4(w.dKV[w.b, key, w.g, (c * HALF + k) * 64 + d], w.ch_s[c][n % 2, j, d])''',
                   '''                elif not skip_atomics:
                    T.atomic_addx4(w.dKV[w.b, key, w.g, (c * HALF + k) * 64 + d], w.ch_s[c][n % 2, j, d])''')
open("glm5_dsa_plugin/ops/_exp87.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp87.py")
