"""Writes glm5_dsa_plugin/ops/_exp95.py (ignored by git), session 29: v32's tree with v31's drain
(atomics straight from the chunk buffer, then the free), the reference for ``exp95.py``. Run from
the repository root."""
from patching import replace_once
from v31_drain import V31_DRAIN_BODY

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
start = src.index("    @T.macro\n    def drain_chunk(w, blk, c, k):")
end = src.index("    @T.macro\n    def step(w, blk):")
src = src[:start] + '''    @T.macro
    def drain_chunk(w, blk, c, k):
        # (v31's drain) warpgroup c's chunk k of this block, 16 bytes per atomic
''' + V31_DRAIN_BODY + '''

''' + src[end:]
src = replace_once(src, '''            drain_keys = T.alloc_local([BS * 16 // 128], T.int32)  # a drain thread's slot keys of a chunk
            drain_vals = T.alloc_local([BS * 16 // 32], acc)  # and its values of the chunk (4 x 16 bytes)
''', "")
src = replace_once(src, "step_done=step_done, drain_keys=drain_keys, drain_vals=drain_vals)", "step_done=step_done)")
open("glm5_dsa_plugin/ops/_exp95.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp95.py")
