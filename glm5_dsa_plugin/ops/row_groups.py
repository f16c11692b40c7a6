"""Key lists of query-row groups, for kernels that process R consecutive query rows per block.

With few heads per kv group (hg < 64) one query row fills a fraction of a 64-row MMA tile, and
every slot costs one kv gather and (backward) one fp32 dKV atomic however few heads there are.
A block of R = 64 / hg consecutive rows instead runs over the *union* of the rows' keys: one
gather and one dKV atomic per key of the group, each row masked to its own keys by member bits.
Consecutive rows share most of their keys (causal ranges, neighbouring tokens' indexer scores),
so the union is much shorter than R * topk.

Duplicate keys within a row count once per slot in the contract (the reference sums over
slots). Here the k-th repeat (k >= 1) of a key in one row gets its own entry, with only that
row's bit set, so every slot still counts exactly once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _group_lists(comp, keys, members, extent, n_kv, RK: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row group: comp [RK] = the group's key * R + row values, sorted ->
    keys (entries, then n_kv), members (|= 1 << row; zeroed by the caller), extent (#entries).
    A chunked scan: run starts, repeat numbers and entry numbers carry from chunk to chunk."""
    base = tl.program_id(0).to(tl.int64) * RK
    ar = tl.arange(0, BLOCK)
    n_entries = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    run_start = n_entries
    key_entry = n_entries - 1
    for start in range(0, RK, BLOCK):
        offs = start + ar
        inside = offs < RK
        c = tl.load(comp + base + offs, mask=inside, other=n_kv * R)
        prev = tl.load(comp + base + offs - 1, mask=inside & (offs > 0), other=-R)
        key = c // R
        row = c - key * R
        valid = inside & (key < n_kv)
        first_key = key != prev // R
        # repeat number of a (key, row) pair: position minus the start of its run of equal values
        rs = tl.maximum(tl.associative_scan(tl.where(c != prev, offs, 0), 0, _max), run_start)
        repeat = offs - rs
        new = valid & (first_key | (repeat > 0))
        entry = n_entries + tl.cumsum(new.to(tl.int32), 0) - 1
        # a first occurrence joins the entry its key opened; a repeat has its own entry
        ke = tl.maximum(tl.associative_scan(tl.where(first_key, entry, -1), 0, _max), key_entry)
        target = tl.where(repeat > 0, entry, ke)
        tl.store(keys + base + entry, key, mask=new)
        tl.atomic_or(members + base + target, (tl.full([BLOCK], 1, tl.int32) << row), mask=valid)
        n_entries += tl.sum(new.to(tl.int32), 0)
        run_start = tl.max(rs, 0)
        key_entry = tl.max(ke, 0)
    for start in range(0, RK, BLOCK):
        offs = start + ar
        tl.store(keys + base + offs, tl.full([BLOCK], 0, tl.int32) + n_kv, mask=(offs < RK) & (offs >= n_entries))
    tl.store(extent + tl.program_id(0), n_entries)


def group_keys(idx: torch.Tensor, n_kv: int, rows_per_group: int):
    """idx [B, T, G, K] int32, every slot in [0, n_kv] (n_kv = padding sentinel, as
    ``prepare_indices`` leaves them) -> (keys, members, extent):

    * keys [B, NG, G, R*K] int32, NG = ceil(T / R): the group's distinct (key, repeat) entries in
      ascending key order, then n_kv;
    * members [B, NG, G, R*K] int32: bit r set when row r of the group holds that entry;
    * extent [B, NG, G] int32: the number of entries.

    Rows past T (the last group) hold only padding. One segmented sort (torch) of the values
    key * R + row per group, then one Triton pass; no host sync.
    """
    R = rows_per_group
    B, T, G, K = idx.shape
    NG = -(-T // R)
    if NG * R != T:
        idx = torch.cat([idx, idx.new_full((B, NG * R - T, G, K), n_kv)], dim=1)
    row = torch.arange(R, device=idx.device, dtype=torch.int32).view(1, 1, R, 1, 1)
    comp = (idx.view(B, NG, R, G, K) * R + row).permute(0, 1, 3, 2, 4).reshape(B * NG * G, R * K)
    comp = comp.sort(dim=-1).values
    keys = torch.empty_like(comp)
    members = torch.zeros_like(comp)
    extent = torch.empty(B * NG * G, dtype=torch.int32, device=idx.device)
    if comp.shape[0]:
        _group_lists[(comp.shape[0],)](comp, keys, members, extent, n_kv, RK=R * K, R=R, BLOCK=1024, num_warps=8)
    shape = (B, NG, G, R * K)
    return keys.view(shape), members.view(shape), extent.view(B, NG, G)


def group_keys_reference(idx: torch.Tensor, n_kv: int, rows_per_group: int):
    """The same lists built row by row in Python (tests)."""
    R = rows_per_group
    B, T, G, K = idx.shape
    NG = -(-T // R)
    keys = torch.full((B, NG, G, R * K), n_kv, dtype=torch.int32)
    members = torch.zeros((B, NG, G, R * K), dtype=torch.int32)
    extent = torch.zeros((B, NG, G), dtype=torch.int32)
    for b in range(B):
        for n in range(NG):
            for g in range(G):
                entries: dict[tuple[int, int], int] = {}
                for r in range(R):
                    t = n * R + r
                    if t >= T:
                        continue
                    seen: dict[int, int] = {}
                    for k in idx[b, t, g].tolist():
                        if k >= n_kv:
                            continue
                        rep = seen.get(k, 0)
                        seen[k] = rep + 1
                        # first occurrences of a key share one entry; repeat k of row r is its own
                        e = (k, -1) if rep == 0 else (k, r * K + rep)
                        entries[e] = entries.get(e, 0) | (1 << r)
                for i, (e, bits) in enumerate(sorted(entries.items(), key=lambda kv: (kv[0][0], kv[0][1]))):
                    keys[b, n, g, i], members[b, n, g, i] = e[0], bits
                extent[b, n, g] = len(entries)
    return keys, members, extent
