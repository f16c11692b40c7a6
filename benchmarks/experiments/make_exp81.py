"""Writes glm5_dsa_plugin/ops/_exp81.py (ignored by git), session 27: exp77_kernel's pairs with the
tree's staged drain (two staging halves per MMA warpgroup, P's fp32 hand-off through warpgroup 0's
first half; see the module docstring it writes). Run from the repository root."""
from patching import replace_once

src = open("benchmarks/experiments/exp77_kernel.py").read()
src = '''"""exp81 (session 27): exp77's pairs (dKV per pair of 32-slot blocks as [64 slots, 64 features]
chunks, A = dS^T / P^T read once per 64 slots) with the tree's drain: each chunk is staged in shared
memory in two halves of 32 slots ([32, 72] fp32 rows, non-transposed: the MMA warps' 8-byte stores
fall in distinct banks) and the gather warpgroup adds them with 16-byte atomics, as the tree does
(exp79: exp77 without its atomics 0.77x the tree's time; the atomics from the MMA warps cost more
than the staging they save, 1.16x). The 37 KB of staging leave no room for the fp32 P hand-off
buffer: P travels from warpgroup 0 to warpgroup 1 through warpgroup 0's first staging half
([64, 32] as P[h, j] at [h // 2, (h % 2) * 36 + j]), once the drain is done with it (the same wait
as the next staging)."""
''' + src[src.index('from types import SimpleNamespace'):]
src = replace_once(src, '''                             mma_regs=232, producer_regs=40, dkv_per_slot=False, skip_dkv_writes=False):
    """``skip_dkv_writes`` (exp79, an ablation: dkv comes out zero): the chunks' GEMMs run, their
    atomics / stores do not."""
''', '''                             mma_regs=216, producer_regs=72, dkv_per_slot=False):
''')
src = replace_once(src, '''    THREADS = 384
''', '''    THREADS = 384
    CP = 64 + 8  # staging row stride (floats): a half-warp's 8-byte stores of 4 rows x 4 column pairs hit 32 banks
    P32 = CP // 2  # P's [64, 32] in a staging half: row h at [h // 2, (h % 2) * P32]
    assert 2 * P32 >= BS
''')
src = replace_once(src, '''    def add_chunk(w, c, col0, pair):
        # the pair's [64 slots, 64 features] chunk at columns col0: atomics (or per-slot stores) of
        # each thread's column pairs, slots whose key is -1 skipped
        for i, j in T.Parallel(PS, 64):
            if w.kf[c][i] >= (1 << 30 if skip_dkv_writes else 0):
                if dkv_per_slot:
                    w.dKV[w.b, w.s, w.bz, pair * PS + i, col0 + j] = w.acc_k[c][i, j]
                else:
                    T.atomic_add(w.dKV[w.b, w.kf[c][i], w.g, col0 + j], w.acc_k[c][i, j])
''', '''    def wait_free(w, c, hb, n):
        # staging half hb of warpgroup c drained of its use n - 1 (use n may go in; n = 0 passes)
        T.barrier_wait(w.ch_free[c][hb], (n & 1) ^ 1)
''')
src = replace_once(src, '''    def value_chunk(w, c, f, pair):
''', '''    def stage_chunk(w, c, n):
        # warpgroup c's chunk (use n): [64 slots, 64 features] fp32 -> its two halves of 32 slots
        wait_free(w, c, 0, n)
        wait_free(w, c, 1, n)
        for i, j in T.Parallel(PS, 64):
            w.ch_s[c][i, j] = w.acc_k[c][i, j]
        T.barrier_arrive(w.ch_full[c][0])
        T.barrier_arrive(w.ch_full[c][1])

    @T.macro
    def value_chunk(w, c, f, n):
''')
src = replace_once(src, '''        add_chunk(w, c, f * 64, pair)
''', '''        stage_chunk(w, c, n)
''')
src = replace_once(src, '''            for i in T.Parallel(PS):
                w.kf[0][i] = w.kidx_s[i]
''', '''''')
src = replace_once(src, '''                value_chunk(w, 0, k, pair)
''', '''                value_chunk(w, 0, k, pair * N_OWN[0] + k)
''')
src = replace_once(src, '''            for i in T.Parallel(PS):
                w.kf[1][i] = w.kidx_s[i]
''', '''''')
src = replace_once(src, '''                value_chunk(w, 1, HALF + k, pair)
        # P, dS and the keys are rewritten by the next pair: both warpgroups are done reading them
''', '''                value_chunk(w, 1, HALF + k, pair * N_OWN[1] + k)
        # P and dS are rewritten by the next pair: both warpgroups are done reading them
''')
src = replace_once(src, '''        # warpgroup 1: the pair's rope-tail chunk, dS^T Q_tail (dp_s and kf[1] still hold the pair's)
''', '''        # warpgroup 1: the pair's rope-tail chunk, dS^T Q_tail (dp_s still holds the pair's dS)
''')
src = replace_once(src, '''        add_chunk(w, 1, D, pair)
''', '''        stage_chunk(w, 1, pair * N_OWN[1] + N_OWN[1] - 1)
''')
src = replace_once(src, '''    def step(w, blk, u):
        # block blk = 2 * pair + u; its P and dS go to columns [u * BS, (u + 1) * BS) of p_s / dp_s
''', '''    def drain_half(w, pair, c, f, n, hb):
        # half hb (32 slot rows) of warpgroup c's chunk (use n) of pair `pair` at feature chunk f
        tp = w.tx - 256
        T.barrier_wait(w.ch_full[c][hb], n & 1)
        if pair * 2 + hb < w.nb:  # (an odd last pair's second half is stale)
            for r in T.unroll(BS * 16 // 128):
                j = (r * 128 + tp) // 16
                d = (r * 128 + tp) % 16 * 4
                key = w.Indices[w.b, w.s, w.g, (pair * 2 + hb) * BS + j]
                if valid_slot(key, n_kv):
                    if dkv_per_slot:
                        for v in T.vectorized(4):
                            w.dKV[w.b, w.s, w.bz, (pair * 2 + hb) * BS + j, f * 64 + d + v] = w.ch_s[c][hb * BS + j, d + v]
                    else:
                        T.atomic_addx4(w.dKV[w.b, key, w.g, f * 64 + d], w.ch_s[c][hb * BS + j, d])
        T.barrier_arrive(w.ch_free[c][hb])

    @T.macro
    def drain_chunk(w, pair, c, f, n):
        drain_half(w, pair, c, f, n, 0)
        drain_half(w, pair, c, f, n, 1)

    @T.macro
    def step(w, blk, u, pair):
        # block blk = 2 * pair + u; its P and dS go to columns [u * BS, (u + 1) * BS) of p_s / dp_s;
        # P in fp32 to warpgroup 1 through warpgroup 0's first staging half
''')
src = replace_once(src, '''            for j in T.Parallel(BS):
                w.kidx_s[u * BS + j] = T.if_then_else(valid_slot(w.Indices[w.b, w.s, w.g, blk * BS + j], n_kv),
                                                      w.Indices[w.b, w.s, w.g, blk * BS + j], -1)
                if u == 0:
                    if blk + 1 == w.nb:
                        w.kidx_s[BS + j] = -1  # an odd last block: the pair's second half is stale
''', '''''')
src = replace_once(src, '''            T.copy(w.acc_sp, w.p32_s[0:h_blk, 0:BS])
''', '''            if u == 0:
                wait_free(w, 0, 0, pair * N_OWN[0])  # the drain is done with the previous pair's last chunk
            for h, j in T.Parallel(h_blk, BS):
                w.ch_s[0][h // 2, (h % 2) * P32 + j] = w.acc_sp[h, j]
''')
src = replace_once(src, '''                w.acc_ds[h, j] = w.p32_s[h, j] * (w.acc_ds[h, j] - w.delta_s[h]) * scale
''', '''                w.acc_ds[h, j] = w.ch_s[0][h // 2, (h % 2) * P32 + j] * (w.acc_ds[h, j] - w.delta_s[h]) * scale
''')
src = replace_once(src, '''            p32_s = T.alloc_shared([h_blk, BS + 8], acc)
            kidx_s = T.alloc_shared([PS], T.int32)  # the pair's kv rows, -1 where no atomic goes
''', '''            ch_s0 = T.alloc_shared([PS, CP], acc)  # warpgroup 0's staging halves (half 0 also carries P)
            ch_s1 = T.alloc_shared([PS, CP], acc)  # warpgroup 1's
''')
src = replace_once(src, '''            kf0 = T.alloc_fragment([PS], T.int32)  # the pair's keys in the chunk's row layout
            kf1 = T.alloc_fragment([PS], T.int32)
''', '''''')
src = replace_once(src, '''            step_done = T.alloc_barrier(arrive_count=256)
''', '''            step_done = T.alloc_barrier(arrive_count=256)
            ch_full00 = T.alloc_barrier(arrive_count=128)  # per MMA warpgroup and staging half
            ch_full01 = T.alloc_barrier(arrive_count=128)
            ch_full10 = T.alloc_barrier(arrive_count=128)
            ch_full11 = T.alloc_barrier(arrive_count=128)
            ch_free00 = T.alloc_barrier(arrive_count=128)
            ch_free01 = T.alloc_barrier(arrive_count=128)
            ch_free10 = T.alloc_barrier(arrive_count=128)
            ch_free11 = T.alloc_barrier(arrive_count=128)
''')
src = replace_once(src, '''                                kv_s=kv_s, kt_s=kt_s, kv_parts=kv_parts, p_s=p_s, dp_s=dp_s, p32_s=p32_s,
                                kidx_s=kidx_s, delta_s=delta_s, full=full, kv_free=kv_free, p_ready=p_ready,
                                ds_ready=ds_ready, acc_k=(acc_k0, acc_k1), kf=(kf0, kf1), step_done=step_done)
''', '''                                kv_s=kv_s, kt_s=kt_s, kv_parts=kv_parts, p_s=p_s, dp_s=dp_s, ch_s=(ch_s0, ch_s1),
                                delta_s=delta_s, full=full, kv_free=kv_free, p_ready=p_ready, ds_ready=ds_ready,
                                acc_k=(acc_k0, acc_k1), step_done=step_done,
                                ch_full=((ch_full00, ch_full01), (ch_full10, ch_full11)),
                                ch_free=((ch_free00, ch_free01), (ch_free10, ch_free11)))
''')
src = replace_once(src, '''                    step(w, pi * 2, 0)
''', '''                    step(w, pi * 2, 0, pi)
''')
src = replace_once(src, '''                        step(w, pi * 2 + 1, 1)
''', '''                        step(w, pi * 2 + 1, 1, pi)
''')
src = replace_once(src, '''                for i in T.serial(nb):
                    if i + 1 < nb:
                        T.barrier_wait(kv_free, i & 1)
                        gather(w, i + 1)
''', '''                n_pairs = (nb + 1) // 2
                for pi in T.serial(n_pairs):
                    if pi * 2 + 1 < nb:
                        T.barrier_wait(kv_free, 0)  # block 2 pi's dQ is done: gather block 2 pi + 1
                        gather(w, pi * 2 + 1)
                    if pi > 0:
                        drain_chunk(w, pi - 1, 1, NCV, pi * N_OWN[1] - 1)  # the previous pair's rope tail
                    if pi * 2 + 2 < nb:
                        T.barrier_wait(kv_free, 1)  # block 2 pi + 1's dQ is done: gather block 2 pi + 2
                        gather(w, pi * 2 + 2)
                    for k in T.unroll(N_OWN[1] - 1):
                        if k < N_OWN[0]:
                            drain_chunk(w, pi, 0, k, pi * N_OWN[0] + k)
                        drain_chunk(w, pi, 1, HALF + k, pi * N_OWN[1] + k)
                if n_pairs > 0:
                    drain_chunk(w, n_pairs - 1, 1, NCV, n_pairs * N_OWN[1] - 1)
''')
open("glm5_dsa_plugin/ops/_exp81.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp81.py")
