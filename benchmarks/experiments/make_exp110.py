"""Writes glm5_dsa_plugin/ops/_exp110.py (ignored by git), session 32: the backward's gather without
its shared-memory bank conflicts. exp108's source counters (W1 H64, v32): the backward's
LDGSTS.128 took 8 shared-memory wavefronts per warp instruction where 4 would do (151 M against an
ideal 75.5 M, 288 extra wavefronts per 32-slot step, about 5% of the step's shared-memory
wavefronts); the forward's take 4. TileLang lays the backward's kv tile out in 64-byte swizzled
rows, one [rows, 32 columns] sub-tile per half of each 64-column unit, so the tree's mapping (the 8
lanes of a quarter warp on one row's 128 bytes) puts each quarter's two 64-byte halves in
different sub-tiles on the same four banks. Here each quarter warp covers two consecutive rows x
32 columns of one sub-tile: 128 contiguous bytes, all 32 banks. Only the one-tile kv writes (R =
1) change; row groups' kv / rope-tail tiles keep the tree's mapping. Run from the repository root.
Outcome (call 4): the wavefronts did not move. The LDGSTS write each gathered 128-byte global line
as one unit, so a line split over two sub-tiles costs two wavefronts whichever lanes fetch it;
exp111 changes the layout instead."""
from patching import replace_once

SRC = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()

src = replace_once(SRC, '''    @T.macro
    def gather(w, blk):
        # 8 threads per kv row, 16 bytes per copy, 16 rows per pass
        tp = w.tx - 256
        c = tp % 8 * 8
        for rr in T.unroll(BS // 16):
            e = rr * 16 + tp // 8
            key = gather_row(w.Indices[w.b, w.s, w.g, blk * BS + e], n_kv, True)
            for u in T.unroll(QW // 64):''', '''    @T.macro
    def gather(w, blk):
        # 16 bytes per copy, 16 rows per pass. exp110 (R = 1): each quarter warp covers two rows x 32
        # columns of one 64-column unit (128 contiguous bytes of the 64-byte swizzled tile: no bank
        # conflict); row groups: 8 threads per kv row, as the tree
        tp = w.tx - 256
        c = (tp // 8 % 2 * 32 + tp % 4 * 8) if one_tile else tp % 8 * 8
        for rr in T.unroll(BS // 16):
            e = (rr * 16 + tp // 16 * 2 + tp % 8 // 4) if one_tile else rr * 16 + tp // 8
            key = gather_row(w.Indices[w.b, w.s, w.g, blk * BS + e], n_kv, True)
            for u in T.unroll(QW // 64):''')
open("glm5_dsa_plugin/ops/_exp110.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp110.py")
