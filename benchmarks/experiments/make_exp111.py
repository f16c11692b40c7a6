"""Writes glm5_dsa_plugin/ops/_exp111.py (ignored by git), session 32: the one-row backward (R = 1)
with its Q and kv tiles split at d_v, as row groups have them. exp108's source counters (W1 H64,
v32): the backward's LDGSTS.128 take 8 shared-memory wavefronts per warp instruction where the
forward's take 4 (151 M against an ideal 75.5 M: 288 extra wavefronts per 32-slot step, about 5%
of the step's). exp110 remapped the gather's lanes and changed nothing. The cause is the tile's
layout: the dQ rope-tail GEMM, split over both MMA warpgroups (FullCol), reads 32-column slices
of kv_s, so TileLang lays the whole [32, 576] tile out in 64-byte swizzled rows; the forward's kv
tiles have 128-byte swizzled rows. Split, kv_s [32, 512] takes the 128-byte swizzle (only the
[32, 64] rope-tail tile keeps the 64-byte one), at the cost of a second score GEMM (Q_tail
K_tail^T). dq still leaves through the Q tile, and Delta's row loop stays unrolled, as at R = 1.
Run from the repository root."""
from patching import replace_once

SRC = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
src = replace_once(SRC, "    one_tile = R == 1\n", "    one_tile = False  # exp111: split at d_v for R = 1 too\n")
src = replace_once(src, "do_from_shared=True, unrolled=one_tile)", "do_from_shared=True, unrolled=R == 1)")
src = replace_once(src, '''                if one_tile:
                    # dq through the Q tile's first d_v columns''', '''                if R == 1:
                    # dq through the Q tile's first d_v columns''')
open("glm5_dsa_plugin/ops/_exp111.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp111.py")
