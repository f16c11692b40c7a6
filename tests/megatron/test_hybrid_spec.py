"""glm5_dsa_hybrid_stack_spec: megatron-core 0.19.2's HybridModel with our DSA layer (CPU, local
path, fp32, gloo world size 1). References: GPTModel on our spec with the same weights (renamed),
megatron-core's own layer classes and pattern split, and the HF checkpoint a model was loaded from."""

import pytest
import torch

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.checkpoints import hybrid_names as hn
from glm5_dsa_plugin.megatron import hybrid_spec as hs
from glm5_dsa_plugin.model.attention import GLM5DSAttention
from megatron_cpu import megatron_single_process  # noqa: F401
from tiny_models import build as build_gpt

B, S = 2, 24


def hybrid_model(card, pattern=None, seed=0, **model_kw):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    config = hs.hybrid_transformer_config(card, pattern, moe_token_dispatcher_type="allgather")
    torch.manual_seed(seed)
    return HybridModel(config=config, hybrid_stack_spec=hs.glm5_dsa_hybrid_stack_spec,
                       vocab_size=card["vocab_size"], max_sequence_length=256,
                       hybrid_layer_pattern=config.hybrid_layer_pattern, position_embedding_type="none", **model_kw)


def batch(card, seed=0):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, card["vocab_size"], (B, S), generator=g)
    return tok, torch.arange(S)[None].expand(B, S), torch.randint(0, card["vocab_size"], (B, S), generator=g)


def two_layer_card(mtp: bool):
    return cards.with_overrides(cards.load_card("tiny"), num_hidden_layers=2, first_k_dense_replace=1,
                                num_nextn_predict_layers=int(mtp))


@pytest.mark.parametrize("mtp", [False, True], ids=["D-DE", "D-DE/DE"])
def test_pattern_builds_our_layers_and_trains(megatron_single_process, mtp):
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    card = two_layer_card(mtp)
    model = hybrid_model(card)
    assert model.hybrid_layer_pattern == ("D-DE/DE" if mtp else "D-DE")
    layers = list(model.decoder.layers)
    assert [layer.layer_number for layer in layers] == [1, 2, 3, 4]
    for layer in (layers[0], layers[2]):  # D: our core attention, no MLP
        assert type(layer.self_attention.core_attention) is hs.GLM5HybridDSAttention
    assert isinstance(layers[1], MLPLayer) and type(layers[1].mlp) is MLP
    assert isinstance(layers[3], MoETransformerLayer) and isinstance(layers[3].mlp, MoELayer)
    assert (getattr(model, "mtp", None) is not None) == mtp
    cores = [m for m in model.modules() if isinstance(m, GLM5DSAttention)]
    assert len(cores) == 2 + int(mtp)
    mtp_cores = [m for m in model.mtp.modules() if isinstance(m, GLM5DSAttention)] if mtp else []
    assert [c.is_mtp for c in cores] == [c in mtp_cores for c in cores]  # the MTP attention is never replayed
    tok, pos, labels = batch(card)
    loss = model(tok, pos, None, labels=labels)
    assert loss.shape == (B, S) and torch.isfinite(loss).all()
    loss.mean().backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not no_grad
    if mtp:  # the MTP layer trains through its own loss
        assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0


def test_pipeline_cut_stages_chain_to_the_whole_model(megatron_single_process):
    """'D-|DE' built stage by stage as megatron-core selects segments (vp_stage 0 / 1) equals 'D-DE'."""
    card = two_layer_card(mtp=False)
    whole = hybrid_model(card, "D-DE")
    first = hybrid_model(card, "D-|DE", pre_process=True, post_process=False, vp_stage=0)
    last = hybrid_model(card, "D-|DE", pre_process=False, post_process=True, vp_stage=1)
    assert [l.layer_number for l in first.decoder.layers] == [1, 2]
    assert [l.layer_number for l in last.decoder.layers] == [3, 4]
    assert last.decoder.layers[0].self_attention.core_attention.layer_number == 2  # DSA layer 2
    ws = whole.state_dict()
    first.load_state_dict({k: ws[k] for k in first.state_dict()}, strict=True)

    def whole_name(k):
        if k.startswith("decoder.layers."):
            j, rest = k[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{int(j) + 2}.{rest}"
        return k

    last.load_state_dict({k: ws[whole_name(k)] for k in last.state_dict()}, strict=True)
    tok, pos, labels = batch(card)
    ref = whole(tok, pos, None, labels=labels)
    hidden = first(tok, pos, None)
    last.set_input_tensor(hidden)
    out = last(tok, pos, None, labels=labels)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    out.sum().backward()
    assert first.embedding.word_embeddings.weight.grad is not None


def test_same_weights_same_logits_and_grads_as_gpt_model(megatron_single_process):
    """Tiny GLM-5.2-shaped card (index sharing: DSA layers 2 and 4 reuse 1 and 3) with MTP."""
    card = cards.with_overrides(cards.load_card("tiny"), index_topk_freq=2, index_skip_topk_offset=1)
    gpt = build_gpt(cards.card_to_transformer_config(card, moe_token_dispatcher_type="allgather"), card, seed=1)
    hyb = hybrid_model(card)
    gpt_state = gpt.state_dict()
    assert set(hn.gpt_to_hybrid_state(gpt_state)) == set(hyb.state_dict())
    hyb.load_state_dict(hn.gpt_to_hybrid_state(gpt_state), strict=True)

    def sharing(model):
        return [(m.layer_number, m.computes_indices, m.source_layer) for m in model.modules()
                if isinstance(m, GLM5DSAttention)]

    assert sharing(hyb) == sharing(gpt) == [(1, True, 1), (2, False, 1), (3, True, 3), (4, False, 3), (1, True, 1)]
    tok, pos, labels = batch(card)
    gpt.eval(), hyb.eval()
    with torch.no_grad():
        torch.testing.assert_close(hyb(tok, pos, None), gpt(tok, pos, None), rtol=0, atol=1e-5)
    gpt.train(), hyb.train()
    lg, lh = gpt(tok, pos, None, labels=labels), hyb(tok, pos, None, labels=labels)
    torch.testing.assert_close(lh, lg, rtol=0, atol=1e-5)
    lg.sum().backward()
    lh.sum().backward()  # includes the MTP loss and the indexer loss
    hyb_params = dict(hyb.named_parameters())
    for name, p in gpt.named_parameters():
        q = hyb_params[hn.gpt_to_hybrid_name(name)]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-5, msg=name)


def test_hf_checkpoint_loads_into_hybrid_and_round_trips(megatron_single_process):
    from glm5_dsa_plugin.checkpoints import hf_megatron as hm
    from tiny_models import tiny_hf, with_mtp

    card, hf = tiny_hf(index_topk_freq=2, index_skip_topk_offset=1)
    state = with_mtp(card, {k: v.detach() for k, v in hf.state_dict().items()})
    hyb = hybrid_model(card)
    missing, unexpected = hm.load_hf_checkpoint(hyb, state, card)
    assert not unexpected and not [k for k in missing if not k.endswith("_extra_state")]
    back = hm.megatron_to_hf({k: v for k, v in hyb.state_dict().items()}, card, model="hybrid")
    expected = {k: v for k, v in state.items() if k in back}
    assert set(back) == set(hm.megatron_to_hf(hm.hf_to_megatron(state, card), card))
    for k, v in expected.items():
        assert torch.equal(back[k], v), k
    # the same checkpoint through the GPT names (tests/checkpoints/test_hf_megatron.py checks those against HF)
    gpt = build_gpt(cards.card_to_transformer_config(card, moe_token_dispatcher_type="allgather"), card, seed=3)
    missing, unexpected = hm.load_hf_checkpoint(gpt, state, card)
    assert not unexpected and not [k for k in missing if not k.endswith("_extra_state")]
    tok, pos, _ = batch(card)
    gpt.eval(), hyb.eval()
    with torch.no_grad():
        torch.testing.assert_close(hyb(tok, pos, None), gpt(tok, pos, None), rtol=0, atol=1e-5)


def test_cut_on_a_reusing_dsa_layer_is_refused_naming_it(megatron_single_process):
    card = cards.with_overrides(cards.load_card("tiny"), index_topk_freq=2, index_skip_topk_offset=1)
    with pytest.raises(ValueError, match=r"starts its DSA layers at layer 3 \(DSA layer 2\), which reuses the "
                                         r"indices of DSA layer 1"):
        hybrid_model(card, "D-|D-DEDE/DE", pre_process=True, post_process=False, vp_stage=0)
    hybrid_model(card, "D-D-|DEDE", pre_process=True, post_process=False, vp_stage=0)  # DSA layer 3 computes


def test_stack_needs_the_pattern(megatron_single_process):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    card = two_layer_card(mtp=False)
    config = hs.hybrid_transformer_config(card, moe_token_dispatcher_type="allgather")
    config.hybrid_layer_pattern = None
    with pytest.raises(ValueError, match="config.hybrid_layer_pattern"):
        HybridModel(config=config, hybrid_stack_spec=hs.glm5_dsa_hybrid_stack_spec, vocab_size=card["vocab_size"],
                    max_sequence_length=64, hybrid_layer_pattern="D-DE", position_embedding_type="none")


def _upstream_hybrid_flags(mtp: bool):
    from client_flags import apex_grad_accum_fusion_available
    from upstream_pretrain_hybrid import upstream_tiny_glm52_hybrid_args

    flags = upstream_tiny_glm52_hybrid_args(seq_length=64, mtp=mtp)
    flags[flags.index("alltoall")] = "allgather"  # built on CPU: a dispatcher without CUDA streams
    flags += ["--use-cpu-initialization"]
    if not apex_grad_accum_fusion_available():
        flags.append("--no-gradient-accumulation-fusion")
    return flags


@pytest.mark.parametrize("mtp", [False, True], ids=["no_mtp", "mtp"])
def test_upstream_hybrid_config_from_args_and_builder(megatron_single_process, monkeypatch, mtp):
    """What ``pretrain_hybrid.py`` builds: upstream's arguments -> ``hybrid_config_from_args`` (imports
    ``--spec`` as an object) -> ``HybridModelBuilder``; the pattern comes from the parsed arguments."""
    from client_flags import parse_megatron_args
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import global_vars
    from megatron.training.argument_utils import hybrid_config_from_args
    from megatron.training.models.hybrid import HybridModelBuilder

    args = parse_megatron_args(_upstream_hybrid_flags(mtp))
    assert args.num_layers == 8 and (args.mtp_num_layers or 0) == int(mtp)
    model_cfg = hybrid_config_from_args(args)
    assert model_cfg.hybrid_stack_spec is hs.glm5_dsa_hybrid_stack_spec
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)  # what megatron-training's initialisation sets
    torch.manual_seed(0)
    model = HybridModelBuilder(model_cfg).build_model(ProcessGroupCollection.use_mpu_process_groups())
    cores = [m for m in model.modules() if isinstance(m, GLM5DSAttention)]
    assert all(type(c) is hs.GLM5HybridDSAttention for c in cores) and len(cores) == 4 + int(mtp)
    # freq 4 / offset 3: DSA layers 1-3 compute, 4 reuses 3 (the GPT path's numbering)
    assert [c.computes_indices for c in cores[:4]] == [True, True, True, False]
    tok = torch.randint(0, 4096, (1, 64))
    loss = model(tok, torch.arange(64)[None], None, labels=torch.roll(tok, -1, 1))
    loss.float().mean().backward()
    assert torch.isfinite(loss).all()
