"""FlashMLA's FP8 sparse KV-cache format (DeepSeek-V3.2 / GLM-5.x), and its quantisation-aware forward.

One token's latent kv [576] = 512 NoPE channels | 64 RoPE channels is stored in 656 bytes:

    bytes [0, 512)    NoPE channels in float8_e4m3fn, tile i (channels 128 i .. 128 i + 127) divided by s_i
    bytes [512, 528)  s_0 .. s_3, float32 (little-endian), one scale per 128-channel tile
    bytes [528, 656)  the 64 RoPE channels, bfloat16, unchanged

``s_i = 2 ** ceil(log2(max(amax_i / 448, 1e-4)))`` (UE8M0: a power of two; amax over the tile of the
bf16 values), ``nope8 = e4m3(clamp(x / s_i, -448, 448))``. Dequantised: ``bf16(float(nope8) * s_i)``
and the RoPE channels as stored. The sparse attention of the rollout engine reads exactly those
dequantised values.

:func:`fake_quant_kv` gives the training forward the same values: forward = dequant(pack(kv)),
backward = identity (straight-through), so quantisation-aware training sees what the rollout saw.
"""

from __future__ import annotations

import torch

from .indexer.fp8_index import ue8m0_ceil

D_NOPE, D_ROPE, TILE = 512, 64, 128
N_TILES = D_NOPE // TILE
BYTES_PER_TOKEN = D_NOPE + 4 * N_TILES + 2 * D_ROPE  # 656
E4M3_MAX = 448.0
SCALE_FLOOR = 1e-4


def _check_latent(kv: torch.Tensor) -> None:
    if kv.shape[-1] != D_NOPE + D_ROPE:
        raise ValueError(f"fp8 kv cache: the latent's last dim must be {D_NOPE}+{D_ROPE} (kv_lora_rank 512, "
                         f"rope 64), got kv {tuple(kv.shape)}")


def tile_scales(nope: torch.Tensor) -> torch.Tensor:
    """nope [..., 512] -> UE8M0 scales [..., 4] fp32: 2 ** ceil(log2(max(amax / 448, 1e-4))), the
    ceiling taken exactly on the fp32 bits (:func:`glm5_dsa_plugin.ops.indexer.fp8_index.ue8m0_ceil`)."""
    amax = nope.float().reshape(*nope.shape[:-1], N_TILES, TILE).abs().amax(-1)
    return ue8m0_ceil((amax / E4M3_MAX).clamp_min(SCALE_FLOOR))


def pack(kv: torch.Tensor) -> torch.Tensor:
    """kv [..., 576] (bf16; other dtypes are rounded to bf16 first) -> cache bytes [..., 656] uint8."""
    _check_latent(kv)
    kv = kv.to(torch.bfloat16)
    lead = kv.shape[:-1]
    nope, rope = kv[..., :D_NOPE], kv[..., D_NOPE:]
    s = tile_scales(nope)  # [..., 4]
    q = (nope.float().reshape(*lead, N_TILES, TILE) / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    out = torch.empty(*lead, BYTES_PER_TOKEN, dtype=torch.uint8, device=kv.device)
    out[..., :D_NOPE] = q.to(torch.float8_e4m3fn).reshape(*lead, D_NOPE).view(torch.uint8)
    out[..., D_NOPE:D_NOPE + 4 * N_TILES] = s.contiguous().view(torch.uint8).reshape(*lead, 4 * N_TILES)
    out[..., D_NOPE + 4 * N_TILES:] = rope.contiguous().view(torch.uint8).reshape(*lead, 2 * D_ROPE)
    return out


def unpack(cache: torch.Tensor) -> torch.Tensor:
    """cache bytes [..., 656] uint8 -> kv [..., 576] bf16 as the sparse attention reads it."""
    if cache.dtype != torch.uint8 or cache.shape[-1] != BYTES_PER_TOKEN:
        raise ValueError(f"fp8 kv cache: expected uint8 [..., {BYTES_PER_TOKEN}], got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    lead = cache.shape[:-1]
    c = cache.contiguous()
    nope8 = c[..., :D_NOPE].contiguous().view(torch.float8_e4m3fn).reshape(*lead, N_TILES, TILE)
    s = c[..., D_NOPE:D_NOPE + 4 * N_TILES].contiguous().view(torch.float32)  # [..., 4]
    rope = c[..., D_NOPE + 4 * N_TILES:].contiguous().view(torch.bfloat16)  # [..., 64]
    nope = (nope8.float() * s[..., None]).to(torch.bfloat16).reshape(*lead, D_NOPE)
    return torch.cat([nope, rope], dim=-1)


def quant_dequant(kv: torch.Tensor) -> torch.Tensor:
    """kv [..., 576] -> the values the FP8 cache returns for it, in kv's dtype (no byte buffer)."""
    _check_latent(kv)
    x = kv.to(torch.bfloat16)
    nope = x[..., :D_NOPE]
    s = tile_scales(nope)[..., None]
    t = nope.float().reshape(*x.shape[:-1], N_TILES, TILE)
    t = ((t / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s).to(torch.bfloat16)
    return torch.cat([t.reshape(*x.shape[:-1], D_NOPE), x[..., D_NOPE:]], dim=-1).to(kv.dtype)


class _FakeQuantKV(torch.autograd.Function):
    """Forward: :func:`quant_dequant`; backward: the incoming gradient unchanged (straight-through)."""

    @staticmethod
    def forward(ctx, kv):
        return quant_dequant(kv)

    @staticmethod
    def backward(ctx, grad):
        return grad


def fake_quant_kv(kv: torch.Tensor) -> torch.Tensor:
    """Differentiable FP8-KV quantisation for training: values as FlashMLA's FP8 cache stores them,
    gradient straight through to ``kv`` [..., 576]."""
    return _FakeQuantKV.apply(kv)


__all__ = ["pack", "unpack", "quant_dequant", "fake_quant_kv", "tile_scales", "BYTES_PER_TOKEN"]
