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


def group_keys(idx: torch.Tensor, n_kv: int, rows_per_group: int, block: int = 64):
    """idx [B, T, G, K] int32, every slot in [0, n_kv] (n_kv = padding sentinel, as
    ``prepare_indices`` leaves them) -> (keys, members, extent):

    * keys [B, NG, G, R*K] int32, NG = ceil(T / R): the group's distinct (key, repeat) entries in
      ascending key order, then n_kv;
    * members [B, NG, G, R*K] int32: bit r set when row r of the group holds that entry;
    * extent [B, NG, G] int32: the number of entries (blocks of ``block`` after it are padding).

    Rows past T (the last group) hold only padding. One sort per group; no host sync.
    """
    R = rows_per_group
    B, T, G, K = idx.shape
    NG = -(-T // R)
    dev = idx.device
    if NG * R != T:
        idx = torch.cat([idx, idx.new_full((B, NG * R - T, G, K), n_kv)], dim=1)
    # [B, NG, G, R, K] -> one row of R*K composite values (key * R + row) per group
    x = idx.view(B, NG, R, G, K).permute(0, 1, 3, 2, 4)
    row = torch.arange(R, device=dev, dtype=torch.int32).view(1, 1, 1, R, 1)
    comp = (x * R + row).reshape(B * NG * G, R * K)
    comp = comp.sort(dim=-1).values
    key, row = comp // R, comp % R
    valid = key < n_kv
    pos = torch.arange(R * K, device=dev, dtype=torch.int32).expand_as(comp)
    first_of_value = torch.ones_like(valid)
    first_of_value[:, 1:] = comp[:, 1:] != comp[:, :-1]
    first_of_key = torch.ones_like(valid)
    first_of_key[:, 1:] = key[:, 1:] != key[:, :-1]
    # repeat number of a (key, row) pair: position minus the start of its run of equal values
    run_start = torch.where(first_of_value, pos, 0).cummax(dim=-1).values
    repeat = pos - run_start
    new_entry = valid & (first_of_key | (repeat > 0))
    entry = new_entry.to(torch.int32).cumsum(dim=-1, dtype=torch.int32) - 1
    # a first occurrence joins the entry its key opened; a repeat has its own entry
    key_entry = torch.where(first_of_key, entry, -1).cummax(dim=-1).values
    target = torch.where(valid, torch.where(repeat > 0, entry, key_entry), pos).long()
    keys = torch.full_like(comp, n_kv).scatter_(1, target, torch.where(valid, key, n_kv))
    bits = torch.where(valid, torch.ones_like(row) << row, 0)
    members = torch.zeros_like(comp).scatter_add_(1, target, bits)
    extent = new_entry.sum(dim=-1, dtype=torch.int32)
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
