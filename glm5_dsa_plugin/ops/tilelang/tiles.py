"""Tile helpers shared by the TileLang kernels: slot validity and gather rows, the row-group tile
layout, the running max's exponent base, and the epilogue / prologue macros."""

from tilelang import language as T

from ..contract import EMPTY_ROW_LSE, LN2

__all__ = ["valid_slot", "slot_blocks", "tile_row", "row_group_access", "members_dtype", "gather_row", "exp_base",
           "finish_rows", "store_rows", "store_lse", "DELTA_COLS", "row_delta"]


def valid_slot(idx, n_rows):
    """A slot is valid iff its index is a real kv row (the same test in both modes). Compared in
    int64: with n_rows = kv_rows - 1 TVM rewrites ``idx < n_rows`` into ``idx + 1 < kv_rows``,
    which in int32 wraps at 2**31 - 1 and passes that index."""
    return (idx >= 0) & (T.cast(idx, "int64") < T.cast(n_rows, "int64"))


def slot_blocks(extent, block):
    """Blocks of ``block`` slots a row needs: ceil(extent / block)."""
    return (extent + block - 1) // block


def tile_row(s, h, h0, R: int, hg: int):
    """(query row, head) that tile row h of block s holds (``row_group_geometry``): (s, h0 + h) for
    R = 1, else (s * R + h // hg, h0 + h % hg), a row that may lie past the sequence."""
    if R == 1:
        return s, h0 + h
    return s * R + h // hg, h0 + h % hg


def row_group_access(R: int, hg: int):
    """(load_rows, load_lse, attends) for the tile layout of ``row_group_geometry``:
    load_rows(X, b, s, h0, h, d, S) reads X[b, row, head, d] for tile row h of block s (rows past
    the sequence read zero), load_lse(Lse, b, s, h0, h, S) reads Lse[b, row, head] (rows past the
    sequence read the last row's: their slots are all masked, P = 0); attends(valid, h, j) says
    whether tile row h attends slot j (R = 1: valid[j] bool; R > 1: bit h // hg of valid[j])."""
    if R == 1:
        return (lambda X, b, s, h0, h, d, S: X[b, s, h0 + h, d],
                lambda Lse, b, s, h0, h, S: Lse[b, s, h0 + h],
                lambda valid, h, j: valid[j])

    def load_rows(X, b, s, h0, h, d, S):
        row, head = tile_row(s, h, h0, R, hg)
        return T.if_then_else(row < S, X[b, T.min(row, S - 1), head, d], T.cast(0, X.dtype))

    def load_lse(Lse, b, s, h0, h, S):
        row, head = tile_row(s, h, h0, R, hg)
        return Lse[b, T.min(row, S - 1), head]

    return load_rows, load_lse, (lambda valid, h, j: ((valid[j] >> (h // hg)) & 1) == 1)


def members_dtype(R: int):
    """dtype of the Members tensor: uint8 member bits for row groups (R <= 8), else int32 (R = 1:
    not read; the caller passes the indices)."""
    return T.int32 if R == 1 else T.uint8


def gather_row(idx, n_rows, select):
    """Row of the sentinel-extended kv that a slot reads. The host already rewrote invalid slots
    to the sentinel (row ``n_rows``); with ``select`` the kernel also maps any index outside
    [0, n_rows) to the sentinel itself, so it stays in bounds even without the host rewrite.
    Without it (``safe=False``, or the forward's ``select_in_kernel=False``) the index is used as is."""
    if not select:
        return idx
    return T.if_then_else(valid_slot(idx, n_rows), idx, n_rows)


def exp_base(m):
    """The running max m [fp32] as the exponents' base: m, or 0 while m is -inf (every slot so far
    masked), so that exp2(s * c - base * c) and the rescale exp2((m_old - base) * c) are 0, not
    NaN, for such a row. The running max starts at -inf: a finite start (such as -2^30) would
    underflow every p of a row whose scores all lie 2048 or more below it (out 0 and an empty
    row's lse, silently)."""
    return T.if_then_else(m == -T.infinity(T.float32), T.float32(0), m)


@T.macro
def finish_rows(acc_o, row_sum, m, inv, scale2, h_blk, width):
    """Forward epilogue on a tile (safe mode): acc_o [h_blk, width] *= 1 / row_sum (``inv`` [h_blk]
    holds the reciprocals: one division per row, not one per entry) and row_sum becomes the
    natural lse; empty rows (row_sum == 0) get out 0 and lse EMPTY_ROW_LSE. The test is ``!= 0``:
    a NaN row sum (NaN or inf among the row's inputs) fails ``> 0``, which made such rows empty
    rows, zeros the guard cannot see; with ``!= 0`` they stay NaN."""
    for h in T.Parallel(h_blk):
        inv[h] = T.if_then_else(row_sum[h] != 0, 1.0 / row_sum[h], 0)
    for h, d in T.Parallel(h_blk, width):
        acc_o[h, d] = T.if_then_else(row_sum[h] != 0, acc_o[h, d] * inv[h], 0)
    for h in T.Parallel(h_blk):
        row_sum[h] = T.if_then_else(row_sum[h] != 0, (T.log2(row_sum[h]) + m[h] * scale2) * LN2, EMPTY_ROW_LSE)


@T.macro
def store_rows(Out, acc_o, b, s, h0, col0, seq_len, R, hg, h_blk, width):
    """Out[b, row, head, col0:col0 + width] = acc_o for the tile's rows (R > 1: rows past seq_len skipped)."""
    if R == 1:
        for h, d in T.Parallel(h_blk, width):
            Out[b, s, h0 + h, col0 + d] = acc_o[h, d]
    else:
        # (tile_row called, not bound: a binding in a macro becomes a TIR let, a new cache key)
        for h, d in T.Parallel(h_blk, width):
            if tile_row(s, h, h0, R, hg)[0] < seq_len:
                Out[(b, *tile_row(s, h, h0, R, hg), col0 + d)] = acc_o[h, d]


@T.macro
def store_lse(Lse, lse, b, s, h0, seq_len, R, hg, h_blk):
    if R == 1:
        for h in T.Parallel(h_blk):
            Lse[b, s, h0 + h] = lse[h]
    else:
        for h in T.Parallel(h_blk):  # (tile_row called, not bound, as in store_rows)
            if tile_row(s, h, h0, R, hg)[0] < seq_len:
                Lse[(b, *tile_row(s, h, h0, R, hg))] = lse[h]


DELTA_COLS = 64  # the backward sums Delta this many columns at a time


@T.macro
def row_delta(w, od, od_sum, delta, seq_len, load_rows, h_blk, d_v, do_from_shared=False, unrolled=False):
    """Backward prologue: w.delta_s[h] = rowsum(O * dO) over the tile's rows, DELTA_COLS columns
    at a time (od [h_blk, DELTA_COLS]: a small fragment beside the dQ accumulator).
    ``do_from_shared``: dO from the tile already in w.do_s (the caller synchronised after
    loading it) instead of global memory; ``unrolled``: the column steps unrolled, so every
    step's O load can be in flight at once (the warp-specialised backward with one-row tiles;
    with row groups it stays serial, where unrolling was slower)."""
    T.clear(delta)
    for c in (T.unroll(d_v // DELTA_COLS) if unrolled else T.serial(d_v // DELTA_COLS)):
        for h, d in T.Parallel(h_blk, DELTA_COLS):
            od[h, d] = (T.cast(load_rows(w.O, w.b, w.s, w.h0, h, c * DELTA_COLS + d, seq_len), T.float32)
                        * (T.cast(w.do_s[h, c * DELTA_COLS + d], T.float32) if do_from_shared
                           else T.cast(load_rows(w.dO, w.b, w.s, w.h0, h, c * DELTA_COLS + d, seq_len), T.float32)))
        T.reduce_sum(od, od_sum, dim=1)
        for h in T.Parallel(h_blk):
            delta[h] = delta[h] + od_sum[h]
    # staged through shared memory: the block loop reads it in the gemm's own layout
    for h in T.Parallel(h_blk):
        w.delta_s[h] = delta[h]
