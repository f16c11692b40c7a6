"""What one DSA layer keeps and allocates on one rank, by tensor (the dry run's attention terms).

``seq`` is the global micro-batch length, ``S_loc = seq / cp`` the local query rows, ``T = seq``
the latent rows gathered over CP; ``tp`` divides the heads. The sparse-MLA terms come from the
backend (``Backend.saved_bytes`` / ``backward_bytes``), the guard's from its configuration.
"""

from __future__ import annotations

from ..model import indexer

__all__ = ["attention_activation_parts", "attention_activation_bytes", "attention_transient_parts",
           "layer_peak_bytes"]


def attention_activation_parts(card: dict, tp: int, cp: int, seq: int, computes: bool,
                               indexer_trains: bool = True) -> dict[str, int]:
    """Bytes one DSA layer keeps for backward per micro batch, by tensor, as the TileLang backend
    keeps them (bf16 activations, fp32 lse, int32 indices):

    * ``q`` (absorbed, [S_loc, H, 576]), ``kv`` (the latent kv, all-gathered over CP, with its zero
      sentinel row), ``out`` and ``lse``;
    * ``indices``: the caller's top-k, kept by the layer that computes them; layers that reuse them
      keep the same tensor (0 here), unless topk is not a multiple of 64: then every layer keeps
      its own padded copy;
    * ``key_lists``: with fewer than 64 heads per rank, the row groups' lists (an int32 key and a
      uint8 member byte per padded slot); an upper bound, since ``row_groups="auto"`` drops them
      for shapes whose rows share no key;
    * ``indexer``: the indexer's q, k and weights in a layer that computes indices;
    * ``indexer_loss_grad``: the indexer's logits at the selected slots, [S_loc, K] fp32, the one
      tensor the loss keeps (the attention's backward forms the loss and its gradient from them);
      both 0 when the indexer is frozen (``indexer_trains=False``: LoRA without ``--lora-indexer``):
      its q / k / w then need no gradient, so neither the selected-slot scores nor the loss keep
      anything for the backward;
    * ``value_out``: the value up-projection's output [S_loc, H * v_head_dim] (bf16), which the
      output projection keeps;
    * ``guard_kv``: the gathered latent kv as the layer passed it [T, 576] (bf16), which the
      guard's late-read forward flags keep until the layer's backward settles them (policy
      ``fallback``, the default; ``ops.guard.run.run_forward``); 0 under ``raise`` or ``off``."""
    H = card["num_attention_heads"] // tp
    S_loc = seq // cp
    dq = card["kv_lora_rank"] + card["qk_rope_head_dim"]
    topk = card["index_topk"]
    saved = _sparse_mla_saved_bytes(card, H, S_loc, seq)
    parts = dict(q=S_loc * H * dq * 2, kv=saved["kv"], out=S_loc * H * card["kv_lora_rank"] * 2,
                 lse=S_loc * H * 4)
    parts["indices"] = S_loc * topk * 4 * computes + saved["indices"]
    parts["key_lists"] = saved["key_lists"]
    parts["indexer"] = ((S_loc * card["index_n_heads"] * card["index_head_dim"] * 2 + seq * card["index_head_dim"] * 2
                         + S_loc * card["index_n_heads"] * 4) if computes and indexer_trains else 0)
    parts["indexer_loss_grad"] = S_loc * topk * 4 * computes * indexer_trains
    parts["value_out"] = S_loc * H * card["v_head_dim"] * 2
    parts["guard_kv"] = seq * dq * 2 if _guard_holds_forward_inputs() else 0
    return parts


def _guard_holds_forward_inputs() -> bool:
    """Whether a recorded sparse-MLA forward's flags are read late, keeping its inputs until the
    backward (``ops.guard.run.run_forward`` on CUDA under policy ``fallback``)."""
    from ..ops.guard.config import cfg

    return cfg.policy == "fallback"


def _sparse_mla_problem(card: dict, H: int, S_loc: int, T: int):
    """A layer's sparse-MLA call: S_loc local query rows of H heads against the T gathered latent
    rows (one kv group)."""
    from ..ops.contract import Problem

    d_v = card["kv_lora_rank"]
    return Problem(batch=1, seq_len=S_loc, seq_len_kv=T, heads=H, kv_groups=1, topk=card["index_topk"],
                   d_qk=d_v + card["qk_rope_head_dim"], d_v=d_v, sm_scale=1.0)  # (the scale sizes nothing)


def _sparse_mla_saved_bytes(card: dict, H: int, S_loc: int, T: int) -> dict[str, int]:
    """What the TileLang backend keeps from a layer's sparse-MLA forward for its backward, by
    tensor (``Backend.saved_bytes``), bf16."""
    from ..ops.backends import get_backend

    return get_backend("tilelang").saved_bytes(_sparse_mla_problem(card, H, S_loc, T), itemsize=2)


def _sparse_mla_backward_bytes(card: dict, H: int, S_loc: int, T: int) -> dict[str, int]:
    """What the TileLang backend's backward allocates besides dq, by tensor (``Backend.backward_bytes``)."""
    from ..ops.backends import get_backend

    return get_backend("tilelang").backward_bytes(_sparse_mla_problem(card, H, S_loc, T), itemsize=2)


def attention_activation_bytes(card: dict, tp: int, cp: int, seq: int, computes: bool) -> int:
    """Sum of :func:`attention_activation_parts`."""
    return sum(attention_activation_parts(card, tp, cp, seq, computes).values())


def attention_transient_parts(card: dict, tp: int, cp: int, seq: int, computes: bool,
                              cp_layout: str = "zigzag") -> dict[str, dict[str, int]]:
    """Bytes one DSA layer allocates on top of what it keeps (:func:`attention_activation_parts`),
    per phase, on a GPU rank (bf16 activations, Triton indexer scores). ``seq`` is the global
    micro-batch length; ``T = seq`` rows are gathered over CP, ``S_loc = seq / cp`` are local.

    * ``gather``: the all-gather's rank-major buffers of kv and indexer keys before their reorder
      into global order (zigzag layout only; the contiguous layout gathers in global order);
    * ``topk``: one row block of the indexer's top-k over local query rows against all ``T`` keys
      (int64 keys, as ``select_topk`` sizes the block, and ``topk``'s int64 values and indices);
    * ``indexer_loss``: the loss's forward: the [S_loc, K] fp32 logits at the slots (kept, in
      :func:`attention_activation_parts`); nothing of size [S_loc, K, D];
    * ``backward``: the incoming gradient of the latent attention output [S_loc, H, kv_lora_rank],
      the gathered kv's gradient (TileLang's fp32 dKV plus its bf16 result; the zigzag layout's
      reorder buffer before the reduce-scatter), the guard's fp32 row-repair accumulator over the
      gathered kv, the indexer keys' gradient (fp32 accumulator and result), the local dq, the
      loss's target [S_loc, K] fp32 (formed there, overwritten by the logits' gradient) and one
      row block of the KL's temporaries, and
      what the guard keeps of the previous layer's backward until its flags are settled (its q,
      incoming gradient and prepared indices; nothing when they exceed ``pending_bytes``)."""
    H, Di = card["num_attention_heads"] // tp, card["index_head_dim"]
    S_loc, T, K = seq // cp, seq, card["index_topk"]
    dq = card["kv_lora_rank"] + card["qk_rope_head_dim"]
    reorder = cp > 1 and cp_layout == "zigzag"
    gather = dict(kv=T * dq * 2 * reorder, indexer_k=T * Di * 2 * reorder * computes)
    rows = min(S_loc, indexer.topk_row_block(T))
    topk = dict(keys=rows * T * 8, topk_out=rows * K * 16) if computes else {}
    loss = dict(logits=S_loc * K * 4) if computes else {}
    backward = dict(d_out=S_loc * H * card["kv_lora_rank"] * 2,
                    dkv=sum(_sparse_mla_backward_bytes(card, H, S_loc, T).values()) + T * dq * 2 * reorder,
                    repair_acc=(T + 1) * dq * 4,
                    dq=S_loc * H * dq * 2, indexer_dk=(T * Di * (4 + 2 * (1 + reorder))) * computes,
                    guard_pending=_guard_pending_bytes(card, H, S_loc, T),
                    **(dict(target=S_loc * K * 4, kl_block=min(S_loc, 4096) * K * 4 * 4) if computes else {}))
    return dict(gather=gather, topk=topk, indexer_loss=loss, backward=backward)


def _guard_pending_bytes(card: dict, H: int, S_loc: int, T: int) -> int:
    """What the guard keeps of one backward until its flags are settled (``ops.guard``'s pending
    queue): q, the incoming gradient, the prepared kv and indices; 0 past ``pending_bytes``."""
    from ..ops.guard.config import cfg

    dq = card["kv_lora_rank"] + card["qk_rope_head_dim"]
    saved = _sparse_mla_saved_bytes(card, H, S_loc, T)
    # the backend's saved tensors hold its own padded indices, else the caller's (topk a multiple of 64)
    kept = (S_loc * H * dq * 2 + S_loc * H * card["kv_lora_rank"] * 2 + saved["kv"]
            + (saved["indices"] or S_loc * card["index_topk"] * 4) + saved["extent"])
    return kept if kept <= cfg.pending_bytes else 0


def layer_peak_bytes(card: dict, tp: int, cp: int, seq: int, computes: bool, cp_layout: str = "zigzag",
                     indexer_loss: bool = True) -> tuple[int, str]:
    """(peak bytes, phase) of one DSA layer on one rank: what it keeps plus its largest phase
    (:func:`attention_transient_parts`); ``indexer_loss=False`` leaves the loss phase out."""
    kept = attention_activation_bytes(card, tp, cp, seq, computes)
    phases = {k: sum(v.values()) for k, v in attention_transient_parts(card, tp, cp, seq, computes,
                                                                        cp_layout).items()}
    if not indexer_loss:
        phases.pop("indexer_loss")
    phase = max(phases, key=phases.get)
    return kept + phases[phase], phase
