"""Writes glm5_dsa_plugin/ops/_exp78.py (ignored by git), session 27: exp77_kernel's backward with pair
i - 1's dKV chunks spread over pair i (half after each block's dQ GEMM), P / dS / keys double-buffered
by pair parity (see the module docstring it writes). Run from the repository root."""
from patching import replace_once

src = open("benchmarks/experiments/exp77_kernel.py").read()
src = '''"""exp78 (session 27): exp77's backward (dKV per pair of 32-slot blocks as [64 slots, 64 features]
chunks, atomics from the MMA registers, no staging, no drain) with pair i - 1's chunks spread over
pair i: half of each warpgroup's chunks after each block's dQ GEMM, where the gather of the next
block lands (exp77 ran a pair's chunks after its second block, so nothing hid the gather of the
pair's second block: 15-17% slower than the tree). P, dS and the keys are double-buffered by pair
parity (two [64, 64] bf16 tiles each: 219 KB in all); the pair loop is unrolled by two so every
buffer choice is static. Warpgroup 1 still computes the rope-tail chunk of pair i - 1 between its
dP GEMM and its wait for P of block 2i; the last pair's chunks run after the loop."""
''' + src[src.index('from types import SimpleNamespace'):]
src = replace_once(src, '''                             mma_regs=232, producer_regs=40, dkv_per_slot=False, skip_dkv_writes=False):
    """``skip_dkv_writes`` (exp79, an ablation: dkv comes out zero): the chunks' GEMMs run, their
    atomics / stores do not."""
''', '''                             mma_regs=232, producer_regs=40, dkv_per_slot=False):
''')
src = replace_once(src, '''            if w.kf[c][i] >= (1 << 30 if skip_dkv_writes else 0):
''', '''            if w.kf[c][i] >= 0:
''')
src = replace_once(src, '''    def value_chunk(w, c, f, pair):
        # dKV[pair slots, f * 64:(f + 1) * 64] = dS^T Q[:, f] + P^T dO[:, f]
        T.gemm(w.dp_s, w.q_s[0:h_blk, f * 64:(f + 1) * 64], w.acc_k[c], transpose_A=True,
''', '''    def value_chunk(w, c, f, pair, buf):
        # dKV[pair slots, f * 64:(f + 1) * 64] = dS^T Q[:, f] + P^T dO[:, f] (buffers `buf`: the pair's)
        T.gemm(w.dp_s[buf], w.q_s[0:h_blk, f * 64:(f + 1) * 64], w.acc_k[c], transpose_A=True,
''')
src = replace_once(src, '''        T.gemm(w.p_s, w.do_s[0:h_blk, f * 64:(f + 1) * 64], w.acc_k[c], transpose_A=True,
''', '''        T.gemm(w.p_s[buf], w.do_s[0:h_blk, f * 64:(f + 1) * 64], w.acc_k[c], transpose_A=True,
''')
src = replace_once(src, '''    def dkv_by_chunks(w, pair):
''', '''    def chunks(w, pair, buf, part, parts):
        # part `part` of `parts` of each warpgroup's d_v chunks of pair `pair` (warpgroup 0: chunks
        # [0, HALF), warpgroup 1: [HALF, NCV); the rope tail separately)
        if w.tx < 128:
            for k in T.unroll(part * HALF // parts, (part + 1) * HALF // parts):
                value_chunk(w, 0, k, pair, buf)
        else:
            for k in T.unroll(part * (NCV - HALF) // parts, (part + 1) * (NCV - HALF) // parts):
                value_chunk(w, 1, HALF + k, pair, buf)

    @T.macro
    def load_keys(w, buf):
        # each warpgroup's registers: the kv rows of the pair in buffers `buf`, in the chunks' row layout
''')
src = replace_once(src, '''                w.kf[0][i] = w.kidx_s[i]
            for k in T.unroll(N_OWN[0]):
                value_chunk(w, 0, k, pair)
''', '''                w.kf[0][i] = w.kidx_s[buf, i]
''')
src = replace_once(src, '''                w.kf[1][i] = w.kidx_s[i]
            for k in T.unroll(N_OWN[1] - 1):
                value_chunk(w, 1, HALF + k, pair)
        # P, dS and the keys are rewritten by the next pair: both warpgroups are done reading them
        T.barrier_arrive(w.step_done)
        T.barrier_wait(w.step_done, pair & 1)
''', '''                w.kf[1][i] = w.kidx_s[buf, i]
''')
src = replace_once(src, '''    def tail_chunk(w, pair):
        # warpgroup 1: the pair's rope-tail chunk, dS^T Q_tail (dp_s and kf[1] still hold the pair's)
        T.gemm(w.dp_s, w.q_parts[1], w.acc_k[1], transpose_A=True, policy=T.GemmWarpPolicy.FullRow,
''', '''    def tail_chunk(w, pair, buf):
        # warpgroup 1: the pair's rope-tail chunk, dS^T Q_tail
        T.gemm(w.dp_s[buf], w.q_parts[1], w.acc_k[1], transpose_A=True, policy=T.GemmWarpPolicy.FullRow,
''')
src = replace_once(src, '''    def step(w, blk, u):
        # block blk = 2 * pair + u; its P and dS go to columns [u * BS, (u + 1) * BS) of p_s / dp_s
''', '''    def step(w, blk, u, buf):
        # block blk = 2 * pair + u; its P and dS go to columns [u * BS, (u + 1) * BS) of buffers `buf`
''')
src = replace_once(src, '''                w.kidx_s[u * BS + j] = T.if_then_else(valid_slot(w.Indices[w.b, w.s, w.g, blk * BS + j], n_kv),
                                                      w.Indices[w.b, w.s, w.g, blk * BS + j], -1)
''', '''                w.kidx_s[buf, u * BS + j] = T.if_then_else(
                    valid_slot(w.Indices[w.b, w.s, w.g, blk * BS + j], n_kv), w.Indices[w.b, w.s, w.g, blk * BS + j], -1)
''')
src = replace_once(src, '''                        w.kidx_s[BS + j] = -1  # an odd last block: the pair's second half is stale
''', '''                        w.kidx_s[buf, BS + j] = -1  # an odd last block: the pair's second half is stale
''')
src = replace_once(src, '''            T.copy(w.acc_sp, w.p_s[0:h_blk, u * BS:(u + 1) * BS])
''', '''            T.copy(w.acc_sp, w.p_s[buf][0:h_blk, u * BS:(u + 1) * BS])
''')
src = replace_once(src, '''                    tail_chunk(w, blk // 2 - 1)
''', '''                    tail_chunk(w, blk // 2 - 1, 1 - buf)  # kf[1] holds the previous pair's rows
''')
src = replace_once(src, '''            T.copy(w.acc_ds, w.dp_s[0:h_blk, u * BS:(u + 1) * BS])
''', '''            T.copy(w.acc_ds, w.dp_s[buf][0:h_blk, u * BS:(u + 1) * BS])
''')
src = replace_once(src, '''        T.gemm(w.dp_s[0:h_blk, u * BS:(u + 1) * BS], w.kv_parts[0], w.acc_dq, policy=T.GemmWarpPolicy.FullCol,
''', '''        T.gemm(w.dp_s[buf][0:h_blk, u * BS:(u + 1) * BS], w.kv_parts[0], w.acc_dq, policy=T.GemmWarpPolicy.FullCol,
''')
src = replace_once(src, '''        T.gemm(w.dp_s[0:h_blk, u * BS:(u + 1) * BS], w.kv_parts[1], w.acc_dqt, policy=T.GemmWarpPolicy.FullCol)
''', '''        T.gemm(w.dp_s[buf][0:h_blk, u * BS:(u + 1) * BS], w.kv_parts[1], w.acc_dqt, policy=T.GemmWarpPolicy.FullCol)
''')
src = replace_once(src, '''        T.barrier_arrive(w.kv_free)
''', '''        T.barrier_arrive(w.kv_free)

    @T.macro
    def pair_of_blocks(w, pi, buf):
        # pair pi (buffers buf): its two blocks, each followed by half of pair pi - 1's chunks
        if pi > 0:
            load_keys(w, 1 - buf)
        step(w, pi * 2, 0, buf)
        if pi > 0:
            chunks(w, pi - 1, 1 - buf, 0, 2)
        if pi * 2 + 1 < w.nb:
            step(w, pi * 2 + 1, 1, buf)
        if pi > 0:
            chunks(w, pi - 1, 1 - buf, 1, 2)
        # pair pi - 1's buffers are rewritten by pair pi + 1: both warpgroups are done with them
        T.barrier_arrive(w.step_done)
        T.barrier_wait(w.step_done, buf)
''')
src = replace_once(src, '''            p_s = T.alloc_shared([h_blk, PS], dtype)  # the pair's P (bf16), block u in columns u * BS
            dp_s = T.alloc_shared([h_blk, PS], dtype)  # the pair's dS
''', '''            # by pair parity: the pair's P / dS (bf16, block u in columns u * BS) and kv rows (-1: no atomic)
            p_s0 = T.alloc_shared([h_blk, PS], dtype)
            p_s1 = T.alloc_shared([h_blk, PS], dtype)
            dp_s0 = T.alloc_shared([h_blk, PS], dtype)
            dp_s1 = T.alloc_shared([h_blk, PS], dtype)
''')
src = replace_once(src, '''            kidx_s = T.alloc_shared([PS], T.int32)  # the pair's kv rows, -1 where no atomic goes
''', '''            kidx_s = T.alloc_shared([2, PS], T.int32)
''')
src = replace_once(src, '''                                kv_s=kv_s, kt_s=kt_s, kv_parts=kv_parts, p_s=p_s, dp_s=dp_s, p32_s=p32_s,
''', '''                                kv_s=kv_s, kt_s=kt_s, kv_parts=kv_parts, p_s=(p_s0, p_s1), dp_s=(dp_s0, dp_s1), p32_s=p32_s,
''')
src = replace_once(src, '''                for pi in T.serial((nb + 1) // 2):
                    step(w, pi * 2, 0)
                    if pi * 2 + 1 < nb:
                        step(w, pi * 2 + 1, 1)
                    dkv_by_chunks(w, pi)
                if tx >= 128:
                    if nb > 0:
                        tail_chunk(w, (nb - 1) // 2)
''', '''                n_pairs = (nb + 1) // 2
                for pq in T.serial((n_pairs + 1) // 2):
                    pair_of_blocks(w, pq * 2, 0)
                    if pq * 2 + 1 < n_pairs:
                        pair_of_blocks(w, pq * 2 + 1, 1)
                if n_pairs > 0:
                    # the last pair's chunks and tail (its buffers: its parity)
                    if (n_pairs - 1) % 2 == 0:
                        load_keys(w, 0)
                        chunks(w, n_pairs - 1, 0, 0, 1)
                        if tx >= 128:
                            tail_chunk(w, n_pairs - 1, 0)
                    else:
                        load_keys(w, 1)
                        chunks(w, n_pairs - 1, 1, 0, 1)
                        if tx >= 128:
                            tail_chunk(w, n_pairs - 1, 1)
''')
open("glm5_dsa_plugin/ops/_exp78.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp78.py")
