"""The TransformerEngine model on the GPU: same parameters as megatron-core's own DSA model, and it trains."""

import pytest
import torch

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.megatron import spec
from glm5_dsa_plugin.model.shared_topk import HOLDER_ATTR
from megatron_cpu import megatron_single_process  # noqa: F401

pytestmark = pytest.mark.gpu


def _te_model(cfg, layer_spec, card, mtp_spec=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=layer_spec, vocab_size=card["vocab_size"],
                    max_sequence_length=256, position_embedding_type="none", mtp_block_spec=mtp_spec).cuda()


def test_te_model_parameters_equal_megatron_cores_and_it_trains(megatron_single_process):
    """Dense layers carry their pre-MLP norm only inside linear_fc1 (``linear_fc1.layer_norm_weight``), MoE
    layers as ``pre_mlp_layernorm``: every parameter name and shape equals the model megatron-core builds
    from its own DSA spec (with MTP); ours then runs a forward / backward with finite gradients."""
    pytest.importorskip("transformer_engine")
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    card = cards.load_card("tiny")
    cfg = cards.card_to_transformer_config(card, moe_token_dispatcher_type="allgather",
                                           transformer_impl="transformer_engine", use_cpu_initialization=False,
                                           params_dtype=torch.bfloat16, bf16=True)
    ours = _te_model(cfg, spec.get_glm5_dsa_spec(None, cfg), card, spec.get_glm5_dsa_mtp_spec(None, cfg))
    mc_block = get_transformer_block_with_experimental_attention_variant_spec(cfg)
    ref = _te_model(cfg, mc_block, card, get_gpt_mtp_block_spec(cfg, mc_block, use_transformer_engine=True))
    shapes = lambda m: {n: tuple(p.shape) for n, p in m.named_parameters()}  # noqa: E731
    assert shapes(ours) == shapes(ref)
    names = set(shapes(ours))
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert "decoder.layers.0.pre_mlp_layernorm.weight" not in names
    assert "decoder.layers.2.pre_mlp_layernorm.weight" in names

    B, S = 2, 32
    tok = torch.randint(0, card["vocab_size"], (B, S), device="cuda")
    ours.train()
    loss = ours(tok, torch.arange(S, device="cuda")[None].expand(B, S), None, labels=tok)
    assert torch.isfinite(loss).all()
    loss.float().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters() if p.requires_grad)


def _glm52_pair():
    """The tiny card with GLM-5.2's index sharing (freq 4, offset 3) and MTP, built on the local
    and the TransformerEngine path from the same fp32 weights, each wrapped in megatron-core's
    ``Float16Module`` (bf16, as training runs them); -> {impl: (model, config)}. The
    attention runs the PyTorch reference backend, so no TileLang is needed."""
    from megatron.core.transformer.module import Float16Module

    from glm5_dsa_plugin.model.attention import GLM5DSAttention

    card = cards.with_overrides(cards.load_card("tiny"), index_topk_freq=4, index_skip_topk_offset=3)
    built = {}
    for impl in ("local", "transformer_engine"):
        cfg = cards.card_to_transformer_config(card, moe_token_dispatcher_type="allgather", transformer_impl=impl,
                                               moe_grouped_gemm=False, use_cpu_initialization=False,
                                               params_dtype=torch.float32, bf16=True)
        torch.manual_seed(0)
        built[impl] = (_te_model(cfg, spec.get_glm5_dsa_spec(None, cfg), card, spec.get_glm5_dsa_mtp_spec(None, cfg)),
                       cfg)
    local, te = built["local"][0], built["transformer_engine"][0]
    lp = dict(local.named_parameters())
    te_name = {}
    for n, p in te.named_parameters():  # dense layers fuse the pre-MLP norm into TE's linear_fc1
        m = n.replace(".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight")
        assert m in lp and lp[m].shape == p.shape, f"TE parameter {n} has no local counterpart"
        te_name[m] = n
        with torch.no_grad():
            p.copy_(lp[m])
    assert set(te_name) == set(lp), sorted(set(lp) - set(te_name))
    out = {}
    for impl, (model, cfg) in built.items():
        for mod in model.modules():
            if isinstance(mod, GLM5DSAttention):
                mod.backend = "reference"
        out[impl] = (Float16Module(cfg, model).train(), cfg)
    return out, te_name, card


def test_te_model_matches_the_local_model_and_trains(megatron_single_process):
    """Same weights on both paths: loss within bf16 rounding, every gradient close, the indexer's
    selections equal; then 50 AdamW steps of the TE model on a fixed batch with finite gradient
    norms and a falling loss."""
    pytest.importorskip("transformer_engine")
    models, te_name, card = _glm52_pair()
    B, S = 2, 64
    g = torch.Generator(device="cuda").manual_seed(3)
    tok = torch.randint(0, card["vocab_size"], (B, S + 1), generator=g, device="cuda")
    pos = torch.arange(S, device="cuda")[None].expand(B, S)
    res = {}
    for impl, (model, cfg) in models.items():
        setattr(cfg, HOLDER_ATTR, {})
        loss = model(tok[:, :-1], pos, None, labels=tok[:, 1:]).float().mean()
        loss.backward()
        res[impl] = dict(loss=float(loss), indices=dict(getattr(cfg, HOLDER_ATTR)),
                         grads={n: p.grad.float() for n, p in model.module.named_parameters()})
    a, b = res["local"], res["transformer_engine"]
    assert abs(a["loss"] - b["loss"]) <= 1e-2 * abs(a["loss"]), (a["loss"], b["loss"])
    assert a["indices"].keys() == b["indices"].keys() and a["indices"]
    for layer, idx in a["indices"].items():
        same = (idx.sort(-1).values == b["indices"][layer].sort(-1).values).all(-1).float().mean().item()
        assert same == 1.0, f"layer {layer}: {same:.4f} of the rows select the same keys"
    worst, total_diff, total = 0.0, 0.0, 0.0
    for n, ga in a["grads"].items():
        gb = b["grads"][te_name[n]]
        err = ((ga - gb).norm() / ga.norm().clamp_min(1e-12)).item()
        worst = max(worst, err if ga.norm() > 1e-6 else 0.0)
        total_diff, total = total_diff + (ga - gb).norm().item() ** 2, total + ga.norm().item() ** 2
    assert (total_diff / total) ** 0.5 < 2e-2 and worst < 0.1, ((total_diff / total) ** 0.5, worst)

    model, cfg = models["transformer_engine"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms = [], []
    for _ in range(50):
        opt.zero_grad(set_to_none=True)
        loss = model(tok[:, :-1], pos, None, labels=tok[:, 1:]).float().mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(norms))) and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
