"""Writes glm5_dsa_plugin/ops/_exp101z.py / _exp101a.py (ignored by git), session 30: more chunk
buffering in the backward. exp94 / exp98 showed the MMA warpgroups waiting on their two chunk
buffers' free; a third buffer for warpgroup 1 (which stages five chunks per block against
warpgroup 0's four) takes 8.7 KB of shared memory, and 2.8 KB are free. z (the control): P's fp32
copy (p32_s, 10 KB) is gone; warpgroup 1 computes dS from the bf16 P in p_s (dS's rounding
changes: one more bf16 rounding of P per entry, so not bitwise the tree's). a: z, and warpgroup 1
stages into three chunk buffers in turn (chunk n into buffer n % 3, phase (n // 3) & 1).
Run from the repository root."""
from patching import replace_once

SRC = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()


def variant(three: bool) -> str:
    src = SRC
    src = replace_once(src, '''            T.copy(w.acc_sp, w.p32_s[0:h_blk, 0:BS])
''', '')
    src = replace_once(src, "w.acc_ds[h, j] = w.p32_s[h, j] * (w.acc_ds[h, j] - w.delta_s[h]) * scale",
                       "w.acc_ds[h, j] = T.cast(w.p_s[h, j], acc) * (w.acc_ds[h, j] - w.delta_s[h]) * scale")
    src = replace_once(src, '''            p32_s = T.alloc_shared([h_blk, BS + 8], acc)
''', '')
    src = replace_once(src, "p_s=p_s, dp_s=dp_s, p32_s=p32_s, delta_s=delta_s,", "p_s=p_s, dp_s=dp_s, delta_s=delta_s,")
    if not three:
        return src
    src = replace_once(src, '''    def wait_chunk_buffer(bars, n, flip):
        # buffer n % 2 of a warpgroup's two, phase (n // 2) & 1 (flip: the "free" side's first use passes)
        if n % 2 == 0:
            T.barrier_wait(bars[0], ((n // 2) & 1) ^ flip)
        else:
            T.barrier_wait(bars[1], ((n // 2) & 1) ^ flip)''', '''    def wait_chunk_buffer(bars, n, flip):
        # buffer n % nb of a warpgroup's nb, phase (n // nb) & 1 (flip: the "free" side's first use passes)
        if len(bars) == 2:
            if n % 2 == 0:
                T.barrier_wait(bars[0], ((n // 2) & 1) ^ flip)
            else:
                T.barrier_wait(bars[1], ((n // 2) & 1) ^ flip)
        else:
            if n % 3 == 0:
                T.barrier_wait(bars[0], ((n // 3) & 1) ^ flip)
            else:
                if n % 3 == 1:
                    T.barrier_wait(bars[1], ((n // 3) & 1) ^ flip)
                else:
                    T.barrier_wait(bars[2], ((n // 3) & 1) ^ flip)''')
    src = replace_once(src, '''    def arrive_chunk_buffer(bars, n):
        if n % 2 == 0:
            T.barrier_arrive(bars[0])
        else:
            T.barrier_arrive(bars[1])''', '''    def arrive_chunk_buffer(bars, n):
        if len(bars) == 2:
            if n % 2 == 0:
                T.barrier_arrive(bars[0])
            else:
                T.barrier_arrive(bars[1])
        else:
            if n % 3 == 0:
                T.barrier_arrive(bars[0])
            else:
                if n % 3 == 1:
                    T.barrier_arrive(bars[1])
                else:
                    T.barrier_arrive(bars[2])''')
    src = replace_once(src, "            w.ch_s[c][n % 2, j, i] = acc_c[i, j]",
                       "            w.ch_s[c][n % len(w.ch_free[c]), j, i] = acc_c[i, j]")
    src = replace_once(src, "w.drain_vals[r * 4 + v] = w.ch_s[c][n % 2, drain_slot(r, tp), drain_col(r, tp) + v]",
                       "w.drain_vals[r * 4 + v] = w.ch_s[c][n % len(w.ch_free[c]), drain_slot(r, tp), drain_col(r, tp) + v]")
    src = replace_once(src, "            ch_s1 = T.alloc_shared([2, BS, CP], acc)",
                       "            ch_s1 = T.alloc_shared([3, BS, CP], acc)  # exp101a: three for warpgroup 1")
    src = replace_once(src, '''            ch_free11 = T.alloc_barrier(arrive_count=128)
''', '''            ch_free11 = T.alloc_barrier(arrive_count=128)
            ch_full12 = T.alloc_barrier(arrive_count=128)
            ch_free12 = T.alloc_barrier(arrive_count=128)
''')
    src = replace_once(src, '''                                ch_full=((ch_full00, ch_full01), (ch_full10, ch_full11)),
                                ch_free=((ch_free00, ch_free01), (ch_free10, ch_free11)),''', '''                                ch_full=((ch_full00, ch_full01), (ch_full10, ch_full11, ch_full12)),
                                ch_free=((ch_free00, ch_free01), (ch_free10, ch_free11, ch_free12)),''')
    return src


for tag, three in (("z", False), ("a", True)):
    open(f"glm5_dsa_plugin/ops/_exp101{tag}.py", "w").write(variant(three))
