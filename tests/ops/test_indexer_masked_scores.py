"""The fused Triton indexer-score kernel against the torch path, run by Triton's interpreter on CPU
(a subprocess: TRITON_INTERPRET must be set before the kernel is defined)."""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import torch
from glm5_dsa_plugin.model import indexer
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

check(indexer.Visibility.causal(45), 45)
cu = torch.tensor([0, 5, 17, 30])
check(indexer.Visibility.from_cu_seqlens(cu), 30)
padded = indexer.Visibility.from_cu_seqlens(torch.tensor([0, 5, 12]), cu_seqlens_padded=torch.tensor([0, 8, 24]))
check(padded, 24)
rows = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19, 28, 29, 30, 31])  # a CP rank's chunks
full = indexer.Visibility.causal(32)
check(full.rows(rows), 32)
print("OK")
"""


@pytest.mark.slow
def test_triton_scores_match_torch_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
