"""The absorbed query built in place (``model.absorbed_mla``) against megatron-core's own
``AbsorbedMLASelfAttention`` on the same weights: q, kv and q_compressed and every gradient, for
bshd and packed THD (padded sequences), fp32 on CPU."""

import pytest
import torch

from glm5_dsa_plugin.model import absorbed_mla
from tests.megatron_cpu import megatron_single_process  # noqa: F401  (fixture)


def _rope(t):  # a RoPE-like map: linear, position-dependent, mixing channels within the rope part
    pos = torch.arange(t.shape[0], dtype=t.dtype).view(-1, *([1] * (t.dim() - 1)))
    return t * torch.cos(pos) + t.flip(-1) * torch.sin(pos)


@pytest.mark.parametrize("lead", [(7,), (5, 2)])
def test_absorbed_query_equals_einsum_and_cat(lead):
    g = torch.Generator().manual_seed(0)
    n, d_nope, d_rope, latent = 3, 6, 4, 8
    q = torch.randn(*lead, n, d_nope + d_rope, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(n, d_nope + 5, latent, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(*lead, n, latent + d_rope, generator=g, dtype=torch.float64)

    ref = torch.cat([torch.einsum("...nd,ndk->...nk", q[..., :d_nope], w[:, :d_nope]), _rope(q[..., d_nope:])], -1)
    dq_ref, dw_ref = torch.autograd.grad(ref, (q, w), grad)
    out = absorbed_mla.absorbed_query(q, w[:, :d_nope], _rope)  # k_up: a strided slice, as megatron-core's
    dq, dw = torch.autograd.grad(out, (q, w), grad)
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dq, dq_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-12, atol=1e-12)
    assert dw[:, d_nope:].abs().max() == 0


def _config():
    from glm5_dsa_plugin.checkpoints import cards

    return cards.card_to_transformer_config(cards.load_card("tiny"), mtp_num_layers=None)


def _qkv(module, hidden, psp):
    q, kv, qc = module.get_query_key_value_tensors(hidden, packed_seq_params=psp)
    g = torch.Generator().manual_seed(3)
    loss = sum((t * torch.randn(t.shape, generator=g).to(t.device)).sum() for t in (q, kv, qc))
    params = [p for _, p in sorted(module.named_parameters()) if p.requires_grad]
    grads = torch.autograd.grad(loss, [hidden] + params, allow_unused=True)
    return (q, kv, qc), grads


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_glm5_absorbed_mla_equals_megatron_cores(megatron_single_process, monkeypatch, fmt):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention
    from megatron.core.transformer.spec_utils import build_module

    from glm5_dsa_plugin.megatron.spec import dsa_attention_spec

    cfg = _config()
    spec = dsa_attention_spec(cfg)
    assert spec.module is absorbed_mla.GLM5AbsorbedMLA  # what the spec builds
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # megatron-core puts RoPE's table on the GPU if any
    ours = build_module(spec, config=cfg, layer_number=1).to(dev)
    spec.module = AbsorbedMLASelfAttention
    ref = build_module(spec, config=cfg, layer_number=1).to(dev)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.3)
    ref.load_state_dict(ours.state_dict())
    calls = []
    real = absorbed_mla.absorbed_query
    monkeypatch.setattr(absorbed_mla, "absorbed_query", lambda *a: calls.append(1) or real(*a))

    h = cfg.hidden_size
    psp = None
    if fmt == "thd":
        cu, cu_pad = torch.tensor([0, 5, 12, 20], dtype=torch.int32), torch.tensor([0, 6, 14, 24], dtype=torch.int32)
        cu, cu_pad = cu.to(dev), cu_pad.to(dev)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                              cu_seqlens_kv_padded=cu_pad, max_seqlen_q=10, max_seqlen_kv=10)
        hidden = torch.randn(24, 1, h, generator=torch.Generator().manual_seed(1))
    else:
        hidden = torch.randn(12, 2, h, generator=torch.Generator().manual_seed(1))
    hidden = hidden.to(dev)
    got, got_g = _qkv(ours, hidden.clone().requires_grad_(True), psp)
    want, want_g = _qkv(ref, hidden.clone().requires_grad_(True), psp)
    assert calls, "GLM5AbsorbedMLA took megatron-core's path"
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(got_g) == len(want_g)
    for a, b in zip(got_g, want_g):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_glm5_absorbed_mla_keeps_megatron_cores_path_where_its_own_does_not_apply(megatron_single_process,
                                                                                 monkeypatch):
    """recompute_up_proj (and inference, RoPE fusion, FP8) run megatron-core's method."""
    from megatron.core.transformer.spec_utils import build_module

    from glm5_dsa_plugin.megatron.spec import dsa_attention_spec

    cfg = _config()
    mla = build_module(dsa_attention_spec(cfg), config=cfg, layer_number=1)
    monkeypatch.setattr(absorbed_mla, "absorbed_query", lambda *a: pytest.fail("own path taken"))
    mla.recompute_up_proj = True
    assert not mla._own_path(None, None)
    mla.recompute_up_proj = False
    assert mla._own_path(None, None)
    assert not mla._own_path(object(), None)
