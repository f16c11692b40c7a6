"""Megatron-Bridge 0.6.2 bridge, provider and the TransformerEngine compatibility guard (CPU)."""

import importlib
import importlib.util
import sys

import pytest
import torch

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.checkpoints import hf_megatron as conversion
from glm5_dsa_plugin.megatron import te_compat
from megatron_cpu import megatron_single_process  # noqa: F401
from tiny_models import bridge_cpu_provider as _cpu_provider

te_compat.install()  # without TE, megatron.bridge imports only behind the guard
# (glm5_dsa_plugin.megatron.bridge raises ImportError with install instructions, not ModuleNotFoundError)
bridge_mod = pytest.importorskip("glm5_dsa_plugin.megatron.bridge", reason="megatron-bridge not installed", exc_type=ImportError)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tiny_models import tiny_hf

    card, hf = tiny_hf(seed=4)
    d = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(d)
    return card, hf, d


def test_registration_wins_over_the_builtin(hf_dir):
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge
    from megatron.bridge.models.glm_moe_dsa.glm5_bridge import GLM5Bridge
    from transformers import GlmMoeDsaForCausalLM

    chosen = get_model_bridge(GlmMoeDsaForCausalLM)
    assert type(chosen) is bridge_mod.GLM5DSAPluginBridge and isinstance(chosen, GLM5Bridge)
    from megatron.bridge import AutoBridge

    assert type(AutoBridge.from_hf_pretrained(str(hf_dir[2]))._model_bridge) is bridge_mod.GLM5DSAPluginBridge


def test_provider_fields_equal_the_card(megatron_single_process, hf_dir):
    card, _, path = hf_dir
    _, prov = _cpu_provider(path)
    assert prov.transformer_layer_spec is bridge_mod.glm5_bridge_layer_spec
    expect = cards.card_to_transformer_config(card)
    for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
              "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_moe_experts", "moe_router_topk",
              "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq", "rotary_base",
              "layernorm_epsilon", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
              "dsa_indexer_topk_freq", "dsa_indexer_skip_topk_offset", "experimental_attention_variant",
              "moe_router_topk_scaling_factor", "moe_router_score_function", "dsa_indexer_rope_interleaved",
              "dsa_indexer_use_sparse_loss", "dsa_indexer_k_norm_epsilon", "dsa_indexer_rotate_activation"):
        assert getattr(prov, f) == getattr(expect, f), f
    assert prov.dsa_indexer_rope_interleaved is True  # the tiny card's (and GLM-5.x's) indexer_rope_interleave


@pytest.mark.parametrize("interleave", [False, True])
def test_provider_passes_the_indexer_rope_convention_through(megatron_single_process, tmp_path, interleave):
    from tiny_models import tiny_hf

    _, hf = tiny_hf(seed=4, indexer_rope_interleave=interleave)
    hf.save_pretrained(tmp_path)
    _, prov = _cpu_provider(tmp_path)
    assert prov.dsa_indexer_rope_interleaved is interleave


@pytest.mark.slow
def test_bridge_path_equals_spec_path(megatron_single_process, hf_dir):
    from glm5_dsa_plugin.model.attention import GLM5DSAttention
    from tiny_models import build

    card, hf, path = hf_dir
    b, prov = _cpu_provider(path)
    torch.manual_seed(0)
    via_bridge = prov.provide()
    b.load_hf_weights([via_bridge])
    assert any(isinstance(m, GLM5DSAttention) for m in via_bridge.modules())
    cfg = cards.card_to_transformer_config(card, moe_token_dispatcher_type="allgather", mtp_num_layers=None)
    via_spec = build(cfg, card, mtp=False)
    via_spec.load_state_dict(conversion.hf_to_megatron(dict(hf.state_dict()), card, include_mtp=False), strict=False)
    pb, ps_ = dict(via_bridge.named_parameters()), dict(via_spec.named_parameters())
    assert pb.keys() == ps_.keys()
    for n in pb:
        assert torch.equal(pb[n], ps_[n]), n
    tok = torch.randint(0, card["vocab_size"], (1, 20))
    via_bridge.eval(), via_spec.eval()
    with torch.no_grad():
        torch.testing.assert_close(via_bridge(tok, torch.arange(20)[None], None),
                                   via_spec(tok, torch.arange(20)[None], None), rtol=0, atol=0)


# ---------------------------------------------------------------- TE guard
needs_no_te = pytest.mark.skipif(te_compat.te_available(), reason="guard is inactive where TE is installed")


@needs_no_te
def test_guard_lets_lora_layers_import_and_is_loud_when_touched():
    from megatron.bridge.peft import lora_layers

    assert te_compat.active()
    with pytest.raises(te_compat.TransformerEngineUnavailable, match="transformer_engine.pytorch.Linear was called"):
        lora_layers.te.Linear(4, 4)
    with pytest.raises(te_compat.TransformerEngineUnavailable, match="isinstance"):
        isinstance(torch.nn.Linear(2, 2), lora_layers.te.Linear)
    with pytest.raises(te_compat.TransformerEngineUnavailable):
        lora_layers.te.fp8_autocast(enabled=False)


@needs_no_te
def test_guard_is_invisible_to_everyone_else():
    assert "transformer_engine" not in sys.modules and "transformer_engine.pytorch" not in sys.modules
    assert importlib.util.find_spec("transformer_engine") is None
    with pytest.raises(ImportError):
        importlib.import_module("transformer_engine")
    import megatron.core.extensions.transformer_engine as mte

    assert not getattr(mte, "HAVE_TE", False)


def test_guard_is_inert_when_te_is_present(monkeypatch):
    monkeypatch.setattr(te_compat, "te_available", lambda: True)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f is not te_compat._FINDER])
    before = list(sys.meta_path)
    assert te_compat.install() is False
    assert sys.meta_path == before and not te_compat.active()
