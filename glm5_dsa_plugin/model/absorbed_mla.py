"""megatron-core's absorbed MLA with the query absorbed in place.

megatron-core 0.19.2's ``AbsorbedMLASelfAttention`` forms the sparse attention's query
``[q_nope @ W_UK | rope(q_pe)]`` [tokens, n, kv_lora_rank + rope] as an einsum (its [n, tokens, 512]
result copied into [tokens, n, 512] by ``.contiguous()``), then a ``torch.cat``; its backward splits
the gradient and copies it back through the einsum's permutes. At GLM-5's widths (n 64, 576
channels) the query's forward + backward takes 22.7 ms at 64K tokens on an H100 that way, 10.2 ms
in place (docs/kernels.md).

:class:`GLM5AbsorbedMLA` computes the same query with :func:`absorbed_query`: one strided batched GEMM
writes ``q_nope @ W_UK`` straight into the [tokens, n, 576] buffer, RoPE's output goes into its
tail, and the backward writes dq's two parts into one buffer (RoPE's gradient through megatron-core's
own RoPE function, recomputed). Same values bit for bit, same parameters, same module interface.

Its own path covers training and evaluation with megatron-core's unfused plain RoPE (GLM-5.x's;
the DSA config refuses YaRN) and a q LoRA rank; anything else (inference contexts, ``apply_rope_fusion``,
``recompute_up_proj``, FP8 / FP4) runs megatron-core's method unchanged.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron.core.models.common.embeddings import apply_rotary_pos_emb
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention
from megatron.core.utils import get_pg_size

__all__ = ["GLM5AbsorbedMLA", "absorbed_query"]


class _AbsorbedQuery(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_up, rope: Callable[[torch.Tensor], torch.Tensor]):
        d_nope, latent = k_up.shape[1], k_up.shape[2]
        lead, n = q.shape[:-2], q.shape[-2]
        q3 = q.reshape(-1, n, q.shape[-1])  # a view: q is the up projection's [..., n, d_nope + rope]
        with torch.no_grad():
            q_pe = rope(q[..., d_nope:])
        out = q.new_empty(q3.shape[0], n, latent + q_pe.shape[-1])
        # [n, tokens, d_nope] @ [n, d_nope, latent] into out[..., :latent] seen as [n, tokens, latent]
        torch.bmm(q3[..., :d_nope].transpose(0, 1), k_up, out=out[..., :latent].transpose(0, 1))
        out[..., latent:].copy_(q_pe.reshape(out.shape[0], n, -1))
        ctx.save_for_backward(q, k_up)
        ctx.rope = rope
        return out.view(*lead, n, out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        q, k_up = ctx.saved_tensors
        d_nope, latent = k_up.shape[1], k_up.shape[2]
        n = q.shape[-2]
        q3 = q.reshape(-1, n, q.shape[-1])
        g = grad.reshape(-1, n, grad.shape[-1])
        g_latent = g[..., :latent].transpose(0, 1)  # [n, tokens, latent]
        dq = torch.empty_like(q3)
        torch.bmm(g_latent, k_up.transpose(1, 2), out=dq[..., :d_nope].transpose(0, 1))
        dk_up = torch.bmm(q3[..., :d_nope].transpose(0, 1).transpose(1, 2), g_latent)
        with torch.enable_grad():  # RoPE's own backward (it is linear in q_pe; recomputing costs one pass)
            q_pe = q[..., d_nope:].detach().requires_grad_(True)
            rotated = ctx.rope(q_pe)
        (dq_pe,) = torch.autograd.grad(rotated, q_pe, grad[..., latent:])
        dq[..., d_nope:].copy_(dq_pe.reshape(dq.shape[0], n, -1))
        return dq.view(q.shape), dk_up, None


def absorbed_query(q: torch.Tensor, k_up: torch.Tensor,
                   rope: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The absorbed MLA query ``[q[..., :d_nope] @ k_up | rope(q[..., d_nope:])]``.

    Args:
        q: [..., n, d_nope + d_rope], the q up projection's output viewed per head (contiguous).
        k_up: [n, d_nope, latent], the key half of the kv up projection per head (any strides).
        rope: maps q's rope part [..., n, d_rope] to its rotated values of the same shape; called
            without grad in the forward and again in the backward for its gradient.

    Returns:
        [..., n, latent + d_rope], contiguous: the same values as megatron-core's einsum + cat.
    """
    return _AbsorbedQuery.apply(q, k_up, rope)


class GLM5AbsorbedMLA(AbsorbedMLASelfAttention):
    """``AbsorbedMLASelfAttention`` whose query is built by :func:`absorbed_query` (module
    docstring). Same constructor, parameters, forward and outputs: ``get_query_key_value_tensors``
    returns (q [tokens, n, kv_lora_rank + rope], kv [tokens, 1, kv_lora_rank + rope], q_compressed),
    with tokens = (s, b) for bshd and t for packed THD."""

    def _own_path(self, inference_context, inference_params) -> bool:
        c = self.config
        return (inference_context is None and inference_params is None and not c.apply_rope_fusion
                and not self.recompute_up_proj and c.q_lora_rank is not None and not c.fp8 and not c.fp4
                and c.rope_type == "rope")

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, packed_seq_params=None,
                                    inference_context=None, *, inference_params=None):
        if not self._own_path(inference_context, inference_params):
            return super().get_query_key_value_tensors(hidden_states, key_value_states, packed_seq_params,
                                                       inference_context, inference_params=inference_params)
        c = self.config
        if hidden_states.ndim != 3:
            raise ValueError(f"hidden_states should be 3D, [s, b, h], got {hidden_states.ndim}D")
        if packed_seq_params is not None and packed_seq_params.local_cp_size is not None:
            raise ValueError("dynamic context parallel (packed_seq_params.local_cp_size) is not supported with MLA")
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states, c, packed_seq_params)
        freqs = self.rotary_pos_emb(rotary_seq_len, packed_seq=packed)
        cu_q = cu_kv = None
        if packed:
            p = packed_seq_params
            cu_q = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
            cu_kv = p.cu_seqlens_kv_padded if p.cu_seqlens_kv_padded is not None else p.cu_seqlens_kv

        tp = get_pg_size(self.tp_group)
        # down projections, as megatron-core shards them: a ColumnParallelLinear output is gathered
        # to its full width (and scattered back to the sequence shard under sequence parallel)
        q_compressed, _ = self.linear_q_down_proj(hidden_states)
        if q_compressed.size(-1) != c.q_lora_rank:
            q_compressed = gather_from_tensor_model_parallel_region(q_compressed)
            if c.sequence_parallel:
                q_compressed = scatter_to_sequence_parallel_region(q_compressed)
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        split = [c.kv_lora_rank, c.qk_pos_emb_head_dim]
        if kv_combined.size(-1) != sum(split):
            kv_combined = gather_from_tensor_model_parallel_region(kv_combined)
            kv_compressed, k_pos_emb = torch.split(kv_combined, split, dim=-1)
            if c.sequence_parallel:
                kv_compressed = scatter_to_sequence_parallel_region(kv_compressed)
        else:
            kv_compressed, k_pos_emb = torch.split(kv_combined, split, dim=-1)
            if tp > 1 and c.sequence_parallel:
                k_pos_emb = gather_from_sequence_parallel_region(k_pos_emb, group=self.tp_group)
        if packed_seq_params is not None:  # [t, 1, ...] -> [t, ...]
            for name, t in (("q_compressed", q_compressed), ("kv_compressed", kv_compressed), ("k_pos_emb", k_pos_emb)):
                if t.ndim != 3 or t.size(1) != 1:
                    raise ValueError(f"packed input: {name} must be [t, 1, d], got {tuple(t.shape)}")
            q_compressed, kv_compressed, k_pos_emb = q_compressed.squeeze(1), kv_compressed.squeeze(1), k_pos_emb.squeeze(1)

        q_compressed = self.q_layernorm(q_compressed)
        kv_compressed = self.kv_layernorm(kv_compressed)
        if tp > 1 and c.sequence_parallel:  # the latent is not up-projected: every rank needs all rows
            kv_compressed = gather_from_sequence_parallel_region(kv_compressed, group=self.tp_group)

        q, _ = self.linear_q_up_proj(q_compressed)
        q = q.view(*q.shape[:-1], self.num_attention_heads_per_partition, self.q_head_dim)
        if packed_seq_params is None or c.context_parallel_size == 1:
            freqs = freqs[: q.shape[0]]  # megatron-core's rule: the full table only for packed CP
        cp_group = self.pg_collection.cp

        def rope(t, cu):
            return apply_rotary_pos_emb(t, freqs, config=c, cu_seqlens=cu, cp_group=cp_group,
                                        mla_rotary_interleaved=True)

        k_up, _ = self._get_kv_up_weights()
        q_absorbed = absorbed_query(q, k_up, lambda t: rope(t, cu_q))
        kv = torch.cat([kv_compressed.unsqueeze(-2), rope(k_pos_emb.unsqueeze(-2), cu_kv)], dim=-1)
        return q_absorbed, kv, q_compressed
