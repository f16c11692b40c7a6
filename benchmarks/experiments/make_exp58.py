"""Writes glm5_dsa_plugin/ops/_exp58.py (ignored by git): exp57's persistent warp-specialised
forward (make_exp57.py, run first here) with rows handed out by a global atomic counter instead of
a static stride (session 23). exp57 ran bitwise on out and 5-7% slower than the tree's kernel
(W2 / W1 H64); a static stride leaves the kernel's time to its slowest CTA, while the tree's
4096 CTAs are handed out by the hardware as SMs free up. Here CTA bx runs row item bx first, then
items P + atomicAdd(Counter, 1) until one is past the last (N = row items); the draw that returns
N - 1 is the launch's last, and it resets the counter to 0 for the next launch (no memset).
The gather warpgroup's thread 0 draws and publishes the item in shared memory (``row_full``,
one arrival); all 384 threads read it and arrive on ``row_taken`` (384), which that thread waits
for before it publishes the next one. Kernel argument ``Counter`` (int32 [1], zero before the
first launch) comes last. Run from the repository root."""
import runpy

from patching import replace_once

runpy.run_path("benchmarks/experiments/make_exp57.py")
src = open("glm5_dsa_plugin/ops/_exp57.py").read()
src = replace_once(src, '''    assert R == 1, "exp57: one row per block only"''', '''    assert R == 1, "exp58: one row per block only"''')
# the kernel's last argument: the row counter
src = replace_once(src, '''        Lse: T.Tensor([B, S, heads], acc),
    ):
        with T.Kernel(P, B, kv_group, threads=384) as (bx, b, g):''', '''        Lse: T.Tensor([B, S, heads], acc),
        Counter: T.Tensor([1], T.int32),
    ):
        with T.Kernel(P, B, kv_group, threads=384) as (bx, b, g):''')
src = replace_once(src, '''            pb = T.alloc_local([1], T.int32)  # the running pair count of this thread's role
''', '''            pb = T.alloc_local([1], T.int32)  # the running pair count of this thread's role
            row_s = T.alloc_shared([1], T.int32)  # the published row item
            row_full = T.alloc_barrier(arrive_count=1)  # row_s holds the next item
            row_taken = T.alloc_barrier(arrive_count=384)  # every thread has read it
            jr = T.alloc_local([1], T.int32)  # rows run so far
            run = T.alloc_local([1], T.int32)
            item = T.alloc_local([1], T.int32)
            prev = T.alloc_local([1], T.int32)
''')
src = replace_once(src, '''            n_rows = T.max((NG * rep - bx + P - 1) // P, 0)  # this CTA's rows: bx, bx + P, ...
''', '')
src = replace_once(src, '''                          Out=Out, Lse=Lse, S=S, Q=Q, q_full=q_full, q_free=q_free)
''', '''                          Out=Out, Lse=Lse, S=S, Q=Q, q_full=q_full, q_free=q_free)
            sched = SimpleNamespace(Counter=Counter, row_s=row_s, row_full=row_full, row_taken=row_taken,
                                    jr=jr, run=run, item=item, prev=prev, pb=pb)
''')
src = replace_once(src, '''            pb[0] = 0
''', '''            pb[0] = 0
            jr[0] = 0
            run[0] = 1
''')
src = replace_once(src, '''0, shared, bx, b, g, Extent, n_rows, pb)''', '''0, shared, bx, b, g, Extent, sched)''')
src = replace_once(src, '''1, shared, bx, b, g, Extent, n_rows, pb)''', '''1, shared, bx, b, g, Extent, sched)''')
start = src.index("                for j in T.serial(n_rows):\n                    w = SimpleNamespace(**shared, **row_of(bx, b, g, Extent, j))")
end = src.index("                    pb[0] = pb[0] + pairs\n", start) + len("                    pb[0] = pb[0] + pairs\n")
src = src[:start] + '''                while run[0] == 1:
                    take_row(sched, tx, bx)
                    if item[0] >= NG * rep:
                        run[0] = 0
                    else:
                        w = SimpleNamespace(**shared, **row_at(b, g, Extent, item[0]))
                        pairs = (w.nb + 1) // 2
                        if pairs > 0:
                            produce_pair(w, 0, pb[0])
                        if jr[0] > 0:
                            T.barrier_wait(q_free, (jr[0] - 1) & 1)
                        load_q(w)
                        for i in T.serial(T.max(pairs - 1, 0)):
                            produce_pair(w, i + 1, pb[0] + i + 1)
                        pb[0] = pb[0] + pairs
                        jr[0] = jr[0] + 1
''' + src[end:]
start = src.index("    def row_of(bx, b, g, Extent, j):")
end = src.index("    @T.prim_func\n    def fwd(\n", start)
src = src[:start] + '''    def row_at(b, g, Extent, item):
        # row item -> (query row s, first head h0, its blocks nb), last rows first
        s = NG - 1 - item // rep
        return dict(s=s, h0=g * hg + (item % rep) * h_blk, nb=T.min(slot_blocks(Extent[b, s, g], BI), NI))

    @T.macro
    def take_row(sched, tx, bx):
        # sched.item := this CTA's next row item (bx first, then drawn), for all 384 threads
        if tx == 256:
            if sched.jr[0] > 0:
                T.barrier_wait(sched.row_taken, (sched.jr[0] - 1) & 1)
                sched.prev[0] = T.atomic_add(sched.Counter[0], 1, return_prev=True)
                if sched.prev[0] == NG * rep - 1:  # the launch's last draw
                    sched.Counter[0] = 0
                sched.row_s[0] = P + sched.prev[0]
            else:
                sched.row_s[0] = bx
            T.barrier_arrive(sched.row_full)
        T.barrier_wait(sched.row_full, sched.jr[0] & 1)
        sched.item[0] = sched.row_s[0]
        T.barrier_arrive(sched.row_taken)

    @T.macro
    def consume_rows(regs, c, shared, bx, b, g, Extent, sched):
        # MMA warpgroup c (its registers in regs) over the rows it is handed; sched.pb: its
        # running pair count
        T.set_max_nreg(232, 1)
        while sched.run[0] == 1:
            take_row(sched, shared["tx"], bx)
            if sched.item[0] >= NG * rep:
                sched.run[0] = 0
            else:
                w = SimpleNamespace(**regs, **shared, **row_at(b, g, Extent, sched.item[0]))
                consume_row(w, c, sched.jr[0], sched.pb[0])
                sched.pb[0] = sched.pb[0] + (w.nb + 1) // 2
                sched.jr[0] = sched.jr[0] + 1

''' + src[end:]
open("glm5_dsa_plugin/ops/_exp58.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp58.py")
