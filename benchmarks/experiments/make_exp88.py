"""Writes glm5_dsa_plugin/ops/_exp88.py (ignored by git), session 28 (prepared, not run): v31's
backward with the kv gathers issued by the MMA warpgroups, so the third warpgroup only drains.
exp87: the drain's atomics cost v31 1.3 ms at W2 H64 (1.8 at W1), the drain at 40 registers
instead of 56 loses 1.5-2% (exp86), and one 128-thread warpgroup adds contributions at 3.8 TB/s
at most (exp83). The dQ GEMMs split dQ's columns between the MMA warpgroups (FullCol: warpgroup c
reads kv columns [c * d_v / 2, (c + 1) * d_v / 2) and the rope tail's [d_v + 32 c, d_v + 32 c +
32); the generated CUDA's B descriptors step by warpgroup), so each warpgroup gathers block i + 1's
columns it alone reads as soon as its own dQ GEMMs of block i are done: no kv_free barrier, and
`full` counts 256 arrivals. Each MMA thread loads its two kv rows' keys for block i + 1 at the
start of step i (their latency then hides under the step). Block 0 is gathered the same way before
the prologue's tile loads. Run from the repository root."""
from patching import replace_once

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
src = replace_once(src, '''    @T.macro
    def wait_chunk_buffer(bars, n, flip):''', '''    @T.macro
    def load_keys(w, blk):
        # MMA thread: the kv rows it gathers for block blk (rows tp // 8 and 16 + tp // 8)
        tp = w.tx % 128
        for rr in T.unroll(BS // 16):
            w.keys[rr] = gather_row(w.Indices[w.b, w.s, w.g, blk * BS + rr * 16 + tp // 8], n_kv, True)

    @T.macro
    def gather_own(w, c):
        # MMA warpgroup c: the kv columns its dQ GEMMs read, for the rows of ``keys``: 64-column units
        # c * NCV / 2 ... of the first d_v, and 32 of the rope tail's 64 (8 threads per row, 16 bytes
        # per copy, 16 rows per pass; half the threads copy the tail)
        tp = w.tx % 128
        k8 = tp % 8 * 8
        for rr in T.unroll(BS // 16):
            e = rr * 16 + tp // 8
            for u in T.unroll(NCV // 2):
                T.ptx_cp_async(T.access_ptr(w.kv_s[e, (c * (NCV // 2) + u) * 64 + k8], "w", 8),
                               T.access_ptr(w.KV[w.b, w.keys[rr], w.g, (c * (NCV // 2) + u) * 64 + k8], "r", 8), 8)
            if tp % 8 < 4:
                if one_tile:
                    T.ptx_cp_async(T.access_ptr(w.kv_s[e, D + c * 32 + k8], "w", 8),
                                   T.access_ptr(w.KV[w.b, w.keys[rr], w.g, D + c * 32 + k8], "r", 8), 8)
                else:
                    T.ptx_cp_async(T.access_ptr(w.kt_s[e, c * 32 + k8], "w", 8),
                                   T.access_ptr(w.KV[w.b, w.keys[rr], w.g, D + c * 32 + k8], "r", 8), 8)
        T.cp_async_barrier_noinc(w.full)

    @T.macro
    def wait_chunk_buffer(bars, n, flip):''')
src = replace_once(src, '''    def dkv_by_chunks(w, c, f0, count, n0):
        # warpgroup c's chunks f0 .. f0 + count - 1 of this block (numbers n0 ..), issued right behind
        # the dQ GEMMs, which are waited for here (the first chunk's two groups run on)
        issue_chunk(w, f0, w.acc_t[c])
        T.wait_wgmma(2)
        T.warpgroup_fence_operand(w.acc_dq, num_regs=h_blk * D // 256)
        T.barrier_arrive(w.kv_free)  # warpgroup 2 may gather the next block now''', '''    def dkv_by_chunks(w, c, f0, count, n0, blk):
        # warpgroup c's chunks f0 .. f0 + count - 1 of this block (numbers n0 ..), issued right behind
        # the dQ GEMMs, which are waited for here (the first chunk's two groups run on)
        issue_chunk(w, f0, w.acc_t[c])
        T.wait_wgmma(2)
        T.warpgroup_fence_operand(w.acc_dq, num_regs=h_blk * D // 256)
        if blk + 1 < w.nb:
            gather_own(w, c)  # exp88: this warpgroup's columns of the next block''')
src = replace_once(src, '''        if w.tx < 128:
            dkv_by_chunks(w, 0, 0, N_OWN[0], blk * N_OWN[0])
        else:
            dkv_by_chunks(w, 1, HALF, N_OWN[1] - 1, blk * N_OWN[1])''', '''        if w.tx < 128:
            dkv_by_chunks(w, 0, 0, N_OWN[0], blk * N_OWN[0], blk)
        else:
            dkv_by_chunks(w, 1, HALF, N_OWN[1] - 1, blk * N_OWN[1], blk)''')
src = replace_once(src, '''    def step(w, blk):
        T.barrier_wait(w.full, blk & 1)
''', '''    def step(w, blk):
        if blk + 1 < w.nb:
            load_keys(w, blk + 1)  # exp88: the next block's keys, under this step
        T.barrier_wait(w.full, blk & 1)
''')
src = replace_once(src, '''            full = T.alloc_barrier(arrive_count=128)  # the gatherers' cp.async landed
            kv_free = T.alloc_barrier(arrive_count=256)  # the MMA warpgroups are done with kv_s / kt_s''',
                   '''            full = T.alloc_barrier(arrive_count=256)  # exp88: both MMA warpgroups' cp.async landed
            keys = T.alloc_local([BS // 16], T.int32)  # exp88: an MMA thread's kv rows of the next block''')
src = replace_once(src, '''full=full, kv_free=kv_free, p_ready=p_ready,''', '''full=full, keys=keys, nb=nb, p_ready=p_ready,''')
src = replace_once(src, '''            if tx >= 256:
                if nb > 0:
                    gather(w, 0)''', '''            if tx < 256:
                if nb > 0:
                    load_keys(w, 0)
                    gather_own(w, tx // 128)''')
src = replace_once(src, '''                for i in T.serial(nb):
                    if i + 1 < nb:
                        T.barrier_wait(kv_free, i & 1)
                        gather(w, i + 1)
                    for k in T.unroll(N_OWN[1]):''', '''                for i in T.serial(nb):
                    for k in T.unroll(N_OWN[1]):''')
open("glm5_dsa_plugin/ops/_exp88.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp88.py")
