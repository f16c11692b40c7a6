"""Writes glm5_dsa_plugin/ops/_exp89.py and _exp90.py (ignored by git), session 28 (prepared, not
run): the drain reads each thread's four slot keys once per block into registers instead of
once per chunk (36 global loads per block and thread become 4; each load sat between the chunk's
wait and its atomics). exp89 = v31 + that; exp90 = exp88 (the MMA warpgroups gather, the drain
only adds) + that. Session 14 measured the same change at 232 / 40 registers within 1%; since
v31 the drain is the backward's next limit (exp86 / exp87). Runs make_exp88.py first. Run from
the repository root."""
import runpy

from patching import replace_once


def keys_once_per_block(src: str) -> str:
    """``src`` (a module holding the warp-specialised backward) with the drain's keys read once per block."""
    src = replace_once(src, '''            key = w.Indices[w.b, w.s, w.g, blk * BS + j]
            if valid_slot(key, n_kv):''', '''            key = w.dkeys[r]  # (exp89: read once per block)
            if valid_slot(key, n_kv):''')
    src = replace_once(src, '''            step_done = T.alloc_barrier(arrive_count=256)
''', '''            step_done = T.alloc_barrier(arrive_count=256)
            dkeys = T.alloc_local([BS * 16 // 128], T.int32)  # exp89: the drain thread's slot keys of a block
''')
    src = replace_once(src, '''                                step_done=step_done)''', '''                                step_done=step_done, dkeys=dkeys)''')
    return replace_once(src, '''                    for k in T.unroll(N_OWN[1]):
                        if k < N_OWN[0]:''', '''                    for r in T.unroll(BS * 16 // 128):
                        dkeys[r] = Indices[b, s, g, i * BS + (r * 128 + tx - 256) // 16]
                    for k in T.unroll(N_OWN[1]):
                        if k < N_OWN[0]:''')


runpy.run_path("benchmarks/experiments/make_exp88.py")
open("glm5_dsa_plugin/ops/_exp89.py", "w").write(
    keys_once_per_block(open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()))
open("glm5_dsa_plugin/ops/_exp90.py", "w").write(keys_once_per_block(open("glm5_dsa_plugin/ops/_exp88.py").read()))
print("wrote glm5_dsa_plugin/ops/_exp89.py, _exp90.py")
