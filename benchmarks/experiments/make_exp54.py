"""Writes glm5_dsa_plugin/ops/_exp54.py (ignored by git) from the tree's tilelang_kernels.py for exp54:
the warp-specialised forward (one row per block) prefetches into L2, in one bulk prefetch, the Q
tile of the block that starts ``prefetch_ahead`` launches later (about when this one ends: one
block per SM, launched in order), and the warp-specialised backward (one row per block) runs rows
last first (``last_first``, as the forward does since session 15) and prefetches that block's Q,
dO and O tiles (``prefetch_ahead``). Run from the repository root."""
import re

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()


def sub(old, new, count=1):
    global src
    assert src.count(old) == count, (old, src.count(old))
    src = src.replace(old, new)


sub('''BLOCK_TOPK = 64''', '''PREFETCH_SRC = r"""
__device__ __forceinline__ void glm5_prefetch_l2(const void* p, unsigned int bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}
"""

BLOCK_TOPK = 64''')
sub('''def sparse_mla_fwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda"):''',
    '''def sparse_mla_fwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda",
                             prefetch_ahead=132):''')
sub('''        with T.Kernel(NG * rep, B, kv_group, threads=384) as (bx, b, g):''',
    '''        with T.Kernel(NG * rep, B, kv_group, threads=384, prelude=PREFETCH_SRC) as (bx, b, g):''')
sub('''                T.set_max_nreg(40, 0)
                w = SimpleNamespace(**shared)
                load_q(w)
''', '''                T.set_max_nreg(40, 0)
                w = SimpleNamespace(**shared)
                load_q(w)
                if R == 1 and prefetch_ahead > 0:
                    if tx == 256:
                        if bx + prefetch_ahead < NG * rep:
                            T.call_extern("handle", "glm5_prefetch_l2",
                                          T.access_ptr(Q[b, NG - 1 - (bx + prefetch_ahead) // rep,
                                                         g * hg + ((bx + prefetch_ahead) % rep) * h_blk, 0],
                                                       "r", h_blk * (D + DT)),
                                          h_blk * (D + DT) * 2)
''')
sub('''def sparse_mla_bwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda",
                             mma_regs=216, producer_regs=72):''',
    '''def sparse_mla_bwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda",
                             mma_regs=216, producer_regs=72, last_first=True, prefetch_ahead=132):''')
sub('''        with T.Kernel(NG, B, kv_group * nh, threads=THREADS) as (bx, b, bz):''',
    '''        with T.Kernel(NG, B, kv_group * nh, threads=THREADS, prelude=PREFETCH_SRC) as (bx, b, bz):''')
line = "            s = bx if R == 1 else NG - 1 - bx  # R > 1: last group first (as the forward)"
at = src.index(line, src.index("prelude=PREFETCH_SRC) as (bx, b, bz)"))
src = src[:at] + "            s = bx if (R == 1 and not last_first) else NG - 1 - bx" + src[at + len(line):]
sub('''            if tx >= 256:
                if nb > 0:
                    gather(w, 0)
''', '''            if tx >= 256:
                if nb > 0:
                    gather(w, 0)
                if R == 1 and prefetch_ahead > 0:
                    if tx == 256:
                        if bx + prefetch_ahead < NG:
                            T.call_extern("handle", "glm5_prefetch_l2",
                                          T.access_ptr(Q[b, NG - 1 - (bx + prefetch_ahead) if last_first
                                                         else bx + prefetch_ahead, h0, 0], "r", h_blk * (D + DT)),
                                          h_blk * (D + DT) * 2)
                            T.call_extern("handle", "glm5_prefetch_l2",
                                          T.access_ptr(dO[b, NG - 1 - (bx + prefetch_ahead) if last_first
                                                          else bx + prefetch_ahead, h0, 0], "r", h_blk * D),
                                          h_blk * D * 2)
                            T.call_extern("handle", "glm5_prefetch_l2",
                                          T.access_ptr(O[b, NG - 1 - (bx + prefetch_ahead) if last_first
                                                         else bx + prefetch_ahead, h0, 0], "r", h_blk * D),
                                          h_blk * D * 2)
''')
open("glm5_dsa_plugin/ops/_exp54.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp54.py")
