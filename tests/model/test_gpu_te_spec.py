"""The TransformerEngine model on the GPU: same parameters as megatron-core's own DSA model, and it trains."""

import pytest
import torch

from glm5_dsa_plugin import cards, spec
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
