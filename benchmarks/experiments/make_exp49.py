"""exp49 (prepared in session 20, run in session 21 and landed in 8363723, so its text
edit no longer matches the tree (it asserts and stops)): the warp-specialised backward (one row per block) stores
dq through the dead Q tile, as the forward stores out (exp32: 4% of that kernel at W1): acc_dq
into q_s[:, 0:d_v] as bf16 by both MMA warpgroups (each its own columns: FullCol splits d_v
between them, and each has finished reading its columns of Q by then; the rope-tail chunk after
the loop reads only q_s[:, d_v:]), then 16-byte coalesced stores of the tile. Writes
glm5_dsa_plugin/ops/_exp49.py (ignored by git) from the tree's kernels (v22, adf2855)."""
import pathlib
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
src = (root / "glm5_dsa_plugin/ops/tilelang_kernels.py").read_text()
old = """                _store_rows(dQ, acc_dq, b, s, h0, 0, S, R, hg, h_blk, D)
                _store_rows(dQ, acc_dqt, b, s, h0, D, S, R, hg, h_blk, DT)
            else:
                # 3 x 168 registers"""
assert src.count(old) == 1
new = """                if one_tile:
                    T.copy(acc_dq, q_s[0:h_blk, 0:D])
                    T.copy(q_s[0:h_blk, 0:D], dQ[b, s, h0:h0 + h_blk, 0:D])
                else:
                    _store_rows(dQ, acc_dq, b, s, h0, 0, S, R, hg, h_blk, D)
                _store_rows(dQ, acc_dqt, b, s, h0, D, S, R, hg, h_blk, DT)
            else:
                # 3 x 168 registers"""
out = root / "glm5_dsa_plugin/ops/_exp49.py"
out.write_text(src.replace(old, new))
print("wrote", out)
