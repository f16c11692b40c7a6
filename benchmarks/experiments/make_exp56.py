"""Writes glm5_dsa_plugin/ops/_exp56.py (ignored by git) from the tree's tilelang_kernels.py for
exp56: the warp-specialised forward with ``repeat`` passes over each row's blocks in one CTA (the
pair counter runs on for the barriers' phases, the blocks wrap around; out is the softmax over each
slot ``repeat`` times, the same out, lse + ln(repeat)). Timing repeat = 1, 2, 3 separates a CTA's
fixed cost (prologue, epilogue, launch and drain; one CTA per SM, so nothing overlaps them) from
its per-pass cost: T(r) = F + r W. Run from the repository root."""

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()


def sub(old, new, count=1):
    global src
    assert src.count(old) == count, (old, src.count(old))
    src = src.replace(old, new)


sub('''def sparse_mla_fwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda"):''',
    '''def sparse_mla_fwd_ws_kernel(heads, d_v, d_tail, topk, kv_group, sm_scale, rows_per_block=1, target="cuda",
                             repeat=1):''')
sub('''        mask_block(w, i * 2 + 2)''', '''        mask_block(w, (i + 1) % ((w.nb + 1) // 2) * 2)''')
sub('''        mask_block(w, i * 2 + 3)''', '''        mask_block(w, (i + 1) % ((w.nb + 1) // 2) * 2 + 1)''')
sub('''        for i in T.serial((w.nb + 1) // 2):''', '''        for i in T.serial((w.nb + 1) // 2 * repeat):''')
sub('''                for i in T.serial(pairs):''', '''                for i in T.serial(pairs * repeat):''')
sub('''                    gather(w, i * 2, kv0, 0, UL, full0l)''', '''                    gather(w, i % pairs * 2, kv0, 0, UL, full0l)''')
sub('''                    gather(w, i * 2 + 1, kv1, UL, UA, full1r)''', '''                    gather(w, i % pairs * 2 + 1, kv1, UL, UA, full1r)''')
sub('''                    gather(w, i * 2, kv0, UL, UA, full0r)''', '''                    gather(w, i % pairs * 2, kv0, UL, UA, full0r)''')
sub('''                    gather(w, i * 2 + 1, kv1, 0, UL, full1l)''', '''                    gather(w, i % pairs * 2 + 1, kv1, 0, UL, full1l)''')
open("glm5_dsa_plugin/ops/_exp56.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp56.py")
