"""Writes glm5_dsa_plugin/ops/_exp57.py (ignored by git) from the tree's tilelang_kernels.py: a
persistent warp-specialised forward, one row per block (R = 1), prepared in session 22, run in
session 23 (exp57.py; slower than the tree's kernel, see NOTES "Session 23"). ``persistent`` = P
CTAs (per batch and kv group) each run the rows (last first) bx, bx + P, bx + 2P, ... with the
barriers' phases carried across rows (a running pair count per role; q_full and sum_full once per
row), so that the gather warpgroup fetches the next row's first pair while the MMA warpgroups finish
the current row's epilogue; the Q tile, through which out leaves, is refilled after a new ``q_free``
barrier (both MMA warpgroups, after their out stores have read it). Warpgroup 0 frees buffer 1's
left part at a row's end (the last pair's P1 V1 is done there) instead of at the next pair's scores,
which would deadlock against the Q load. exp56 measured the fixed cost this can hide: 11-13% of the
W2 H64 forward, 6-7% at W1. Run from the repository root."""

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()


def sub(old, new, count=1):
    global src
    assert src.count(old) == count, (old[:80], src.count(old))
    src = src.replace(old, new)


sub('''def sparse_mla_fwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda"):''',
    '''def sparse_mla_fwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda",
                             persistent=132):''')
sub('''    R = rows_per_block
    assert heads % kv_group == 0 and topk % BLOCK_TOPK == 0 and d_tail == 64 and d_v % 128 == 0
    hg = heads // kv_group
    h_blk, rep = row_group_geometry(hg, R)
    assert h_blk == 64, "the warp-specialised forward runs 64-row tiles"''',
    '''    R = rows_per_block
    assert R == 1, "exp57: one row per block only"
    assert heads % kv_group == 0 and topk % BLOCK_TOPK == 0 and d_tail == 64 and d_v % 128 == 0
    hg = heads // kv_group
    h_blk, rep = row_group_geometry(hg, R)
    assert h_blk == 64, "the warp-specialised forward runs 64-row tiles"
    P = persistent''')
# barrier phases: ph (the CTA's running pair index) instead of the row's pair index i
sub('''    def score_part(w, c, part, i):''', '''    def score_part(w, c, part, ph):''')
sub('''        T.barrier_wait(w.full[c][part], i & 1)''', '''        T.barrier_wait(w.full[c][part], ph & 1)''')
sub('''    def scores(w, c, i):''', '''    def scores(w, c, i, ph):''')
sub('''        score_part(w, c, first, i)''', '''        score_part(w, c, first, ph)''')
sub('''        score_part(w, c, second, i)''', '''        score_part(w, c, second, ph)''')
sub('''    def pair0(w, i):
        scores(w, 0, i)''', '''    def pair0(w, i, ph):
        scores(w, 0, i, ph)''')
sub('''        T.barrier_wait(w.max_ready[1], i & 1)''', '''        T.barrier_wait(w.max_ready[1], ph & 1)''')
sub('''        T.barrier_wait(w.p_ready[1], i & 1)''', '''        T.barrier_wait(w.p_ready[1], ph & 1)''')
sub('''    def pair1(w, i):
        scores(w, 1, i)''', '''    def pair1(w, i, ph):
        scores(w, 1, i, ph)''')
sub('''        T.barrier_wait(w.max_ready[0], i & 1)''', '''        T.barrier_wait(w.max_ready[0], ph & 1)''')
sub('''        T.barrier_wait(w.p_ready[0], i & 1)''', '''        T.barrier_wait(w.p_ready[0], ph & 1)''')
# one row of a consumer: no register setting (once per CTA), phases from (row j, pair base pb)
sub('''    def consume(w, c):
        T.set_max_nreg(232, 1)
        T.fill(w.acc_o, 0)''', '''    def consume_row(w, c, j, pb):
        T.fill(w.acc_o, 0)''')
sub('''        T.barrier_wait(w.q_full, 0)
        for i in T.serial((w.nb + 1) // 2):
            if c == 0:
                pair0(w, i)
            else:
                pair1(w, i)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(w.acc_o, num_regs=h_blk * DH // 128)''',
    '''        T.barrier_wait(w.q_full, j & 1)
        for i in T.serial((w.nb + 1) // 2):
            if c == 0:
                pair0(w, i, pb + i)
            else:
                pair1(w, i, pb + i)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(w.acc_o, num_regs=h_blk * DH // 128)
        if c == 0:
            if w.nb > 0:
                T.barrier_arrive(w.free[1][0])  # the row's last P1 V1 is done''')
sub('''        T.barrier_wait(w.sum_full, 0)''', '''        T.barrier_wait(w.sum_full, j & 1)''')
sub('''            T.copy(w.q_s[0:h_blk, lo:hi], w.Out[w.b, w.s, w.h0:w.h0 + h_blk, lo:hi])
        else:''', '''            T.copy(w.q_s[0:h_blk, lo:hi], w.Out[w.b, w.s, w.h0:w.h0 + h_blk, lo:hi])
            T.barrier_arrive(w.q_free)
        else:''')
# the kernel: P CTAs, rows handed out by a static stride, per-row views
sub('''        with T.Kernel(NG * rep, B, kv_group, threads=384) as (bx, b, g):''',
    '''        with T.Kernel(P, B, kv_group, threads=384) as (bx, b, g):''')
sub('''            q_full = T.alloc_barrier(arrive_count=128)  # the Q tile landed
''', '''            q_full = T.alloc_barrier(arrive_count=128)  # the Q tile landed
            q_free = T.alloc_barrier(arrive_count=256)  # both MMA warpgroups' out stores have read it
            pb = T.alloc_local([1], T.int32)  # the running pair count of this thread's role
''')
start = src.index("            s = NG - 1 - bx // rep  # last rows (groups) first: under a causal mask the longest lists")
end = src.index("    return tilelang.compile(fwd, pass_configs=PASS_CONFIGS, target=target)", start)
src = src[:start] + '''            n_rows = T.max((NG * rep - bx + P - 1) // P, 0)  # this CTA's rows: bx, bx + P, ...
            tx = T.get_thread_binding()
            kv = (kv0, kv1)
            full = ((full0l, full0r), (full1l, full1r))
            free = ((free0l, free0r), (free1l, free1r))
            shared = dict(tx=tx, Indices=Indices, Members=Members, KV=KV, b=b, g=g, q_s=q_s,
                          kv=kv, p_s=p_s, max_s=max_s, full=full, free=free, max_ready=(max_ready0, max_ready1),
                          p_ready=(p_ready0, p_ready1), sum_s=sum_s, sum_full=sum_full,
                          Out=Out, Lse=Lse, S=S, Q=Q, q_full=q_full, q_free=q_free)

            pb[0] = 0
            if tx < 128:
                consume_rows(dict(valid=valid0, acc_s=acc_s0, p=p0, acc_o=acc_o0, row_sum=row_sum0, blk_sum=blk_sum0,
                                  alpha=alpha0, m=m0, m_blk=m_blk0), 0, shared, bx, b, g, Extent, n_rows, pb)
            elif tx < 256:
                consume_rows(dict(valid=valid1, acc_s=acc_s1, p=p1, acc_o=acc_o1, row_sum=row_sum1, blk_sum=blk_sum1,
                                  alpha=alpha1, m=m1, m_blk=m_blk1), 1, shared, bx, b, g, Extent, n_rows, pb)
            else:
                T.set_max_nreg(40, 0)
                for j in T.serial(n_rows):
                    w = SimpleNamespace(**shared, **row_of(bx, b, g, Extent, j))
                    pairs = (w.nb + 1) // 2
                    # the row's first pair as soon as the previous row's last readers free the
                    # buffers (under that row's epilogue), then its Q tile once the previous row's
                    # out has left it, then the rest
                    if pairs > 0:
                        produce_pair(w, 0, pb[0])
                    if j > 0:
                        T.barrier_wait(q_free, (j - 1) & 1)
                    load_q(w)
                    for i in T.serial(T.max(pairs - 1, 0)):
                        produce_pair(w, i + 1, pb[0] + i + 1)
                    pb[0] = pb[0] + pairs

''' + src[end:]
# row j of a CTA, defined before the warp-specialised kernel (a def inside the prim_func is not kept)
head = "    @T.prim_func\n    def fwd(\n"
at = src.index(head, src.index("def sparse_mla_fwd_ws_kernel("))
src = src[:at] + '''    def row_of(bx, b, g, Extent, j):
        # row j of CTA bx: (query row s, first head h0, its blocks nb), last rows first
        item = bx + j * P
        s = NG - 1 - item // rep
        return dict(s=s, h0=g * hg + (item % rep) * h_blk, nb=T.min(slot_blocks(Extent[b, s, g], BI), NI))

    @T.macro
    def consume_rows(regs, c, shared, bx, b, g, Extent, n_rows, pb):
        # MMA warpgroup c (its registers in regs) over the CTA's rows; pb: its running pair count
        T.set_max_nreg(232, 1)
        for j in T.serial(n_rows):
            w = SimpleNamespace(**regs, **shared, **row_of(bx, b, g, Extent, j))
            consume_row(w, c, j, pb[0])
            pb[0] = pb[0] + (w.nb + 1) // 2

''' + src[at:]
# the gathers of one pair (block 2i into kv0, 2i + 1 into kv1), phases from ph
sub('''    @T.macro
    def load_q(w):''', '''    @T.macro
    def produce_pair(w, i, ph):
        # parts in the order their last readers free them
        T.barrier_wait(w.free[0][0], (ph & 1) ^ 1)
        gather(w, i * 2, w.kv[0], 0, UL, w.full[0][0])
        T.barrier_wait(w.free[1][1], (ph & 1) ^ 1)
        gather(w, i * 2 + 1, w.kv[1], UL, UA, w.full[1][1])
        T.barrier_wait(w.free[0][1], (ph & 1) ^ 1)
        gather(w, i * 2, w.kv[0], UL, UA, w.full[0][1])
        T.barrier_wait(w.free[1][0], (ph & 1) ^ 1)
        gather(w, i * 2 + 1, w.kv[1], 0, UL, w.full[1][0])

    @T.macro
    def load_q(w):''')
open("glm5_dsa_plugin/ops/_exp57.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp57.py")
