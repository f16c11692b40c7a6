"""Writes glm5_dsa_plugin/ops/_exp67.py (ignored by git), session 23: the tree's warp-specialised
backward with its fp32 dKV^T chunk stores (read only by the drain warpgroup's generic loads, never
by wgmma) made through an extern device function instead of plain stores. TileLang's fence pass
treats unknown extern calls as async-proxy work, so it no longer sees generic shared-memory
traffic after each step's explicit fences and stops putting a fence.proxy.async before every
chunk's GEMM (exp65 / exp66: without those fences the backward is 1.5-2.4% faster at W2 H64),
for this kernel only, with the pass itself left on. Outcome (CPU build, not run on the GPU): the
generated CUDA keeps all 7 fences; TileLang 0.1.15 counts the extern call as generic traffic. Run
from the repository root."""
from patching import replace_once

src = open("glm5_dsa_plugin/ops/tilelang_kernels.py").read()
src = replace_once(src, '''BLOCK_TOPK = 64  # topk is padded with -1 to a multiple of this
''', '''BLOCK_TOPK = 64  # topk is padded with -1 to a multiple of this
# exp67: a plain fp32 shared-memory store the fence pass cannot see (an extern call)
STORE_SRC = r"""
__device__ __forceinline__ void glm5_store_chunk_f32(void* p, float v) { *(float*)p = v; }
"""
''')
src = replace_once(src, '''        for i, j in T.Parallel(64, BS):
            w.ch_s[c][n % 2, j, i] = w.acc_t[c][i, j]''', '''        for i, j in T.Parallel(64, BS):
            T.call_extern("handle", "glm5_store_chunk_f32", T.access_ptr(w.ch_s[c][n % 2, j, i], "w", 1),
                          w.acc_t[c][i, j])''')
at = src.index("def sparse_mla_bwd_ws_kernel(")
head, tail = src[:at], src[at:]
line = "        with T.Kernel(NG, B, kv_group * nh, threads=THREADS) as (bx, b, bz):"
assert tail.count(line) == 1, tail.count(line)
tail = tail.replace(line, "        with T.Kernel(NG, B, kv_group * nh, threads=THREADS, prelude=STORE_SRC) as (bx, b, bz):")
src = head + tail
open("glm5_dsa_plugin/ops/_exp67.py", "w").write(src)
print("wrote glm5_dsa_plugin/ops/_exp67.py")
