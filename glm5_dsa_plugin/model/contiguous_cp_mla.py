"""megatron-core's absorbed MLA for slime's contiguous allgather-CP layout (``--allgather-cp``).

megatron-core 0.19.2's ``AbsorbedMLASelfAttention`` rotates q and the rope part of the latent key
assuming its own zigzag CP split: for bshd ``RotaryEmbedding`` keeps the frequencies of chunks
``r`` and ``2 * cp - 1 - r`` (``get_pos_emb_on_this_cp_rank``), for packed THD
``apply_rotary_pos_emb`` cuts every sequence into ``2 * cp`` chunks. Under the contiguous layout
(:mod:`glm5_dsa_plugin.model.cp_layout`) rank ``r`` holds other rows, so those positions would be
wrong for every rank but the CP = 1 case.

:class:`ContiguousCPAbsorbedMLA` changes only where the RoPE frequencies come from. With CP > 1
its ``get_query_key_value_tensors`` computes the position of each local row inside its own
sequence (bshd: ``r * s_local + i``; THD: the row's offset in its sequence of the global
``cu_seqlens``, sequences cut across ranks included) and runs megatron-core's own method on its
non-CP path: the rotary module hands out the frequencies of exactly those rows, and packed input
goes through the ``[t, 1, ...]`` path (the same projections and norms; cu_seqlens=None, so no
per-sequence CP split), its outputs squeezed back to megatron-core's packed shapes. Projections,
norms, absorption, the core attention call and the parameters are megatron-core's.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

from megatron.core.utils import get_pg_rank, get_pg_size

from . import cp_layout
from .absorbed_mla import GLM5AbsorbedMLA

__all__ = ["ContiguousCPAbsorbedMLA"]


class _RowPositionsRotary(torch.nn.Module):
    """megatron-core's rotary module (``RotaryEmbedding`` / ``YarnRotaryEmbedding``, kept as
    ``inner``) answering with the frequencies of given rows: inside :meth:`at` a call returns
    ``inner``'s embedding [n, 1, 1, rope_dim] (yarn: with its mscale) at ``positions`` [n], with
    no CP slicing; outside it a call is ``inner``'s own (CP = 1)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self._positions: Optional[torch.Tensor] = None

    @contextmanager
    def at(self, positions: torch.Tensor):
        """positions: int64 [n] (CPU), the RoPE position of each row q / k will hold."""
        self._positions = positions
        try:
            yield
        finally:
            self._positions = None

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def get_cached_cos_sin(self, *args, **kwargs):
        raise RuntimeError("ContiguousCPAbsorbedMLA: apply_rope_fusion is not supported (the fused MLA RoPE kernel "
                           "computes zigzag CP positions itself)")

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        pos = self._positions
        if pos is None:
            return self.inner(max_seq_len, offset=offset, packed_seq=packed_seq, cp_group=cp_group)
        if offset:
            raise ValueError(f"ContiguousCPAbsorbedMLA: RoPE offset {offset} is not supported")
        emb = self.inner.get_emb(int(pos.max()) + 1 if pos.numel() else 1)  # [L, 1, 1, d]; yarn: (emb, mscale)
        if isinstance(emb, tuple):
            return emb[0].index_select(0, pos.to(emb[0].device)), emb[1]
        return emb.index_select(0, pos.to(emb.device))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.pop(f"{prefix}inv_freq", None)  # as megatron-core's RotaryEmbedding does for this key
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class ContiguousCPAbsorbedMLA(GLM5AbsorbedMLA):
    """:class:`~glm5_dsa_plugin.model.absorbed_mla.GLM5AbsorbedMLA` whose RoPE rotates q / k by the positions of slime's contiguous
    allgather-CP layout (module docstring). Same constructor, forward, submodules and parameter
    names; with CP = 1 it is its parent unchanged.

    Inputs as megatron-core's: bshd ``hidden_states`` [s_local (/ tp with sequence parallel), b, h]
    where rank ``r`` holds positions ``[r * s_local, (r + 1) * s_local)`` of every row; packed THD
    [t_local (/ tp), 1, h] where rank ``r`` holds rows ``[r * t_local, (r + 1) * t_local)`` of the
    global packed stream that ``packed_seq_params.cu_seqlens_q`` (``_padded`` when given)
    describes. ``apply_rope_fusion`` is refused (the fused kernel assumes zigzag)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.apply_rope_fusion:
            raise ValueError("ContiguousCPAbsorbedMLA (slime's --allgather-cp layout): apply_rope_fusion=True is not "
                             "supported; megatron-core's fused MLA RoPE kernel assumes the zigzag CP layout. Set "
                             "apply_rope_fusion=False (--no-rope-fusion)")
        self.rotary_pos_emb = _RowPositionsRotary(self.rotary_pos_emb)

    def _row_positions(self, hidden_states: torch.Tensor, packed_seq_params) -> torch.Tensor:
        """RoPE position of each row of this rank's q / k: int64 [s_local] (bshd; the same for every
        batch row) or [t_local] (THD), on the CPU."""
        cp_group = self.pg_collection.cp
        cp, rank = get_pg_size(cp_group), get_pg_rank(cp_group)
        rows = hidden_states.shape[0]
        if self.config.sequence_parallel and get_pg_size(self.tp_group) > 1:
            rows *= get_pg_size(self.tp_group)  # q / k hold every row of the CP shard
        if packed_seq_params is None:
            return cp_layout.positions_in_sequence("contiguous", cp, rank, rows, batch=1)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"ContiguousCPAbsorbedMLA: packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}, "
                             f"expected 'thd' (or no packed_seq_params for bshd)")
        if hidden_states.shape[1] != 1:
            raise ValueError(f"ContiguousCPAbsorbedMLA: packed THD hidden_states must be [t, 1, h], got "
                             f"{tuple(hidden_states.shape)}")
        if packed_seq_params.cu_seqlens_kv is not None and not torch.equal(
                packed_seq_params.cu_seqlens_kv.cpu(), packed_seq_params.cu_seqlens_q.cpu()):
            raise ValueError("ContiguousCPAbsorbedMLA: self-attention needs cu_seqlens_kv == cu_seqlens_q, got "
                             f"{packed_seq_params.cu_seqlens_kv.tolist()} and {packed_seq_params.cu_seqlens_q.tolist()}")
        return cp_layout.positions_in_sequence("contiguous", cp, rank, rows, cu_seqlens=packed_seq_params.cu_seqlens_q,
                                         cu_seqlens_padded=packed_seq_params.cu_seqlens_q_padded)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, packed_seq_params=None,
                                    inference_context=None, *, inference_params=None):
        """megatron-core's method with q / k rotated by the contiguous layout's positions (CP > 1)."""
        if get_pg_size(self.pg_collection.cp) == 1:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, packed_seq_params,
                                                       inference_context, inference_params=inference_params)
        if inference_context is not None or inference_params is not None:
            raise ValueError("ContiguousCPAbsorbedMLA: inference is not supported")
        if packed_seq_params is not None and packed_seq_params.local_cp_size is not None:
            raise ValueError("ContiguousCPAbsorbedMLA: dynamic context parallel (packed_seq_params.local_cp_size) is "
                             "not supported")
        positions = self._row_positions(hidden_states, packed_seq_params)
        with self.rotary_pos_emb.at(positions):
            # packed THD runs megatron-core's [t, 1, ...] path: per-row frequencies, no per-sequence CP split
            q, kv, q_compressed = super().get_query_key_value_tensors(hidden_states, key_value_states, None)
        if packed_seq_params is not None:  # megatron-core's packed shapes: [t, n, d], [t, 1, d], [t, q_lora_rank]
            q, kv, q_compressed = q.squeeze(1), kv.squeeze(1), q_compressed.squeeze(1)
        return q, kv, q_compressed
