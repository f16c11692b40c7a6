"""Writes glm5_dsa_plugin/ops/_exp80.py (ignored by git), session 27: exp77_kernel's backward with each
warpgroup's dKV chunks software-pipelined through two accumulators (see the module docstring it
writes). Run from the repository root."""
from patching import replace_once

src = open("benchmarks/experiments/exp77_kernel.py").read()
src = '''"""exp80 (session 27): exp77's backward with each warpgroup's dKV chunks software-pipelined: two
chunk accumulators, chunk k + 1's GEMMs issued before chunk k's atomics go out, so the tensor cores
run while the atomics issue (exp79: without its atomics exp77 took 0.77x the tree's time, with them
1.16x: the atomics from the MMA warps stalled them)."""
''' + src[src.index('from types import SimpleNamespace'):]
src = replace_once(src, '''    def add_chunk(w, c, col0, pair):
''', '''    def add_chunk(w, c, col0, pair, slot):
''')
src = replace_once(src, '''                    w.dKV[w.b, w.s, w.bz, pair * PS + i, col0 + j] = w.acc_k[c][i, j]
''', '''                    w.dKV[w.b, w.s, w.bz, pair * PS + i, col0 + j] = w.acc_k[c][slot][i, j]
''')
src = replace_once(src, '''                    T.atomic_add(w.dKV[w.b, w.kf[c][i], w.g, col0 + j], w.acc_k[c][i, j])
''', '''                    T.atomic_add(w.dKV[w.b, w.kf[c][i], w.g, col0 + j], w.acc_k[c][slot][i, j])
''')
src = replace_once(src, '''    def value_chunk(w, c, f, pair):
        # dKV[pair slots, f * 64:(f + 1) * 64] = dS^T Q[:, f] + P^T dO[:, f]
        T.gemm(w.dp_s, w.q_s[0:h_blk, f * 64:(f + 1) * 64], w.acc_k[c], transpose_A=True,
''', '''    def issue_chunk(w, c, f, slot):
        # dKV[pair slots, f * 64:(f + 1) * 64] = dS^T Q[:, f] + P^T dO[:, f] into accumulator `slot`, not waited for
        T.gemm(w.dp_s, w.q_s[0:h_blk, f * 64:(f + 1) * 64], w.acc_k[c][slot], transpose_A=True,
''')
src = replace_once(src, '''        T.gemm(w.p_s, w.do_s[0:h_blk, f * 64:(f + 1) * 64], w.acc_k[c], transpose_A=True,
               policy=T.GemmWarpPolicy.FullRow)
        add_chunk(w, c, f * 64, pair)
''', '''        T.gemm(w.p_s, w.do_s[0:h_blk, f * 64:(f + 1) * 64], w.acc_k[c][slot], transpose_A=True,
               policy=T.GemmWarpPolicy.FullRow, annotations={"wg_wait": -1})

    @T.macro
    def chunks_pipelined(w, c, f0, n, pair):
        # chunks f0 .. f0 + n - 1 (n even) through accumulators 0, 1, 0, 1, ...: each chunk's atomics
        # go out while the next chunk's GEMMs run
        issue_chunk(w, c, f0, 0)
        for kk in T.unroll(n // 2):
            issue_chunk(w, c, f0 + kk * 2 + 1, 1)
            T.wait_wgmma(2)  # the previous chunk's two GEMMs are done (this one's may run on)
            T.warpgroup_fence_operand(w.acc_k[c][0], num_regs=PS * 64 // 128)
            add_chunk(w, c, (f0 + kk * 2) * 64, pair, 0)
            if kk * 2 + 2 < n:
                issue_chunk(w, c, f0 + kk * 2 + 2, 0)
                T.wait_wgmma(2)
            else:
                T.wait_wgmma(0)
            T.warpgroup_fence_operand(w.acc_k[c][1], num_regs=PS * 64 // 128)
            add_chunk(w, c, (f0 + kk * 2 + 1) * 64, pair, 1)
''')
src = replace_once(src, '''    def dkv_by_chunks(w, pair):
''', '''    def dkv_by_chunks(w, pair):
        assert N_OWN[0] % 2 == 0 and (N_OWN[1] - 1) % 2 == 0
''')
src = replace_once(src, '''            for k in T.unroll(N_OWN[0]):
                value_chunk(w, 0, k, pair)
''', '''            chunks_pipelined(w, 0, 0, N_OWN[0], pair)
''')
src = replace_once(src, '''            for k in T.unroll(N_OWN[1] - 1):
                value_chunk(w, 1, HALF + k, pair)
''', '''            chunks_pipelined(w, 1, HALF, N_OWN[1] - 1, pair)
''')
src = replace_once(src, '''        T.gemm(w.dp_s, w.q_parts[1], w.acc_k[1], transpose_A=True, policy=T.GemmWarpPolicy.FullRow,
''', '''        T.gemm(w.dp_s, w.q_parts[1], w.acc_k[1][0], transpose_A=True, policy=T.GemmWarpPolicy.FullRow,
''')
src = replace_once(src, '''        add_chunk(w, 1, D, pair)
''', '''        add_chunk(w, 1, D, pair, 0)
''')
src = replace_once(src, '''            acc_k0 = T.alloc_fragment([PS, 64], acc)  # a dKV chunk, per warpgroup
            acc_k1 = T.alloc_fragment([PS, 64], acc)
''', '''            acc_k0a = T.alloc_fragment([PS, 64], acc)  # two dKV chunks in flight, per warpgroup
            acc_k0b = T.alloc_fragment([PS, 64], acc)
            acc_k1a = T.alloc_fragment([PS, 64], acc)
            acc_k1b = T.alloc_fragment([PS, 64], acc)
''')
src = replace_once(src, '''                                ds_ready=ds_ready, acc_k=(acc_k0, acc_k1), kf=(kf0, kf1), step_done=step_done)
''', '''                                ds_ready=ds_ready, acc_k=((acc_k0a, acc_k0b), (acc_k1a, acc_k1b)), kf=(kf0, kf1), step_done=step_done)
''')
open("glm5_dsa_plugin/ops/_exp80.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp80.py")
