"""The radix-select top-k kernel against a stable sort of the same scores (an order independent of
the kernel's and of ``score_keys``'s integer images), run by Triton's interpreter on CPU."""

import pytest
import torch

from triton_interpreter import run_interpreted

SCRIPT = r"""
import torch
from glm5_dsa_plugin.ops.indexer.radix_topk import radix_topk

def stable_sort_topk(scores, k):
    # highest first, equal scores in ascending key index, -inf -> -1; -0.0 equals +0.0
    vals, order = torch.sort(scores + 0.0, dim=-1, descending=True, stable=True)
    n = scores.shape[-1]
    idx = torch.where(vals[:, :k] == float("-inf"), -1, order[:, :k]).to(torch.int32)
    return torch.nn.functional.pad(idx, (0, max(0, k - n)), value=-1)

def key_order(idx):
    # ascending key index, -1 last
    last = torch.iinfo(torch.int32).max
    s = torch.where(idx < 0, last, idx).sort(-1).values
    return torch.where(s == last, -1, s).to(torch.int32)

def check(scores, k, block=64, strides=(8, 1)):
    want = stable_sort_topk(scores, k)
    # a candidate list wider than any bucket, and one of 2 entries (most rows take the row passes);
    # the sampled threshold (stride 8) and the full passes alone (stride 1)
    for candidates in (1024, 2):
        for stride in strides:
            got = radix_topk(scores, k, block=block, candidates=candidates, sample_stride=stride)
            assert torch.equal(got, want), (k, block, candidates, stride, got, want)
            # key order: the same entries, ascending key index, -1 last
            by_key = radix_topk(scores, k, block=block, candidates=candidates, ordered=False, sample_stride=stride)
            assert by_key.dtype == torch.int32 and by_key.shape == want.shape
            assert torch.equal(by_key, key_order(want)), (k, block, candidates, stride, by_key, want)

g = torch.Generator().manual_seed(0)
C, n = 6, 300
s = torch.randn(C, n, generator=g)
for k in (1, 17, 299, 300, 400):                    # k = n and k > n: every key, then padding
    check(s, k)
check(s, 17, block=512)                              # one tile wider than the row
ties = (torch.randn(C, n, generator=g) * 2).round() / 2   # a few values, hundreds of ties each
check(ties, 40); check(ties, 150)
masked = s.clone(); masked[:, 100:] = float("-inf"); masked[2] = float("-inf")
check(masked, 130)                                   # rows with fewer visible keys than k, one with none
check(masked, 50)
front = s.clone(); front[:, :250] = float("-inf")     # invisible keys before the visible ones (packed rows)
check(front, 130); check(front, 30)
zeros = torch.zeros(C, n); zeros[:, ::3] = -0.0; zeros[1, 5] = 1e-30; zeros[3, 7] = -1e-30
check(zeros, 20)                                     # -0.0 ties with +0.0; denormal-scale neighbours
check(torch.tensor([[float("inf"), 3.0, -float("inf"), 3.0, 2.0, -7.5]]), 3, block=4)
# scores one ulp apart: the k-th is found only by the last (lowest) byte
close = 1.0 + torch.arange(n) * 1.2e-7
check(close[None, :].repeat(C, 1), 33)
check(close[torch.randperm(n, generator=g)][None, :], 33)
# wider rows, where the sampled list holds the top-k (stride 8 and 3)
wide = torch.randn(3, 4096, generator=g)
check(wide, 64, block=256, strides=(8, 3))
check(wide, 700, block=256, strides=(8, 3))
# a misleading sample: the sampled positions (multiples of 8) hold the row's lowest scores (the
# list would take nearly every entry) or its highest (the list holds fewer than k): both rows
# must fall back to the full passes and still equal the sort
low = wide.clone(); low[:, ::8] = -10.0 - torch.rand(3, 512, generator=g)
high = wide.clone(); high[:, ::8] = 10.0 + torch.rand(3, 512, generator=g)
check(low, 64, block=256); check(high, 64, block=256); check(high, 700, block=256)
wide_front = wide.clone(); wide_front[:, :3000] = float("-inf")  # 1096 visible keys
check(wide_front, 700, block=256, strides=(8,)); check(wide_front, 1500, block=256, strides=(8,))
print("OK")
"""


@pytest.mark.slow
def test_radix_topk_matches_a_stable_sort_in_interpreter():
    run_interpreted(SCRIPT)


def test_radix_topk_refuses_non_float32_scores():
    from glm5_dsa_plugin.ops.indexer.radix_topk import radix_topk

    with pytest.raises(TypeError, match="scores must be 2-D float32, got torch.bfloat16"):
        radix_topk(torch.zeros(2, 8, dtype=torch.bfloat16), 4)
    with pytest.raises(ValueError, match="sample_stride must be >= 1, got 0"):
        radix_topk(torch.zeros(2, 8), 4, sample_stride=0)
