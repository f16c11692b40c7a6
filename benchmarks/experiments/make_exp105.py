"""Writes glm5_dsa_plugin/ops/_exp105a.py / _exp105b.py (ignored by git), session 31: warpgroup 1
adds its rope-tail chunk to dKV itself. exp102: the drain is busy about 73% of its loop and the
MMA warpgroups wait 18% / 28% for it to free chunk buffers, while warpgroup 1 waits 8% for P in
the phase where it computes block i - 1's tail chunk (Q_tail^T dS). Here warpgroup 1 stages that
chunk through the buffer of its next chunk (block i's first, so the drain's order and buffer
phases only lose the tail: four chunks per warpgroup and block), reads it back as the drain does
(16 bytes per thread and slot row) and issues the 16-byte atomics (deterministic mode: the
per-slot stores) for the rope-tail columns; the drain goes from nine chunks per block to eight.
a: the slot keys read before the tail's GEMM; b: after the staging, with the values. Run from
the repository root."""
from patching import replace_once

SRC = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
KEYS = '''        for r in T.unroll(BS * 16 // 128):
            w.drain_keys[r] = w.Indices[w.b, w.s, w.g, blk * BS + drain_slot(r, tp)]
'''


def variant(keys_first: bool) -> str:
    src = replace_once(SRC, "    N_OWN = (HALF, NCV - HALF + 1)",
                       "    N_OWN = (HALF, NCV - HALF)  # exp105: the drain's chunks; the tail is warpgroup 1's own")
    src = replace_once(src, '''        # warpgroup 1: block blk's rope-tail chunk, Q_tail^T dS (dp_s still holds blk's dS)
        T.gemm(w.q_parts[1], w.dp_s, w.acc_t[1], transpose_A=True, policy=T.GemmWarpPolicy.FullRow,
               clear_accum=True)
        stage_chunk(w, 1, w.acc_t[1], blk * N_OWN[1] + N_OWN[1] - 1)''', '''        # warpgroup 1: block blk's rope-tail chunk, Q_tail^T dS (dp_s still holds blk's dS)
        tp = w.tx - 128
''' + (KEYS if keys_first else "") + '''        T.gemm(w.q_parts[1], w.dp_s, w.acc_t[1], transpose_A=True, policy=T.GemmWarpPolicy.FullRow,
               clear_accum=True)
        # exp105: through the buffer of warpgroup 1's next chunk (number (blk + 1) * N_OWN[1]), added
        # to dKV's rope-tail columns by warpgroup 1 itself
        n = (blk + 1) * N_OWN[1]
        wait_chunk_buffer(w.ch_free[1], n, 1)
        for i, j in T.Parallel(64, BS):
            w.ch_s[1][n % 2, j, i] = w.acc_t[1][i, j]
''' + ("" if keys_first else KEYS) + '''        for r in T.unroll(BS * 16 // 128):
            for v in T.vectorized(4):
                w.drain_vals[r * 4 + v] = w.ch_s[1][n % 2, drain_slot(r, tp), drain_col(r, tp) + v]
        for r in T.unroll(BS * 16 // 128):
            j, d = drain_slot(r, tp), drain_col(r, tp)
            if valid_slot(w.drain_keys[r], n_kv):
                if dkv_per_slot:
                    for v in T.vectorized(4):
                        w.dKV[w.b, w.s, w.bz, blk * BS + j, D + d + v] = w.drain_vals[r * 4 + v]
                else:
                    T.atomic_addx4(w.dKV[w.b, w.drain_keys[r], w.g, D + d], w.drain_vals[r * 4])''')
    src = replace_once(src, "            dkv_by_chunks(w, 1, HALF, N_OWN[1] - 1, blk * N_OWN[1])",
                       "            dkv_by_chunks(w, 1, HALF, N_OWN[1], blk * N_OWN[1])")
    # drain_slot / drain_col are defined after tail_chunk in the tree; tail_chunk now uses them
    start = src.index("    def drain_slot(r, tp):")
    end = src.index("    @T.macro\n    def drain_chunk(w, blk, c, k):")
    helpers = src[start:end]
    src = src[:start] + src[end:]
    return replace_once(src, "    @T.macro\n    def tail_chunk(w, blk):", helpers + "    @T.macro\n    def tail_chunk(w, blk):")


for tag, keys_first in (("a", True), ("b", False)):
    open(f"glm5_dsa_plugin/ops/_exp105{tag}.py", "w").write(variant(keys_first))
    print(f"wrote glm5_dsa_plugin/ops/_exp105{tag}.py")
