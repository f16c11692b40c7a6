"""exp83's floor kernels (session 28): only the backward's dKV contributions, atomics or stores."""
import tilelang
from tilelang import language as T

from glm5_dsa_plugin.ops import tilelang_kernels as tk


def floor_kernel(topk: int, mode: str, threads: int, pin: bool, D: int = 576, target: str = "cuda"):
    """See exp83.py's part B."""
    BS, NS = 32, topk // 32
    B, S, SKV1 = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("kv_rows")
    n_kv = SKV1 - 1
    per_pass = threads // 16  # slot rows per pass of 16 threads each

    @T.prim_func
    def k(Indices: T.Tensor([B, S, 1, topk], T.int32), Extent: T.Tensor([B, S, 1], T.int32),
          dKV: T.Tensor([B, SKV1, 1, D], T.float32)):
        with T.Kernel(S, B, threads=threads) as (bx, b):
            buf = T.alloc_shared([BS, 68], T.float32)
            pad = T.alloc_shared([200 * 1024 // 4 if pin else 4], T.float32)
            tx = T.get_thread_binding()
            for i, j in T.Parallel(BS, 68):
                buf[i, j] = 1.0
            pad[tx % 4] = 0.0
            T.sync_threads()
            s = S - 1 - bx
            nb = T.min(tk.slot_blocks(Extent[b, s, 0], BS), NS)
            for blk in T.serial(nb):
                for c in T.serial(D // 64):
                    for r in T.unroll(BS // per_pass):
                        j = r * per_pass + tx // 16
                        d = tx % 16 * 4
                        key = Indices[b, s, 0, blk * BS + j]
                        if tk.valid_slot(key, n_kv):
                            if mode == "atomic":
                                T.atomic_addx4(dKV[b, key, 0, c * 64 + d], buf[j, d])
                            else:
                                for v in T.vectorized(4):
                                    dKV[b, key, 0, c * 64 + d + v] = buf[j, d + v] + pad[0]

    return tilelang.compile(k, pass_configs=tk.PASS_CONFIGS, target=target)
