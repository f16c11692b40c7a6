"""GLM-5.x hybrid layer patterns. References: megatron-core's own pattern parser, the cards'
layer counts, and the GPT path's pipeline-stage check of index sharing."""

import pytest

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.checkpoints import hybrid_pattern as hp
from glm5_dsa_plugin.model import index_sharing


def test_tiny_card_pattern():
    assert hp.glm5_hybrid_layer_pattern(cards.load_card("tiny")) == "D-D-DEDE/DE"
    assert hp.glm5_hybrid_layer_pattern(cards.load_card("tiny"), mtp=False) == "D-D-DEDE"
    assert hp.glm5_hybrid_layer_pattern(cards.load_card("tiny"), stage_layers=[1, 3]) == "D-|D-DEDE/DE"


@pytest.mark.parametrize("name", ["glm5", "glm5.2"])
def test_published_cards_parse_as_megatron_core_reads_them(name):
    from megatron.core.models.hybrid.hybrid_layer_allocation import get_hybrid_total_layer_count, parse_hybrid_pattern

    card = cards.load_card(name)
    n, k = card["num_hidden_layers"], card["first_k_dense_replace"]
    pattern = hp.glm5_hybrid_layer_pattern(card)
    # the same string from the HF config transformers builds from the card
    assert hp.glm5_hybrid_layer_pattern(cards.card_to_hf_config(card)) == pattern
    parsed = parse_hybrid_pattern(pattern)
    assert get_hybrid_total_layer_count(pattern) == 2 * n
    assert parsed.main_pattern.count("D") == n and parsed.main_pattern.count("-") == k
    assert parsed.main_pattern.count("E") == n - k
    assert parsed.mtp_pattern == "DE" and parsed.mtp_num_depths == card["num_nextn_predict_layers"]
    # DSA layer numbers are GPT layer numbers: hybrid layer 2i + 1 is GPT layer i + 1
    assert [hp.dsa_layer_number(pattern, 2 * i + 1) for i in range(n)] == list(range(1, n + 1))
    assert hp.dsa_layer_number(pattern, 1, mtp=True) == 1


def test_stage_layers_place_cuts_where_megatron_core_splits():
    from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern

    card = cards.load_card("glm5.2")
    pattern = hp.glm5_hybrid_layer_pattern(card, stage_layers=[14] + [6] * 8 + [16])
    segments = parse_hybrid_pattern(pattern).main_pattern.split("|")
    assert [len(s) for s in segments] == [28] + [12] * 8 + [32]
    with pytest.raises(ValueError, match="sum to num_hidden_layers=78"):
        hp.glm5_hybrid_layer_pattern(card, stage_layers=[14, 6])


@pytest.mark.parametrize("freq,offset", [(4, 3), (2, 1), (1, 0)])
def test_cut_check_agrees_with_the_gpt_stage_check(freq, offset):
    """A '|' before GPT layer c is refused exactly when the GPT path refuses a stage starting there."""
    card = cards.with_overrides(cards.load_card("tiny"), num_hidden_layers=9, first_k_dense_replace=1)
    for c in range(1, 9):
        pattern = hp.glm5_hybrid_layer_pattern(card, stage_layers=[c, 9 - c])
        try:
            index_sharing.check_stage_layers(c + 1, 9, freq, offset)
            gpt_refuses = False
        except ValueError:
            gpt_refuses = True
        if gpt_refuses:
            src = index_sharing.index_source_layer(c + 1, freq, offset)
            with pytest.raises(ValueError, match=rf"stage 1 starts its DSA layers at layer {2 * c + 1} "
                                                 rf"\(DSA layer {c + 1}\), which reuses the indices of DSA layer {src}"):
                hp.check_index_sharing(pattern, freq, offset)
        else:
            hp.check_index_sharing(pattern, freq, offset)


def test_symbols_this_stack_does_not_build_are_refused():
    with pytest.raises(ValueError, match="symbol 'M' at position 2"):
        hp.split_pattern("D-MDE")
    with pytest.raises(ValueError, match="layer 2 of the main pattern 'D-DE' is '-'"):
        hp.dsa_layer_number("D-DE", 2)
