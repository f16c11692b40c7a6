"""exp47 (session 20; its edits match session 19's kernels, ecc27e9): variants of tilelang_kernels.py written as modules beside it (glm5_dsa_plugin/ops/_exp47{a,b}.py).
a: single-warpgroup forward's safe epilogue divides once per row (alpha, dead after the loop, holds 1/row_sum);
   ws backward's row delta reads dO from do_s (shared, already loaded) instead of global memory.
b: a + the gather warpgroup issues block 0's kv gather before the Q / dO prologue load.
c: b + the row delta's 8 column steps unrolled (all O loads in flight at once)."""
import pathlib, sys
root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
src = (root / "glm5_dsa_plugin/ops/tilelang_kernels.py").read_text()

def sub(text, old, new, count=1):
    assert text.count(old) == count, (old, text.count(old))
    return text.replace(old, new)

a = sub(src, """                    for h, d in T.Parallel(h_blk, D):
                        acc_o[h, d] = T.if_then_else(row_sum[h] != 0, acc_o[h, d] / row_sum[h], 0)
""", """                    for h in T.Parallel(h_blk):
                        alpha[h] = T.if_then_else(row_sum[h] != 0, 1.0 / row_sum[h], 0)
                    for h, d in T.Parallel(h_blk, D):
                        acc_o[h, d] = T.if_then_else(row_sum[h] != 0, acc_o[h, d] * alpha[h], 0)
""")
a = sub(a, "@T.macro\ndef _load_q_do(", '''@T.macro
def _row_delta_smem(w, od, od_sum, delta, seq_len, load_rows, h_blk, d_v):
    T.clear(delta)
    for c in T.serial(d_v // DELTA_COLS):
        for h, d in T.Parallel(h_blk, DELTA_COLS):
            od[h, d] = (T.cast(load_rows(w.O, w.b, w.s, w.h0, h, c * DELTA_COLS + d, seq_len), T.float32)
                        * T.cast(w.do_s[h, c * DELTA_COLS + d], T.float32))
        T.reduce_sum(od, od_sum, dim=1)
        for h in T.Parallel(h_blk):
            delta[h] = delta[h] + od_sum[h]
    for h in T.Parallel(h_blk):
        w.delta_s[h] = delta[h]


@T.macro
def _load_q_do(''')
a = sub(a, "                _row_delta(w, od, od_sum, delta, S, load_rows, h_blk, D)\n                for i in T.serial(nb):\n                    step(w, i)",
        "                _row_delta_smem(w, od, od_sum, delta, S, load_rows, h_blk, D)\n                for i in T.serial(nb):\n                    step(w, i)")
# b: move the namespace before the prologue load, gather block 0 first
ws_start = a.index("def sparse_mla_bwd_ws_kernel(")
head, ws = a[:ws_start], a[ws_start:]
load = ws[ws.index("            if one_tile:\n                for h, d in T.Parallel(h_blk, D + DT):"):ws.index("            # Q and the kv block as (first d_v columns")]
ns = ws[ws.index("            # Q and the kv block as (first d_v columns"):ws.index("            if tx < 256:\n                T.set_max_nreg(mma_regs, 1)")]
ws_b = ws.replace(load + ns, ns + "            if tx >= 256:\n                if nb > 0:\n                    gather(w, 0)\n" + load)
ws_b = sub(ws_b, """                T.set_max_nreg(producer_regs, 0)
                if nb > 0:
                    gather(w, 0)
""", """                T.set_max_nreg(producer_regs, 0)
""")
b = head + ws_b
out = root / "glm5_dsa_plugin/ops"
(out / "_exp47a.py").write_text(a)
(out / "_exp47b.py").write_text(b)
c = sub(b, """def _row_delta_smem(w, od, od_sum, delta, seq_len, load_rows, h_blk, d_v):
    T.clear(delta)
    for c in T.serial(d_v // DELTA_COLS):""", """def _row_delta_smem(w, od, od_sum, delta, seq_len, load_rows, h_blk, d_v):
    T.clear(delta)
    for c in T.unroll(d_v // DELTA_COLS):""")
(out / "_exp47c.py").write_text(c)
# d: c + dO's prologue rows loaded as 48 + 12 + 4 (64 x 512 over 384 threads vectorised 4 bytes wide)
d = sub(c, """            if one_tile:
                for h, d in T.Parallel(h_blk, D + DT):
                    q_s[h, d] = load_rows(Q, b, s, h0, h, d, S)
                for h, d in T.Parallel(h_blk, D):
                    do_s[h, d] = load_rows(dO, b, s, h0, h, d, S)
""", """            if one_tile:
                for h, d in T.Parallel(h_blk, D + DT):
                    q_s[h, d] = load_rows(Q, b, s, h0, h, d, S)
                for h, d in T.Parallel(48, D):
                    do_s[h, d] = load_rows(dO, b, s, h0, h, d, S)
                for h, d in T.Parallel(12, D):
                    do_s[48 + h, d] = load_rows(dO, b, s, h0, 48 + h, d, S)
                for h, d in T.Parallel(4, D):
                    do_s[60 + h, d] = load_rows(dO, b, s, h0, 60 + h, d, S)
""")
(out / "_exp47d.py").write_text(d)
print("wrote", out / "_exp47a.py", out / "_exp47b.py")
