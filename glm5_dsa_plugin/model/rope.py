"""RoPE of the GLM-5 lightning indexer (the HF layout: the rotated part is the *first* ``rope_dim``
channels of the indexer q / k).

Two rotation conventions (``apply_rope_first``): interleaved (GLM-5.x: config
``indexer_rope_interleave: true``, megatron-core ``dsa_indexer_rope_interleaved=True``) rotates the
channel pairs (0, 1), (2, 3), ...; half split (DeepSeek-V3.2) rotates the pairs (i, i + rope_dim / 2).
"""

from __future__ import annotations

import torch

__all__ = ["rope_cos_sin", "apply_rope_first"]


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float, dtype=torch.float32):
    """positions [T] int -> (cos, sin) [T, rope_dim] in HF's ``cat(freqs, freqs)`` layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device) / rope_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
                     ) -> torch.Tensor:
    """RoPE on the first ``r = cos.shape[-1]`` channels of x [T, ..., D]; cos/sin [T, r] (``rope_cos_sin``).

    ``interleaved=False``: channel i pairs with i + r/2 (half split). ``interleaved=True``: channel
    2j pairs with 2j + 1, rotated by frequency j; the rotated channels come out de-interleaved
    (the j-th pair's two outputs at j and j + r/2), as HF and megatron-core lay them out. Every
    score is a dot product of a rotated q with a rotated k, so that output order is invisible
    as long as q and k use the same convention."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    if interleaved:
        x_rot = torch.cat([x_rot[..., 0::2], x_rot[..., 1::2]], dim=-1)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    c, s = cos.view(shape), sin.view(shape)
    half = r // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * c + rotated * s, x_pass], dim=-1)
