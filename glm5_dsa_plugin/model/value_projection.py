"""The absorbed MLA's value up-projection, per head, with every tensor in token-major layout.

``y[t, h] = W[h] @ o[t, h]`` for the attention's latent output o [T, H, C] (C = kv_lora_rank) and
``W`` [H, D, C] (D = v_head_dim). ``torch.einsum`` runs this as a head-batched matmul whose results
are head-major: y and, in the backward, d(o) come out as permuted views, and the consumers
(``reshape`` of y, the sparse-MLA backward's ``grad_out.contiguous()``) copy them: one extra
[T, H, C] tensor alive in the backward (4 GiB at 64K tokens, 64 heads). Here the batched matmuls
write straight into token-major y [T, H, D] and d(o) [T, H, C] through strided views (a BLAS
leading dimension of H * D or H * C), so neither is copied. Values equal the einsum's.
"""

from __future__ import annotations

import torch

__all__ = ["value_up_projection"]


class _ValueUpProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, w):
        T, H, C = o.shape
        y = o.new_empty(T, H, w.shape[1])
        torch.bmm(o.transpose(0, 1), w.transpose(1, 2), out=y.transpose(0, 1))
        ctx.save_for_backward(o, w)
        return y

    @staticmethod
    def backward(ctx, dy):
        o, w = ctx.saved_tensors
        dy_h = dy.transpose(0, 1)  # [H, T, D] view
        do = dw = None
        if ctx.needs_input_grad[0]:
            do = torch.empty_like(o, memory_format=torch.contiguous_format)
            torch.bmm(dy_h, w, out=do.transpose(0, 1))
        if ctx.needs_input_grad[1]:
            dw = torch.bmm(dy_h.transpose(1, 2), o.transpose(0, 1))  # [H, D, C]
        return do, dw


def value_up_projection(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """o [T, H, C], w [H, D, C] (same dtype) -> y [T, H, D] contiguous; d(o) comes back
    contiguous [T, H, C], d(w) [H, D, C]."""
    if o.dim() != 3 or w.dim() != 3 or o.shape[1] != w.shape[0] or o.shape[2] != w.shape[2]:
        raise ValueError(f"value_up_projection: o [T, H, C] and w [H, D, C] expected, got o {tuple(o.shape)} and "
                         f"w {tuple(w.shape)}")
    if o.dtype != w.dtype:
        raise ValueError(f"value_up_projection: o is {o.dtype}, w is {w.dtype}")
    return _ValueUpProjection.apply(o, w)
