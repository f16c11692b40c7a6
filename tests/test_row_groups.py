"""``row_groups.group_keys`` (the key lists of query-row groups) against a row-by-row Python build."""

import pytest
import torch

from glm5_dsa_plugin.ops.row_groups import group_keys, group_keys_reference


@pytest.mark.parametrize("R", [2, 4, 8])
def test_group_keys_match_a_row_by_row_build(R):
    gen = torch.Generator().manual_seed(R)
    for _ in range(20):
        B, T, G = (int(torch.randint(1, n, (1,), generator=gen)) for n in (3, 20, 3))
        K, n_kv = (int(torch.randint(1, n, (1,), generator=gen)) for n in (12, 15))
        # values in [0, n_kv]: n_kv is the padding sentinel; small n_kv makes repeats common
        idx = torch.randint(0, n_kv + 1, (B, T, G, K), generator=gen, dtype=torch.int32)
        for got, want, name in zip(group_keys(idx, n_kv, R), group_keys_reference(idx, n_kv, R), "kme"):
            assert torch.equal(got, want), name


def test_every_slot_counts_once():
    """Each row's multiset of keys is exactly what its member bits select: repeats included,
    padding excluded, rows past T empty."""
    gen = torch.Generator().manual_seed(0)
    T, K, n_kv, R = 13, 9, 6, 4
    idx = torch.randint(0, n_kv + 1, (1, T, 1, K), generator=gen, dtype=torch.int32)
    keys, members, extent = group_keys(idx, n_kv, R)
    for t in range(-(-T // R) * R):
        n, r = divmod(t, R)
        e = int(extent[0, n, 0])
        sel = ((members[0, n, 0, :e] >> r) & 1).bool()
        got = sorted(keys[0, n, 0, :e][sel].tolist())
        want = sorted(k for k in idx[0, t, 0].tolist() if k < n_kv) if t < T else []
        assert got == want, t
        assert torch.all(keys[0, n, 0, e:] == n_kv) and torch.all(members[0, n, 0, e:] == 0)
