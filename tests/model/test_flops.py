"""Model FLOPs of DSA layers and models against counts worked out by hand for a tiny shape, and the
pair counts against the indexer's own visibility and top-k."""

import pytest
import torch

from glm5_dsa_plugin.model import flops, indexer, visibility

# hidden 8, 2 heads, q_lora 4, kv_lora 4, nope 2, rope 2, v 2, indexer 2 x 4, top-k 3, ffn 6,
# 4 experts of width 2, 2 per token, 1 shared
TINY = flops.DSAShape(hidden_size=8, num_attention_heads=2, q_lora_rank=4, kv_lora_rank=4, qk_nope_head_dim=2,
                      qk_rope_head_dim=2, v_head_dim=2, index_n_heads=2, index_head_dim=4, index_topk=3,
                      intermediate_size=6, moe_intermediate_size=2, n_routed_experts=4, num_experts_per_tok=2,
                      n_shared_experts=1, num_hidden_layers=3, first_k_dense_replace=1, index_topk_freq=2,
                      index_skip_topk_offset=1, num_nextn_predict_layers=1, vocab_size=10)

# one sequence of 5 tokens: rows see 1..5 keys, select min(3, t + 1) = 1, 2, 3, 3, 3 -> 12 pairs; 15 visible
DENSE_5 = dict(
    projections=6 * 5 * (8 * 4 + 4 * 2 * 4 + 8 * 6 + 4 * 2 * 4 + 2 * 2 * 8),  # 176 parameters -> 5280
    indexer_projections=6 * 5 * (4 * 2 * 4 + 8 * 4 + 8 * 2),  # 80 -> 2400
    mlp=6 * 5 * 3 * 8 * 6,  # 4320
    moe=0,
    sparse_mla=6 * 12 * 2 * (6 + 4),  # Dqk = 4 + 2, Dv = 4 -> 1440
    indexer_scores=2 * 15 * 2 * 4,  # 240
    indexer_loss=6 * 12 * 2 * 4,  # 576
    indexer_target=2 * 12 * 2 * 6,  # 288
)
MOE_5 = 6 * 5 * (8 * 4 + 3 * 8 * 2 * (2 + 1))  # router 32 + experts 144 -> 5280


def test_dense_layer_parts_match_the_hand_count():
    got = flops.layer_flops(TINY, [5])
    assert {k: got[k] for k in DENSE_5} == pytest.approx(DENSE_5)
    assert got["total"] == 14544


def test_moe_layer_and_a_layer_that_reuses_indices():
    moe = flops.layer_flops(TINY, [5], moe=True)
    assert moe["mlp"] == 0 and moe["moe"] == MOE_5
    assert moe["total"] == 14544 - 4320 + 5280
    reuse = flops.layer_flops(TINY, [5], moe=True, computes_indices=False)
    assert reuse["indexer_projections"] == reuse["indexer_scores"] == reuse["indexer_loss"] == 0
    assert reuse["indexer_target"] == 0
    assert reuse["total"] == 5280 + 5280 + 1440
    assert flops.layer_flops(TINY, [5], indexer_loss=False)["total"] == 14544 - 864


def test_model_counts_dense_then_moe_layers_index_sharing_logits_and_mtp():
    # layer 1 dense, computes; layer 2 MoE, reuses (freq 2, offset 1); layer 3 MoE, computes
    layers = 14544 + (5280 + 5280 + 1440) + (5280 + 5280 + 1440 + 2400 + 240 + 864)
    logits = 6 * 5 * 8 * 10
    assert flops.model_flops(TINY, [5]) == layers + logits
    mtp = (5280 + 5280 + 1440 + 2400 + 240 + 864) + 6 * 5 * 2 * 8 * 8 + logits
    assert flops.model_flops(TINY, [5], mtp=True) == layers + logits + mtp


def test_pair_counts_equal_the_indexers_visibility_and_topk():
    lens = [7, 1, 12, 3]
    cu = torch.tensor([0, 7, 8, 20, 23])
    vis = visibility.Visibility.from_cu_seqlens(cu)
    assert flops.visible_pairs(lens) == int(vis.mask().sum())
    g = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(23, 2, 8, generator=g), torch.randn(23, 8, generator=g), torch.randn(23, 2, generator=g)
    idx = indexer.select_topk(q, k, w, 4, vis)
    assert flops.selected_pairs(lens, 4) == int((idx >= 0).sum())


def test_packed_sequences_cost_less_attention_than_one_sequence_of_the_same_tokens():
    one, two = flops.layer_flops(TINY, [10]), flops.layer_flops(TINY, [5, 5])
    assert one["projections"] == two["projections"] and one["mlp"] == two["mlp"]
    assert two["indexer_scores"] == 2 * 240 < one["indexer_scores"] == 2 * 55 * 2 * 4
    assert two["sparse_mla"] == 2 * 1440 < one["sparse_mla"]


@pytest.mark.parametrize("name", ["glm5", "glm5.2", "tiny"])
def test_shape_from_a_card_and_from_its_transformer_config_agree(name):
    from glm5_dsa_plugin.checkpoints import cards

    card = cards.load_card(name)
    cfg = cards.card_to_transformer_config(card)
    a, b = flops.DSAShape.from_card(card), flops.DSAShape.from_config(cfg, vocab_size=card["vocab_size"])
    assert a == b
    if name == "glm5":
        assert a.num_hidden_layers == 78 and a.first_k_dense_replace == 3 and a.n_shared_experts == 1


@pytest.mark.parametrize("name", ["glm5", "tiny"])
def test_shape_from_a_hybrid_config_counts_glm5_layers_not_pattern_symbols(name):
    from glm5_dsa_plugin.checkpoints import cards
    from glm5_dsa_plugin.megatron.hybrid_spec import hybrid_transformer_config

    card = cards.load_card(name)
    cfg = hybrid_transformer_config(card)
    assert cfg.num_layers == 2 * card["num_hidden_layers"]  # two pattern symbols per GLM-5 layer
    assert flops.DSAShape.from_config(cfg, vocab_size=card["vocab_size"]) == flops.DSAShape.from_card(card)
    cfg.hybrid_layer_pattern = "DEDE-"
    with pytest.raises(ValueError, match="2 attention layers 'D' but 3"):
        flops.DSAShape.from_config(cfg)
    cfg.hybrid_layer_pattern = "DED-"
    with pytest.raises(ValueError, match="only dense layers first"):
        flops.DSAShape.from_config(cfg)
    cfg.hybrid_layer_pattern = "D-M-"
    with pytest.raises(ValueError, match="symbol 'M' at position 2"):
        flops.DSAShape.from_config(cfg)


def test_bad_input_is_refused_and_mfu_needs_a_known_device():
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = -2"):
        flops.layer_flops(TINY, [4, -2])
    with pytest.raises(ValueError, match="index_topk"):
        flops.DSAShape(**{**TINY.__dict__, "index_topk": -1})
    with pytest.raises(ValueError, match="MoE layer"):
        flops.layer_flops(flops.DSAShape(**{**TINY.__dict__, "n_routed_experts": 0}), [5], moe=True)
    assert flops.mfu(989.4e12, 1.0, "NVIDIA H200") == pytest.approx(1.0)
    assert flops.mfu(989.4e12, 2.0, "NVIDIA H100 80GB HBM3", n_devices=2) == pytest.approx(0.25)
    assert flops.mfu(1e12, 1.0, "cpu") is None
