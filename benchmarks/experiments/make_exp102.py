"""Writes glm5_dsa_plugin/ops/_exp102.py (ignored by git), session 30, for the next session: v32's
warp-specialised backward with cycle counters around its waits, to see where each warpgroup
waits before trying more chunk buffering again (exp101a, a third buffer, was 6% slower). Each
thread keeps, in registers, the clock64 cycles it spent in each wait; thread 0 of each warpgroup
writes them, with its cycles from the end of the prologue to the end of its loop, to an extra
kernel argument ``Waits`` [NG, 3, 8] int64 (row (group), warpgroup, category):
0 the block's kv rows landed (``full``; MMA warpgroups), 1 a free chunk buffer (``ch_free``; MMA
warpgroups), 2 warpgroup 0: both done with the previous P / dS (``step_done``), warpgroup 1: P
written (``p_ready``), 3 dS written (``ds_ready``; MMA warpgroups), 4 a staged chunk (``ch_full``;
the drain), 5 the kv buffer free for the next gather (``kv_free``; the drain), 6 the loop's
cycles. ``exp102.py`` wraps the builder so the backend's call passes ``Waits``. Run from the
repository root."""
from patching import replace_once

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()


def timed(call: str, cat: int, indent: str) -> str:
    """``call`` (one statement) between two clock64 reads, the difference added to waits[cat]."""
    return (f"{indent}w.t0[0] = T.call_extern(\"int64\", \"clock64\")\n{indent}{call}\n"
            f"{indent}w.waits[{cat}] = w.waits[{cat}] + (T.call_extern(\"int64\", \"clock64\") - w.t0[0])")


src = replace_once(src, "        wait_chunk_buffer(w.ch_free[c], n, 1)",
                   timed("wait_chunk_buffer(w.ch_free[c], n, 1)", 1, "        "))
src = replace_once(src, "        wait_chunk_buffer(w.ch_full[c], n, 0)",
                   timed("wait_chunk_buffer(w.ch_full[c], n, 0)", 4, "        "))
src = replace_once(src, "        T.barrier_wait(w.full, blk & 1)\n", timed("T.barrier_wait(w.full, blk & 1)", 0, "        ") + "\n")
src = replace_once(src, "                T.barrier_wait(w.step_done, (blk - 1) & 1)  # both warpgroups are done with block blk - 1's P / dS",
                   timed("T.barrier_wait(w.step_done, (blk - 1) & 1)", 2, "                "))
src = replace_once(src, "            T.barrier_wait(w.p_ready, blk & 1)\n", timed("T.barrier_wait(w.p_ready, blk & 1)", 2, "            ") + "\n")
src = replace_once(src, "        T.barrier_wait(w.ds_ready, blk & 1)\n", timed("T.barrier_wait(w.ds_ready, blk & 1)", 3, "        ") + "\n")
src = replace_once(src, "                        T.barrier_wait(kv_free, i & 1)",
                   timed("T.barrier_wait(kv_free, i & 1)", 5, "                        "))
src = replace_once(src, '''        Flags: T.Tensor([1], T.int32),
    ):
        with T.Kernel(NG, B, kv_group * nh, threads=THREADS) as (bx, b, bz):''', '''        Flags: T.Tensor([1], T.int32),
        Waits: T.Tensor([NG, 3, 8], T.int64),
    ):
        with T.Kernel(NG, B, kv_group * nh, threads=THREADS) as (bx, b, bz):
            waits = T.alloc_local([8], T.int64)  # exp102: cycles per wait category
            t0 = T.alloc_local([1], T.int64)
            t_loop = T.alloc_local([1], T.int64)
            for e in T.serial(8):
                waits[e] = 0''')
src = replace_once(src, "                                step_done=step_done, drain_keys=drain_keys, drain_vals=drain_vals)",
                   "                                step_done=step_done, drain_keys=drain_keys, drain_vals=drain_vals,\n"
                   "                                waits=waits, t0=t0)")
# the MMA warpgroups' loop
src = replace_once(src, '''                for i in T.serial(nb):
                    step(w, i)
                if nb > 0:  # both warpgroups done with the last block (the epilogue rewrites the Q tile)
                    T.barrier_wait(step_done, (nb - 1) & 1)''', '''                t_loop[0] = T.call_extern("int64", "clock64")
                for i in T.serial(nb):
                    step(w, i)
                waits[6] = T.call_extern("int64", "clock64") - t_loop[0]
                if tx % 128 == 0:
                    for e in T.serial(8):
                        Waits[bx, tx // 128, e] = waits[e]
                if nb > 0:  # both warpgroups done with the last block (the epilogue rewrites the Q tile)
                    T.barrier_wait(step_done, (nb - 1) & 1)''')
# the drain's loop
src = replace_once(src, '''                T.set_max_nreg(producer_regs, 0)
                for i in T.serial(nb):''', '''                T.set_max_nreg(producer_regs, 0)
                t_loop[0] = T.call_extern("int64", "clock64")
                for i in T.serial(nb):''')
src = replace_once(src, '''                        drain_chunk(w, i, 1, k)
''', '''                        drain_chunk(w, i, 1, k)
                waits[6] = T.call_extern("int64", "clock64") - t_loop[0]
                if tx == 256:
                    for e in T.serial(8):
                        Waits[bx, 2, e] = waits[e]
''')
open("glm5_dsa_plugin/ops/_exp102.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp102.py")
