"""megatron-core 0.19.2's DSA config fields: each one honoured, or refused when the modules are built."""

import dataclasses

import pytest
import torch

from glm5_dsa_plugin.model import index_sharing, indexer, rope
from glm5_dsa_plugin.model.dsa_fields import KNOWN_DSA_FIELDS
from megatron_cpu import megatron_single_process  # noqa: F401


def _config(**over):
    from tiny_models import tiny_config

    over.setdefault("mtp_num_layers", None)
    return tiny_config(**over)


def _model(**over):
    from tiny_models import build

    card, cfg = _config(**over)
    return build(cfg, card, mtp=False)


def _indexer(cfg):
    from megatron.core.transformer.spec_utils import build_module

    from glm5_dsa_plugin.megatron.spec import dsa_attention_spec

    torch.manual_seed(0)
    return build_module(dsa_attention_spec(cfg).submodules.core_attention.submodules.indexer, config=cfg)


def test_every_megatron_core_dsa_field_is_covered():
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig) if f.name.startswith("dsa_")}
    assert fields == set(KNOWN_DSA_FIELDS)


def test_dense_indexer_loss_is_refused_while_the_loss_is_on(megatron_single_process):
    with pytest.raises(ValueError, match=r"dsa_indexer_use_sparse_loss=False is not supported.*dense"):
        _model(dsa_indexer_use_sparse_loss=False, dsa_indexer_loss_coeff=0.001)
    _model(dsa_indexer_use_sparse_loss=False, dsa_indexer_loss_coeff=0.0)  # no loss: the field changes nothing
    _model(dsa_indexer_use_sparse_loss=True, dsa_indexer_loss_coeff=0.001)


def test_scoring_without_relu_is_refused(megatron_single_process):
    with pytest.raises(ValueError, match=r"dsa_indexer_scoring_relu=False is not supported"):
        _model(dsa_indexer_scoring_relu=False)


def test_megatron_core_kernel_backend_is_refused(megatron_single_process):
    from tiny_models import build

    card, cfg = _config()
    # megatron-core checks at config creation that the backend's packages and a GPU exist; set it after
    cfg.dsa_kernel_backend = "tilelang"
    with pytest.raises(ValueError, match=r"dsa_kernel_backend='tilelang' is not supported.*dsa_kernel_backend='none'"):
        build(cfg, card, mtp=False)


def test_rotate_activation_is_an_orthonormal_no_op_or_refused(megatron_single_process):
    """Had / sqrt(Di) applied to q and k (megatron-core's rotate_activation) leaves every score and so
    the selection unchanged at a power-of-two head dim; any other head dim is refused."""
    torch.manual_seed(1)
    T, Hi, Di = 20, 4, 32
    q, k, w = torch.randn(T, Hi, Di, dtype=torch.float64), torch.randn(T, Di, dtype=torch.float64), torch.randn(T, Hi)
    had = torch.ones(1, 1, dtype=torch.float64)
    while had.shape[0] < Di:  # Sylvester construction
        had = torch.cat([torch.cat([had, had], 1), torch.cat([had, -had], 1)], 0)
    had = had / Di**0.5
    torch.testing.assert_close(indexer.index_scores(q @ had.T, k @ had.T, w), indexer.index_scores(q, k, w))
    _model(dsa_indexer_rotate_activation=True)  # tiny card: Di = 32
    with pytest.raises(ValueError, match=r"dsa_indexer_rotate_activation=True is not supported.*head_dim=48"):
        _model(dsa_indexer_rotate_activation=True, dsa_indexer_head_dim=48)


def test_k_norm_epsilon_defaults_to_layernorm_epsilon(megatron_single_process):
    _, cfg = _config(dsa_indexer_k_norm_epsilon=None, layernorm_epsilon=3e-5)
    assert _indexer(cfg).k_norm.eps == 3e-5  # megatron-core's DSAIndexer default
    _, cfg = _config(dsa_indexer_k_norm_epsilon=2e-6)
    assert _indexer(cfg).k_norm.eps == 2e-6


def test_k_norm_runs_on_fp32_inputs_when_asked(megatron_single_process, monkeypatch):
    seen = []
    real = torch.nn.functional.layer_norm

    def spy(x, *a, **kw):
        seen.append(x.dtype)
        return real(x, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "layer_norm", spy)
    T = 6
    for fp32, want in ((False, torch.bfloat16), (True, torch.float32)):
        _, cfg = _config(dsa_indexer_k_norm_fp32=fp32, params_dtype=torch.bfloat16, bf16=True)
        idx = _indexer(cfg).bfloat16()
        x, qr = torch.randn(T, cfg.hidden_size).bfloat16(), torch.randn(T, cfg.q_lora_rank).bfloat16()
        seen.clear()
        q, k, w = idx.qkw(x, qr, torch.arange(T))
        assert seen == [want] and k.dtype == torch.bfloat16
        ref = real(idx.linear_wk(x)[0].to(want), (cfg.dsa_indexer_head_dim,), idx.k_norm.weight.to(want),
                   idx.k_norm.bias.to(want), idx.k_norm.eps).bfloat16()
        cos, sin = rope.rope_cos_sin(torch.arange(T), cfg.qk_pos_emb_head_dim, cfg.rotary_base, dtype=torch.bfloat16)
        torch.testing.assert_close(k, rope.apply_rope_first(ref[:, None], cos, sin, True)[:, 0], rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_indexer_module_rotates_as_configured(megatron_single_process, interleaved):
    _, cfg = _config(dsa_indexer_rope_interleaved=interleaved)
    idx = _indexer(cfg)
    T = 9
    x, qr = torch.randn(T, cfg.hidden_size), torch.randn(T, cfg.q_lora_rank)
    q, k, _ = idx.qkw(x, qr, torch.arange(T))
    cos, sin = rope.rope_cos_sin(torch.arange(T), cfg.qk_pos_emb_head_dim, cfg.rotary_base)
    q_raw = idx.linear_wq_b(qr)[0].view(T, cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim)
    torch.testing.assert_close(q, rope.apply_rope_first(q_raw, cos, sin, interleaved))
    other = rope.apply_rope_first(q_raw, cos, sin, not interleaved)
    assert (q - other).abs().max() > 1e-3


def test_other_rope_variants_are_refused(megatron_single_process):
    """megatron-core's DSAIndexer applies these from the config too; ours implements plain RoPE only."""
    with pytest.raises(ValueError, match=r"rope_type='yarn' is not supported"):
        _model(rope_type="yarn", rotary_scaling_factor=4.0)
    _model(rope_type="yarn", rotary_scaling_factor=1.0)  # plain RoPE frequencies: accepted
    with pytest.raises(ValueError, match=r"rotary_percent=0.5 is not supported"):
        _model(rotary_percent=0.5)


def test_indexer_head_narrower_than_its_rope_channels_is_refused(megatron_single_process):
    """The indexer rotates its first qk_pos_emb_head_dim channels: a narrower head is an error at
    build time, not a shape mismatch inside the first forward."""
    card, cfg = _config()
    with pytest.raises(ValueError, match=rf"dsa_indexer_head_dim={cfg.qk_pos_emb_head_dim // 2} is not supported"):
        _model(dsa_indexer_head_dim=cfg.qk_pos_emb_head_dim // 2)


def test_dsa_geometry_resolves_the_index_sharing_schedule_once():
    """``dsa_geometry`` reads each DSA geometry field once: None freq / offset as megatron-core's
    defaults 1 / 0, the schedule the same as ``index_sharing.computes_indices``; a period below 1 or a
    negative offset is refused naming the field and the value."""
    from types import SimpleNamespace

    from glm5_dsa_plugin.model.dsa_fields import DSAGeometry, dsa_geometry

    plain = dsa_geometry(SimpleNamespace(dsa_indexer_topk=2048, dsa_indexer_topk_freq=None,
                                         dsa_indexer_skip_topk_offset=None, dsa_indexer_n_heads=32,
                                         dsa_indexer_head_dim=128, dsa_indexer_rope_interleaved=True))
    assert plain == DSAGeometry(topk=2048, topk_freq=1, skip_offset=0, indexer_heads=32, indexer_head_dim=128,
                                rope_interleaved=True)
    assert all(plain.computes_indices(L) for L in range(1, 10))
    shared = dsa_geometry(SimpleNamespace(dsa_indexer_topk=2048, dsa_indexer_topk_freq=4,
                                          dsa_indexer_skip_topk_offset=3))
    assert [shared.computes_indices(L) for L in range(1, 13)] == [index_sharing.computes_indices(L, 4, 3) for L in range(1, 13)]
    assert [L for L in range(1, 13) if shared.computes_indices(L)] == [1, 2, 3, 7, 11]
    assert shared.source_layer(6) == 3 and shared.source_layer(7) == 7
    with pytest.raises(ValueError, match=r"pipeline stage starting at layer 5 would reuse the DSA indices of layer 3"):
        shared.check_stage_layers(5, 8)
    shared.check_stage_layers(7, 10)
    with pytest.raises(ValueError, match=r"config.dsa_indexer_topk_freq=0 is not supported"):
        dsa_geometry(SimpleNamespace(dsa_indexer_topk_freq=0))
    with pytest.raises(ValueError, match=r"config.dsa_indexer_skip_topk_offset=-1 is not supported"):
        dsa_geometry(SimpleNamespace(dsa_indexer_skip_topk_offset=-1))


def test_attention_modules_take_their_schedule_from_the_geometry(megatron_single_process):
    from glm5_dsa_plugin.model.attention import GLM5DSAttention
    from glm5_dsa_plugin.model.dsa_fields import dsa_geometry

    card, cfg = _config(dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1)
    model = _model(dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1)
    atts = [m for m in model.modules() if isinstance(m, GLM5DSAttention)]
    assert atts and all(a.geometry == dsa_geometry(cfg) for a in atts)
    for a in atts:
        assert a.computes_indices == index_sharing.computes_indices(a.layer_number, 2, 1) == (a.indexer is not None)
        assert a.source_layer == index_sharing.index_source_layer(a.layer_number, 2, 1)
