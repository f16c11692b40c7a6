"""The spec through each client's calling convention (CPU, local path, gloo world size 1).

slime / miles: megatron-training's parser on slime's GLM-5.2 model flags, an HF config written
by transformers on disk, the spec imported and called as slime's model provider does. Upstream:
megatron-core 0.19.2's own ``GPTModelBuilder``. The references are the HF config files on disk and
megatron-core's modules, never the code under test."""

import argparse
import json
import logging

import pytest
import torch

from client_flags import (parse_megatron_args, slime_extra_args, slime_glm52_model_args, te_available,
                          without_te_only_flags)
from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.megatron import spec
from glm5_dsa_plugin.model.attention import GLM5DSAttention
from megatron_cpu import megatron_single_process  # noqa: F401


def write_hf_config(path, card_name="glm5.2", **over):
    """config.json as transformers writes it (GlmMoeDsaConfig.save_pretrained); returns its dict."""
    card = cards.with_overrides(cards.load_card(card_name), **over)
    cards.card_to_hf_config(card).save_pretrained(path)
    return json.loads((path / "config.json").read_text())


def slime_args(hf_dir, **sizes):
    flags = without_te_only_flags(slime_glm52_model_args(**sizes))
    # the model is built on CPU: weights initialised without a CUDA RNG tracker, RoPE without Triton
    flags += ["--use-cpu-initialization", "--no-rope-fusion"]
    if not te_available():
        flags.append("--no-gradient-accumulation-fusion")  # local path without Apex: the spec asks for it
    return parse_megatron_args(flags + ["--hf-checkpoint", str(hf_dir), "--seq-length", "128",
                                        "--max-position-embeddings", "128", "--micro-batch-size", "1"],
                               extra_args_provider=slime_extra_args)


def slime_spec_call(args, vp_stage=None):
    """What slime's model provider does with --spec: import, build the config, call (args, config, vp_stage)."""
    from megatron.core.transformer.spec_utils import import_module
    from megatron.training.argument_utils import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    fn = import_module(args.spec)
    return config, fn(args, config, vp_stage)


def _module(spec_or_partial):
    return getattr(spec_or_partial, "func", None) or spec_or_partial.module


def core_modules(block):
    return [ls.submodules.self_attention.submodules.core_attention.module for ls in block.layer_specs]


def test_slime_glm52_flags_take_geometry_from_hf_checkpoint(tmp_path, megatron_single_process, caplog):
    hf = write_hf_config(tmp_path)
    args = slime_args(tmp_path)
    assert args.allgather_cp and args.spec == ["glm5_dsa_plugin.spec", "get_glm5_dsa_spec"]
    with caplog.at_level(logging.INFO, logger="glm5_dsa_plugin.spec"):
        config, block = slime_spec_call(args)
        config2, _ = slime_spec_call(args)
    assert (config.dsa_indexer_n_heads, config.dsa_indexer_head_dim, config.dsa_indexer_topk,
            config.dsa_indexer_topk_freq, config.dsa_indexer_skip_topk_offset) == (
        hf["index_n_heads"], hf["index_head_dim"], hf["index_topk"], hf["index_topk_freq"], hf["index_skip_topk_offset"])
    assert len(block.layer_specs) == hf["num_hidden_layers"] == 78
    assert all(m is GLM5DSAttention for m in core_modules(block))
    from megatron.core.transformer.moe.moe_layer import MoELayer

    is_moe = [_module(ls.submodules.mlp) is MoELayer for ls in block.layer_specs]
    assert is_moe == [False] * hf["first_k_dense_replace"] + [True] * 75
    # --allgather-cp passed on for the core attention
    assert config.cp_comm_type == "all_gather" and config.glm5_dsa_cp_layout == "contiguous"
    lines = [r.getMessage() for r in caplog.records if "DSA geometry" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path) in lines[0]


def test_slime_provider_builds_and_trains_tiny_glm52_shape(tmp_path, megatron_single_process):
    """Slime's flags at tiny sizes, GLM-5.2 index sharing (freq 4, offset 3) from the HF config; the
    model is built as slime's model provider builds it and takes a packed THD step."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams

    hf = write_hf_config(tmp_path, "tiny", num_hidden_layers=6, first_k_dense_replace=1, index_topk_freq=4,
                         index_skip_topk_offset=3)
    args = slime_args(tmp_path, n_dense=1, n_moe=5, hidden=64, ffn=128, moe_ffn=32, experts=4, router_topk=2,
                      heads=4, q_lora=32, kv_lora=32, qk_head=16, v_head=16, rope_head=16, vocab=256)
    config, block = slime_spec_call(args)
    assert config.dsa_indexer_topk_freq == 4 and config.dsa_indexer_skip_topk_offset == 3
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=hf["vocab_size"],
                     max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                     parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                     rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling)
    cores = [m for m in model.modules() if isinstance(m, GLM5DSAttention)]
    # computing layers 1, 2, 3 (offset 3) then every 4th from 7: layers 4-6 reuse layer 3's indices
    assert [c.indexer is not None for c in cores] == [True, True, True, False, False, False]
    lens = [20, 12, 32]
    cu = torch.tensor([0, 20, 32, 64], dtype=torch.int32)
    psp = PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=32, max_seqlen_kv=32, qkv_format="thd")
    tok = torch.randint(0, hf["vocab_size"], (1, sum(lens)))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    loss = model(tok, pos, None, labels=torch.roll(tok, -1, 1), packed_seq_params=psp)
    assert torch.isfinite(loss).all()
    loss.sum().backward()
    params = dict(model.named_parameters())
    for i in range(6):
        g = params[f"decoder.layers.{i}.self_attention.linear_q_down_proj.weight"].grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    # slime's flags set no --dsa-indexer-loss-coeff: the indexer gets no loss, hence no gradient
    assert config.dsa_indexer_loss_coeff is None
    assert params["decoder.layers.0.self_attention.core_attention.indexer.linear_wk.weight"].grad is None


def _tiny(**over):
    card = cards.load_card("tiny")
    over.setdefault("moe_token_dispatcher_type", "allgather")
    return card, cards.card_to_transformer_config(card, **over)


def _describe(block):
    return [(ls.module, _module(ls.submodules.mlp), ls.submodules.self_attention.submodules.core_attention.module)
            for ls in block.layer_specs]


def test_every_calling_convention_gives_the_same_block(megatron_single_process):
    from megatron.training.models.gpt import GPTModelConfig

    card, cfg = _tiny(mtp_num_layers=None)
    ref = _describe(spec.get_glm5_dsa_spec(None, cfg))
    ns = argparse.Namespace(allgather_cp=False)
    assert _describe(spec.get_glm5_dsa_spec(ns, cfg, None)) == ref  # slime / miles
    assert _describe(spec.get_glm5_dsa_spec(cfg, vp_stage=None)) == ref  # Megatron-Bridge
    assert _describe(spec.get_glm5_dsa_spec(config=cfg, vp_stage=None)) == ref
    wrapped = GPTModelConfig(transformer=cfg, vocab_size=card["vocab_size"])
    assert _describe(spec.get_glm5_dsa_spec(wrapped, vp_stage=None)) == ref  # upstream Megatron-LM
    assert len(ref) == 4 and all(core is GLM5DSAttention for _, _, core in ref)
    with pytest.raises(TypeError, match="needs a config"):
        spec.get_glm5_dsa_spec(ns)


def _upstream_model(cfg, card):
    """megatron-core 0.19.2's GPTModelBuilder (what pretrain_gpt.py builds through) with our --spec."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

    mc = GPTModelConfig(transformer=cfg, vocab_size=card["vocab_size"], transformer_layer_spec=spec.get_glm5_dsa_spec,
                        position_embedding_type="rope", seq_length=64)
    return GPTModelBuilder(mc).build_model(ProcessGroupCollection.use_mpu_process_groups())


def test_upstream_builder_mtp_needs_the_hook_then_uses_our_attention(megatron_single_process):
    from glm5_dsa_plugin import megatron_lm

    card, cfg = _tiny(mtp_num_layers=None)
    model = _upstream_model(cfg, card)
    assert sum(isinstance(m, GLM5DSAttention) for m in model.modules()) == 4 and getattr(model, "mtp", None) is None
    card, cfg = _tiny()  # mtp_num_layers = 1
    megatron_lm.uninstall_mtp_hook()
    with pytest.raises(RuntimeError, match="python -m glm5_dsa_plugin.megatron_lm"):
        _upstream_model(cfg, card)
    megatron_lm.install_mtp_hook()
    try:
        model = _upstream_model(cfg, card)
    finally:
        megatron_lm.uninstall_mtp_hook()
    assert model.mtp is not None
    mtp_cores = [m for m in model.mtp.modules() if isinstance(m, GLM5DSAttention)]
    assert len(mtp_cores) == 1
    tok = torch.randint(0, card["vocab_size"], (2, 16))
    loss = model(tok, torch.arange(16)[None].expand(2, 16), None, labels=tok)
    loss.sum().backward()
    assert torch.isfinite(loss).all()


def _no_dsa(**over):
    return _tiny(dsa_indexer_n_heads=None, dsa_indexer_head_dim=None, dsa_indexer_topk=None,
                 experimental_attention_variant=None, **over)


def test_geometry_from_a_model_card_named_in_args(megatron_single_process):
    card, cfg = _no_dsa()
    spec.get_glm5_dsa_spec(argparse.Namespace(card="tiny"), cfg)
    assert (cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim, cfg.dsa_indexer_topk) == (
        card["index_n_heads"], card["index_head_dim"], card["index_topk"])


def test_missing_geometry_names_the_flags(megatron_single_process):
    _, cfg = _no_dsa()
    with pytest.raises(ValueError, match="dsa_indexer_n_heads.*--dsa-indexer-n-heads.*--hf-checkpoint"):
        spec.get_glm5_dsa_spec(None, cfg)


def test_conflict_between_config_and_hf_checkpoint_names_both_values(tmp_path, megatron_single_process):
    write_hf_config(tmp_path, "tiny", index_topk=16)
    _, cfg = _tiny()  # dsa_indexer_topk = 8 from the card
    with pytest.raises(ValueError, match=r"dsa_indexer_topk conflicts.*config says 8.*HF config of .* says 16"):
        spec.get_glm5_dsa_spec(argparse.Namespace(hf_checkpoint=str(tmp_path)), cfg)
    write_hf_config(tmp_path, "tiny", kv_lora_rank=64)
    _, cfg = _tiny()
    with pytest.raises(ValueError, match=r"kv_lora_rank conflicts.*config says 32.*says 64"):
        spec.get_glm5_dsa_spec(argparse.Namespace(hf_checkpoint=str(tmp_path)), cfg)
    write_hf_config(tmp_path, "tiny", index_topk_freq=2, index_skip_topk_offset=1)
    _, cfg = _tiny(dsa_indexer_topk_freq=4, dsa_indexer_skip_topk_offset=3)
    with pytest.raises(ValueError, match=r"dsa_indexer_topk_freq conflicts.*says 4.*says 2"):
        spec.get_glm5_dsa_spec(argparse.Namespace(hf_checkpoint=str(tmp_path)), cfg)


def test_allgather_cp_flag_and_its_conflict(megatron_single_process):
    _, cfg = _tiny()
    spec.get_glm5_dsa_spec(argparse.Namespace(allgather_cp=True), cfg)
    assert cfg.cp_comm_type == "all_gather" and cfg.glm5_dsa_cp_layout == "contiguous"
    _, cfg = _tiny(cp_comm_type="a2a")
    with pytest.raises(ValueError, match="--allgather-cp needs cp_comm_type 'all_gather'.*'a2a'"):
        spec.get_glm5_dsa_spec(argparse.Namespace(allgather_cp=True), cfg)
    _, cfg = _tiny()
    spec.get_glm5_dsa_spec(argparse.Namespace(allgather_cp=False), cfg)
    assert cfg.cp_comm_type is None and not hasattr(cfg, "glm5_dsa_cp_layout")


def test_local_path_builds_with_upstream_default_persist_layer_norm(megatron_single_process):
    """megatron-training's default is persist_layer_norm=True; megatron-core's torch norm refuses it."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    card, cfg = _tiny(persist_layer_norm=True)
    with pytest.raises(AssertionError, match="persist_layer_norm"):
        WrappedTorchNorm(config=cfg, hidden_size=8)
    model = GPTModel(config=cfg, transformer_layer_spec=spec.get_glm5_dsa_spec(None, cfg), vocab_size=card["vocab_size"],
                     max_sequence_length=64, position_embedding_type="none",
                     mtp_block_spec=spec.get_glm5_dsa_mtp_spec(None, cfg))
    assert cfg.persist_layer_norm is True  # the caller's config is left as it is
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) >= 4 * 2 + 1 + 3  # input / pre-MLP per layer, final, MTP enorm / hnorm / final


def test_local_path_without_apex_names_the_flag_at_spec_build(megatron_single_process):
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "_grad_accum_fusion_available", True):
        pytest.skip("Apex's fused_weight_gradient_mlp_cuda is installed: gradient accumulation fusion works")
    _, cfg = _tiny(gradient_accumulation_fusion=True)
    with pytest.raises(ValueError, match="--no-gradient-accumulation-fusion"):
        spec.get_glm5_dsa_spec(None, cfg)


@pytest.mark.parametrize("mtp", [False, True])
def test_upstream_flags_through_gpt_config_from_args_and_builder(megatron_single_process, mtp):
    """Upstream's arguments -> ``gpt_config_from_args`` (imports --spec) -> ``GPTModelBuilder``, one
    forward / backward at a short sequence (megatron-training's ``pretrain`` itself needs CUDA:
    tests/train/test_gpu_upstream_pretrain.py runs it)."""
    from client_flags import apex_grad_accum_fusion_available, upstream_tiny_glm52_args
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    from glm5_dsa_plugin import megatron_lm

    flags = upstream_tiny_glm52_args(seq_length=64, mtp=mtp)
    # built on CPU: no CUDA RNG tracker, no Triton RoPE, a dispatcher without CUDA streams
    flags[flags.index("alltoall")] = "allgather"
    flags += ["--use-cpu-initialization", "--no-rope-fusion"]
    if not apex_grad_accum_fusion_available():
        flags.append("--no-gradient-accumulation-fusion")
    args = parse_megatron_args(flags)
    model_cfg = gpt_config_from_args(args)
    assert model_cfg.transformer_layer_spec is spec.get_glm5_dsa_spec
    if mtp:
        megatron_lm.install_mtp_hook()
    try:
        torch.manual_seed(0)
        model = GPTModelBuilder(model_cfg).build_model(ProcessGroupCollection.use_mpu_process_groups())
    finally:
        megatron_lm.uninstall_mtp_hook()
    cores = [m for m in model.modules() if isinstance(m, GLM5DSAttention)]
    assert len(cores) == 4 + int(mtp)
    assert [c.computes_indices for c in cores[:4]] == [True, True, True, False]
    tok = torch.randint(0, 4096, (1, 64))
    loss = model(tok, torch.arange(64)[None], None, labels=torch.roll(tok, -1, 1))
    loss.float().mean().backward()
    assert torch.isfinite(loss).all()


def test_hf_indexer_rope_interleave_is_read_and_a_conflict_refused(tmp_path, megatron_single_process):
    """miles reads ``indexer_rope_interleave`` from the HF config (GLM-5.x publish it true); the spec
    takes it when the config leaves megatron-core's default, and refuses a config that says otherwise."""
    write_hf_config(tmp_path, "tiny")
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    cfg_json["indexer_rope_interleave"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    _, cfg = _tiny(dsa_indexer_rope_interleaved=False)  # megatron-core's default (the cards say True)
    assert cfg.dsa_indexer_rope_interleaved is False
    spec.get_glm5_dsa_spec(argparse.Namespace(hf_checkpoint=str(tmp_path)), cfg)
    assert cfg.dsa_indexer_rope_interleaved is True
    cfg_json["indexer_rope_interleave"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    _, cfg = _tiny(dsa_indexer_rope_interleaved=True)
    with pytest.raises(ValueError, match=r"dsa_indexer_rope_interleaved conflicts.*says True.*says False"):
        spec.get_glm5_dsa_spec(argparse.Namespace(hf_checkpoint=str(tmp_path)), cfg)


def test_launcher_card_overrides_apply_to_the_card_source(megatron_single_process):
    card, cfg = _tiny(dsa_indexer_topk=4)
    ns = argparse.Namespace(card="tiny", card_override=["index_topk=4"])
    spec.get_glm5_dsa_spec(ns, cfg)
    assert cfg.dsa_indexer_topk == 4
    _, cfg = _tiny(dsa_indexer_topk=4)
    with pytest.raises(ValueError, match=r"dsa_indexer_topk conflicts.*says 4.*model card 'tiny' says 8"):
        spec.get_glm5_dsa_spec(argparse.Namespace(card="tiny"), cfg)
