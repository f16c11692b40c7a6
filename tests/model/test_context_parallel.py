"""CP layouts against megatron-core 0.19.2's own layout functions (zigzag, packed THD and bshd) and
slime's ``--allgather-cp`` slicing; the gather permutation against megatron-core's key reorder."""

import pytest
import torch

from glm5_dsa_plugin import context_parallel as cpx

CPU = torch.device("cpu")


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("lens", [[16, 32, 48], [64], [16, 0, 80]])
def test_zigzag_thd_matches_megatron(cp, lens):
    from megatron.core.transformer.experimental_attention_variant import dsa_layout

    cu = torch.tensor([0] + lens).cumsum(0)
    T = int(cu[-1])
    bounds = cpx.units("zigzag", T, cu_seqlens=cu)
    for rank in range(cp):
        ref = dsa_layout.build_packed_allgather_cp_local_positions(cu, cp, rank, CPU, output_size=T // cp,
                                                                   cu_seqlens_cover_output=True)
        assert torch.equal(cpx.local_rows(bounds, cp, rank, "zigzag"), ref)
    _, reorder = dsa_layout.build_packed_allgather_cp_query_positions_and_key_reorder(
        cu, cu, cp, 0, CPU, local_output_size=T // cp, global_output_size=T, query_cu_seqlens_cover_output=True,
        key_cu_seqlens_cover_output=True)
    assert torch.equal(cpx.gather_order(bounds, cp, "zigzag"), reorder)


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_bshd_matches_megatron(cp):
    from megatron.core.transformer.experimental_attention_variant import dsa_layout

    S, b = 32, 3
    bounds = cpx.units("zigzag", S * b, batch=b)
    for rank in range(cp):
        pos = dsa_layout.build_zigzag_cp_local_positions(S, cp, rank, CPU)
        ref = torch.cat([i * S + pos for i in range(b)])  # [s_loc, b] flattened batch-major
        assert torch.equal(cpx.local_rows(bounds, cp, rank, "zigzag"), ref)
    one = cpx.units("zigzag", S, batch=1)
    assert torch.equal(cpx.gather_order(one, cp, "zigzag"), dsa_layout.build_zigzag_allgather_cp_key_reorder(
        S // cp, cp, CPU))


@pytest.mark.parametrize("cp", [2, 8])
def test_contiguous_is_slime_chunk(cp):
    cu = torch.tensor([0, 13, 20, 40, 48])  # slime: the global pad is the last "sequence"
    bounds = cpx.units("contiguous", 48, cu_seqlens=cu)
    stream = torch.arange(48)
    for rank in range(cp):
        assert torch.equal(cpx.local_rows(bounds, cp, rank, "contiguous"), stream.chunk(cp)[rank])
    assert cpx.gather_order(bounds, cp, "contiguous") is None  # rank-major gather is global order


def test_layout_errors_name_the_unit():
    cu = torch.tensor([0, 16, 28, 48])
    with pytest.raises(ValueError, match=r"unit 1 \[16, 28\) has length 12"):
        cpx.local_rows(cpx.units("zigzag", 48, cu_seqlens=cu), 4, 0, "zigzag")
    with pytest.raises(ValueError, match="cp_layout must be one of"):
        cpx.check_layout("ring", "allgather")
    with pytest.raises(ValueError, match="cp_comm_type='p2p'"):
        cpx.check_layout("zigzag", "p2p")
    cpx.check_layout("contiguous", "p2p")  # slime's flag chooses the layout explicitly


def test_layout_from_slime_args():
    class Args:
        allgather_cp = True

    assert cpx.layout_from_args(Args()) == "contiguous"
    assert cpx.layout_from_args(object()) == "zigzag"
    assert cpx.layout_from_args(None) == "zigzag"


def test_spec_refuses_slime_layout_under_megatron_mla():
    """megatron-core's MLA rotates q / k by zigzag positions: the spec refuses --allgather-cp with CP > 1."""
    from glm5_dsa_plugin import cards
    from glm5_dsa_plugin.spec import get_glm5_dsa_spec

    class Args:
        allgather_cp = True

    cfg = cards.card_to_transformer_config(cards.load_card("tiny"), context_parallel_size=2, mtp_num_layers=None,
                                           cp_comm_type="allgather")
    with pytest.raises(ValueError, match="AbsorbedMLASelfAttention, which this spec uses, applies RoPE"):
        get_glm5_dsa_spec(Args(), cfg)
