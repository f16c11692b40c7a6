"""Writes glm5_dsa_plugin/ops/_exp69_{chain,lse,mask,pre,lseonly,lsevalid}.py (ignored by git), session 24: the
tree's warp-specialised backward with fewer wgmma waits. Every ``T.gemm`` of the backward waits
for its own wgmma batch (``wgmma.wait_group 0``) before the next is issued, also where the next
GEMM needs nothing from it: the two GEMMs of each dKV^T chunk (Q^T dS, then dO^T P into the same
accumulator), dQ's two (d_v columns, then the rope tail, separate accumulators) and warpgroup 1's
dP GEMM followed by the previous block's tail chunk. "chain" issues the first of each pair with
``wg_wait=-1`` (as the forward does), so one wait covers both (9-10 waits per step and MMA
warpgroup instead of 14-15); the arithmetic and its order are unchanged. On top of "chain":
"lse", warpgroup 0 keeps its rows' lse * log2(e) in registers (read once, not from global memory
after every score GEMM); "mask", warpgroup 0 sets the step's slot mask before it waits for the
gathered block, not after; "pre", both; "lseonly", "lse" without "chain"; "lsevalid", "lse" with only
the mask's index loads before the wait ("mask" spills 136 bytes). Run from the repository root on
v25's kernels (the tree before 0a23893, which landed "lse" as v26)."""
from patching import replace_once

tree = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
at = tree.index("def sparse_mla_bwd_ws_kernel(")
head, src = tree[:at], tree[at:]
unchained = src

# chain: value_chunk's Q^T dS, dQ's first GEMM, warpgroup 1's dP GEMM leave their batch open
src = replace_once(src, '''        T.gemm(w.q_s[0:h_blk, f * 64:(f + 1) * 64], w.dp_s, w.acc_t[c], transpose_A=True,
               policy=T.GemmWarpPolicy.FullRow, clear_accum=True)''', '''        T.gemm(w.q_s[0:h_blk, f * 64:(f + 1) * 64], w.dp_s, w.acc_t[c], transpose_A=True,
               policy=T.GemmWarpPolicy.FullRow, clear_accum=True, annotations={"wg_wait": -1})''')
src = replace_once(src, '''        T.gemm(w.dp_s, w.kv_parts[0], w.acc_dq, policy=T.GemmWarpPolicy.FullCol)''',
                   '''        T.gemm(w.dp_s, w.kv_parts[0], w.acc_dq, policy=T.GemmWarpPolicy.FullCol, annotations={"wg_wait": -1})''')
src = replace_once(src, '''            T.gemm(w.do_s, w.kv_parts[0], w.acc_ds, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                   clear_accum=True)
            if blk > 0:
                tail_chunk(w, blk - 1)
''', '''            T.gemm(w.do_s, w.kv_parts[0], w.acc_ds, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                   clear_accum=True, annotations={"wg_wait": -1})
            if blk > 0:
                tail_chunk(w, blk - 1)  # its GEMM's wait covers dP's batch too
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(w.acc_ds, num_regs=h_blk * BS // 128)
''')
# the dQ pair: the second GEMM's wait<0> covers both accumulators; fence the first's registers
src = replace_once(src, '''        T.gemm(w.dp_s, w.kv_parts[1], w.acc_dqt, policy=T.GemmWarpPolicy.FullCol)
''', '''        T.gemm(w.dp_s, w.kv_parts[1], w.acc_dqt, policy=T.GemmWarpPolicy.FullCol)
        T.warpgroup_fence_operand(w.acc_dq, num_regs=h_blk * D // 256)
''')
chain = src

# the step's opening: the wait for the gathered block, then warpgroup 0's slot mask (index loads,
# VALID, then the 0 / -inf fill, FILL) before its score GEMM
STEP = "    def step(w, blk):\n"
WAIT = "        T.barrier_wait(w.full, blk & 1)\n"
WG0 = """        if w.tx < 128:
"""
COMMENT = "            # warpgroup 0: masked scores, P = exp(S - lse); P to p32_s (fp32, for dS) and p_s (bf16)\n"
VALID = """            for j in T.Parallel(BS):
                if R == 1:
                    w.valid[j] = valid_slot(w.Indices[w.b, w.s, w.g, blk * BS + j], n_kv)
                else:
                    w.valid[j] = T.cast(w.Members[w.b, w.s, w.g, blk * BS + j], T.int32)
"""
FILL = """            for h, j in T.Parallel(h_blk, BS):
                w.acc_sp[h, j] = T.if_then_else(attends(w.valid, h, j), 0, -T.infinity(acc))
"""
GEMM = "            T.gemm("
MASK_AFTER_WAIT = STEP + WAIT + WG0 + COMMENT + VALID + FILL + GEMM


def early_mask(src):
    """The step's slot mask set before warpgroup 0 waits for the gathered block."""
    return replace_once(src, MASK_AFTER_WAIT, STEP + WG0 + VALID + FILL + WAIT + WG0 + COMMENT + GEMM)


def early_valid(src):
    """Only the slot mask's index loads before warpgroup 0 waits for the gathered block."""
    return replace_once(src, MASK_AFTER_WAIT, STEP + WG0 + VALID + WAIT + WG0 + COMMENT + FILL + GEMM)


def lse_in_registers(src):
    """Warpgroup 0's rows' lse * log2(e) read once into registers."""
    src = replace_once(src, "w.acc_sp[h, j] * scale2 - load_lse(w.Lse, w.b, w.s, w.h0, h, S) * LOG2E)",
                       "w.acc_sp[h, j] * scale2 - w.lse2[h])")
    line = "            acc_dqt = T.alloc_fragment([h_blk, DT], acc)\n"
    src = replace_once(src, line, line + "            lse2 = T.alloc_fragment([h_blk], acc)  # exp69: warpgroup 0's rows' lse * log2(e)\n")
    src = replace_once(src, "w = SimpleNamespace(tx=tx, ", "w = SimpleNamespace(tx=tx, lse2=lse2, ")
    line = "                _row_delta(w, od, od_sum, delta, S, load_rows, h_blk, D, do_from_shared=True, unrolled=one_tile)\n"
    return replace_once(src, line, line + """                if tx < 128:
                    for h in T.Parallel(h_blk):
                        lse2[h] = load_lse(Lse, b, s, h0, h, S) * LOG2E
""")


for name, text in (("chain", chain), ("mask", early_mask(chain)), ("lse", lse_in_registers(chain)),
                   ("pre", lse_in_registers(early_mask(chain))), ("lseonly", lse_in_registers(unchained)),
                   ("lsevalid", lse_in_registers(early_valid(chain)))):
    open(f"glm5_dsa_plugin/ops/_exp69_{name}.py", "w").write(head + text)
print("wrote glm5_dsa_plugin/ops/_exp69_{chain,mask,lse,pre,lseonly,lsevalid}.py")
