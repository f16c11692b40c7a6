"""Rollout-matched numerics in the DSA attention: the FP8 indexer picks the top-k, the FP8-KV
forward reads the latent as the FP8 cache holds it, both off by default, both checked."""

import pytest
import torch

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.model import attention as attn_mod
from glm5_dsa_plugin.model import indexer, visibility
from glm5_dsa_plugin.model import rollout_numerics as rn
from glm5_dsa_plugin.model.dsa_fields import check_dsa_config
from glm5_dsa_plugin.ops import fp8_kv
from glm5_dsa_plugin.ops.indexer import fp8_index
from megatron_cpu import megatron_single_process  # noqa: F401

S, B = 40, 1
# the tiny card with the FP8 formats' widths: indexer head 128, latent 512 + 64
WIDE = dict(index_head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64, index_topk=8)


def _config(**attrs):
    card = cards.with_overrides(cards.load_card("tiny"), **WIDE)
    cfg = cards.card_to_transformer_config(card, mtp_num_layers=None)
    for k, v in attrs.items():
        setattr(cfg, k, v)
    return card, cfg


def _attention(cfg):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from glm5_dsa_plugin.megatron.spec import dsa_attention_spec

    torch.manual_seed(0)
    return build_module(dsa_attention_spec(cfg).submodules.core_attention, config=cfg, layer_number=1,
                        attn_mask_type=AttnMaskType.causal, attention_type="self", softmax_scale=0.1,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]))


def _inputs(card):
    g = torch.Generator().manual_seed(1)
    H, dq = card["num_attention_heads"], card["kv_lora_rank"] + card["qk_rope_head_dim"]
    return dict(query=torch.randn(S, B, H, dq, generator=g), key=torch.randn(S, B, 1, dq, generator=g),
                x=torch.randn(S, B, card["hidden_size"], generator=g),
                qr=torch.randn(S, B, card["q_lora_rank"], generator=g),
                up_v=torch.randn(H, card["v_head_dim"], card["kv_lora_rank"], generator=g))


def _run(att, inp, key=None, monkeypatch=None):
    seen = {}
    real = attn_mod.sparse_mla

    def spy(q, kv, indices, *a, **k):
        seen["indices"], seen["kv"] = indices[:, 0].clone(), kv.detach().clone()
        return real(q, kv, indices, *a, **k)

    monkeypatch.setattr(attn_mod, "sparse_mla", spy)
    key = inp["key"] if key is None else key
    out = att(inp["query"], key, None, None, inp["x"], inp["qr"], up_v_weight=inp["up_v"])
    return out, seen


def test_defaults_are_off(monkeypatch):
    monkeypatch.delenv(rn.ENV_FP8_INDEXER, raising=False)
    monkeypatch.delenv(rn.ENV_KV_FP8_QAT, raising=False)
    _, cfg = _config()
    assert rn.indexer_precision(cfg) == "bf16" and rn.kv_fp8_qat(cfg) is False


def test_slime_environment_switches_apply_when_the_config_leaves_them_unset(monkeypatch):
    monkeypatch.setenv(rn.ENV_FP8_INDEXER, "1")
    monkeypatch.setenv(rn.ENV_KV_FP8_QAT, "1")
    _, cfg = _config()
    assert rn.indexer_precision(cfg) == "fp8" and rn.kv_fp8_qat(cfg) is True
    _, cfg = _config(dsa_indexer_precision="bf16", dsa_kv_fp8_qat=False)  # the config wins
    assert rn.indexer_precision(cfg) == "bf16" and rn.kv_fp8_qat(cfg) is False
    monkeypatch.setenv(rn.ENV_KV_FP8_QAT_BLOCK, "64")
    with pytest.raises(ValueError, match="DSA_KV_FP8_QAT_BLOCK_SIZE='64'.*set it to 128"):
        rn.kv_fp8_qat(_config()[1])


def test_bad_values_geometries_and_misspelt_fields_are_refused():
    with pytest.raises(ValueError, match=r"dsa_indexer_precision='fp16' is not supported"):
        check_dsa_config(_config(dsa_indexer_precision="fp16")[1])
    with pytest.raises(ValueError, match=r"config.dsa_kv_fp8_qa=True is not supported: no DSA field"):
        check_dsa_config(_config(dsa_kv_fp8_qa=True)[1])
    tiny = cards.card_to_transformer_config(cards.load_card("tiny"), mtp_num_layers=None)
    tiny.dsa_indexer_precision = "fp8"
    with pytest.raises(ValueError, match=r"needs dsa_indexer_head_dim=128.*got 32"):
        check_dsa_config(tiny)
    tiny.dsa_indexer_precision, tiny.dsa_kv_fp8_qat = "bf16", True
    with pytest.raises(ValueError, match=r"kv_lora_rank=32, qk_pos_emb_head_dim=16"):
        check_dsa_config(tiny)


def test_fp8_indexer_selects_the_fp8_topk_and_bf16_keeps_the_reference(megatron_single_process, monkeypatch):
    for precision in ("bf16", "fp8"):
        card, cfg = _config(dsa_indexer_precision=precision, dsa_kv_fp8_qat=False)
        att = _attention(cfg).eval()
        inp = _inputs(card)
        with torch.no_grad():
            _, seen = _run(att, inp, monkeypatch=monkeypatch)
            vis = visibility.Visibility.causal(S)
            q, k, w = att.indexer.qkw(inp["x"][:, 0], inp["qr"][:, 0], vis.query_pos)
            if precision == "fp8":
                ref = fp8_index.fp8_select_topk(q, k, w, 8, vis.mask)
                assert not torch.equal(ref, indexer.select_topk(q, k, w, 8, vis))  # the two scorings differ here
            else:
                ref = indexer.select_topk(q, k, w, 8, vis)
        # the attention reads each row's slots in key order (indexer.attention_slot_order)
        assert torch.equal(seen["indices"], indexer.attention_slot_order(ref, S)), precision


def test_sparse_mla_reads_the_topk_in_key_order_from_key_order_min_keys(megatron_single_process, monkeypatch):
    card, cfg = _config(dsa_indexer_precision="bf16", dsa_kv_fp8_qat=False)
    att = _attention(cfg).eval()
    inp = _inputs(card)
    vis = visibility.Visibility.causal(S)
    with torch.no_grad():
        q, k, w = att.indexer.qkw(inp["x"][:, 0], inp["qr"][:, 0], vis.query_pos)
        topk = indexer.select_topk(q, k, w, 8, vis)
        monkeypatch.setattr(indexer, "KEY_ORDER_MIN_KEYS", S + 1)
        out_topk, seen = _run(att, inp, monkeypatch=monkeypatch)
        assert torch.equal(seen["indices"], topk)  # S kv rows < KEY_ORDER_MIN_KEYS: the top-k's order
        monkeypatch.setattr(indexer, "KEY_ORDER_MIN_KEYS", S)
        out_by_key, seen = _run(att, inp, monkeypatch=monkeypatch)
    by_key = indexer.slots_in_key_order(topk)
    assert not torch.equal(by_key, topk)  # the two orders differ here
    assert torch.equal(seen["indices"], by_key)
    torch.testing.assert_close(out_by_key, out_topk, rtol=1e-4, atol=1e-4)  # the same attention (sum order aside)

def test_kv_fp8_qat_forward_reads_the_cache_values_and_passes_gradients_straight(megatron_single_process,
                                                                                 monkeypatch):
    card, cfg_on = _config(dsa_kv_fp8_qat=True)
    _, cfg_off = _config(dsa_kv_fp8_qat=False)
    inp = _inputs(card)
    key_q = fp8_kv.quant_dequant(inp["key"].to(torch.bfloat16)).float()
    k_on = inp["key"].clone().requires_grad_()
    out_on, seen = _run(_attention(cfg_on).eval(), inp, key=k_on, monkeypatch=monkeypatch)
    assert torch.equal(seen["kv"][:, 0], key_q[:, 0, 0])  # B = 1: packed rows are the s rows
    k_off = key_q.clone().requires_grad_()
    out_off, _ = _run(_attention(cfg_off).eval(), inp, key=k_off, monkeypatch=monkeypatch)
    assert torch.equal(out_on, out_off)
    g = torch.randn_like(out_on)
    out_on.backward(g)
    out_off.backward(g)
    assert torch.equal(k_on.grad, k_off.grad)  # straight-through: d out / d key at the quantised key
