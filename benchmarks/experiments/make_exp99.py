"""Writes glm5_dsa_plugin/ops/_exp99a.py / _exp99b.py (ignored by git), session 30: the forward's
score GEMM with the Q tile's last QR 64-column units (a: QR = 1, the rope tail; b: QR = 2) read
from registers. With one 64-slot block per MMA warpgroup the score GEMM is m64n64 with both
operands in shared memory: per k16 step 2 KB of Q and 2 KB of K in the 32 cycles the tensor cores
need, which is all of the 128 bytes per cycle shared memory gives, while the gathers and the PV
GEMMs use it too. Each warpgroup copies those columns of Q into a wgmma A fragment (16 registers
per unit) once per row and issues their k-steps register-sourced. (TileLang 0.1.15 lowers that
copy to ldmatrix reads of the tile's first columns: the variants compute wrong scores, as timed
in session 30; NOTES.) Run from the repository root."""
from patching import replace_once, with_forward_locals

SRC = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()


def variant(qr: int) -> str:
    src = SRC
    src = replace_once(src, '''        lo, hi = (0, DH) if part == 0 else (DH, D + DT)
        kv = w.kv[c]
        T.barrier_wait(w.full[c][part], i & 1)
        T.gemm(w.q_s[0:h_blk, lo:hi], kv[0:BI, lo:hi], w.acc_s, transpose_B=True,
               policy=T.GemmWarpPolicy.FullRow, annotations={"wg_wait": -1})''', f'''        lo, hi = (0, DH) if part == 0 else (DH, D + DT)
        kv = w.kv[c]
        T.barrier_wait(w.full[c][part], i & 1)
        if part == 1:
            # exp99: Q's last {qr} 64-column unit(s) from registers (w.q_r)
            T.gemm(w.q_s[0:h_blk, lo:QC0], kv[0:BI, lo:QC0], w.acc_s, transpose_B=True,
                   policy=T.GemmWarpPolicy.FullRow, annotations={{"wg_wait": -1}})
            T.gemm(w.q_r, kv[0:BI, QC0:hi], w.acc_s, transpose_B=True,
                   policy=T.GemmWarpPolicy.FullRow, annotations={{"wg_wait": -1}})
        else:
            T.gemm(w.q_s[0:h_blk, lo:hi], kv[0:BI, lo:hi], w.acc_s, transpose_B=True,
                   policy=T.GemmWarpPolicy.FullRow, annotations={{"wg_wait": -1}})''')
    src = replace_once(src, '''    DH = D // 2
    UL, UA = DH // 64, (D + DT) // 64''', f'''    DH = D // 2
    QC0 = D + DT - 64 * {qr}  # exp99: Q columns [QC0, D + DT) from registers
    UL, UA = DH // 64, (D + DT) // 64''')
    src = replace_once(src, '''        mask_block(w, c)
        T.barrier_wait(w.q_full, 0)
''', '''        mask_block(w, c)
        T.barrier_wait(w.q_full, 0)
        T.copy(w.q_s[0:h_blk, QC0:D + DT], w.q_r)
''')
    return with_forward_locals(src, "q_r", "T.alloc_fragment([h_blk, D + DT - QC0], dtype)")


for tag, qr in (("a", 1), ("b", 2)):
    open(f"glm5_dsa_plugin/ops/_exp99{tag}.py", "w").write(variant(qr))
