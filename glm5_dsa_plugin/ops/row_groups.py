"""Key lists of query-row groups, for kernels that process R consecutive query rows per block.

With few heads per kv group (hg < 64) one query row fills a fraction of a 64-row MMA tile, and
every slot costs one kv gather and (backward) one fp32 dKV atomic however few heads there are.
A block of R = 64 / hg consecutive rows instead runs over the *union* of the rows' keys: one
gather and one dKV atomic per key of the group, each row masked to its own keys by member bits.
Consecutive rows share most of their keys (causal ranges, neighbouring tokens' indexer scores),
so the union is much shorter than R * topk.

Duplicate keys within a row count once per slot in the contract (the reference sums over
slots). Here every further copy of a key in one row gets its own entry, with only that row's
bit set, so every slot still counts exactly once.

The lists come from a bit table instead of a sort: each group owns ``n_kv * R`` bits (bit
``(key % KPW) * R + row`` of word ``key // KPW``, KPW = 32 / R keys per int32 word). Marking a
slot is one atomic OR; a bit that was already set is a repeat. Reading the table in key order
gives the distinct keys sorted with their member bits. The table takes n_kv / 8 bytes per query
row, no more than the indices themselves (4 * topk bytes per row) while n_kv <= 32 * topk;
longer tables are processed a batch of groups at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["TABLE_WORDS", "group_keys", "canonical_lists", "group_keys_reference"]

# int32 words of bit table per batch of groups (256 MiB); each further batch zeroes it again
TABLE_WORDS = 1 << 26


@triton.jit
def _mark_keys(idx, table, repeats, n_repeats, g0, T, NG, G, n_kv, n_words,
               K: tl.constexpr, R: tl.constexpr, KPW: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (groups of this batch, R * K / BLOCK). Sets bit (key % KPW) * R + row of word key // KPW
    in the group's table for every valid slot of its R rows; a slot whose bit was already set is a
    repeat, appended (as key * R + row) to the group's repeat list (order unspecified)."""
    pid = tl.program_id(0)
    gid = g0 + pid
    g = gid % G
    n = (gid // G) % NG
    b = gid // (G * NG)
    s = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    r = s // K
    t = n * R + r
    inside = (s < R * K) & (t < T)
    src = ((b.to(tl.int64) * T + t) * G + g) * K + (s - r * K)
    key = tl.load(idx + src, mask=inside, other=n_kv)
    valid = inside & (key < n_kv)
    bit = tl.full([BLOCK], 1, tl.int32) << ((key % KPW) * R + r)
    old = tl.atomic_or(table + pid.to(tl.int64) * n_words + key // KPW, bit, mask=valid)
    repeat = valid & ((old & bit) != 0)
    slot = tl.atomic_add(n_repeats + pid + tl.zeros([BLOCK], tl.int32), 1, mask=repeat)
    tl.store(repeats + pid.to(tl.int64) * (R * K) + slot, key * R + r, mask=repeat)


@triton.jit
def _read_table(table, repeats, n_repeats, keys, members, extent, g0, n_kv, n_words,
                RK: tl.constexpr, RKP: tl.constexpr, R: tl.constexpr, KPW: tl.constexpr, WORDS: tl.constexpr,
                BLOCK: tl.constexpr):
    """One program per group of this batch: the table's set bits in key order -> entries (key,
    member bits), then the repeats (one entry each, sorted by (key, row); RKP = RK rounded up to a
    power of two), then n_kv / 0 to R * K. Reads the table only: clearing it here raced (R = 2:
    WORDS = 128 words over 256 threads, each word held by two threads, and one thread's zero
    store could land before the other's load; lists lost entries or member bits)."""
    pid = tl.program_id(0)
    gid = (g0 + pid).to(tl.int64)
    tbase = pid.to(tl.int64) * n_words
    n_entries = tl.sum(tl.zeros([WORDS * KPW], tl.int32), 0)
    sub = tl.arange(0, KPW)
    start = n_entries * 0
    while start < n_words:  # (a while loop: the interpreter cannot range() over a runtime bound)
        w_off = start + tl.arange(0, WORDS)
        w = tl.load(table + tbase + w_off, mask=w_off < n_words, other=0)
        bits = tl.reshape((w[:, None] >> (sub[None, :] * R)) & ((1 << R) - 1), [WORDS * KPW])
        key = tl.reshape(w_off[:, None] * KPW + sub[None, :], [WORDS * KPW])
        new = bits != 0
        entry = n_entries + tl.cumsum(new.to(tl.int32), 0) - 1
        tl.store(keys + gid * RK + entry, key, mask=new)
        tl.store(members + gid * RK + entry, bits.to(tl.uint8), mask=new)
        n_entries += tl.sum(new.to(tl.int32), 0)
        start += WORDS
    n_rep = tl.load(n_repeats + pid)
    if n_rep > 0:
        # the atomics appended the repeats in any order; sorted by key * R + row (equal values are
        # the same entry) the list is one fixed order, so the kernels' sums are reproducible
        offs = tl.arange(0, RKP)
        rep = offs < n_rep
        v = tl.sort(tl.load(repeats + pid.to(tl.int64) * RK + offs, mask=rep, other=2147483647))
        tl.store(keys + gid * RK + n_entries + offs, v // R, mask=rep)
        tl.store(members + gid * RK + n_entries + offs, (tl.full([RKP], 1, tl.int32) << (v % R)).to(tl.uint8), mask=rep)
    ar = tl.arange(0, BLOCK)
    total = n_entries + n_rep
    for start in range(0, RK, BLOCK):
        offs = start + ar
        tail = (offs < RK) & (offs >= total)
        tl.store(keys + gid * RK + offs, tl.full([BLOCK], 0, tl.int32) + n_kv, mask=tail)
        tl.store(members + gid * RK + offs, tl.zeros([BLOCK], tl.uint8), mask=tail)
    tl.store(extent + gid, total)


def group_keys(idx: torch.Tensor, n_kv: int, rows_per_group: int, table_words: int = TABLE_WORDS):
    """idx [B, T, G, K] int32, every slot in [0, n_kv] (n_kv = padding sentinel, as
    ``prepare_indices`` leaves them) -> (keys, members, extent):

    * keys [B, NG, G, R*K] int32, NG = ceil(T / R): the group's distinct keys in ascending order,
      then one entry per further copy of a key in one row (sorted by (key, row)), then n_kv;
    * members [B, NG, G, R*K] uint8: bit r set when row r of the group holds that entry (0 past
      the entries);
    * extent [B, NG, G] int32: the number of entries.

    Rows past T (the last group) hold only padding. Two Triton launches per batch of groups (a
    batch's bit table fits ``table_words``; batches after the first zero it again); no host sync.
    """
    R = rows_per_group
    if R not in (2, 4, 8):
        raise ValueError(f"rows_per_group must be 2, 4 or 8 (member bits are uint8), got {R}")
    idx = idx.contiguous()
    B, T, G, K = idx.shape
    NG = -(-T // R)
    n_groups, kpw = B * NG * G, 32 // R
    n_words = max(1, -(-n_kv // kpw))
    shape = (B, NG, G, R * K)
    keys = torch.empty(shape, dtype=torch.int32, device=idx.device)
    members = torch.empty(shape, dtype=torch.uint8, device=idx.device)
    extent = torch.empty((B, NG, G), dtype=torch.int32, device=idx.device)
    if n_groups == 0 or K == 0:
        return keys.fill_(n_kv), members.zero_(), extent.zero_()
    batch = max(1, min(n_groups, table_words // n_words))
    table = torch.zeros(batch * n_words, dtype=torch.int32, device=idx.device)
    repeats = torch.empty((batch, R * K), dtype=torch.int32, device=idx.device)
    n_repeats = torch.empty(batch, dtype=torch.int32, device=idx.device)
    for g0 in range(0, n_groups, batch):
        size = min(batch, n_groups - g0)
        if g0:
            table.zero_()
        n_repeats.zero_()
        _mark_keys[(size, triton.cdiv(R * K, 1024))](idx, table, repeats, n_repeats, g0, T, NG, G, n_kv, n_words,
                                                      K=K, R=R, KPW=kpw, BLOCK=1024, num_warps=4)
        _read_table[(size,)](table, repeats, n_repeats, keys, members, extent, g0, n_kv, n_words,
                             RK=R * K, RKP=triton.next_power_of_2(R * K), R=R, KPW=kpw, WORDS=2048 // kpw,
                             BLOCK=1024, num_warps=8)
    return keys, members, extent


def canonical_lists(keys: torch.Tensor, members: torch.Tensor, extent: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Each group's entries as a sorted list of (key, member bits): what the kernels' sums depend
    on (the order of a group's entries does not change which slots count). Tests."""
    R = keys.shape[-1]
    k, m, e = keys.reshape(-1, R).tolist(), members.reshape(-1, R).tolist(), extent.reshape(-1).tolist()
    return [sorted(zip(k[i][: e[i]], m[i][: e[i]])) for i in range(len(e))]


def group_keys_reference(idx: torch.Tensor, n_kv: int, rows_per_group: int):
    """The same lists built row by row in Python (tests): distinct keys ascending, then the
    repeats sorted by (key, row)."""
    R = rows_per_group
    B, T, G, K = idx.shape
    NG = -(-T // R)
    keys = torch.full((B, NG, G, R * K), n_kv, dtype=torch.int32)
    members = torch.zeros((B, NG, G, R * K), dtype=torch.uint8)
    extent = torch.zeros((B, NG, G), dtype=torch.int32)
    for b in range(B):
        for n in range(NG):
            for g in range(G):
                firsts: dict[int, int] = {}
                repeats: list[tuple[int, int]] = []
                for r in range(R):
                    t = n * R + r
                    if t >= T:
                        continue
                    seen: set[int] = set()
                    for k in idx[b, t, g].tolist():
                        if k >= n_kv:
                            continue
                        if k in seen:
                            repeats.append((k, 1 << r))
                        else:
                            seen.add(k)
                            firsts[k] = firsts.get(k, 0) | (1 << r)
                entries = sorted(firsts.items()) + sorted(repeats)
                for i, (k, bits) in enumerate(entries):
                    keys[b, n, g, i], members[b, n, g, i] = k, bits
                extent[b, n, g] = len(entries)
    return keys, members, extent
