"""GLM-5 DSA core attention and indexer modules for megatron-core 0.19.2.

``GLM5DSAttention`` is a drop-in for megatron-core's ``DSAttention`` (same constructor keywords,
same forward signature, same parameter names) whose indexer is :mod:`glm5_dsa_plugin.model.indexer`
and whose attention is :func:`glm5_dsa_plugin.ops.sparse_mla`. It never calls a kernel from
``megatron.core.transformer.experimental_attention_variant.ops``.

Layouts: Megatron hands us sbhd (``[s, b, h, d]``) or packed THD (``[t, h, d]`` / ``[t, 1, h, d]``
with ``PackedSeqParams``). Internally every batch is flattened to one packed sequence set, so
bshd is THD with ``cu_seqlens = [0, s, 2s, ...]``; indices are positions in that packed kv.

Context parallel (allgather CP, :mod:`glm5_dsa_plugin.model.cp_layout`): each rank holds ``T / cp``
rows (megatron-core's zigzag layout, or slime's contiguous one with ``cp_layout="contiguous"``);
queries stay local, the latent kv and the indexer keys are all-gathered into global packed order,
so indices are rows of the gathered kv; ``cu_seqlens`` describe the global packed sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_size

from .cp_layout import check_layout, indexer_loss_tracker_groups, shard
from . import indexer
from . import indexer_loss
from . import rope
from . import visibility
from . import indexer_replay as replay_mod
from . import rollout_numerics
from .dsa_fields import check_dsa_config, dsa_geometry
from . import micro_batch
from .shared_topk import SharedTopk, StaleMicroBatchStateError
from .switches import apply_guard_policy, resolve_switches
from ..ops import SlotProbsGrad, guard_policy, sparse_mla
from ..ops.fp8_kv import fake_quant_kv
from .value_projection import value_up_projection

__all__ = ["GLM5DSAIndexerSubmodules", "GLM5DSAttentionSubmodules", "GLM5DSAIndexer", "GLM5DSAttention"]


@dataclass
class GLM5DSAIndexerSubmodules:
    """Same field names as megatron-core's ``DSAIndexerSubmodules`` (checkpoint compatibility)."""

    linear_wq_b: Union[ModuleSpec, type] = None
    linear_wk: Union[ModuleSpec, type] = None
    k_norm: Union[ModuleSpec, type] = None
    linear_weights_proj: Union[ModuleSpec, type] = None


@dataclass
class GLM5DSAttentionSubmodules:
    indexer: Union[ModuleSpec, type] = None


class GLM5DSAIndexer(MegatronModule):
    """Lightning indexer: wq_b(qr), LayerNorm(wk(x)), weights_proj(x); RoPE on the first
    ``qk_pos_emb_head_dim`` channels (HF layout), interleaved or half split as
    ``dsa_indexer_rope_interleaved`` says (GLM-5.x: interleaved); deterministic top-k."""

    def __init__(self, config: TransformerConfig, submodules: GLM5DSAIndexerSubmodules,
                 pg_collection: Optional[ProcessGroupCollection] = None) -> None:
        super().__init__(config=config)
        c = self.config
        check_dsa_config(c)
        self.geometry = g = dsa_geometry(c)
        self.n_heads, self.head_dim, self.topk = g.indexer_heads, g.indexer_head_dim, g.topk
        self.rope_dim = c.qk_pos_emb_head_dim
        self.rope_interleaved = g.rope_interleaved
        self.precision = rollout_numerics.indexer_precision(c)  # "bf16" or "fp8" (the rollout's scoring)
        q_lora_rank = c.q_lora_rank if c.q_lora_rank is not None else c.hidden_size
        common = dict(config=c, init_method=c.init_method, bias=False, skip_bias_add=False,
                      skip_weight_param_allocation=False, parallel_mode="duplicated")
        self.linear_wq_b = build_module(submodules.linear_wq_b, q_lora_rank, self.n_heads * self.head_dim, **common)
        self.linear_wk = build_module(submodules.linear_wk, c.hidden_size, self.head_dim, **common)
        eps = c.dsa_indexer_k_norm_epsilon if c.dsa_indexer_k_norm_epsilon is not None else c.layernorm_epsilon
        self.k_norm = torch.nn.LayerNorm(self.head_dim, eps=eps, dtype=c.params_dtype) if submodules.k_norm is None else build_module(
            submodules.k_norm, config=_layernorm_config(c), hidden_size=self.head_dim, eps=eps)
        self.linear_weights_proj = build_module(submodules.linear_weights_proj, c.hidden_size, self.n_heads, **common)
        # duplicated across TP ranks: average their gradients there (as megatron-core does)
        for p in self.parameters():
            setattr(p, "average_gradients_across_tp_domain", True)

    def qkw(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor):
        """x [T, hidden], qr [T, q_lora_rank], positions [T] -> q [T, Hi, Di], k [T, Di], w [T, Hi]."""
        T = x.shape[0]
        q, _ = self.linear_wq_b(qr)
        k, _ = self.linear_wk(x)
        k = self._k_norm(k)
        w, _ = self.linear_weights_proj(x)
        cos, sin = rope.rope_cos_sin(positions, self.rope_dim, self.config.rotary_base, dtype=q.dtype)
        q = rope.apply_rope_first(q.view(T, self.n_heads, self.head_dim), cos, sin, self.rope_interleaved)
        k = rope.apply_rope_first(k.view(T, 1, self.head_dim), cos, sin, self.rope_interleaved)[:, 0]
        return q, k, w * self.n_heads**-0.5

    def select_topk(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, vis: visibility.Visibility,
                    key_order: bool = False) -> torch.Tensor:
        """Top-k indices [T, topk] of the indexer scores: bf16 / fp32 (:func:`indexer.select_topk`), or with
        ``dsa_indexer_precision="fp8"`` the FP8 scores of the rollout engines (Hadamard, e4m3, UE8M0
        scales); both highest first, ties to the lower key index, -1 last, or with ``key_order`` each
        row's same entries in key order."""
        return indexer.select_topk(q, k, w, self.topk, vis, check=False, precision=self.precision,
                                   key_order=key_order)

    def _k_norm(self, k: torch.Tensor) -> torch.Tensor:
        """LayerNorm of the indexer key; on fp32 inputs (result cast back) with ``dsa_indexer_k_norm_fp32``."""
        if not self.config.dsa_indexer_k_norm_fp32:
            return self.k_norm(k)
        n = self.k_norm
        if isinstance(n, torch.nn.LayerNorm):  # its parameters may be bf16: run the whole norm in fp32
            w = n.weight.float() if n.weight is not None else None
            b = n.bias.float() if n.bias is not None else None
            return torch.nn.functional.layer_norm(k.float(), n.normalized_shape, w, b, n.eps).to(k.dtype)
        return n(k.float()).to(k.dtype)


def _layernorm_config(config):
    import copy

    c = copy.copy(config)
    c.normalization = "LayerNorm"
    return c


class GLM5DSAttention(MegatronModule):
    """Sparse attention over the indexer's top-k, through ``glm5_dsa_plugin.ops.sparse_mla``.

    Works under ``AbsorbedMLASelfAttention``: query [s, b, H, kv_lora_rank + rope],
    key [s, b, 1, kv_lora_rank + rope], value None, ``up_v_weight`` [H, v_head_dim, kv_lora_rank],
    ``softmax_scale`` = qk_head_dim ** -0.5 (from the caller). Returns [s, b, H * v_head_dim]."""

    consumes_absorbed_v_up_projection = True
    requires_dsa_inputs = True
    _backend_override: Optional[str] = None

    def __init__(self, config: TransformerConfig, submodules: GLM5DSAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type: str = "p2p",
                 pg_collection: ProcessGroupCollection = None, cp_layout: str = "zigzag", is_mtp: bool = False):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.is_mtp = is_mtp  # an MTP layer's attention: its own indices, never replayed or recorded
        self.kv_fp8_qat = rollout_numerics.kv_fp8_qat(config)  # sparse MLA reads the FP8-cache latent
        check_dsa_config(config)
        # backend, deterministic mode and guard policy of this module's calls, from the config (and
        # environment overrides), resolved once (see model.switches)
        self.switches = resolve_switches(config)
        apply_guard_policy(self.switches)
        self.geometry = dsa_geometry(config)  # topk, index-sharing schedule, indexer heads / RoPE convention
        self.topk_freq, self.skip_offset = self.geometry.topk_freq, self.geometry.skip_offset
        self.computes_indices = self.geometry.computes_indices(layer_number)
        self.source_layer = self.geometry.source_layer(layer_number)
        self.shared_topk = SharedTopk(layer_number, self.source_layer)  # index sharing's hand-over (checked)
        self._replay_check = micro_batch.RecomputeCheck()  # a recompute replays what its forward replayed
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.indexer = build_module(submodules.indexer, config=config, pg_collection=pg_collection) \
            if self.computes_indices else None
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(k_channels if k_channels is not None else config.kv_channels)
        self.softmax_scale = softmax_scale
        self.cp_comm_type = cp_comm_type
        self.cp_layout = cp_layout  # allgather CP layout: "zigzag" (megatron-core) or "contiguous" (slime)
        if get_pg_size(getattr(pg_collection, "cp", None)) > 1:
            check_layout(cp_layout, cp_comm_type)

    # ---------------------------------------------------------------- helpers
    def _carrier(self, packed_seq_params, attention_mask):
        """The per-micro-batch object that carries index sharing, replay and recording (:mod:`.micro_batch`)."""
        return micro_batch.carrier(packed_seq_params, attention_mask, self.config)

    def _check_replay(self, replay, shared_carrier: bool) -> None:
        """A recomputed forward on a carrier shared by micro batches (the config, or a mask / packed
        parameters that held another micro batch's replay) must find the replay its forward used."""
        token = replay.serial if replay is not None else 0
        recomputing, seen = self._replay_check.read(token, self.training)
        if recomputing and shared_carrier and seen != token:
            raise StaleMicroBatchStateError(
                f"DSA layer {self.layer_number}: a recomputed forward finds indexer replay {token or 'none'} on a "
                f"carrier shared by micro batches (the model's config, or a mask / PackedSeqParams reused), but this "
                f"micro batch's forward used replay {seen or 'none'} (another micro batch's was attached since). "
                f"Attach each micro batch's replay to its own PackedSeqParams or attention mask, or recompute no "
                f"DSA layer. {micro_batch.NO_GRAD_TRAINING_HINT}")

    @staticmethod
    def _packed_visibility(packed_seq_params: PackedSeqParams, device) -> visibility.Visibility:
        """The micro batch's THD visibility, built by its first DSA layer and kept on its
        ``PackedSeqParams`` for the others: boundaries on a GPU cost a host read, which waits for
        the GPU's queue, once per micro batch instead of once per layer. Kept while the boundary
        tensors are the same objects, unmodified (their identity and in-place version)."""
        cu, padded = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded
        if cu.is_inference() or (padded is not None and padded.is_inference()):
            # inference tensors keep no version counter: an in-place change could not be seen
            return visibility.Visibility.from_cu_seqlens(cu, device=device, cu_seqlens_padded=padded)
        ident = tuple((id(t), t._version) if t is not None else None for t in (cu, padded)) + (str(device),)
        kept = micro_batch.state(packed_seq_params, micro_batch.VISIBILITY_ATTR)
        hit = kept.get("packed")
        if hit is not None and hit[0] == ident:
            return hit[2]
        vis = visibility.Visibility.from_cu_seqlens(cu, device=device, cu_seqlens_padded=padded)
        kept["packed"] = (ident, (cu, padded), vis)  # the tensors held, so their ids are not reused
        return vis

    @staticmethod
    def _to_packed(t: torch.Tensor) -> torch.Tensor:
        """[s, b, ...] -> [b*s, ...] (batch-major)."""
        return t.transpose(0, 1).reshape(t.shape[0] * t.shape[1], *t.shape[2:])

    @staticmethod
    def _hidden_rows(t: torch.Tensor, s: int, b: int) -> torch.Tensor:
        """x / qr as [b*s, features]; packed THD may hand them over without the batch dim."""
        if t.dim() == 2:
            return t
        return t.transpose(0, 1).reshape(b * s, t.shape[-1])

    # ---------------------------------------------------------------- forward
    def forward(self, query, key, value, attention_mask, x, qr, position_ids=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params: PackedSeqParams = None, up_v_weight=None):
        if attention_bias is not None:
            raise ValueError("GLM5DSAttention does not take an attention_bias")
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed and query.dim() == 3:
            query, key = query.unsqueeze(1), key.unsqueeze(1)
            value = value.unsqueeze(1) if value is not None else None
        s, b = query.shape[:2]
        tp = get_pg_size(getattr(self.pg_collection, "tp", None))
        if self.config.sequence_parallel and tp > 1:
            # sequence parallel: x / qr hold this rank's rows, the query holds all of them
            if x.shape[0] * tp == s:
                x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
            if qr.shape[0] * tp == s:
                qr = gather_from_sequence_parallel_region(qr, group=self.pg_collection.tp)
        if packed and b != 1:
            raise ValueError(f"packed THD input must have batch 1, got {b}")
        vis, cp_shard = self._visibility(packed_seq_params, packed, attention_mask, s, b, query.device)
        q_att, kv_att, d_v, backend = self._attention_operands(query, key, value, up_v_weight)
        if value is None and self.kv_fp8_qat:  # the latent as the rollout's FP8 KV cache holds it (straight-through)
            kv_att = fake_quant_kv(kv_att)
        if cp_shard is not None:  # CP: the latent kv of the whole sequence set
            kv_att = cp_shard.gather(kv_att)

        carrier = self._carrier(packed_seq_params, attention_mask)
        att_idx, index_logits = self._topk(carrier, vis, cp_shard, self._hidden_rows(x, s, b),
                                           self._hidden_rows(qr, s, b), kv_att.shape[0])
        G = kv_att.shape[1]
        # The indices come from our own top-k. With the guard on, validating them is free (read with
        # the guard's flag); with GLM5_DSA_NONFINITE=off the attention reads no device flag at all.
        # The indexer loss is formed in the attention's backward, from the probabilities it forms.
        loss_grad = self._indexer_loss_grad(index_logits, att_idx) if index_logits is not None else None
        out, _ = sparse_mla(q_att, kv_att, att_idx[:, None, :].expand(-1, G, -1).contiguous(),
                            self.softmax_scale, d_v=d_v, backend=backend, validate=guard_policy() != "off",
                            deterministic=self.switches.deterministic, slot_probs_grad=loss_grad)  # [b*s, H, d_v]
        if value is None:
            out = value_up_projection(out, up_v_weight.to(out.dtype))
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()  # [s, b, H * v]

    def _visibility(self, packed_seq_params, packed: bool, attention_mask, s: int, b: int, device):
        """-> (the visibility of this rank's query rows, the micro batch's CP shard or None);
        ``packed``: THD (``packed_seq_params`` describes the rows), else bshd.

        Context parallel (allgather CP): queries stay local; kv and the indexer keys are gathered
        into global packed order, so indices are rows of the gathered kv. One shard per micro
        batch, shared by its layers (on the index-sharing holder's carrier)."""
        cp_group = getattr(self.pg_collection, "cp", None)
        if get_pg_size(cp_group) > 1:
            shards = micro_batch.state(self._carrier(packed_seq_params, attention_mask), micro_batch.CP_SHARDS_ATTR)
            shard_key = (id(cp_group), self.cp_layout, s, b, device)
            if shard_key not in shards:
                shards[shard_key] = shard(cp_group, self.cp_layout, s * b, batch=b, device=device,
                                          cu_seqlens=packed_seq_params.cu_seqlens_q if packed else None,
                                          cu_seqlens_padded=packed_seq_params.cu_seqlens_q_padded if packed else None)
            return shards[shard_key].vis, shards[shard_key]
        if packed:
            vis = self._packed_visibility(packed_seq_params, device)
            if int(vis.query_seq.shape[0]) != s:
                raise ValueError(f"cu_seqlens covers {vis.query_seq.shape[0]} tokens, query has {s}")
            return vis, None
        return visibility.Visibility.uniform(b, s, device=device), None

    def _attention_operands(self, query, key, value, up_v_weight):
        """-> (q [b*s, H, Dqk], kv [b*s, G, Dqk], d_v, backend) of the sparse attention.

        Absorbed MLA (``value`` None): the latent kv [s, b, 1, kv_lora_rank + rope] as one kv group.
        Un-absorbed MLA (per-head keys and values): kv = [value | key], q = [0 | q], d_v = the value
        dim; exact, but only the reference backend supports that split."""
        q = self._to_packed(query)
        if value is None:
            if up_v_weight is None:
                raise RuntimeError("absorbed DSA (value=None) needs up_v_weight [H, v_head_dim, kv_lora_rank]")
            kv = self._to_packed(key)
            d_v = self.config.kv_lora_rank
            if kv.shape[1] != 1 or query.shape[-1] != d_v + self.config.qk_pos_emb_head_dim:
                raise RuntimeError(f"absorbed DSA expects key [s, b, 1, {d_v}+{self.config.qk_pos_emb_head_dim}], "
                                   f"got {tuple(key.shape)}")
            return q, kv, d_v, self.backend
        k, v = self._to_packed(key), self._to_packed(value)
        d_v = v.shape[-1]
        return torch.cat([q.new_zeros(*q.shape[:-1], d_v), q], dim=-1), torch.cat([v, k], dim=-1), d_v, "reference"

    def _topk(self, carrier, vis, cp_shard, xs, qrs, n_kv: int):
        """-> (top-k [T, topk] in the attention's slot order, the selected index logits for the
        indexer loss or None). The indexer's own top-k, the rollout's replayed one (rows it does not
        hold keep ours), or, on an index-sharing layer, the top-k its source layer published."""
        if self.indexer is None:
            return self.shared_topk.read(carrier, self.training, shared_carrier=carrier is self.config), None
        replay = None if self.is_mtp else replay_mod.indexer_replay_of(carrier)
        self._check_replay(replay, carrier is self.config or replay_mod.carries_several_replays(carrier))
        recorder = None if self.is_mtp else getattr(carrier, replay_mod.RECORDER_ATTR, None)
        replayed = self._replayed(replay, vis, xs.shape[0], xs.device) if replay is not None else None
        coeff = self.config.dsa_indexer_loss_coeff or 0.0
        want_loss = self.training and coeff > 0 and torch.is_grad_enabled()
        own_all = replayed is None or replay.measure_overlap
        if own_all or want_loss or replay.own_rows.numel():
            # detached inputs, as in megatron-core: the indexer loss trains the indexer only, never the trunk
            qi, ki, wi = self.indexer.qkw(xs.detach(), qrs.detach(), vis.query_pos)
            if cp_shard is not None:  # CP: the indexer keys of the whole sequence set
                ki = cp_shard.gather(ki)
        if own_all:  # selected in the attention's slot order (below)
            indices = self.indexer.select_topk(qi.detach(), ki.detach(), wi.detach(), vis,
                                               key_order=indexer.reads_key_order(n_kv))
        if replayed is not None:
            if replay.measure_overlap:
                replay.record_overlap(self.layer_number, replayed, indices)
                own = indices
            elif replay.own_rows.numel():
                r = replay.own_rows
                own = self.indexer.select_topk(qi[r].detach(), ki.detach(), wi[r].detach(), vis.rows(r))
            indices = replayed
            if replay.own_rows.numel():  # rows the record does not hold keep the trainer's own top-k
                indices = replayed.clone()
                indices[replay.own_rows] = own if not replay.measure_overlap else own[replay.own_rows]
        if recorder is not None:
            recorder.add(self.layer_number, indices, vis.qidx)
        att_idx = indices if replayed is None else indexer.attention_slot_order(indices, n_kv)
        if self.topk_freq > 1:  # kept when later layers reuse them (index sharing): the kernels' order
            self.shared_topk.publish(carrier, att_idx)
        if not want_loss:
            return att_idx, None
        # in the attention's slot order: the loss does not depend on it, and no second copy is kept
        return att_idx, indexer.selected_scores(qi, ki, wi, att_idx, deterministic=self.switches.deterministic)

    @property
    def backend(self) -> str:
        """The sparse_mla backend of this module's absorbed calls: one assigned in code (instance, or
        a string assigned to the class attribute; tests and benchmarks pin one that way), else
        ``self.switches.backend`` (``config.dsa_sparse_mla_backend``, ``GLM5_DSA_BACKEND``, "auto")."""
        return self._backend_override if self._backend_override is not None else self.switches.backend

    @backend.setter
    def backend(self, name: Optional[str]) -> None:
        self._backend_override = name

    def _replayed(self, replay, vis, rows: int, device) -> torch.Tensor:
        """This layer's replayed indices [rows, topk], checked against the rows this forward holds."""
        t = replay.layer(self.layer_number, device)
        if t is None:
            raise RuntimeError(f"indexer replay: no indices for DSA layer {self.layer_number} (the replay holds "
                               f"layers {sorted(replay.indices)}); pack it with this stage's layers")
        if t.shape != (rows, self.indexer.topk):
            raise RuntimeError(f"indexer replay: layer {self.layer_number} holds {tuple(t.shape)} indices; this "
                               f"forward has {rows} query rows and index_topk {self.indexer.topk}")
        if replay.own_rows.device != t.device:
            replay.own_rows = replay.own_rows.to(t.device)
        if not getattr(replay, "_rows_checked", False):
            if not torch.equal(replay.rows.to(vis.qidx.device), vis.qidx):
                raise RuntimeError("indexer replay: its rows are not the query rows of this rank (context parallel: "
                                   "pack with rows=cp_layout.local_row_ids(...) of this rank and layout)")
            replay._rows_checked = True
        return t

    def _indexer_loss_grad(self, index_logits, indices) -> SlotProbsGrad:
        """The sparse KL loss of megatron-core (``sparse_loss=True``) as the attention's backward forms
        it: the target (the attention probabilities at the slots, summed over heads: over TP ranks
        too, and over the per-head kv groups of un-absorbed MLA) comes from that backward, the
        gradient of ``index_logits`` [T, topk] is scaled as ``DSAIndexerLossAutoScaler`` scales the
        loss's, and the loss value is logged (and kept as ``last_indexer_loss``) there."""
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexerLossAutoScaler,
            DSAIndexerLossLoggingHelper,
        )

        tp_group = getattr(self.pg_collection, "tp", None)
        coeff = self.config.dsa_indexer_loss_coeff

        def grad_from(probs):  # [T, G, topk] fp32, owned
            target = probs[:, 0] if probs.shape[1] == 1 else probs.sum(1)
            if get_pg_size(tp_group) > 1:  # heads are split over TP: the target sums all of them
                torch.distributed.all_reduce(target, group=tp_group)
            loss, grad = indexer_loss.indexer_kl_loss_and_grad(index_logits, target.contiguous(), indices, coeff)
            if torch.cuda.is_available():  # CP: each rank's loss covers its query rows; the log averages them
                groups = indexer_loss_tracker_groups(getattr(self.pg_collection, "cp", None),
                                                     bool(getattr(self.config, "calculate_per_token_loss", False)))
                DSAIndexerLossLoggingHelper.save_loss_to_tracker(loss, self.layer_number, self.config.num_layers,
                                                                 **groups)
            self.last_indexer_loss = loss.detach()
            scale = DSAIndexerLossAutoScaler.main_loss_backward_scale
            return grad if scale is None else grad.mul_(scale.to(grad.device))

        return SlotProbsGrad(index_logits, grad_from)
