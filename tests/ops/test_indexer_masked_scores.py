"""The fused Triton indexer-score kernel against the torch path, run by Triton's interpreter on CPU
(a subprocess: TRITON_INTERPRET must be set before the kernel is defined)."""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import torch
from glm5_dsa_plugin.model import indexer, visibility
from glm5_dsa_plugin.ops.indexer.masked_scores import masked_index_scores

def check(vis, T_kv, Hi=3, Di=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = vis.query_seq.shape[0]
    q, k, w = torch.randn(T, Hi, Di, generator=g), torch.randn(T_kv, Di, generator=g), torch.randn(T, Hi, generator=g)
    got = masked_index_scores(q, k, w, vis.query_seq, vis.query_pos, vis.qidx, vis.key_seq, vis.key_pos,
                              block_t=16, block_s=16)
    want = indexer.index_scores(q, k, w).masked_fill(~vis.mask(), float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "visibility differs"
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-4)

check(visibility.Visibility.causal(45), 45)
cu = torch.tensor([0, 5, 17, 30])
check(visibility.Visibility.from_cu_seqlens(cu), 30)
padded = visibility.Visibility.from_cu_seqlens(torch.tensor([0, 5, 12]), cu_seqlens_padded=torch.tensor([0, 8, 24]))
check(padded, 24)
rows = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19, 28, 29, 30, 31])  # a CP rank's chunks
full = visibility.Visibility.causal(32)
check(full.rows(rows), 32)
print("OK")
"""


@pytest.mark.slow
def test_triton_scores_match_torch_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


FP8_SCRIPT = r"""
import torch
from glm5_dsa_plugin.model import indexer, visibility
from glm5_dsa_plugin.ops.indexer import fp8_index
from glm5_dsa_plugin.ops.indexer.masked_scores import masked_index_scores

g = torch.Generator().manual_seed(3)
vis = visibility.Visibility.from_cu_seqlens(torch.tensor([0, 7, 30, 41]))
T, Hi, K = 41, 4, 8
# magnitudes spread over channels and rows, so the e4m3 scales differ per row / head / key
q = (torch.randn(T, Hi, 128, generator=g) * torch.rand(T, Hi, 1, generator=g) * 8).to(torch.bfloat16)
k = (torch.randn(T, 128, generator=g) * torch.rand(T, 1, generator=g) * 4).to(torch.bfloat16)
w = torch.randn(T, Hi, generator=g)
q8, wq = fp8_index.quantize_queries(q, w)
k8, ks = fp8_index.quantize_keys(k)
args = (vis.query_seq, vis.query_pos, vis.qidx, vis.key_seq, vis.key_pos)
got = masked_index_scores(q8, k8, wq, *args, block_t=16, block_s=16, key_scale=ks)
want = fp8_index.fp8_index(q8, wq, k8, ks).masked_fill(~vis.mask(), float("-inf"))
assert torch.equal(torch.isinf(got), torch.isinf(want)), "visibility differs"
fin = torch.isfinite(want)
torch.testing.assert_close(got[fin], want[fin], rtol=1e-6, atol=1e-6)
# without the key scale the scores are off by it: the check above can fail
assert not torch.allclose(got[fin], (want / ks[None, :])[fin], rtol=1e-3)
keys = masked_index_scores(q8, k8, wq, *args, block_t=16, block_s=16, key_scale=ks, keys=True)
idx = indexer.topk_from_keys(keys, K)
ref = fp8_index.fp8_select_topk(q, k, w, K, vis.mask)
assert torch.equal(idx, ref), (idx, ref)
assert torch.equal(indexer.select_topk(q, k, w, K, vis, precision="fp8"), ref)
assert (ref == -1).any() and (ref >= 0).all(-1).any()  # short rows padded, long rows full
try:
    masked_index_scores(q, k8, wq, *args, key_scale=ks)
except TypeError as e:
    assert "q must be float8_e4m3fn, got torch.bfloat16" in str(e), e
else:
    raise AssertionError("bf16 q with a key scale was accepted")
print("OK")
"""


@pytest.mark.slow
def test_fp8_scores_match_the_reference_fp8_index_in_interpreter():
    """The kernel's FP8 mode (e4m3 q / k, per-key scale) equals the published definition
    (fp8_index.fp8_index) and selects the reference top-k (fp8_select_topk) on packed sequences."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", FP8_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
