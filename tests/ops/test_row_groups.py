"""``row_groups.group_keys`` (the key lists of query-row groups) against a row-by-row Python build;
its Triton pass runs in the interpreter on CPU (in a subprocess, as the other Triton tests)."""

import pytest
import torch

from triton_interpreter import run_interpreted

from glm5_dsa_plugin.ops.row_groups import group_keys_reference


def test_reference_lists_count_every_slot_once():
    """The row-by-row build the kernel is checked against: each row's multiset of keys is exactly
    what its member bits select (repeats included, padding excluded, rows past T empty)."""
    gen = torch.Generator().manual_seed(0)
    T, K, n_kv, R = 13, 9, 6, 4
    idx = torch.randint(0, n_kv + 1, (1, T, 1, K), generator=gen, dtype=torch.int32)
    keys, members, extent = group_keys_reference(idx, n_kv, R)
    for t in range(-(-T // R) * R):
        n, r = divmod(t, R)
        e = int(extent[0, n, 0])
        sel = ((members[0, n, 0, :e] >> r) & 1).bool()
        got = sorted(keys[0, n, 0, :e][sel].tolist())
        want = sorted(k for k in idx[0, t, 0].tolist() if k < n_kv) if t < T else []
        assert got == want, t
        assert torch.all(keys[0, n, 0, e:] == n_kv) and torch.all(members[0, n, 0, e:] == 0)


# TRIALS / LONG select which of the cases below one run checks: the trials listed, and the long
# contexts when LONG; every run draws the same random numbers, so the parts together check exactly
# the cases of one run over all of them, in processes that parallel test workers can share (the
# parts are cut to take similar time in the interpreter: trials with R = 8 and repeats sort most).
INTERPRETED = r"""
import torch
from glm5_dsa_plugin.ops.row_groups import canonical_lists, group_keys, group_keys_reference
TRIALS, LONG = {trials}, {long}
g = torch.Generator().manual_seed(1)
for trial in range(12):
    R = (2, 4, 8)[trial % 3]
    B, T, G = (int(torch.randint(1, n, (1,), generator=g)) for n in (3, 20, 3))
    # K up to 299: R * K slots span several of the kernels' 1024-slot blocks
    K, n_kv = int(torch.randint(1, 300, (1,), generator=g)), int(torch.randint(1, 120, (1,), generator=g))
    if trial % 4 == 3:  # rows without repeats (the indexer's case)
        idx = torch.stack([torch.randperm(n_kv + K, generator=g)[:K] for _ in range(B * T * G)]).view(B, T, G, K)
        idx = idx.clamp(max=n_kv).int()
    else:
        idx = torch.randint(0, n_kv + 1, (B, T, G, K), generator=g, dtype=torch.int32)
    if trial not in TRIALS:
        continue
    # trial % 3 == 2: a bit table of one word forces one group per batch
    got = group_keys(idx, n_kv, R, **({"table_words": 1} if trial % 3 == 2 else {}))
    want = group_keys_reference(idx, n_kv, R)
    assert torch.equal(got[2], want[2]), trial
    assert canonical_lists(*got) == canonical_lists(*want), trial
    e = got[2][..., None]
    pos = torch.arange(R * K)
    assert torch.all(got[0][pos >= e] == n_kv) and torch.all(got[1][pos >= e] == 0), trial
    # one fixed order, repeats included (sorted by (key, row)): the kernels' sums are reproducible
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), trial
# long contexts: a group's table spans several passes of the table read (2048 keys per pass)
for R, n_kv, K in ((2, 5000, 200), (8, 3000, 150)):
    idx = torch.stack([torch.randperm(n_kv, generator=g)[:K] for _ in range(2 * R)]).view(1, 2 * R, 1, K).int()
    if not LONG:
        continue
    got, want = group_keys(idx, n_kv, R), group_keys_reference(idx, n_kv, R)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (R, n_kv)
print("OK")
"""


@pytest.mark.slow
@pytest.mark.parametrize("trials,long", [((5,), False), ((1, 3, 7, 9, 11), True), ((0, 2, 4, 6, 8, 10), False)])
def test_group_keys_triton_passes_in_interpreter(trials, long):
    """The bit-table passes (CUDA in production) in the interpreter, against the row-by-row build:
    the same lists entry for entry (distinct keys ascending, then the repeats sorted by (key, row),
    though the atomics append them in any order), a clean tail, batches of groups sharing one
    table, and tables longer than one pass of the read (the interpreter runs one thread: races
    between threads show only on the GPU, see test_gpu_sparse_mla)."""
    run_interpreted(INTERPRETED.replace("{trials}", repr(trials)).replace("{long}", repr(long)))


SORT_AND_XOR_SUM = r"""
import torch
import triton
import triton.language as tl


@triton.jit
def sort_and_xor(X, SORTED, XOR, N: tl.constexpr):
    x = tl.load(X + tl.arange(0, N))
    tl.store(SORTED + tl.arange(0, N), tl.sort(x))
    tl.store(XOR, tl.xor_sum(x, 0))


x = torch.randint(-2**31, 2**31 - 1, (2048,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
got, xor = torch.empty_like(x), torch.empty(1, dtype=torch.int32)
sort_and_xor[(1,)](x, got, xor, N=2048)
assert torch.equal(got, x.sort().values)
want = 0
for v in x.tolist():
    want ^= v
assert xor.item() == want, (xor.item(), want)
print("OK")
"""


def test_interpreter_sort_and_xor_sum_under_the_fast_path():
    """The interpreter's numpy xor reduction (tests/triton_interpreter.py) gives tl.xor_sum's value
    and tl.sort's order on 2048 int32 lanes, the width the row-group kernel sorts."""
    run_interpreted(SORT_AND_XOR_SUM)
