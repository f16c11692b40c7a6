"""Writes glm5_dsa_plugin/ops/_exp66.py (ignored by git), session 23: the tree's warp-specialised
backward with the drain warpgroup's kv row numbers loaded once per block. Each thread of the drain
adds 4 slots' 16 bytes per chunk (j = r * 8 + tp / 16, r < 4) and reloads those 4 indices from
global memory for every one of a block's 9 chunks (36 loads per block, 32 of them repeats, each
ahead of its atomics). Here they go to 4 registers after the next block's gather is issued, with
the padding test folded in (-1 for a slot without a row). Run from the repository root."""
from patching import replace_once

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
src = replace_once(src, '''        for r in T.unroll(BS * 16 // 128):
            j = (r * 128 + tp) // 16
            d = (r * 128 + tp) % 16 * 4
            key = w.Indices[w.b, w.s, w.g, blk * BS + j]
            if valid_slot(key, n_kv):
                T.atomic_addx4(w.dKV[w.b, key, w.g, (c * HALF + k) * 64 + d], w.ch_s[c][n % 2, j, d])''',
    '''        for r in T.unroll(BS * 16 // 128):
            j = (r * 128 + tp) // 16
            d = (r * 128 + tp) % 16 * 4
            if w.drain_keys[r] >= 0:
                T.atomic_addx4(w.dKV[w.b, w.drain_keys[r], w.g, (c * HALF + k) * 64 + d], w.ch_s[c][n % 2, j, d])''')
src = replace_once(src, '''                T.set_max_nreg(producer_regs, 0)
                for i in T.serial(nb):
                    if i + 1 < nb:
                        T.barrier_wait(kv_free, i & 1)
                        gather(w, i + 1)
''', '''                T.set_max_nreg(producer_regs, 0)
                for i in T.serial(nb):
                    if i + 1 < nb:
                        T.barrier_wait(kv_free, i & 1)
                        gather(w, i + 1)
                    for r in T.unroll(BS * 16 // 128):  # this thread's slots of block i (drain_chunk's j)
                        key = Indices[b, s, g, i * BS + (r * 128 + tx - 256) // 16]
                        drain_keys[r] = T.if_then_else(valid_slot(key, n_kv), key, -1)
''')
at = src.index("def sparse_mla_bwd_ws_kernel(")
head, tail = src[:at], src[at:]
line = '''            valid = T.alloc_fragment([BS], "bool" if R == 1 else T.int32)  # R > 1: member bits
'''
assert tail.count(line) == 1
tail = tail.replace(line, line + '''            drain_keys = T.alloc_local([BS * 16 // 128], T.int32)  # exp66: the drain's rows of this block
''')
assert tail.count("w = SimpleNamespace(tx=tx, ") == 1
tail = tail.replace("w = SimpleNamespace(tx=tx, ", "w = SimpleNamespace(tx=tx, drain_keys=drain_keys, ")
src = head + tail
open("glm5_dsa_plugin/ops/_exp66.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp66.py")
