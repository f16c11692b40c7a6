"""scripts/bench_rollout_alignment.py: the sampled query rows, the agreement measure, the row merge, and a
small run of both modes against the rollout forward."""

import importlib.util
import os

import pytest
import torch

from glm5_dsa_plugin.model import indexer, visibility

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_rollout_alignment.py")
_spec = importlib.util.spec_from_file_location("bench_rollout_alignment", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_query_rows_are_strided_to_the_last_row_or_all_rows():
    assert bench.query_rows(10, 3, "cpu").tolist() == [3, 6, 9]
    rows = bench.query_rows(16384, 4096, "cpu")
    assert rows.shape == (4096,) and rows[-1] == 16383 and (rows.diff() == 4).all()
    assert bench.query_rows(5, None, "cpu").tolist() == [0, 1, 2, 3, 4]
    assert bench.query_rows(5, 9, "cpu").tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="--rows must be >= 1"):
        bench.query_rows(5, 0, "cpu")


def test_agreement_counts_members_of_the_rollout_set_and_ignores_order_and_empty_slots():
    train = torch.tensor([[2, 0, 1, -1], [5, 4, 3, 2], [-1, -1, -1, -1], [0, -1, -1, -1]], dtype=torch.int32)
    roll = torch.tensor([[0, 1, 2, -1], [5, 4, 1, 0], [-1, -1, -1, -1], [1, -1, -1, -1]], dtype=torch.int32)
    # row 0: same set in another order; row 1: 2 of 4; row 2: nothing to select; row 3: 0 of 1
    assert bench.agreement(train, roll).tolist() == [1.0, 0.5, 1.0, 0.0]


def _row(width, T, mode, tag, card="cpu", backend="reference"):
    return dict(mode=mode, T=T, tag=tag, width=width, card=card, backend=backend)


def test_merge_replaces_the_remeasured_rows_and_keeps_other_widths_cards_and_backends():
    h200 = dict(card="NVIDIA H200", backend="tilelang")
    old = [_row("tiny", 4096, "bf16", "old"), _row("tiny", 4096, "rollout_matched", "old"),
           _row("full", 4096, "rollout_matched", "old"), _row("full", 4096, "bf16", "old"),
           _row("tiny", 4096, "bf16", "old", **h200)]
    new = [_row("tiny", 4096, "rollout_matched", "new"), _row("tiny", 4096, "bf16", "new"),
           _row("tiny", 16384, "bf16", "new")]
    got = [(r["card"], r["width"], r["T"], r["mode"], r["tag"]) for r in bench.merge_rows(old, new)]
    assert got == [("NVIDIA H200", "tiny", 4096, "bf16", "old"),
                   ("cpu", "tiny", 4096, "bf16", "new"), ("cpu", "tiny", 4096, "rollout_matched", "new"),
                   ("cpu", "tiny", 16384, "bf16", "new"), ("cpu", "full", 4096, "bf16", "old"),
                   ("cpu", "full", 4096, "rollout_matched", "old")]


@pytest.fixture
def small(monkeypatch):
    """Top-k 16 over 80 keys: rows past 16 choose, the two indexer scorings disagree somewhere."""
    monkeypatch.setattr(bench, "TOPK", 16)
    T = 80
    return T, bench.make_inputs(T, torch.device("cpu")), visibility.Visibility.causal(T)


def test_rollout_matched_training_reproduces_the_rollout_and_bf16_does_not(small):
    T, inp, vis = small
    rows = bench.query_rows(T, None, "cpu")
    ridx, rlp = bench.rollout_forward(inp, vis, rows, chunk=32)
    indexer.check_topk(ridx, vis)
    matched_idx, matched_lp = bench.train_forward(inp, vis, "rollout_matched", rows)
    bf16_idx, bf16_lp = bench.train_forward(inp, vis, "bf16", rows)
    assert torch.equal(matched_idx, ridx)
    assert bench.agreement(bf16_idx, ridx).min() < 1.0
    gap_matched, gap_bf16 = (matched_lp - rlp).abs().max(), (bf16_lp - rlp).abs().max()
    assert gap_matched < 1e-3 and gap_matched * 10 < gap_bf16


def test_sampled_rows_give_the_full_runs_values_of_those_rows(small):
    T, inp, vis = small
    full, some = bench.query_rows(T, None, "cpu"), bench.query_rows(T, 7, "cpu")
    assert some.tolist() == [13, 24, 35, 46, 57, 68, 79]
    ridx, rlp = bench.rollout_forward(inp, vis, full, chunk=32)
    sidx, slp = bench.rollout_forward(inp, vis, some, chunk=32)
    assert torch.equal(sidx, ridx[some])
    assert torch.allclose(slp, rlp[some], rtol=0, atol=1e-5)
    for mode in ("bf16", "rollout_matched"):
        fidx, flp = bench.train_forward(inp, vis, mode, full)
        tidx, tlp = bench.train_forward(inp, vis, mode, some)
        assert torch.equal(tidx, fidx[some]), mode
        assert torch.allclose(tlp, flp[some], rtol=0, atol=1e-5), mode


def test_flashmla_order_attention_is_the_softmax_up_to_bf16_probabilities():
    """The online softmax over 64-key blocks (a running max that grows block after block, a block
    without any valid key, a row without keys) against one fp32 softmax of the same scores."""
    g = torch.Generator().manual_seed(0)
    c, H, K = 3, 4, 256
    q = torch.randn(c, H, 576, generator=g).bfloat16()
    kvs = torch.randn(c, K, 576, generator=g).bfloat16()
    kvs[0] = kvs[0] * torch.linspace(0.1, 3.0, K)[:, None].bfloat16()  # row 0: the max grows across blocks
    valid = torch.ones(c, K, dtype=torch.bool)
    valid[1, :64] = False  # row 1: its first block has no key
    valid[2] = False  # row 2: no key at all
    got = bench.flashmla_order_attention(q, kvs, valid)
    s = torch.einsum("chd,ckd->chk", q.float(), kvs.float()) * bench.SM_SCALE
    p = torch.softmax(s.masked_fill(~valid[:, None, :], float("-inf")), -1)
    want = torch.einsum("chk,ckd->chd", p[:2], kvs[:2, :, :bench.LAT].float())
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    err = (got[:2] - want).abs().max() / want.abs().max()
    assert 0 < err < 2 ** -7, err  # bf16 probabilities: close to the softmax, not equal to it
