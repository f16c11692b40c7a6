"""Per-rank memory of a training run, by term, for the dry run (:mod:`.planner`).

All figures are bytes on one rank of one pipeline stage. ``t`` below is the tokens one rank holds
of a micro batch: ``micro_batch * seq / cp``; hidden-size tensors are further split over TP
(megatron-core's sequence parallelism, which MoE with TP > 1 requires).

Terms:

* ``weights``: every parameter of the stage in bf16 (2 B), frozen and trainable alike; LoRA
  adapters are counted in ``lora_weights``.
* ``grads`` / ``optimizer``: for the trainable parameters only. ``optimizer="megatron"``
  (megatron-core's mixed precision): fp32 main gradients (4 B) and fp32 master weights plus
  AdamW's two moments (12 B), the 12 B sharded over the data-parallel ranks (``dp * cp`` for
  dense, ``dp * cp * tp / ep`` for expert parameters) with ``distributed_optimizer``.
  ``optimizer="launcher"`` (the launchers' single-process ``torch.optim.AdamW``): gradients and
  both moments in the parameter's dtype (2 + 4 B).
* ``activations``: what each layer keeps for its backward, per micro batch, times the micro
  batches in flight on the stage under 1F1B (``min(pp - stage, micro_batches)``); see
  :func:`layer_kept_parts` and :func:`stage_kept_parts` (the shared top-k, the final norm).
* ``transient``: the largest short-lived allocation of one layer (the DSA layer's largest phase,
  which holds the guard's and the kernels' workspaces, or the MoE dispatch buffers) and, on the
  last stage, the logits and the loss.

Recompute (megatron-core's ``--recompute-granularity``): ``selective`` recomputes the core
attention (the DSA kernel's kept q, out and lse are dropped, the projections kept); ``full``
keeps only each layer's input per micro batch and re-runs one layer at a time in backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..checkpoints.cards import index_sharing
from .attention_memory import attention_activation_parts, attention_transient_parts

__all__ = ["GIB", "RECOMPUTE", "OPTIMIZERS", "CUDA_ALLOC_CONF", "Training", "StageMemory", "lora_modules",
           "lora_params_per_layer", "layer_kept_parts", "stage_kept_parts", "layer_transient_bytes", "logits_bytes",
           "optimizer_bytes"]

GIB = 1024**3
RECOMPUTE = ("none", "selective", "full")
OPTIMIZERS = ("megatron", "launcher")
# The CUDA caching allocator these counts assume (the launchers' default PYTORCH_CUDA_ALLOC_CONF):
# with fixed segments a peak that fits can still fail at a large late allocation.
CUDA_ALLOC_CONF = "expandable_segments:True"


@dataclass(frozen=True)
class Training:
    """What trains: LoRA adapters of rank ``lora_dim`` (``None``: every parameter) and how.
    ``fused_swiglu``: megatron-core's fused SwiGLU (``bias_activation_fusion``, what the launchers
    run on a GPU), which keeps only its input; ``False``: the unfused activation's operands too."""

    lora_dim: int | None = 8
    lora_indexer: bool = False
    optimizer: str = "megatron"
    distributed_optimizer: bool = False
    recompute: str = "none"
    fused_swiglu: bool = True

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: expected one of {OPTIMIZERS}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}: expected one of {RECOMPUTE}")


@dataclass
class StageMemory:
    """Bytes of one rank of one stage, by term (``parts``), and their sum."""

    stage: int
    in_flight: int
    parts: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def lora_modules(card: dict, include_indexer: bool) -> list[tuple[str, int, int, str]]:
    """(name, in_features, out_features, split) of the LoRA targets of one layer; ``split`` is how
    megatron-core shards the base linear over TP: ``col`` (output), ``row`` (input) or ``none``."""
    h, H = card["hidden_size"], card["num_attention_heads"]
    dn, dr, dv = card["qk_nope_head_dim"], card["qk_rope_head_dim"], card["v_head_dim"]
    mods = [("linear_q_down_proj", h, card["q_lora_rank"], "none"),
            ("linear_q_up_proj", card["q_lora_rank"], H * (dn + dr), "col"),
            ("linear_kv_down_proj", h, card["kv_lora_rank"] + dr, "none"),
            ("linear_kv_up_proj", card["kv_lora_rank"], H * (dn + dv), "col"),
            ("linear_proj", H * dv, h, "row")]
    if include_indexer:
        Hi, Di = card["index_n_heads"], card["index_head_dim"]
        mods += [("linear_wq_b", card["q_lora_rank"], Hi * Di, "none"), ("linear_wk", h, Di, "none"),
                 ("linear_weights_proj", h, Hi, "none")]
    return mods


def lora_params_per_layer(card: dict, dim: int, tp: int, include_indexer: bool = False) -> int:
    """Adapter parameters of one layer on one rank: ``dim * (in + out)`` per target, the side that
    follows the base linear's TP split divided by ``tp`` (column: the output side; row: the input)."""
    n = 0
    for _, fin, fout, split in lora_modules(card, include_indexer):
        n += dim * ((fin // tp if split == "row" else fin) + (fout // tp if split == "col" else fout))
    return n


def layer_kept_parts(card: dict, tp: int, cp: int, seq: int, micro_batch: int, is_moe: bool, computes: bool,
                     training: Training, ep: int = 1, cp_layout: str = "zigzag") -> dict[str, int]:
    """Bytes one layer keeps for its backward per micro batch on one rank (bf16 unless noted), as
    megatron-core's local modules and torch keep them (counted on the tiny card with
    ``torch.autograd.graph.saved_tensors_hooks`` in ``tests/train/test_planner_memory.py``; norms
    as torch's fused CUDA ``rms_norm`` keeps them: its bf16 input and an fp32 rstd per row). A
    frozen local linear keeps nothing of its input; a LoRA adapter keeps the input and its rank-wide
    intermediate.

    * ``attention``: the DSA core's kept tensors (:func:`.attention_memory.attention_activation_parts`, the
      indexer's only when it trains) per sequence, times ``micro_batch``;
    * ``projections``: the layer input and the normalised input (``2 h``), the query latent before
      and after its norm (``2 q_lora``), the kv latent with its RoPE part (``kv_lora + dr``, one
      tensor: the kv norm keeps a view of it), the query heads before absorption
      (``H / tp * (dn + dr)``, kept by the absorbing matmul), RoPE's cos / sin of k (``2 dr``; q's
      rotation is recomputed in the absorbed query's backward), three norms' fp32 rstd and, under
      LoRA, each called adapter's rank-wide intermediate (q_down, q_up, kv_down, proj; kv_up is
      absorbed into the weights);
    * ``mlp`` (dense): the pre-MLP norm's input (``h``) and rstd, the SwiGLU input (``2 ffn / tp``)
      and, unfused (``training.fused_swiglu=False``), the activation's two operands (``silu(x)`` and
      ``x_linear + offset``, ``2 ffn / tp``); when the MLP trains also fc1's input (``h``) and fc2's
      input (``ffn / tp``);
    * ``moe``: the pre-MLP norm's input and rstd, the router's input (``h``), the router's and the
      dispatcher's fp32 scores, masks and int64 maps (``10 E + 32 k + 12`` bytes), per routed token
      copy the expert's SwiGLU input (``2 moe_ffn``; unfused also the activation's two operands and
      the activation scaled by the routing probability, ``5 moe_ffn`` in all; every token copy once
      over the EP group: ``t * k`` copies per rank) and the shared expert's SwiGLU input (``2
      shared``; unfused with its operands, ``4 shared``); when the experts train also their linears'
      inputs;
    * ``recompute="full"`` keeps the layer input only; ``"selective"`` drops the DSA core's q, out
      and lse (recomputed from the kept latents).

    The top-k a computing layer shares with later layers (index sharing) and the final norm's
    input on the last stage are per stage: :func:`stage_kept_parts`.
    """
    h, H = card["hidden_size"], card["num_attention_heads"]
    t = micro_batch * seq // cp
    t_sp = t // tp if tp > 1 else t
    if training.recompute == "full":
        return dict(layer_input=t_sp * h * 2)
    full = training.lora_dim is None
    attn = attention_activation_parts(card, tp, cp, seq, computes, indexer_trains=full or training.lora_indexer)
    if training.recompute == "selective":
        for k in ("q", "out", "lse"):
            attn[k] = 0
    dn, dr = card["qk_nope_head_dim"], card["qk_rope_head_dim"]
    q_lat, kv_lat = card["q_lora_rank"], card["kv_lora_rank"] + dr
    adapters = 0 if full else (4 + 3 * training.lora_indexer) * training.lora_dim * 2
    parts = dict(attention=sum(attn.values()) * micro_batch,
                 projections=(2 * t_sp * h + 2 * t * q_lat + t * kv_lat + t * H // tp * (dn + dr) + 2 * t * dr) * 2
                 + 3 * t * 4 + t * adapters)
    glu = 2 if training.fused_swiglu else 4  # SwiGLU input (two halves), unfused with the two operands
    expert_glu = 2 if training.fused_swiglu else 5  # unfused: also the probability-scaled activation
    if not is_moe:
        ffn = card["intermediate_size"] // tp
        parts["mlp"] = (t_sp * h + glu * t * ffn + (t_sp * h + t * ffn) * full) * 2 + t_sp * 4
    else:
        E, k, f = card["n_routed_experts"], card["num_experts_per_tok"], card["moe_intermediate_size"]
        shared = card.get("n_shared_experts", 0) * f // tp
        parts["moe"] = (2 * t_sp * h * 2 + t_sp * 4 + t * (10 * E + 32 * k + 12) + t * k * expert_glu * f * 2
                        + t * glu * shared * 2 + (t * k * (f + h) + t * (shared + h)) * 2 * full)
    return parts


def stage_kept_parts(card: dict, tp: int, cp: int, seq: int, micro_batch: int, training: Training,
                     computing_layers: int, last_stage: bool) -> dict[str, int]:
    """Bytes a stage keeps per micro batch in flight besides its layers' own
    (:func:`layer_kept_parts`):

    * ``index_holder``: with index sharing (``index_topk_freq > 1``) each computing layer's top-k
      [t, topk] int32 stays on the micro batch's carrier (``model.micro_batch``) for the
      layers that reuse it, outside autograd, and so under recompute too; without recompute the
      same tensor is the computing layer's kept ``indices`` (0 here). Counted once per micro batch
      in flight (a carrier per micro batch: its packed-sequence parameters or attention mask);
    * ``final_norm``: on the last stage, the final norm's input [t, h] and its fp32 rstd, kept
      outside megatron-core's recompute (the frozen output layer keeps nothing of its input)."""
    h, topk = card["hidden_size"], card["index_topk"]
    t = micro_batch * seq // cp
    t_sp = t // tp if tp > 1 else t
    sharing = index_sharing(card)[0] > 1
    out = dict(index_holder=computing_layers * t * topk * 4 if sharing and training.recompute == "full" else 0)
    out["final_norm"] = (t_sp * h * 2 + t_sp * 4) if last_stage else 0
    return out


def layer_transient_bytes(card: dict, tp: int, cp: int, seq: int, micro_batch: int, is_moe: bool, computes: bool,
                          cp_layout: str = "zigzag", ep: int = 1) -> dict[str, int]:
    """The short-lived allocations of one layer on one rank, by phase (they do not overlap; the
    layer's transient peak is the largest): the DSA layer's largest phase
    (the guard's and the kernels' workspaces; :func:`.attention_memory.attention_transient_parts`) per
    sequence times ``micro_batch``, and for a MoE layer the dispatch: the permuted token copies and
    their combine (``2 k h``, bf16) plus, with EP > 1, the all-to-all's send and receive buffers."""
    phases = attention_transient_parts(card, tp, cp, seq, computes, cp_layout)
    out = dict(attention=max(sum(v.values()) for v in phases.values()) * micro_batch)
    if is_moe:
        t = micro_batch * seq // cp
        k, h = card["num_experts_per_tok"], card["hidden_size"]
        out["moe_dispatch"] = t * k * h * 2 * (2 + 2 * (ep > 1))
    return out


def logits_bytes(card: dict, tp: int, cp: int, seq: int, micro_batch: int) -> dict[str, int]:
    """Last stage: megatron-core's vocab-parallel cross entropy keeps the fp32 softmax
    ``[t, V / tp]`` (4 B) and, while it converts, the bf16 logits beside it (2 B); its backward
    holds the fp32 gradient and its bf16 copy (the same 6 B)."""
    t = micro_batch * seq // cp
    V = card["vocab_size"] // tp
    return dict(softmax_fp32=t * V * 4, logits_bf16=t * V * 2)


def optimizer_bytes(trainable_dense: int, trainable_expert: int, training: Training, tp: int, cp: int, ep: int,
                    dp: int) -> dict[str, int]:
    """Gradients and AdamW state of the trainable parameters of one rank (see the module doc)."""
    n = trainable_dense + trainable_expert
    if training.optimizer == "launcher":
        return dict(grads=n * 2, optimizer=n * 4)
    shard_dense = dp * cp if training.distributed_optimizer else 1
    shard_expert = max(1, dp * cp * tp // ep) if training.distributed_optimizer else 1
    return dict(grads=n * 4, optimizer=trainable_dense * 12 // shard_dense + trainable_expert * 12 // shard_expert)
