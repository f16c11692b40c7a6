"""Writes glm5_dsa_plugin/ops/_exp83.py (ignored by git), session 28: the tree's kernels with
ablation switches on the warp-specialised backward (timing only; dq / dkv come out wrong by design):
``skip_atomics`` (the drain waits for and frees every staged chunk but adds nothing),
``skip_stage`` (the MMA warpgroups compute every dKV^T chunk but do not store it; the drain still
adds the stale buffer), ``hot_gather`` (every block gathers kv rows 0..31, which stay in L1 / L2,
instead of its own keys). With none set the kernel is the tree's (exp83.py compares the generated
CUDA). Run from the repository root."""
from patching import replace_once

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
src = replace_once(src, '''                             mma_regs=216, producer_regs=72, dkv_per_slot=False):''',
                   '''                             mma_regs=216, producer_regs=72, dkv_per_slot=False, skip_atomics=False,
                             skip_stage=False, hot_gather=False):''')
src = replace_once(src, '''    @T.macro
    def gather(w, blk):''', '''    def gather_key(idx, e):
        # hot_gather: kv row e (< 32) instead of the slot's own key
        return e if hot_gather else gather_row(idx, n_kv, True)

    @T.macro
    def gather(w, blk):''')
src = replace_once(src, '''            key = gather_row(w.Indices[w.b, w.s, w.g, blk * BS + e], n_kv, True)
            for u in T.unroll(QW // 64):''', '''            key = gather_key(w.Indices[w.b, w.s, w.g, blk * BS + e], e)
            for u in T.unroll(QW // 64):''')
src = replace_once(src, '''        wait_chunk_buffer(w.ch_free[c], n, 1)
        for i, j in T.Parallel(64, BS):
            w.ch_s[c][n % 2, j, i] = w.acc_t[c][i, j]''', '''        wait_chunk_buffer(w.ch_free[c], n, 1)
        if not skip_stage:
            for i, j in T.Parallel(64, BS):
                w.ch_s[c][n % 2, j, i] = w.acc_t[c][i, j]''')
src = replace_once(src, '''                else:
                    T.atomic_addx4(w.dKV[w.b, key, w.g, (c * HALF + k) * 64 + d], w.ch_s[c][n % 2, j, d])''',
                   '''                elif not skip_atomics:
                    T.atomic_addx4(w.dKV[w.b, key, w.g, (c * HALF + k) * 64 + d], w.ch_s[c][n % 2, j, d])''')
open("glm5_dsa_plugin/ops/_exp83.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp83.py")
