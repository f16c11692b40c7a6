"""Writes glm5_dsa_plugin/ops/_exp104{h3,h5,o,k}.py (ignored by git), session 31: the drain's share
of the chunks and its order. exp102: warpgroup 1 waits 28% of its loop for a free chunk buffer,
warpgroup 0 18% (and 8% / 7% for P / dS), the drain 27% for work; exp103: more work in warpgroup
0's score phase costs more than it frees. h3 / h5: warpgroup 0 computes 3 / 5 of d_v's eight
64-feature chunks instead of 4 (warpgroup 1 the rest and the rope tail); the drain takes the
phase-B chunks of both alternately, then warpgroup 1's tail (with four each, the tree's order).
o: the tree's split, the drain takes warpgroup 1's chunk before warpgroup 0's at each step. k: the
tree, with the drain's slot keys read once per block (at the top of its iteration) instead of
before each of the block's nine chunks. Run from the repository root."""
from patching import replace_once

SRC = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
TREE_ORDER = '''                    for k in T.unroll(N_OWN[1]):
                        if k < N_OWN[0]:
                            drain_chunk(w, i, 0, k)
                        drain_chunk(w, i, 1, k)'''


def split(half: int) -> str:
    src = replace_once(SRC, "    HALF = NCV // 2  #", f"    HALF = {half}  # exp104 (the tree: NCV // 2);")
    return replace_once(src, TREE_ORDER, '''                    for k in T.unroll(max(N_OWN[0], N_OWN[1] - 1)):
                        if k < N_OWN[0]:
                            drain_chunk(w, i, 0, k)
                        if k < N_OWN[1] - 1:
                            drain_chunk(w, i, 1, k)
                    drain_chunk(w, i, 1, N_OWN[1] - 1)''')


def wg1_first() -> str:
    return replace_once(SRC, TREE_ORDER, '''                    for k in T.unroll(N_OWN[1]):
                        drain_chunk(w, i, 1, k)
                        if k < N_OWN[0]:
                            drain_chunk(w, i, 0, k)''')


def keys_once() -> str:
    src = replace_once(SRC, '''        for r in T.unroll(BS * 16 // 128):
            w.drain_keys[r] = w.Indices[w.b, w.s, w.g, blk * BS + drain_slot(r, tp)]
''', '')
    return replace_once(src, '''                for i in T.serial(nb):
                    if i + 1 < nb:
                        T.barrier_wait(kv_free, i & 1)''', '''                for i in T.serial(nb):
                    for r in T.unroll(BS * 16 // 128):  # exp104k: the block's slot keys, once
                        drain_keys[r] = Indices[b, s, g, i * BS + drain_slot(r, tx - 256)]
                    if i + 1 < nb:
                        T.barrier_wait(kv_free, i & 1)''')


for tag, src in (("h3", split(3)), ("h5", split(5)), ("o", wg1_first()), ("k", keys_once())):
    open(f"glm5_dsa_plugin/ops/_exp104{tag}.py", "w").write(src)
    print(f"wrote glm5_dsa_plugin/ops/_exp104{tag}.py")
