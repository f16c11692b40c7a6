"""Writes glm5_dsa_plugin/ops/_exp94.py (ignored by git), session 29: v31's drain frees each chunk
buffer before it issues the chunk's atomics. The tree's drain waits for a chunk, issues its four
16-byte atomics per thread straight from shared memory and only then arrives on the buffer's free
barrier; that arrive has release semantics, so it also waits behind the atomics' issue, which
stalls whenever the memory system pushes back. exp94: each thread reads its four slot keys before
the wait, its chunk values (four 16-byte vectors) into registers after it, arrives on the free
barrier, then issues the atomics (deterministic mode: the stores) from registers. exp91 / exp92
(two drain warpgroups) were slower: the drain's issue rate is not the limit; what the MMA
warpgroups wait for may be the buffers' release. Run from the repository root."""
from patching import replace_once
from v31_drain import V31_DRAIN_BODY

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
src = replace_once(src, V31_DRAIN_BODY, '''        tp = w.tx - 256
        n = blk * N_OWN[c] + k
        for r in T.unroll(BS * 16 // 128):  # exp94: keys before the wait, values into registers, free, add
            w.dkeys[r] = w.Indices[w.b, w.s, w.g, blk * BS + (r * 128 + tp) // 16]
        wait_chunk_buffer(w.ch_full[c], n, 0)
        for r in T.unroll(BS * 16 // 128):
            for v in T.vectorized(4):
                w.dvals[r * 4 + v] = w.ch_s[c][n % 2, (r * 128 + tp) // 16, (r * 128 + tp) % 16 * 4 + v]
        arrive_chunk_buffer(w.ch_free[c], n)
        for r in T.unroll(BS * 16 // 128):
            j = (r * 128 + tp) // 16
            d = (r * 128 + tp) % 16 * 4
            if valid_slot(w.dkeys[r], n_kv):
                if dkv_per_slot:
                    for v in T.vectorized(4):
                        w.dKV[w.b, w.s, w.bz, blk * BS + j, (c * HALF + k) * 64 + d + v] = w.dvals[r * 4 + v]
                else:
                    T.atomic_addx4(w.dKV[w.b, w.dkeys[r], w.g, (c * HALF + k) * 64 + d], w.dvals[r * 4])''')
src = replace_once(src, '''            step_done = T.alloc_barrier(arrive_count=256)
''', '''            step_done = T.alloc_barrier(arrive_count=256)
            dkeys = T.alloc_local([BS * 16 // 128], T.int32)  # exp94: a drain thread's slot keys of a chunk
            dvals = T.alloc_local([BS * 16 // 32], acc)  # exp94: its chunk values
''')
src = replace_once(src, '''                                step_done=step_done)''', '''                                step_done=step_done, dkeys=dkeys, dvals=dvals)''')
open("glm5_dsa_plugin/ops/_exp94.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp94.py")
