"""Writes glm5_dsa_plugin/ops/_exp107.py (ignored by git), session 31: the drain takes the MMA
warpgroups' chunks in the order they are staged instead of the tree's fixed alternation. exp102:
warpgroup 1 waits 28% of its loop for free chunk buffers, warpgroup 0 18%, and the drain 12% for
a staged chunk; with a fixed order the drain can wait for one warpgroup's next chunk while the
other's is staged and that warpgroup waits for its buffers. Here, before each of a block's nine
chunks, one drain thread tests (``test_wait``, no blocking) whether each warpgroup's next chunk is
staged and picks: warpgroup 0's if it is staged or warpgroup 1 has none left; else warpgroup 1's
if it is staged or warpgroup 0 has none left; else the one with fewer drained (warpgroup 0 on a
tie, the tree's order). The pick goes to the other drain threads through shared memory (two
slots, by chunk parity) behind a 128-thread named barrier, so all four drain warps take the same
chunk (the buffers' free counts all 128 arrivals). Each warpgroup's chunks stay in its own order,
so the buffers' phases are the tree's. Run from the repository root."""
from patching import replace_once

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
src = replace_once(src, '''                    for k in T.unroll(N_OWN[1]):
                        if k < N_OWN[0]:
                            drain_chunk(w, i, 0, k)
                        drain_chunk(w, i, 1, k)''', '''                    taken[0] = 0
                    taken[1] = 0
                    for ci in T.serial(N_OWN[0] + N_OWN[1]):
                        if tx == 256:
                            staged[0] = 0
                            staged[1] = 0
                            if taken[0] < N_OWN[0]:
                                chunk_staged(0, i * N_OWN[0] + taken[0], staged, 0)
                            if taken[1] < N_OWN[1]:
                                chunk_staged(1, i * N_OWN[1] + taken[1], staged, 1)
                            pick_s[ci % 2] = T.if_then_else(
                                (taken[1] >= N_OWN[1]) | ((taken[0] < N_OWN[0]) & ((staged[0] == 1) | (
                                    (staged[1] == 0) & (taken[0] <= taken[1])))), 0, 1)
                        T.sync_threads(9, 128)
                        if pick_s[ci % 2] == 0:
                            drain_chunk(w, i, 0, taken[0])
                            taken[0] = taken[0] + 1
                        else:
                            drain_chunk(w, i, 1, taken[1])
                            taken[1] = taken[1] + 1''')
src = replace_once(src, '''            drain_vals = T.alloc_local([BS * 16 // 32], acc)  # and its values of the chunk (4 x 16 bytes)
''', '''            drain_vals = T.alloc_local([BS * 16 // 32], acc)  # and its values of the chunk (4 x 16 bytes)
            taken = T.alloc_local([2], T.int32)  # exp107: chunks drained per warpgroup in this block
            staged = T.alloc_local([2], T.int32)  # exp107: each warpgroup's next chunk is staged
            pick_s = T.alloc_shared([2], T.int32)  # exp107: the warpgroup whose chunk goes next
''')
src = replace_once(src, '''    @T.macro
    def drain_chunk(w, blk, c, k):''', '''    @T.macro
    def chunk_staged(c, n, out, e):
        # exp107: out[e] := 1 if warpgroup c's chunk n is staged (mbarrier test_wait: no blocking)
        if n % 2 == 0:
            out[e] = T.cast(T.call_extern("bool", f"ch_full{c}0[0].test_wait", (n // 2) & 1, 1), T.int32)
        else:
            out[e] = T.cast(T.call_extern("bool", f"ch_full{c}1[0].test_wait", (n // 2) & 1, 1), T.int32)

    @T.macro
    def drain_chunk(w, blk, c, k):''')
open("glm5_dsa_plugin/ops/_exp107.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp107.py")
