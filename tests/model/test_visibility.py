"""Visibility from packed boundaries: the same rows as a hand-written loop, clear errors on bad
boundaries, and (GPU) no host read on the bshd path or for boundaries handed over on the host."""

import pytest
import torch

from glm5_dsa_plugin.model.visibility import Visibility


def loop_visibility(cu, padded=None):
    """Row by row: (query_seq, query_pos, key_seq, key_pos) of the packed layout."""
    layout = padded if padded is not None else cu
    qs, ks, ps = [], [], []
    for i in range(len(layout) - 1):
        real = cu[i + 1] - cu[i]
        for p in range(layout[i + 1] - layout[i]):
            qs.append(i if p < real else -1)
            ks.append(i if p < real else -2)
            ps.append(p)
    return [torch.tensor(v, dtype=torch.int64) for v in (qs, ps, ks, ps)]


@pytest.mark.parametrize("cu,padded", [([0, 5, 5, 12, 13], None), ([0, 5, 12], [0, 8, 16]), ([0, 0], None),
                                       ([0, 3, 7, 7], [0, 4, 8, 10])])
def test_rows_match_a_loop(cu, padded):
    vis = Visibility.from_cu_seqlens(torch.tensor(cu), cu_seqlens_padded=None if padded is None else torch.tensor(padded))
    got = [vis.query_seq, vis.query_pos, vis.key_seq, vis.key_pos]
    for g, w in zip(got, loop_visibility(cu, padded)):
        assert torch.equal(g.cpu(), w)


@pytest.mark.parametrize("b,s", [(1, 7), (3, 5), (2, 1)])
def test_uniform_is_equal_sequences(b, s):
    vis = Visibility.uniform(b, s)
    want = loop_visibility([i * s for i in range(b + 1)])
    for g, w in zip([vis.query_seq, vis.query_pos, vis.key_seq, vis.key_pos], want):
        assert torch.equal(g, w)
    causal = Visibility.causal(s)
    assert torch.equal(causal.query_pos, torch.arange(s)) and not causal.query_seq.any()


@pytest.mark.parametrize("cu,padded,match", [
    ([0, 5, 3], None, "non-decreasing"),
    ([0, 5, 12], [0, 4, 16], "does not hold"),
    ([0, 5, 12], [0, 8], "does not hold"),
    ([2, 5, 12], None, "start at 0"),
])
def test_bad_boundaries_are_refused(cu, padded, match):
    with pytest.raises(ValueError, match=match):
        Visibility.from_cu_seqlens(torch.tensor(cu), cu_seqlens_padded=None if padded is None else torch.tensor(padded))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_no_host_read_for_host_boundaries_or_bshd():
    """Each host read waits for the GPU's queue: the bshd path and boundaries given on the host
    build their rows without one; boundaries on the GPU cost one read, not several."""
    cu = torch.tensor([0, 1000, 1001, 3000, 4096])
    want = Visibility.from_cu_seqlens(cu)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        a = Visibility.uniform(2, 2048, device="cuda")
        b = Visibility.from_cu_seqlens(cu, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(a.query_pos.cpu(), torch.arange(4096) % 2048)
    for g, w in zip([b.query_seq, b.query_pos, b.key_seq, b.key_pos], [want.query_seq, want.query_pos, want.key_seq,
                                                                      want.key_pos]):
        assert torch.equal(g.cpu(), w)
    g = Visibility.from_cu_seqlens(cu.cuda())
    assert torch.equal(g.query_pos.cpu(), want.query_pos)


def test_packed_visibility_is_built_once_per_micro_batch():
    """The layers of one micro batch share its THD visibility; boundaries changed in place or
    replaced are seen (never a stale mask)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from glm5_dsa_plugin.model.attention import GLM5DSAttention

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    first = GLM5DSAttention._packed_visibility(psp, "cpu")
    assert GLM5DSAttention._packed_visibility(psp, "cpu") is first
    cu[1] = 5  # in place: rebuilt
    moved = GLM5DSAttention._packed_visibility(psp, "cpu")
    assert moved is not first and torch.equal(moved.query_pos, torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]))
    psp.cu_seqlens_q = torch.tensor([0, 8], dtype=torch.int32)  # replaced: rebuilt
    assert torch.equal(GLM5DSAttention._packed_visibility(psp, "cpu").query_pos, torch.arange(8))
    other = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)  # another micro batch
    assert GLM5DSAttention._packed_visibility(other, "cpu") is not moved


def test_packed_visibility_of_inference_tensors_is_built_each_time():
    """Boundaries made under torch.inference_mode() have no version counter: built, never kept."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from glm5_dsa_plugin.model.attention import GLM5DSAttention

    with torch.inference_mode():
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    a = GLM5DSAttention._packed_visibility(psp, "cpu")
    b = GLM5DSAttention._packed_visibility(psp, "cpu")
    assert a is not b and torch.equal(a.query_pos, torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]))
    assert torch.equal(b.query_seq, a.query_seq)
