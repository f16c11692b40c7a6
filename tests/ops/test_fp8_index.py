"""FP8 indexer scoring reference (DeepSeek-V3.2 inference definition) against hand-worked cases."""

import math

import pytest
import torch

from glm5_dsa_plugin.model import indexer, visibility
from glm5_dsa_plugin.ops.indexer import fp8_index as f8


def test_ue8m0_rounds_up_to_a_power_of_two_and_keeps_exact_powers():
    s = torch.tensor([1.0, 1.5, 0.3, 0.125, 3.0000002, 2.0 ** -22 * 0.93], dtype=torch.float32)
    assert f8.ue8m0_ceil(s).tolist() == [1.0, 2.0, 0.5, 0.125, 4.0, 2.0 ** -22]


def test_ue8m0_refuses_non_positive_scales():
    with pytest.raises(ValueError, match=r"positive and finite, got 0.0 at \[1\]"):
        f8.ue8m0_ceil(torch.tensor([1.0, 0.0]))


def test_act_quant_hand_worked_block():
    x = torch.zeros(1, 256)
    # block 0: amax 224 -> 224 / 448 = 0.5 exactly, a power of two: s = 0.5
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 224.0, -112.0, 1.0, 0.34375
    # block 1: amax 300 -> 300 / 448 = 0.67 -> s = 1; 300 lies between the e4m3 values 288 and 320
    x[0, 128], x[0, 129] = 300.0, 3.3
    y, s = f8.act_quant(x)
    assert s.tolist() == [[0.5, 1.0]]
    assert y.dtype == torch.float8_e4m3fn
    # 0.34375 / 0.5 = 0.6875 = 1.375 * 2**-1: representable (3 mantissa bits)
    assert y[0, :4].float().tolist() == [448.0, -224.0, 2.0, 0.6875]
    # 300 -> 288 (nearest of 288 / 320), 3.3 -> 3.25 (nearest of 3.25 / 3.5)
    assert y[0, 128:130].float().tolist() == [288.0, 3.25]


def test_act_quant_zero_row_gets_the_floor_scale_and_zeros():
    y, s = f8.act_quant(torch.zeros(3, 128))
    # amax floor 1e-4: 1e-4 / 448 = 2.23e-7, log2 = -22.1 -> 2 ** -22
    assert s.flatten().tolist() == [2.0 ** -22] * 3
    assert (y.float() == 0).all()


def test_act_quant_without_ue8m0_keeps_amax_over_448():
    x = torch.zeros(1, 128)
    x[0, 5] = -300.0
    y, s = f8.act_quant(x, scale_fmt=None)
    assert s.item() == pytest.approx(300.0 / 448.0, rel=1e-7)
    assert y[0, 5].float().item() == -448.0


def test_act_quant_refuses_a_width_off_the_block():
    with pytest.raises(ValueError, match=r"last dim 96 of x \(2, 96\) is not a multiple of block 128"):
        f8.act_quant(torch.zeros(2, 96))


def _sylvester(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_hadamard_rotation_is_the_sylvester_matrix_and_orthonormal():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 128, dtype=torch.float64)
    ref = x @ _sylvester(128).double() / math.sqrt(128)
    got = f8.hadamard_rotate(x.float()).double()
    assert torch.allclose(got, ref, atol=1e-5)
    a, b = x[0, 0].float(), x[1, 2].float()
    assert torch.dot(f8.hadamard_rotate(a), f8.hadamard_rotate(b)).item() == pytest.approx(torch.dot(a, b).item(),
                                                                                            rel=1e-5)


def test_fp8_index_hand_worked():
    q = torch.zeros(1, 2, 128)
    q[0, 0, 0], q[0, 0, 1] = 1.0, 1.0
    q[0, 1, 0], q[0, 1, 1] = -1.0, 2.0
    k = torch.zeros(2, 128)
    k[0, 0] = 2.0
    k[1, 0], k[1, 1] = 1.0, 1.0
    weights = torch.tensor([[0.5, 0.25]])
    k_s = torch.tensor([1.0, 2.0])
    out = f8.fp8_index(q.to(torch.float8_e4m3fn), weights, k.to(torch.float8_e4m3fn), k_s)
    # key 0: 1 * (relu(2) * 0.5 + relu(-2) * 0.25) = 1; key 1: 2 * (relu(2) * 0.5 + relu(1) * 0.25) = 2.5
    assert out.tolist() == [[1.0, 2.5]]


def test_fp8_scores_equal_bf16_scores_when_every_value_is_representable():
    q = torch.zeros(1, 1, 128)
    q[0, 0, 0], q[0, 0, 1] = 2.0, 1.0  # amax 2 -> s = 2**-7, q8 = [256, 128]
    k = torch.zeros(1, 128)
    k[0, 0] = 4.0  # amax 4 -> s = 2**-6, k8 = [256]
    w = torch.tensor([[0.75]])
    got = f8.fp8_index_scores(q, k, w, rotate=False)
    # 2**-6 * 256 * 256 * (0.75 * 2**-7 * 128**-0.5) = 8 * 0.75 / sqrt(128)
    assert got.item() == pytest.approx(6.0 / math.sqrt(128), rel=1e-7)
    assert got.item() == pytest.approx(indexer.index_scores(q, k, w).item(), rel=1e-7)


def test_fp8_scores_need_head_dim_128():
    with pytest.raises(ValueError, match=r"head dim 64 must be 128"):
        f8.fp8_index_scores(torch.zeros(2, 1, 64), torch.zeros(3, 64), torch.zeros(2, 1))


def test_topk_order_ties_and_padding_hand_worked():
    inf = float("-inf")
    sc = torch.tensor([[1.0, 2.0, 2.0, 1.0], [inf, 0.5, inf, inf], [-0.0, 0.0, inf, 3.0]])
    got = f8.topk_ordered(sc, 3)
    assert got.tolist() == [[1, 2, 0], [1, -1, -1], [3, 0, 1]]
    assert f8.topk_ordered(sc, 6)[1].tolist() == [1, -1, -1, -1, -1, -1]


def test_topk_order_matches_deterministic_topk_on_many_ties():
    g = torch.Generator().manual_seed(3)
    sc = torch.randint(0, 4, (16, 40), generator=g).float()
    sc = sc.masked_fill(~visibility.Visibility.causal(40).mask(slice(24, 40)), float("-inf"))
    assert torch.equal(f8.topk_ordered(sc, 12), indexer.deterministic_topk(sc, 12))


def test_fp8_select_topk_is_the_ordered_topk_of_masked_fp8_scores_in_any_chunking():
    torch.manual_seed(1)
    T, Hi = 37, 4
    q = torch.randn(T, Hi, 128).to(torch.bfloat16)
    k = torch.randn(T, 128).to(torch.bfloat16)
    w = torch.randn(T, Hi)
    vis = visibility.Visibility.from_cu_seqlens(torch.tensor([0, 20, 37]))
    full = f8.fp8_index_scores(q, k, w).masked_fill(~vis.mask(), float("-inf"))
    ref = indexer.deterministic_topk(full, 8)
    for chunk in (None, 5):
        got = f8.fp8_select_topk(q, k, w, 8, vis.mask, chunk_rows=chunk)
        assert torch.equal(got, ref)
    indexer.check_topk(ref, vis)
    assert (ref[0, 1:] == -1).all() and ref[0, 0] == 0  # row 0 sees only key 0
    assert (ref[20, 1:] == -1).all() and ref[20, 0] == 20  # first row of sequence 2


def test_fp8_scores_track_bf16_scores():
    torch.manual_seed(2)
    q = torch.randn(8, 4, 128).to(torch.bfloat16)
    k = torch.randn(50, 128).to(torch.bfloat16)
    w = torch.rand(8, 4)
    ref = indexer.index_scores(q, k, w)
    got = f8.fp8_index_scores(q, k, w)
    assert not torch.equal(got, ref)  # FP8 rounding is visible
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


def test_zero_query_row_scores_zero_and_selects_visible_keys_in_index_order_then_minus_one():
    # a zero row of q (and a zero key) quantises with the floor scale 2**-22 to exact zeros: every
    # score is 0, not NaN, so the row takes its visible keys lowest index first and -1 after them
    torch.manual_seed(4)
    T, Hi = 6, 2
    q = torch.randn(T, Hi, 128).to(torch.bfloat16)
    q[4] = 0
    k = torch.randn(T, 128).to(torch.bfloat16)
    k[2] = 0
    w = torch.rand(T, Hi)
    sc = f8.fp8_index_scores(q, k, w)
    assert torch.isfinite(sc).all()
    assert (sc[4] == 0).all() and (sc[:, 2] == 0).all()
    got = f8.fp8_select_topk(q, k, w, 8, visibility.Visibility.causal(T).mask)
    assert got[4].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    assert got[1].tolist()[2:] == [-1] * 6 and sorted(got[1, :2].tolist()) == [0, 1]
