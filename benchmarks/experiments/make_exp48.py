"""exp48 (prepared in session 20, run in session 21: not landed, see NOTES): the warp-specialised forward tests out / lse for NaN / inf
in registers (``_flag_nonfinite``) and sets Flags[0], on top of the tree's reciprocal epilogue
(session 19's exp42 measured the same test at +10-12% of the kernel on the per-entry-division
epilogue). Writes glm5_dsa_plugin/ops/_exp48.py (ignored by git) from the tree's kernels (v22,
adf2855): the forward takes ``Flags`` (int32 [1]) as its last argument."""
import pathlib
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
src = (root / "glm5_dsa_plugin/ops/tilelang_kernels.py").read_text()


def sub(text, old, new):
    assert text.count(old) == 1, (old, text.count(old))
    return text.replace(old, new)


start = src.index("def sparse_mla_fwd_ws_kernel(")
end = src.index("def sparse_mla_bwd_kernel(")
ws = src[start:end]
ws = sub(ws, """        _finish_rows(w.acc_o, w.row_sum, w.m, w.alpha, scale2, h_blk, DH)  # (alpha is dead: the reciprocals)
""", """        _finish_rows(w.acc_o, w.row_sum, w.m, w.alpha, scale2, h_blk, DH)  # (alpha is dead: the reciprocals)
        _flag_nonfinite(w.Flags, w.acc_o, h_blk, DH)
        if c == 0:
            for h in T.Parallel(h_blk):
                if T.isnan(w.row_sum[h]) | T.isinf(w.row_sum[h]):
                    w.Flags[0] = 1
""")
ws = sub(ws, """        Lse: T.Tensor([B, S, heads], acc),
    ):
        with T.Kernel(NG * rep, B, kv_group, threads=384) as (bx, b, g):""", """        Lse: T.Tensor([B, S, heads], acc),
        Flags: T.Tensor([1], T.int32),
    ):
        with T.Kernel(NG * rep, B, kv_group, threads=384) as (bx, b, g):""")
ws = sub(ws, "                          Out=Out, Lse=Lse, h0=h0, S=S, Q=Q, q_full=q_full)",
         "                          Out=Out, Lse=Lse, h0=h0, S=S, Q=Q, q_full=q_full, Flags=Flags)")
out = root / "glm5_dsa_plugin/ops/_exp48.py"
out.write_text(src[:start] + ws + src[end:])
print("wrote", out)
