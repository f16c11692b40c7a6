"""glm5_dsa_plugin.spec on megatron-core 0.19.2 (CPU, local path, gloo world size 1)."""

import pytest
import torch

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.megatron import spec
from glm5_dsa_plugin.model.attention import GLM5DSAttention
from megatron_cpu import megatron_single_process  # noqa: F401
from tiny_models import build, tiny_config


@pytest.fixture
def forbid_megatron_dsa_kernels(monkeypatch):
    """Every megatron-core DSA attention kernel raises; ours counts its calls."""
    import glm5_dsa_plugin.model.attention as att
    from megatron.core.transformer.experimental_attention_variant import dsa, dsa_kernels
    from megatron.core.transformer.experimental_attention_variant.ops import sparse_mla as mc_sparse

    def boom(*a, **k):
        raise AssertionError("a megatron-core DSA kernel was called")

    monkeypatch.setattr(mc_sparse, "SparseMLA", type("X", (), {"apply": staticmethod(boom)}))
    monkeypatch.setattr(dsa_kernels, "run_fused_absorbed_sparse_attention", boom)
    monkeypatch.setattr(dsa, "_unfused_absorbed_dsa_fn", boom)
    monkeypatch.setattr(dsa, "unfused_dsa_fn", boom)
    calls = []
    real = att.sparse_mla

    def counting(*a, **k):
        calls.append(k.get("backend"))
        return real(*a, **k)

    monkeypatch.setattr(att, "sparse_mla", counting)
    return calls


@pytest.mark.slow
def test_tiny_model_bshd_forward_backward(megatron_single_process, forbid_megatron_dsa_kernels):
    card, cfg = tiny_config()
    model = build(cfg, card)
    assert len(model.decoder.layers) == 4 and model.mtp is not None
    from megatron.core.transformer.moe.moe_layer import MoELayer

    kinds = [isinstance(layer.mlp, MoELayer) for layer in model.decoder.layers]
    assert kinds == [False, False, True, True]  # first_k_dense_replace = 2
    cores = [m for m in model.modules() if isinstance(m, GLM5DSAttention)]
    assert len(cores) == 5  # 4 decoder layers + the MTP layer
    names = {n for n, _ in model.named_parameters()}
    for leaf in ("linear_wq_b.weight", "linear_wk.weight", "k_norm.weight", "linear_weights_proj.weight"):
        assert f"decoder.layers.0.self_attention.core_attention.indexer.{leaf}" in names
    model.train()
    B, S = 2, 24
    tok = torch.randint(0, card["vocab_size"], (B, S))
    loss = model(tok, torch.arange(S)[None].expand(B, S), None, labels=torch.randint(0, card["vocab_size"], (B, S)))
    assert torch.isfinite(loss).all()
    loss.mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    # the indexer is trained only through its KL loss: a nonzero gradient proves the loss is attached
    assert grads["decoder.layers.2.self_attention.core_attention.indexer.linear_wk.weight"].abs().sum() > 0
    assert len(forbid_megatron_dsa_kernels) == 5


@pytest.mark.slow
def test_tiny_model_thd_three_sequences(megatron_single_process, forbid_megatron_dsa_kernels):
    from megatron.core.packed_seq_params import PackedSeqParams

    card, cfg = tiny_config(mtp_num_layers=None)
    model = build(cfg, card, mtp=False)
    cu = torch.tensor([0, 5, 17, 30], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=13, max_seqlen_kv=13)
    T = 30
    tok = torch.randint(0, card["vocab_size"], (1, T))
    pos = torch.cat([torch.arange(5), torch.arange(12), torch.arange(13)])[None]
    model.train()
    loss = model(tok, pos, None, labels=torch.randint(0, card["vocab_size"], (1, T)), packed_seq_params=psp)
    assert loss.shape == (1, T) and torch.isfinite(loss).all()
    loss.sum().backward()
    # packing must not leak across sequences: the middle sequence alone gives the same logits
    model.eval()
    with torch.no_grad():
        full = model(tok, pos, None, packed_seq_params=psp)
        cu1 = torch.tensor([0, 12], dtype=torch.int32)
        one = model(tok[:, 5:17], pos[:, 5:17], None,
                    packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu1, cu_seqlens_kv=cu1,
                                                      max_seqlen_q=12, max_seqlen_kv=12))
    torch.testing.assert_close(full[:, 5:17], one, rtol=1e-5, atol=1e-5)


def test_index_sharing_layers_reuse_indices(megatron_single_process):
    card, cfg = tiny_config(dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1, mtp_num_layers=None)
    model = build(cfg, card, mtp=False)
    has_indexer = [layer.self_attention.core_attention.indexer is not None for layer in model.decoder.layers]
    assert has_indexer == [True, False, True, False]
    tok = torch.randint(0, card["vocab_size"], (1, 12))
    out = model(tok, torch.arange(12)[None], None)
    assert torch.isfinite(out).all()


def test_stage_starting_on_a_reusing_layer_is_refused():
    _, cfg = tiny_config(dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1)
    spec.check_index_sharing_split(cfg, [0, 1])
    with pytest.raises(ValueError, match="starting at layer 2 would reuse the DSA indices of layer 1"):
        spec.check_index_sharing_split(cfg, [1, 2, 3])


def test_upstream_object_form_builds_the_same_model(megatron_single_process):
    card, cfg = tiny_config(mtp_num_layers=None)
    a = build(cfg, card, mtp=False, seed=3)
    b = build(cfg, card, layer_spec=spec.glm5_dsa_layer_spec, mtp=False, seed=3)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for n in pa:
        assert pa[n].shape == pb[n].shape, n
    b.load_state_dict(a.state_dict(), strict=False)
    tok = torch.randint(0, card["vocab_size"], (1, 10))
    a.eval(), b.eval()
    with torch.no_grad():
        torch.testing.assert_close(a(tok, torch.arange(10)[None], None), b(tok, torch.arange(10)[None], None))


def test_transformer_engine_is_lazy_and_loud():
    _, cfg = tiny_config(transformer_impl="transformer_engine")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="TransformerEngine does not import"):
            spec.get_glm5_dsa_spec(None, cfg)
    else:  # pragma: no cover - a TE box
        spec.get_glm5_dsa_spec(None, cfg)


def test_config_without_dsa_fields_is_refused():
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="config lacks"):
        spec.get_glm5_dsa_spec(None, cfg)


@pytest.mark.slow
def test_tiny_model_with_mtp_thd_forward_backward(megatron_single_process, forbid_megatron_dsa_kernels):
    from megatron.core.packed_seq_params import PackedSeqParams

    card, cfg = tiny_config()  # 2 dense + 2 MoE layers + 1 MTP layer
    model = build(cfg, card, mtp=True)
    cu = torch.tensor([0, 5, 17, 30], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=13, max_seqlen_kv=13)
    tok = torch.randint(0, card["vocab_size"], (1, 30))
    pos = torch.cat([torch.arange(5), torch.arange(12), torch.arange(13)])[None]
    model.train()
    loss = model(tok, pos, None, labels=torch.randint(0, card["vocab_size"], (1, 30)), packed_seq_params=psp)
    assert loss.shape == (1, 30) and torch.isfinite(loss).all()
    loss.sum().backward()
    mtp_grads = [p.grad for n, p in model.named_parameters() if n.startswith("mtp.") and "core_attention" in n]
    assert mtp_grads and all(g is not None and torch.isfinite(g).all() for g in mtp_grads)
    assert len(forbid_megatron_dsa_kernels) == 5  # 4 decoder layers + the MTP layer, all ours


def test_deterministic_mode_reaches_sparse_mla(megatron_single_process, monkeypatch, no_deterministic_backend):
    """config.deterministic_mode (megatron's --deterministic-mode) selects sparse_mla's deterministic
    backward: a backend without one is refused, the reference (CPU) runs."""
    for det in (False, True):
        card, cfg = tiny_config(deterministic_mode=det)
        model = build(cfg, card)
        monkeypatch.setattr(GLM5DSAttention, "backend", no_deterministic_backend)
        B, S = 2, 24
        tok = torch.randint(0, card["vocab_size"], (B, S))
        labels = torch.randint(0, card["vocab_size"], (B, S))
        run = lambda: model(tok, torch.arange(S)[None].expand(B, S), None, labels=labels)  # noqa: E731
        if det:
            with pytest.raises(ValueError, match="has no deterministic mode"):
                run()
            monkeypatch.setattr(GLM5DSAttention, "backend", "reference")
        assert torch.isfinite(run()).all()


@pytest.mark.slow
def test_attention_validates_unless_the_guard_is_off(megatron_single_process, monkeypatch):
    """The spec's attention validates its indices while the guard is on (free: read with the
    guard's flag) and reads no device flag with GLM5_DSA_NONFINITE=off (no host sync per layer,
    capturable in a CUDA graph)."""
    import glm5_dsa_plugin.model.attention as attention
    from glm5_dsa_plugin.ops import configure, sparse_mla

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["validate"])
        return sparse_mla(*args, **kwargs)

    monkeypatch.setattr(attention, "sparse_mla", spy)
    card, cfg = tiny_config()
    model = build(cfg, card)
    B, S = 2, 24
    tok = torch.randint(0, card["vocab_size"], (B, S))
    try:
        for pol, want in (("fallback", True), ("off", False)):
            configure(policy=pol)
            seen.clear()
            model(tok, torch.arange(S)[None].expand(B, S), None)
            assert seen and all(v is want for v in seen), (pol, seen)
    finally:
        configure(policy="fallback")
