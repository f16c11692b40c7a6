"""CP layouts against megatron-core 0.19.2's own layout functions (zigzag, packed THD and bshd) and
slime's ``--allgather-cp`` slicing; the gather permutation against megatron-core's key reorder."""

import pytest
import torch

from glm5_dsa_plugin.model import cp_layout
from megatron_cpu import megatron_single_process  # noqa: F401

CPU = torch.device("cpu")


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("lens", [[16, 32, 48], [64], [16, 0, 80]])
def test_zigzag_thd_matches_megatron(cp, lens):
    from megatron.core.transformer.experimental_attention_variant import dsa_layout

    cu = torch.tensor([0] + lens).cumsum(0)
    T = int(cu[-1])
    bounds = cp_layout.units("zigzag", T, cu_seqlens=cu)
    for rank in range(cp):
        ref = dsa_layout.build_packed_allgather_cp_local_positions(cu, cp, rank, CPU, output_size=T // cp,
                                                                   cu_seqlens_cover_output=True)
        assert torch.equal(cp_layout.local_rows(bounds, cp, rank, "zigzag"), ref)
    _, reorder = dsa_layout.build_packed_allgather_cp_query_positions_and_key_reorder(
        cu, cu, cp, 0, CPU, local_output_size=T // cp, global_output_size=T, query_cu_seqlens_cover_output=True,
        key_cu_seqlens_cover_output=True)
    assert torch.equal(cp_layout.gather_order(bounds, cp, "zigzag"), reorder)


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_bshd_matches_megatron(cp):
    from megatron.core.transformer.experimental_attention_variant import dsa_layout

    S, b = 32, 3
    bounds = cp_layout.units("zigzag", S * b, batch=b)
    for rank in range(cp):
        pos = dsa_layout.build_zigzag_cp_local_positions(S, cp, rank, CPU)
        ref = torch.cat([i * S + pos for i in range(b)])  # [s_loc, b] flattened batch-major
        assert torch.equal(cp_layout.local_rows(bounds, cp, rank, "zigzag"), ref)
    one = cp_layout.units("zigzag", S, batch=1)
    assert torch.equal(cp_layout.gather_order(one, cp, "zigzag"), dsa_layout.build_zigzag_allgather_cp_key_reorder(
        S // cp, cp, CPU))


@pytest.mark.parametrize("cp", [2, 8])
def test_contiguous_is_slime_chunk(cp):
    cu = torch.tensor([0, 13, 20, 40, 48])  # slime: the global pad is the last "sequence"
    bounds = cp_layout.units("contiguous", 48, cu_seqlens=cu)
    stream = torch.arange(48)
    for rank in range(cp):
        assert torch.equal(cp_layout.local_rows(bounds, cp, rank, "contiguous"), stream.chunk(cp)[rank])
    assert cp_layout.gather_order(bounds, cp, "contiguous") is None  # rank-major gather is global order


def test_layout_errors_name_the_unit():
    cu = torch.tensor([0, 16, 28, 48])
    with pytest.raises(ValueError, match=r"unit 1 \[16, 28\) has length 12"):
        cp_layout.local_rows(cp_layout.units("zigzag", 48, cu_seqlens=cu), 4, 0, "zigzag")
    with pytest.raises(ValueError, match="cp_layout must be one of"):
        cp_layout.check_layout("ring", "allgather")
    with pytest.raises(ValueError, match="cp_comm_type='p2p'"):
        cp_layout.check_layout("zigzag", "p2p")
    cp_layout.check_layout("contiguous", "p2p")  # slime's flag chooses the layout explicitly


def test_layout_from_slime_args():
    class Args:
        allgather_cp = True

    assert cp_layout.layout_from_args(Args()) == "contiguous"
    assert cp_layout.layout_from_args(object()) == "zigzag"
    assert cp_layout.layout_from_args(None) == "zigzag"


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp", [2, 4])
def test_positions_in_sequence_thd(layout, cp):
    """Each local row's offset in its own sequence, sequences cut across ranks included, against the
    positions of the global packed stream (``Visibility``) at the rows the rank holds (slime's chunk
    for the contiguous layout, megatron-core's own split for zigzag)."""
    from glm5_dsa_plugin.model.visibility import Visibility
    from megatron.core.transformer.experimental_attention_variant import dsa_layout

    for real, padded in (([8, 24, 0, 16], None), ([13, 7, 20, 6], [16, 8, 24, 16])):
        cu = torch.tensor([0] + real).cumsum(0)
        cu_pad = None if padded is None else torch.tensor([0] + padded).cumsum(0)
        extent = cu if cu_pad is None else cu_pad
        T = int(extent[-1])
        want_all = Visibility.from_cu_seqlens(cu, cu_seqlens_padded=cu_pad).query_pos
        for rank in range(cp):
            if layout == "contiguous":
                rows = torch.arange(T).chunk(cp)[rank]
            else:
                rows = dsa_layout.build_packed_allgather_cp_local_positions(
                    extent, cp, rank, CPU, output_size=T // cp, cu_seqlens_cover_output=True)
            got = cp_layout.positions_in_sequence(layout, cp, rank, T // cp, cu_seqlens=cu, cu_seqlens_padded=cu_pad)
            assert torch.equal(got, want_all[rows]), (real, padded, rank)


def test_positions_in_sequence_bshd_and_errors():
    S, b, cp = 12, 2, 3
    for rank in range(cp):  # every row holds positions [rank * s_loc, (rank + 1) * s_loc)
        got = cp_layout.positions_in_sequence("contiguous", cp, rank, b * S // cp, batch=b)
        assert torch.equal(got, torch.arange(S).chunk(cp)[rank].repeat(b))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 40 global tokens.*holds 16 rows \(32 over"):
        cp_layout.positions_in_sequence("contiguous", 2, 0, 16, cu_seqlens=torch.tensor([0, 24, 40]))


def test_spec_builds_contiguous_cp_mla_for_slime_layout(megatron_single_process):
    """--allgather-cp with CP > 1: every layer (and the MTP layer) gets the MLA that rotates q / k by
    contiguous positions, with the contiguous core attention; CP = 1 or the zigzag layout keep
    the default MLA class."""
    from glm5_dsa_plugin.checkpoints import cards
    from glm5_dsa_plugin.model.absorbed_mla import GLM5AbsorbedMLA
    from glm5_dsa_plugin.model.contiguous_cp_mla import ContiguousCPAbsorbedMLA
    from glm5_dsa_plugin.spec import get_glm5_dsa_mtp_spec, get_glm5_dsa_spec

    class Slime:
        allgather_cp = True

    def attention_specs(args, cp):
        cfg = cards.card_to_transformer_config(cards.load_card("tiny"), context_parallel_size=cp,
                                               cp_comm_type="allgather")
        block, mtp = get_glm5_dsa_spec(args, cfg), get_glm5_dsa_mtp_spec(args, cfg)
        layers = block.layer_specs + [m.submodules.mtp_model_layer for m in mtp.layer_specs]
        return [ls.submodules.self_attention for ls in layers]

    for args, cp, mla, layout in ((Slime(), 2, ContiguousCPAbsorbedMLA, "contiguous"),
                                  (Slime(), 1, GLM5AbsorbedMLA, "contiguous"),
                                  (None, 2, GLM5AbsorbedMLA, "zigzag")):
        specs = attention_specs(args, cp)
        assert len(specs) == 5
        for att in specs:
            assert att.module is mla, (cp, layout)
            assert att.submodules.core_attention.params["cp_layout"] == layout
