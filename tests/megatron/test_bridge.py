"""Megatron-Bridge 0.6.2 bridge, provider and the TransformerEngine compatibility guard (CPU)."""

import dataclasses
import functools
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


# ---------------------------------------------------------------- HybridModel through the bridge
GLM52 = dict(index_topk_freq=2, index_skip_topk_offset=1)  # GLM-5.2-shaped: DSA layers 2 and 4 reuse 1 and 3


@pytest.fixture(scope="module")
def hf52_dir(tmp_path_factory):
    from tiny_models import tiny_hf

    card, hf = tiny_hf(seed=6, **GLM52)
    d = tmp_path_factory.mktemp("hf52")
    hf.save_pretrained(d)
    return card, hf, d


def test_register_bridge_picks_the_model_autobridge_builds(megatron_single_process, hf_dir):
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from transformers import GlmMoeDsaForCausalLM

    from glm5_dsa_plugin.bridge import register_bridge

    try:
        assert register_bridge(model="hybrid") is bridge_mod.GLM5DSAPluginHybridBridge
        assert type(get_model_bridge(GlmMoeDsaForCausalLM)) is bridge_mod.GLM5DSAPluginHybridBridge
        prov = AutoBridge.from_hf_pretrained(str(hf_dir[2])).to_megatron_provider(load_weights=False)
        assert type(prov) is bridge_mod.GLM5DSAHybridModelProvider
        assert prov._resolve_hybrid_stack_spec() is bridge_mod.glm5_dsa_hybrid_stack_spec
    finally:
        assert register_bridge(model="gpt") is bridge_mod.GLM5DSAPluginBridge
    assert type(get_model_bridge(GlmMoeDsaForCausalLM)) is bridge_mod.GLM5DSAPluginBridge
    assert get_model_bridge(GlmMoeDsaForCausalLM).PROVIDER_CLASS is bridge_mod.MLAModelProvider
    with pytest.raises(ValueError, match="model must be one of"):
        register_bridge(model="mamba")
    assert issubclass(bridge_mod._BRIDGES["hybrid"][1], HybridModel)


def test_hybrid_provider_is_the_gpt_provider_on_the_pattern(megatron_single_process, hf52_dir):
    from glm5_dsa_plugin.checkpoints.hybrid_pattern import glm5_hybrid_layer_pattern

    card, _, path = hf52_dir
    _, gpt = _cpu_provider(path)
    _, hyb = _cpu_provider(path, model="hybrid")
    assert hyb.hybrid_layer_pattern == glm5_hybrid_layer_pattern(card, mtp=False) == "D-D-DEDE"
    assert (hyb.num_layers, hyb.moe_layer_freq, hyb.is_hybrid_model) == (8, 1, True)
    assert (gpt.num_layers, gpt.moe_layer_freq) == (4, [0, 0, 1, 1])
    assert not gpt.mtp_num_layers and not hyb.mtp_num_layers
    shared = {f.name for f in dataclasses.fields(gpt)} & {f.name for f in dataclasses.fields(hyb)}
    differ = sorted(n for n in shared if not _same_value(getattr(gpt, n), getattr(hyb, n)))
    # the model class's own fields differ; every other field both providers have is the GPTModel path's
    assert differ == ["is_hybrid_model", "moe_layer_freq", "mtp_hybrid_override_pattern", "num_layers",
                      "position_embedding_type"], differ
    # what an HF export writes (config.json from a Megatron checkpoint): the same GLM config either way
    assert bridge_mod.GLM5DSAPluginHybridBridge.megatron_to_hf_config(hyb) == \
        bridge_mod.GLM5DSAPluginBridge.megatron_to_hf_config(gpt)


def _same_value(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):  # init methods: one per provider
        return (a.func, a.args, a.keywords) == (b.func, b.args, b.keywords)
    try:
        return bool(a == b)
    except Exception:
        return a is b


def test_hybrid_names_registry_maps_through_the_gpt_names(hf52_dir):
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping
    from transformers import GlmMoeDsaForCausalLM

    _, hf, _ = hf52_dir
    b = get_model_bridge(GlmMoeDsaForCausalLM, hf_config=hf.config)
    b._megatron_names = "hybrid"
    reg = b.mapping_registry()
    assert isinstance(reg, bridge_mod.HybridNamesMappingRegistry)
    q_down = "decoder.layers.2.self_attention.linear_q_down_proj.weight"
    m = reg.megatron_to_hf_lookup(q_down)
    assert (type(m), m.megatron_param, m.hf_param) == (AutoMapping, q_down, "model.layers.1.self_attn.q_a_proj.weight")
    m = reg.megatron_to_hf_lookup("decoder.layers.3.mlp.linear_fc1.weight")
    assert type(m) is GatedMLPMapping and m.megatron_param == "decoder.layers.3.mlp.linear_fc1.weight"
    assert m.hf_param == {"gate": "model.layers.1.mlp.gate_proj.weight", "up": "model.layers.1.mlp.up_proj.weight"}
    assert reg.megatron_to_hf_lookup("decoder.final_norm.weight").hf_param == "model.norm.weight"
    m = reg.megatron_to_hf_lookup("decoder.layers.7.mlp.experts.linear_fc2.weight3")
    assert m.hf_param == "model.layers.3.mlp.experts.3.down_proj.weight"
    m = reg.hf_to_megatron_lookup("model.layers.3.self_attn.indexer.wk.weight")
    assert m.megatron_param == "decoder.layers.6.self_attention.core_attention.indexer.linear_wk.weight"
    with pytest.raises(ValueError, match="hybrid layer 1 holds"):
        reg.megatron_to_hf_lookup("decoder.layers.1.self_attention.linear_proj.weight")
    b._megatron_names = "gpt"
    assert b.mapping_registry().megatron_to_hf_lookup(q_down).hf_param == "model.layers.2.self_attn.q_a_proj.weight"


@pytest.mark.slow
def test_hybrid_through_the_bridge_equals_gpt_through_the_bridge(megatron_single_process, hf52_dir):
    """HF checkpoint -> AutoBridge -> HybridModel and -> GPTModel: same weights (renamed), same logits,
    and the HybridModel exports back to the checkpoint bit for bit."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from glm5_dsa_plugin.checkpoints import hybrid_names
    from glm5_dsa_plugin.megatron.hybrid_spec import GLM5HybridDSAttention

    card, hf, path = hf52_dir
    b, gpt_prov = _cpu_provider(path)
    _, hyb_prov = _cpu_provider(path, model="hybrid")
    torch.manual_seed(0)
    gpt = gpt_prov.provide()
    torch.manual_seed(1)  # other random weights: only loading can make the two equal
    hyb = hyb_prov.provide()
    assert type(gpt) is GPTModel and type(hyb) is HybridModel
    assert hyb.hybrid_layer_pattern == "D-D-DEDE"
    cores = [m for m in hyb.modules() if isinstance(m, GLM5HybridDSAttention)]
    assert [(c.layer_number, c.computes_indices) for c in cores] == [(1, True), (2, False), (3, True), (4, False)]
    b.load_hf_weights([gpt])  # GPT registered: the bridge maps by the model it is given
    bridge_mod.register_bridge(model="hybrid")
    try:
        b.load_hf_weights([hyb])
    finally:
        bridge_mod.register_bridge(model="gpt")
    gs, hs = gpt.state_dict(), hyb.state_dict()
    gs = {k: v for k, v in gs.items() if not k.endswith("_extra_state")}
    hs = {k: v for k, v in hs.items() if not k.endswith("_extra_state")}
    renamed = hybrid_names.gpt_to_hybrid_state(gs)
    assert renamed.keys() == hs.keys()
    for k in hs:
        assert torch.equal(hs[k], renamed[k]), k
    tok = torch.randint(0, card["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(24)[None].expand(2, 24)
    gpt.eval(), hyb.eval()
    with torch.no_grad():
        lg, lh = gpt(tok, pos, None), hyb(tok, pos, None)
    diff = (lh - lg).abs().max().item()
    print(f"bridge HybridModel vs GPTModel, fp32 logits: max abs diff {diff:.3e} (|logit| max {lg.abs().max():.3f})")
    assert lg.dtype == torch.float32 and diff <= 1e-5
    from safetensors.torch import load_file

    on_disk = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}  # per-expert names
    out_h = dict(b.export_hf_weights([hyb], cpu=True, show_progress=False))
    out_g = dict(b.export_hf_weights([gpt], cpu=True, show_progress=False))
    assert out_h.keys() == out_g.keys() == on_disk.keys()
    for k, v in out_h.items():
        assert v.dtype == on_disk[k].dtype and torch.equal(v, on_disk[k]), k
        assert torch.equal(v, out_g[k]), k


@pytest.mark.slow
def test_hybrid_with_mtp_through_the_bridge_loads_as_the_converter(megatron_single_process, tmp_path):
    """provider.mtp_num_layers = 1 appends '/DE'; the bridge loads every weight, MTP included, as
    hf_megatron.hf_to_megatron(model="hybrid") converts it, and exports it back bit for bit."""
    from safetensors.torch import load_file, save_file

    from glm5_dsa_plugin.checkpoints import hf_megatron
    from tiny_models import tiny_hf, with_mtp

    card, hf = tiny_hf(seed=7, **GLM52)
    hf.save_pretrained(tmp_path)
    (shard,) = sorted(tmp_path.glob("*.safetensors"))
    on_disk = with_mtp(card, load_file(shard))  # transformers writes no MTP layer; HF checkpoints carry one
    save_file(on_disk, str(shard), metadata={"format": "pt"})
    b, prov = _cpu_provider(tmp_path, model="hybrid")
    prov.mtp_num_layers = 1
    prov.finalize()
    assert (prov.hybrid_layer_pattern, prov.num_layers) == ("D-D-DEDE/DE", 8)
    torch.manual_seed(0)
    model = prov.provide()
    assert model.mtp is not None
    b.load_hf_weights([model])
    got = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    want = hf_megatron.hf_to_megatron(on_disk, card, model="hybrid")
    assert got.keys() == want.keys() and any(k.startswith("mtp.layers.0.mtp_model_layer.layers.1.") for k in got)
    for k in got:
        assert torch.equal(got[k], want[k]), k
    out = dict(b.export_hf_weights([model], cpu=True, show_progress=False))
    n = card["num_hidden_layers"]
    # the MTP layer's embedding and head are the model's own (megatron-core shares them): not exported
    assert set(on_disk) - set(out) == {f"model.layers.{n}.embed_tokens.weight",
                                       f"model.layers.{n}.shared_head.head.weight"}
    assert set(out) <= set(on_disk)
    for k, v in out.items():
        assert torch.equal(v, on_disk[k]), k


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
