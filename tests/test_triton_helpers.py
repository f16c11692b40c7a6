"""Backward preprocessing (row delta), the guard's finiteness flag and the backward's per-row
block count, on CPU (Triton kernels through the interpreter in a subprocess)."""

import os
import subprocess
import sys

import torch

from glm5_dsa_plugin.ops.tilelang_backend import _leading_blocks, kernel_indices

SCRIPT = r"""
import torch
from glm5_dsa_plugin.ops.triton_helpers import row_delta, flag_nonfinite
g = torch.Generator().manual_seed(0)
for shape in [(2, 5, 3, 512), (7, 4, 256), (3, 40)]:
    o = torch.randn(*shape, generator=g).bfloat16(); d = torch.randn(*shape, generator=g).bfloat16()
    torch.testing.assert_close(row_delta(o, d), (o.float() * d.float()).sum(-1), rtol=1e-5, atol=1e-4)
x = torch.randn(20000, generator=g).bfloat16()
f = torch.zeros(3, dtype=torch.int32); flag_nonfinite(x, f, 1); assert f.tolist() == [0, 0, 0]
for bad in (float("nan"), float("inf"), -float("inf")):
    for pos in (0, 8191, 8192, 19999):
        y = x.clone(); y[pos] = bad; f = torch.zeros(3, dtype=torch.int32)
        flag_nonfinite(y, f, 2); assert f.tolist() == [0, 0, 1], (bad, pos, f)
z = torch.full((5, 7), 3e38, dtype=torch.float32); f = torch.zeros(1, dtype=torch.int32)
flag_nonfinite(z, f, 0); assert f.item() == 0, "huge but finite must not be flagged"
from glm5_dsa_plugin.ops.triton_helpers import segment_sum_rows
for N, R, D in [(1000, 37, 576), (5, 3, 70), (40, 1, 64)]:
    c = torch.randn(N, D, generator=g); k = torch.randint(0, R, (N,), generator=g)
    out = torch.randn(R, D, generator=g); want = out.double().index_add(0, k, c.double())
    segment_sum_rows(c, k, out)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
print("OK")
"""


def test_row_delta_and_nonfinite_flag_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_leading_blocks_counts_through_the_last_valid_slot():
    g = torch.Generator().manual_seed(0)
    B, T, G, K, blk, T_kv = 2, 9, 2, 256, 64, 50
    idx = torch.randint(0, T_kv, (B, T, G, K), generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=g) < 0.5] = -1  # padding anywhere, not only at the tail
    idx[0, 0, 0] = -1  # empty row
    idx[0, 1, 0, :] = -1
    idx[0, 1, 0, 130] = 7  # one valid slot in the third block
    idx[1, 2, 1, :] = -1
    idx[1, 2, 1, 255] = T_kv  # invalid index is not a valid slot (it will be rejected by validation)
    got = _leading_blocks(idx, T_kv, blk)
    valid = (idx >= 0) & (idx < T_kv)
    for b in range(B):
        for t in range(T):
            for gg in range(G):
                pos = valid[b, t, gg].nonzero()
                want = 0 if pos.numel() == 0 else int(pos.max()) // blk + 1
                assert got[b, t, gg].item() == want
    assert got[0, 0, 0] == 0 and got[0, 1, 0] == 3 and got[1, 2, 1] == 0


def test_kernel_indices_map_every_invalid_slot_to_the_sentinel():
    T_kv = 50
    idx = torch.tensor([[[[0, 49, -1, 50, -7, 2**31 - 1, 3]]]], dtype=torch.int32)
    got = kernel_indices(idx, T_kv, 4)
    assert got.dtype == torch.int32 and got.shape == (1, 1, 1, 8)
    assert got.flatten().tolist() == [0, 49, 50, 50, 50, 50, 3, 50]
    assert _leading_blocks(got, T_kv, 4).item() == 2


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 5), G=st.integers(1, 3), nblk=st.integers(1, 4),
       blk=st.sampled_from([1, 4, 64]), T_kv=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_kernel_indices_properties(B, T, G, nblk, blk, T_kv, seed):
    """Any int32 input: output in [0, T_kv], valid slots unchanged, everything else the sentinel,
    topk padded to a multiple of the block; the block count covers exactly the last valid slot."""
    g = torch.Generator().manual_seed(seed)
    K = max(1, nblk * blk - int(torch.randint(0, blk, (1,), generator=g)))
    pool = torch.tensor([-2**31, -7, -1, T_kv, T_kv + 1, 2**31 - 1], dtype=torch.int32)
    idx = torch.randint(0, T_kv, (B, T, G, K), generator=g, dtype=torch.int32)
    wild = torch.rand(idx.shape, generator=g) < 0.4
    idx[wild] = pool[torch.randint(0, len(pool), (int(wild.sum()),), generator=g)]
    out = kernel_indices(idx, T_kv, blk)
    assert out.dtype == torch.int32 and out.shape[-1] % blk == 0 and out.shape[-1] - K < blk
    assert int(out.min()) >= 0 and int(out.max()) <= T_kv
    valid = (idx >= 0) & (idx < T_kv)
    head = out[..., :K]
    assert torch.equal(head[valid], idx[valid]) and bool((head[~valid] == T_kv).all())
    assert bool((out[..., K:] == T_kv).all())
    counts = _leading_blocks(out, T_kv, blk)
    ok = out < T_kv
    for b in range(B):
        for t in range(T):
            for gg in range(G):
                pos = ok[b, t, gg].nonzero()
                assert counts[b, t, gg].item() == (0 if pos.numel() == 0 else int(pos.max()) // blk + 1)
