"""Tiny GLM-5 models the tests share: a megatron-core config from the ``tiny`` card, a GPTModel on
our spec, a tiny HF checkpoint (with MTP weights when asked) and a Megatron-Bridge CPU provider."""

import torch

from glm5_dsa_plugin.megatron import spec
from glm5_dsa_plugin.checkpoints import cards


def tiny_config(**over):
    card = cards.load_card("tiny")
    over.setdefault("moe_token_dispatcher_type", "allgather")
    return card, cards.card_to_transformer_config(card, **over)


def build(cfg, card, layer_spec=None, mtp=True, seed=0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: F401

    torch.manual_seed(seed)
    block = layer_spec if layer_spec is not None else spec.get_glm5_dsa_spec(None, cfg)
    mtp_spec = spec.get_glm5_dsa_mtp_spec(None, cfg) if mtp else None
    return GPTModel(config=cfg, transformer_layer_spec=block, vocab_size=card["vocab_size"], max_sequence_length=256,
                    position_embedding_type="none", mtp_block_spec=mtp_spec)


def tiny_hf(seed=0, **card_over):
    from transformers import GlmMoeDsaForCausalLM

    card = cards.with_overrides(cards.load_card("tiny"), **card_over)
    torch.manual_seed(seed)
    cfg = cards.card_to_hf_config(card)
    cfg._attn_implementation = "eager"
    model = GlmMoeDsaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.uniform_(0.5, 1.5)  # non-trivial norm weights catch a swapped norm
            else:
                p.normal_(0, 0.08)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    return card, model


def with_mtp(card, state, seed=1):
    """Add the MTP layer HF checkpoints carry (transformers does not model it)."""
    g = torch.Generator().manual_seed(seed)
    n, H = card["num_hidden_layers"], card["hidden_size"]
    layer2 = {k[len("model.layers.2."):]: v for k, v in state.items() if k.startswith("model.layers.2.")}
    out = dict(state)
    for k, v in layer2.items():
        out[f"model.layers.{n}.{k}"] = torch.randn(v.shape, generator=g) * 0.05
    out[f"model.layers.{n}.enorm.weight"] = torch.rand(H, generator=g) + 0.5
    out[f"model.layers.{n}.hnorm.weight"] = torch.rand(H, generator=g) + 0.5
    out[f"model.layers.{n}.eh_proj.weight"] = torch.randn(H, 2 * H, generator=g) * 0.05
    out[f"model.layers.{n}.shared_head.norm.weight"] = torch.rand(H, generator=g) + 0.5
    out[f"model.layers.{n}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    out[f"model.layers.{n}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    return out


def bridge_cpu_provider(path, model="gpt"):
    """(AutoBridge, finalised CPU provider); ``model="hybrid"``: the provider ``AutoBridge`` gives while
    ``glm5_dsa_plugin.bridge.register_bridge(model="hybrid")`` holds (GPT registered again afterwards)."""
    from megatron.bridge import AutoBridge
    from megatron.core.process_groups_config import ProcessGroupCollection

    from glm5_dsa_plugin.bridge import register_bridge

    b = AutoBridge.from_hf_pretrained(str(path))
    register_bridge(model=model)
    try:
        prov = b.to_megatron_provider(load_weights=False)
    finally:
        register_bridge(model="gpt")
    # CPU-only test settings; production keeps the bridge's defaults (TE, grouped GEMM, flex dispatcher)
    prov.transformer_impl, prov.moe_token_dispatcher_type, prov.moe_grouped_gemm = "local", "allgather", False
    prov.moe_permute_fusion = prov.moe_shared_expert_overlap = False
    prov.make_vocab_size_divisible_by, prov.use_cpu_initialization = 1, True
    prov.params_dtype, prov.bf16 = torch.float32, False
    prov.finalize()
    prov._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return b, prov


def core_attention(cfg, softmax_scale=32**-0.5, layer_number=1):
    """Our DSA core attention as the spec builds it (seed 0), on megatron's process groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from glm5_dsa_plugin.megatron.spec import dsa_attention_spec

    core_spec = dsa_attention_spec(cfg).submodules.core_attention
    torch.manual_seed(0)
    return build_module(core_spec, config=cfg, layer_number=layer_number, attn_mask_type=AttnMaskType.causal,
                        attention_type="self", softmax_scale=softmax_scale,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]))
