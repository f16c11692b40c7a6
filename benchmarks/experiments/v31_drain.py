"""v31's drain_chunk body (session 28's tree): each chunk's atomics straight from its shared buffer,
then the buffer's free. make_exp94.py replaced it (exp94, landed as v32); make_exp95.py puts it
back into v32 as exp95's reference."""

V31_DRAIN_BODY = '''        tp = w.tx - 256
        n = blk * N_OWN[c] + k
        wait_chunk_buffer(w.ch_full[c], n, 0)
        for r in T.unroll(BS * 16 // 128):
            j = (r * 128 + tp) // 16
            d = (r * 128 + tp) % 16 * 4
            key = w.Indices[w.b, w.s, w.g, blk * BS + j]
            if valid_slot(key, n_kv):
                if dkv_per_slot:
                    for v in T.vectorized(4):
                        w.dKV[w.b, w.s, w.bz, blk * BS + j, (c * HALF + k) * 64 + d + v] = w.ch_s[c][n % 2, j, d + v]
                else:
                    T.atomic_addx4(w.dKV[w.b, key, w.g, (c * HALF + k) * 64 + d], w.ch_s[c][n % 2, j, d])
        arrive_chunk_buffer(w.ch_free[c], n)'''
