"""FlashMLA FP8 KV-cache packing (656 bytes per token) and the straight-through fake quantisation."""

import pytest
import torch

from glm5_dsa_plugin.ops import fp8_kv


def _latent(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 576, generator=g) * torch.rand(n, 1, generator=g) * 4).to(torch.bfloat16)


def test_a_token_takes_656_bytes_in_the_documented_order():
    kv = torch.zeros(1, 576, dtype=torch.bfloat16)
    kv[0, 0] = 224.0  # tile 0: amax 224 -> 224 / 448 = 0.5 -> scale 0.5, stored e4m3 448
    kv[0, 130] = -3.0  # tile 1: 3 / 448 = 0.0067 -> scale 2**-7, stored -384
    kv[0, 512], kv[0, 575] = 1.5, -2.25  # RoPE channels, bf16 as is
    c = fp8_kv.pack(kv)
    assert fp8_kv.BYTES_PER_TOKEN == 656 and c.shape == (1, 656) and c.dtype == torch.uint8
    nope = c[0, :512].view(torch.float8_e4m3fn).float()
    assert nope[0].item() == 448.0 and nope[130].item() == -384.0 and nope[1].item() == 0.0
    scales = c[0, 512:528].view(torch.float32).tolist()
    assert scales == [0.5, 2.0 ** -7, 2.0 ** -13, 2.0 ** -13]  # empty tiles: floor 1e-4 -> 2**-13
    rope = c[0, 528:].view(torch.bfloat16)
    assert rope[0].item() == 1.5 and rope[63].item() == -2.25


def test_round_trip_recovers_representable_values_exactly_and_others_within_e4m3_precision():
    kv = _latent(64)
    back = fp8_kv.unpack(fp8_kv.pack(kv))
    assert back.shape == kv.shape and back.dtype == torch.bfloat16
    assert torch.equal(back[:, 512:], kv[:, 512:])  # RoPE untouched
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 above the tile's subnormal range
    big = kv[:, :512].float().abs() > 0.1
    rel = ((back[:, :512].float() - kv[:, :512].float()).abs() / kv[:, :512].float().abs())[big]
    assert rel.max() <= 2.0 ** -4 + 1e-3
    assert not torch.equal(back, kv)
    # values already on the grid come back bit for bit
    assert torch.equal(fp8_kv.unpack(fp8_kv.pack(back)), back)


def test_quant_dequant_equals_unpack_of_pack_in_any_leading_shape():
    kv = _latent(24, seed=1).view(4, 6, 1, 576)
    assert torch.equal(fp8_kv.quant_dequant(kv), fp8_kv.unpack(fp8_kv.pack(kv)))
    assert fp8_kv.pack(kv).shape == (4, 6, 1, 656)


def test_straight_through_gradient_and_quantised_forward():
    kv = _latent(8, seed=2).float().requires_grad_()
    out = fp8_kv.fake_quant_kv(kv)
    assert torch.equal(out.detach(), fp8_kv.quant_dequant(kv.detach()))
    g = torch.randn_like(out)
    out.backward(g)
    assert torch.equal(kv.grad, g)


def test_refuses_a_latent_of_another_width():
    with pytest.raises(ValueError, match=r"512\+64.*got kv \(3, 544\)"):
        fp8_kv.pack(torch.zeros(3, 544))
    with pytest.raises(ValueError, match=r"expected uint8 \[..., 656\]"):
        fp8_kv.unpack(torch.zeros(3, 600, dtype=torch.uint8))
