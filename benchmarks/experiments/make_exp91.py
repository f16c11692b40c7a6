"""Writes glm5_dsa_plugin/ops/_exp91.py and _exp92.py (ignored by git), session 29: v31's backward
with a fourth warpgroup, so two warpgroups drain (512 threads; registers 224 / 224 / 32 / 32, the
register file's 64 K exactly). exp87: the drain's atomics cost v31 1.3 ms at W2 H64 (1.8 at W1);
exp83: one 128-thread warpgroup adds contributions at 3.8 TB/s at most, three at 5.1, so the limit
is requests in flight per warpgroup. exp91: warpgroup 2 gathers and drains warpgroup 0's chunks (4
per block), warpgroup 3 drains warpgroup 1's (5 per block, with the rope tail). exp92: both drain
every chunk, each 16 of its 32 slots (the chunk buffers' free barriers count 256 arrivals);
warpgroup 2 also gathers. exp93, the control: the tree with only their split of dQ's accumulator
(``split_dq``). Run from the repository root."""
from patching import replace_once

tree = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()


def split_dq(src: str) -> str:
    """dQ's [64, d_v] accumulator as two [64, d_v / 2] halves, two GEMMs: with 512 threads ptxas
    compiles every instruction within the launch's 128 registers, and one m64n256 wgmma per
    warpgroup needs 154 (C7602)."""
    src = replace_once(src, '''            acc_dq = T.alloc_fragment([h_blk, D], acc)
            acc_dqt = T.alloc_fragment([h_blk, DT], acc)
            lse_log2''', '''            acc_dq = T.alloc_fragment([h_blk, D // 2], acc)  # exp91: two halves
            acc_dq2 = T.alloc_fragment([h_blk, D // 2], acc)
            acc_dqt = T.alloc_fragment([h_blk, DT], acc)
            lse_log2''')
    src = replace_once(src, "                                acc_dq=acc_dq, acc_dqt=acc_dqt,\n",
                       "                                acc_dq=acc_dq, acc_dq2=acc_dq2, acc_dqt=acc_dqt,\n")
    src = replace_once(src, "        T.warpgroup_fence_operand(w.acc_dq, num_regs=h_blk * D // 256)\n",
                       "        T.warpgroup_fence_operand(w.acc_dq, num_regs=h_blk * D // 512)\n"
                       "        T.warpgroup_fence_operand(w.acc_dq2, num_regs=h_blk * D // 512)\n")
    src = replace_once(src, "        T.gemm(w.dp_s, w.kv_parts[0], w.acc_dq, policy=T.GemmWarpPolicy.FullCol, "
                            "annotations={\"wg_wait\": -1})\n",
                       "        T.gemm(w.dp_s, w.kv_s[0:BS, 0:D // 2], w.acc_dq, policy=T.GemmWarpPolicy.FullCol,\n"
                       "               annotations={\"wg_wait\": -1})\n"
                       "        T.gemm(w.dp_s, w.kv_s[0:BS, D // 2:D], w.acc_dq2, policy=T.GemmWarpPolicy.FullCol,\n"
                       "               annotations={\"wg_wait\": -1})\n")
    src = replace_once(src, "                T.clear(acc_dq)\n                T.clear(acc_dqt)\n",
                       "                T.clear(acc_dq)\n                T.clear(acc_dq2)\n                T.clear(acc_dqt)\n")
    src = replace_once(src, "                _flag_nonfinite(Flags, acc_dq, h_blk, D)\n",
                       "                _flag_nonfinite(Flags, acc_dq, h_blk, D // 2)\n"
                       "                _flag_nonfinite(Flags, acc_dq2, h_blk, D // 2)\n")
    src = replace_once(src, "                    T.copy(acc_dq, q_s[0:h_blk, 0:D])\n",
                       "                    T.copy(acc_dq, q_s[0:h_blk, 0:D // 2])\n"
                       "                    T.copy(acc_dq2, q_s[0:h_blk, D // 2:D])\n")
    return replace_once(src, "                    _store_rows(dQ, acc_dq, b, s, h0, 0, S, R, hg, h_blk, D)\n",
                        "                    _store_rows(dQ, acc_dq, b, s, h0, 0, S, R, hg, h_blk, D // 2)\n"
                        "                    _store_rows(dQ, acc_dq2, b, s, h0, D // 2, S, R, hg, h_blk, D // 2)\n")


def four_warpgroups(src: str) -> str:
    src = split_dq(src)
    src = replace_once(src, "    THREADS = 384  # two MMA warpgroups and the gather / drain warpgroup",
                       "    THREADS = 512  # exp91: two MMA warpgroups, the gather / drain warpgroup and a second drain")
    src = replace_once(src, '''            if tx >= 256:
                if nb > 0:
                    gather(w, 0)''', '''            if tx >= 256:
                if tx < 384:
                    if nb > 0:
                        gather(w, 0)''')
    return src


def exp91(src: str) -> str:
    src = four_warpgroups(src)
    src = replace_once(src, '''        # warpgroup c's chunk k of this block: columns (c * HALF + k) * 64 + [0, 64), 16 bytes per atomic
        tp = w.tx - 256''', '''        # warpgroup c's chunk k of this block: columns (c * HALF + k) * 64 + [0, 64), 16 bytes per atomic
        tp = w.tx % 128  # exp91: warpgroup 2 + c drains warpgroup c's chunks''')
    return replace_once(src, '''                T.set_max_nreg(producer_regs, 0)
                for i in T.serial(nb):
                    if i + 1 < nb:
                        T.barrier_wait(kv_free, i & 1)
                        gather(w, i + 1)
                    for k in T.unroll(N_OWN[1]):
                        if k < N_OWN[0]:
                            drain_chunk(w, i, 0, k)
                        drain_chunk(w, i, 1, k)''', '''                T.set_max_nreg(producer_regs, 0)
                if tx < 384:
                    for i in T.serial(nb):
                        if i + 1 < nb:
                            T.barrier_wait(kv_free, i & 1)
                            gather(w, i + 1)
                        for k in T.unroll(N_OWN[0]):
                            drain_chunk(w, i, 0, k)
                else:
                    for i in T.serial(nb):
                        for k in T.unroll(N_OWN[1]):
                            drain_chunk(w, i, 1, k)''')


def exp92(src: str) -> str:
    src = four_warpgroups(src)
    src = replace_once(src, '''        tp = w.tx - 256
        n = blk * N_OWN[c] + k
        wait_chunk_buffer(w.ch_full[c], n, 0)
        for r in T.unroll(BS * 16 // 128):
            j = (r * 128 + tp) // 16''', '''        tp = w.tx - 256  # exp92: 0 .. 255 over both drain warpgroups, 16 slots each
        n = blk * N_OWN[c] + k
        wait_chunk_buffer(w.ch_full[c], n, 0)
        for r in T.unroll(BS * 16 // 256):
            j = (r * 256 + tp) // 16''')
    src = replace_once(src, '''            d = (r * 128 + tp) % 16 * 4''', '''            d = (r * 256 + tp) % 16 * 4''')
    for c in ("00", "01", "10", "11"):
        src = replace_once(src, f"            ch_free{c} = T.alloc_barrier(arrive_count=128)",
                           f"            ch_free{c} = T.alloc_barrier(arrive_count=256)")
    return replace_once(src, '''                    if i + 1 < nb:
                        T.barrier_wait(kv_free, i & 1)
                        gather(w, i + 1)
                    for k in T.unroll(N_OWN[1]):''', '''                    if i + 1 < nb:
                        if tx < 384:
                            T.barrier_wait(kv_free, i & 1)
                            gather(w, i + 1)
                    for k in T.unroll(N_OWN[1]):''')


open("glm5_dsa_plugin/ops/_exp91.py", "w").write(exp91(tree))
open("glm5_dsa_plugin/ops/_exp92.py", "w").write(exp92(tree))
open("glm5_dsa_plugin/ops/_exp93.py", "w").write(split_dq(tree))
print("wrote glm5_dsa_plugin/ops/_exp91.py, _exp92.py, _exp93.py")
