"""``--dry-run``: plan a real GLM-5 run (TP/PP/EP/CP) on the meta device, without allocating.

Each distinct layer kind of the card (dense or MoE MLP, computing or reusing DSA indices, the MTP
layer) is built once through our spec on the ``meta`` device at TP = EP = 1; its parameters are
then divided per rank by how megatron-core shards them (column/row-parallel weights over TP,
routed experts over EP, everything else replicated). Pipeline stages are the most balanced split
whose every stage starts on a layer that computes its own indices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..checkpoints import cards
from ..model import index_sharing
from ..model.dsa_fields import dsa_geometry
from . import memory
from .attention_memory import attention_activation_bytes, layer_peak_bytes

__all__ = ["GIB", "Stage", "balanced_split", "split_with_ends", "check_layout", "layer_kind_params", "plan",
           "stage_memory", "peak_bytes", "FRAGMENTATION", "RESERVED_GIB", "fits", "Layout", "layout_peak",
           "nearest_fit", "add_plan_arguments", "training_from_args", "plan_and_print", "print_memory", "print_verdict"]

GIB = 1024**3


@dataclass
class Stage:
    index: int
    first: int  # 1-indexed, inclusive
    last: int
    layer_kinds: list[str] = field(default_factory=list)
    params_per_rank: int = 0
    expert_params_per_rank: int = 0  # the routed experts' share of params_per_rank
    attn_act_bytes: int = 0
    has_mtp: bool = False


def balanced_split(n_layers: int, pp: int, freq: int, offset: int) -> list[tuple[int, int]]:
    """Stages (first, last), 1-indexed, minimising the largest stage; every first layer computes indices."""
    if pp > n_layers:
        raise ValueError(f"pp={pp} > {n_layers} layers")
    ok = [index_sharing.computes_indices(L, freq, offset) for L in range(1, n_layers + 2)]
    INF = math.inf
    # best[k][i]: minimal max stage length splitting layers [1, i] into k stages
    best = [[INF] * (n_layers + 1) for _ in range(pp + 1)]
    cut = [[-1] * (n_layers + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for k in range(1, pp + 1):
        for i in range(1, n_layers + 1):
            for j in range(k - 1, i):  # stage k covers layers j+1 .. i
                if not ok[j] or best[k - 1][j] is INF:
                    continue
                v = max(best[k - 1][j], i - j)
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    if best[pp][n_layers] is INF:
        raise ValueError(f"no split of {n_layers} layers into {pp} stages starts every stage on a computing layer")
    out, i = [], n_layers
    for k in range(pp, 0, -1):
        j = cut[k][i]
        out.append((j + 1, i))
        i = j
    return out[::-1]


def split_with_ends(n_layers: int, pp: int, first: int | None, last: int | None, freq: int, offset: int
                    ) -> list[tuple[int, int]]:
    """Stages (first, last), 1-indexed, as megatron-core's ``--decoder-first-pipeline-num-layers`` /
    ``--decoder-last-pipeline-num-layers`` lay them out (the other stages share the rest evenly);
    every stage must start on a layer that computes its indices."""
    first_n, last_n = first or 0, last or 0
    inner = pp - (first is not None) - (last is not None)
    rest = n_layers - first_n - last_n
    if inner < 0 or rest < 0 or (inner == 0 and rest) or (inner and rest % inner):
        raise ValueError(f"{n_layers} layers do not split into pp={pp} stages with first={first}, last={last} "
                         f"({rest} layers left for {inner} middle stages)")
    sizes = ([first_n] if first is not None else []) + [rest // max(inner, 1)] * inner \
        + ([last_n] if last is not None else [])
    out, a = [], 1
    for k in sizes:
        index_sharing.check_stage_layers(a, a + k - 1, freq, offset)
        out.append((a, a + k - 1))
        a += k
    return out


def _per_rank_params(module: torch.nn.Module, tp: int, ep: int) -> tuple[int, int]:
    """(all, routed-expert) parameters of ``module`` on one rank."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    total = expert = 0
    for name, m in module.named_modules():
        own = sum(p.numel() for p in m.parameters(recurse=False))
        if own == 0:
            continue
        if ".experts." in f".{name}." and ".shared_experts" not in name:
            total += own // ep
            expert += own // ep
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            total += own // tp
        else:
            total += own
    return total, expert


def _layer_params(config, is_moe: bool, computes: bool, tp: int, ep: int) -> tuple[int, int]:
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from ..megatron.spec import layer_submodules

    spec = ModuleSpec(module=TransformerLayer, submodules=layer_submodules(config, is_moe))
    # layer_number 1 computes; with freq > 1 the first reusing layer is offset + 1
    geometry = dsa_geometry(config)
    number = 1 if computes else next(L for L in range(1, config.num_layers + 1)
                                      if not geometry.computes_indices(L))
    with torch.device("meta"):
        layer = build_module(spec, config=config, layer_number=number, add_layer_offset=False)
    return _per_rank_params(layer, tp, ep)


def check_layout(card: dict, tp: int, ep: int, cp: int, seq: int, cp_layout: str = "zigzag") -> None:
    """Raise a ValueError naming the field when TP / EP / CP do not divide the model or the sequence."""
    parts = 2 * cp if cp_layout == "zigzag" and cp > 1 else cp  # zigzag: 2 * cp chunks per sequence
    if card["num_attention_heads"] % tp or card["n_routed_experts"] % ep or seq % parts:
        raise ValueError(f"layout does not divide the model: heads {card['num_attention_heads']} / tp {tp}, "
                         f"experts {card['n_routed_experts']} / ep {ep}, seq {seq} / {parts} CP chunks")


def layer_kind_params(card: dict, tp: int, ep: int) -> dict[tuple[bool, bool], tuple[int, int]]:
    """{(is_moe, computes indices): (parameters, routed-expert parameters)} of one layer on one rank,
    each kind built once through the spec on the meta device."""
    n, k = card["num_hidden_layers"], card.get("first_k_dense_replace", 0)
    freq, _ = cards.index_sharing(card)
    config = cards.card_to_transformer_config(card, moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
                                              transformer_impl="local", mtp_num_layers=None)
    kinds = {}
    for is_moe in (False, True):
        for computes in (True, False):
            if (not is_moe and k == 0) or (is_moe and k >= n):
                continue
            if not computes and freq == 1:
                continue
            kinds[(is_moe, computes)] = _layer_params(config, is_moe, computes, tp, ep)
    if card.get("num_nextn_predict_layers") and (True, True) not in kinds:  # the MTP layer is a MoE layer
        kinds[(True, True)] = _layer_params(config, True, True, tp, ep)
    return kinds


def plan(card: dict, tp: int, pp: int, ep: int, cp: int, seq: int, first_stage_layers: int | None = None,
         last_stage_layers: int | None = None, cp_layout: str = "zigzag", kinds: dict | None = None
         ) -> tuple[list[Stage], dict]:
    """Stages and their per-rank parameters; ``kinds`` (from :func:`layer_kind_params` at the same
    TP / EP) skips the meta builds."""
    n = card["num_hidden_layers"]
    k = card.get("first_k_dense_replace", 0)
    freq, off = cards.index_sharing(card)
    check_layout(card, tp, ep, cp, seq, cp_layout)
    kinds = kinds or layer_kind_params(card, tp, ep)
    V, Hd = card["vocab_size"], card["hidden_size"]
    embed = V * Hd // tp
    stages = []
    if first_stage_layers is None and last_stage_layers is None:
        split = balanced_split(n, pp, freq, off)
    else:
        split = split_with_ends(n, pp, first_stage_layers, last_stage_layers, freq, off)
    for s, (a, b) in enumerate(split):
        st = Stage(s, a, b)
        for L in range(a, b + 1):
            is_moe, comp = L > k, index_sharing.computes_indices(L, freq, off)
            st.layer_kinds.append(("moe" if is_moe else "dense") + ("" if comp else "+reuse"))
            st.params_per_rank += kinds[(is_moe, comp)][0]
            st.expert_params_per_rank += kinds[(is_moe, comp)][1]
            st.attn_act_bytes += attention_activation_bytes(card, tp, cp, seq, comp) * (pp - s)  # 1F1B in flight
        if s == 0:
            st.params_per_rank += embed
        if s == pp - 1:
            st.params_per_rank += embed + Hd  # output layer + final norm
            if card.get("num_nextn_predict_layers"):
                st.has_mtp = True
                st.params_per_rank += kinds[(True, True)][0] + 2 * Hd * Hd + 3 * Hd  # MTP layer, eh_proj, 3 norms
                st.expert_params_per_rank += kinds[(True, True)][1]
        stages.append(st)
    info = dict(layer_params_per_rank={f"{'moe' if m else 'dense'}{'' if c else '+reuse'}": v[0]
                                       for (m, c), v in kinds.items()}, embedding_per_rank=embed,
                layer_peak={c: {loss: layer_peak_bytes(card, tp, cp, seq, c, cp_layout, loss)
                                for loss in (True, False)} for c in ((True, False) if freq > 1 else (True,))})
    return stages, info


def stage_memory(card: dict, stages: list[Stage], tp: int, pp: int, ep: int, cp: int, seq: int,
                 micro_batch: int, training: memory.Training, dp: int = 1, micro_batches: int | None = None,
                 cp_layout: str = "zigzag") -> list[memory.StageMemory]:
    """Each stage's per-rank bytes by term (:mod:`.memory`): static (weights, LoRA, gradients,
    optimizer), the activations of the micro batches in flight under 1F1B, and the larger of one
    layer's transient peak and, on the last stage, the logits and loss."""
    k = card.get("first_k_dense_replace", 0)
    freq, off = cards.index_sharing(card)
    lora = (memory.lora_params_per_layer(card, training.lora_dim, tp, training.lora_indexer)
            if training.lora_dim is not None else 0)
    out = []
    for st in stages:
        in_flight = min(pp - st.index, micro_batches or pp)
        layers = [(L > k, index_sharing.computes_indices(L, freq, off)) for L in range(st.first, st.last + 1)]
        if st.has_mtp:
            layers.append((True, True))
        n_lora = lora * len(layers)
        if training.lora_dim is None:
            dense, expert = st.params_per_rank - st.expert_params_per_rank, st.expert_params_per_rank
        else:
            dense, expert = n_lora, 0
        parts = dict(weights=st.params_per_rank * 2, lora_weights=n_lora * 2)
        parts.update(memory.optimizer_bytes(dense, expert, training, tp, cp, ep, dp))
        parts["activations"] = in_flight * (sum(
            sum(memory.layer_kept_parts(card, tp, cp, seq, micro_batch, moe, comp, training, ep, cp_layout).values())
            for moe, comp in layers) + sum(memory.stage_kept_parts(card, tp, cp, seq, micro_batch, training,
                                                                sum(comp for _, comp in layers),
                                                                st.index == pp - 1).values()))
        transient = max(max(memory.layer_transient_bytes(card, tp, cp, seq, micro_batch, moe, comp, cp_layout,
                                                      ep).values()) for moe, comp in layers)
        if training.recompute == "full":  # one layer's activations rebuilt at a time in backward
            transient += max(sum(memory.layer_kept_parts(card, tp, cp, seq, micro_batch, moe, comp,
                                                      replace(training, recompute="none"), ep,
                                                      cp_layout).values())
                             for moe, comp in layers)
        parts["transient"] = transient
        if st.index == pp - 1:
            parts["logits_loss"] = sum(memory.logits_bytes(card, tp, cp, seq, micro_batch).values())
        out.append(memory.StageMemory(st.index, in_flight, parts))
    return out


def peak_bytes(m: memory.StageMemory) -> int:
    """The stage's peak: static terms + kept activations + the larger of the layer transient and the logits."""
    p = m.parts
    return m.total - min(p["transient"], p.get("logits_loss", 0))


# Caching-allocator slack on top of the allocated peak: segments that still hold a live block
# cannot be returned, so a large late allocation (the loss's fp32 logits) needs memory beyond the
# live tensors. Not countable from the code; set from the measured GLM-5.2 slice at 64K
# (benchmarks/results/lora_slice.json): its fp32 logits (37.81 GiB) failed with 42.48 GiB of the
# process in use while the plan's live tensors at that point came to 34.83 GiB, i.e. at least
# 7.65 GiB beyond them; less the 2 GiB reserve that is at least 7.8% of the slice's planned
# 72.65 GiB peak. 5% (the earlier value) let that run through the verdict. The verdict assumes
# expandable segments (memory.CUDA_ALLOC_CONF, the launchers' default): the 64K slice planned at
# 126.75 GiB ran on a 139.8 GiB H200 with them (127.83 GiB peak) and failed without them.
FRAGMENTATION = 0.08
RESERVED_GIB = 2.0  # CUDA context, NCCL and library workspaces outside the model's tensors


def fits(peak: int, gpu_memory_gib: float) -> bool:
    """Whether an allocated peak fits a card of ``gpu_memory_gib`` after the reserve and slack."""
    return peak * (1 + FRAGMENTATION) / GIB + RESERVED_GIB <= gpu_memory_gib


@dataclass
class Layout:
    tp: int
    pp: int
    ep: int
    cp: int
    recompute: str = "none"
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def describe(self) -> str:
        return (f"TP{self.tp} PP{self.pp} EP{self.ep} CP{self.cp}"
                + (f" recompute={self.recompute}" if self.recompute != "none" else ""))


def layout_peak(card: dict, lay: Layout, seq: int, micro_batch: int, training: memory.Training, dp: int = 1,
                micro_batches: int | None = None, cp_layout: str = "zigzag", kinds: dict | None = None
                ) -> tuple[int, list[memory.StageMemory]]:
    """(largest stage peak, every stage's terms) of one layout."""
    tr = replace(training, recompute=lay.recompute)
    stages, _ = plan(card, lay.tp, lay.pp, lay.ep, lay.cp, seq, lay.first_stage_layers, lay.last_stage_layers,
                     cp_layout, kinds=kinds)
    mems = stage_memory(card, stages, lay.tp, lay.pp, lay.ep, lay.cp, seq, micro_batch, tr, dp, micro_batches,
                        cp_layout)
    return max(peak_bytes(m) for m in mems), mems


def nearest_fit(card: dict, lay: Layout, seq: int, micro_batch: int, training: memory.Training, gpu_memory_gib: float,
                dp: int = 1, micro_batches: int | None = None, cp_layout: str = "zigzag", kinds: dict | None = None
                ) -> tuple[Layout, int] | None:
    """The closest layout that fits by :func:`layout_peak`: more PP (x2, x4), more CP (x2, x4) and
    recompute (selective, then full), ordered by how many more GPUs it takes, then by how much it
    recomputes; balanced stages where PP changes. ``None`` when none of them fits."""
    kinds = kinds or layer_kind_params(card, lay.tp, lay.ep)
    levels = memory.RECOMPUTE[memory.RECOMPUTE.index(lay.recompute):]
    cands = []
    for fp in (1, 2, 4):
        for fc in (1, 2, 4):
            for r in levels:
                if (fp, fc, r) == (1, 1, lay.recompute):
                    continue
                keep_ends = fp == 1
                cands.append((fp * fc, levels.index(r), Layout(lay.tp, lay.pp * fp, lay.ep, lay.cp * fc, r,
                                                              lay.first_stage_layers if keep_ends else None,
                                                              lay.last_stage_layers if keep_ends else None)))
    for _, _, cand in sorted(cands, key=lambda c: (c[0], c[1])):
        try:
            peak, _ = layout_peak(card, cand, seq, micro_batch, training, dp, micro_batches, cp_layout, kinds)
        except ValueError:  # the layers or the sequence do not split that way
            continue
        if fits(peak, gpu_memory_gib):
            return cand, peak
    return None


def add_plan_arguments(ap) -> None:
    """The dry run's memory options (every launcher)."""
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0,
                    help="dry run: the card's memory for the verdict (141 is shown beside it)")
    ap.add_argument("--recompute", default="none", choices=memory.RECOMPUTE,
                    help="dry run: megatron-core's recompute granularity (none, selective, full)")
    ap.add_argument("--distributed-optimizer", action="store_true",
                    help="dry run: shard the fp32 optimizer state over the data-parallel ranks")
    ap.add_argument("--dp", type=int, default=1, help="dry run: data-parallel ranks (beside TP, PP, CP)")
    ap.add_argument("--micro-batches", type=int, default=None,
                    help="dry run: micro batches per step (default: at least PP, the 1F1B steady state)")
    ap.add_argument("--plan-optimizer", default="megatron", choices=memory.OPTIMIZERS,
                    help="dry run: megatron-core's mixed-precision AdamW or the launchers' torch AdamW")


def training_from_args(args) -> memory.Training:
    """LoRA when the launcher has ``--lora-dim`` (the LoRA job), else every parameter trains."""
    return memory.Training(getattr(args, "lora_dim", None), getattr(args, "lora_indexer", False),
                        getattr(args, "plan_optimizer", "megatron"), getattr(args, "distributed_optimizer", False),
                        getattr(args, "recompute", "none"))


def plan_and_print(args, card: dict) -> int:
    """The dry run: parameters, per-stage memory by term and the verdict, for micro batches of
    ``--batch-size`` sequences of ``--seq-len`` tokens (global, before the CP split), as training reads them."""
    from ..model.cp_layout import layout_from_args

    layout = layout_from_args(args)
    seq, mb = args.seq_len, args.batch_size
    training = training_from_args(args)
    lay = Layout(args.tp, args.pp, args.ep, args.cp, training.recompute,
                 getattr(args, "decoder_first_pipeline_num_layers", None),
                 getattr(args, "decoder_last_pipeline_num_layers", None))
    kinds = layer_kind_params(card, args.tp, args.ep)
    stages, info = plan(card, args.tp, args.pp, args.ep, args.cp, seq, lay.first_stage_layers, lay.last_stage_layers,
                        layout, kinds=kinds)
    mems = stage_memory(card, stages, args.tp, args.pp, args.ep, args.cp, seq, mb, training, args.dp,
                        args.micro_batches, layout)
    name = card.get("_card", {}).get("name", "card")
    freq, off = cards.index_sharing(card)
    cp_desc = f" ({layout} allgather CP)" if args.cp > 1 else ""
    what = (f"LoRA rank {training.lora_dim}" if training.lora_dim is not None else "every parameter") + \
        f" trains, {training.optimizer} AdamW" + (" (distributed)" if training.distributed_optimizer else "")
    print(f"dry run: {name}  TP{args.tp} PP{args.pp} EP{args.ep} CP{args.cp}{cp_desc} DP{args.dp}  micro batch "
          f"{mb} x {seq} tokens (--batch-size x --seq-len, global)  (index_topk_freq={freq}, "
          f"index_skip_topk_offset={off}); {what}; recompute {training.recompute}; "
          f"built on the meta device, nothing allocated")
    print(f"per-rank parameters of one layer: {info['layer_params_per_rank']}")
    for computes, by_loss in info["layer_peak"].items():
        (with_loss, phase), (without, phase2) = by_loss[True], by_loss[False]
        kind = "computes" if computes else "reuses"
        print(f"one DSA layer ({kind} indices), per rank, {seq // args.cp} local "
              f"of {seq} tokens: peak {with_loss / GIB:.2f} GiB ({phase}); "
              f"without the indexer-loss phase {without / GIB:.2f} GiB ({phase2})")
    print(f"{'stage':>5} {'layers':>9} {'dense':>5} {'moe':>4} {'params/rank':>14} {'attn act GiB':>12}  indices")
    total = 0
    for st in stages:
        comp = [L for L in range(st.first, st.last + 1) if index_sharing.computes_indices(L, freq, off)]
        reuse = [f"{L}<-{index_sharing.index_source_layer(L, freq, off)}" for L in range(st.first, st.last + 1)
                 if not index_sharing.computes_indices(L, freq, off)]
        n_dense = sum(x.startswith("dense") for x in st.layer_kinds)
        total += st.params_per_rank
        print(f"{st.index:>5} {st.first:>4}-{st.last:<4} {n_dense:>5} {len(st.layer_kinds) - n_dense:>4} "
              f"{st.params_per_rank / 1e9:>12.3f} B {st.attn_act_bytes * mb / GIB:>12.2f}  compute {comp}"
              + (f" reuse {reuse}" if reuse else "") + (" +MTP" if st.has_mtp else ""))
    print(f"sum over one rank per stage: {total / 1e9:.2f} B parameters")
    print_memory(mems)
    peak = max(peak_bytes(m) for m in mems)
    print_verdict(card, lay, peak, seq, mb, training, args.gpu_memory_gib, args.dp, args.micro_batches, layout, kinds)
    return 0


def print_memory(mems: list[memory.StageMemory]) -> None:
    keys = list(dict.fromkeys(k for m in mems for k in m.parts))
    print("memory per rank (GiB): peak = every term but the smaller of transient and logits_loss")
    print(f"{'stage':>5} {'in flight':>9} " + " ".join(f"{k:>12}" for k in keys) + f" {'peak':>8}")
    for m in mems:
        print(f"{m.stage:>5} {m.in_flight:>9} " + " ".join(f"{m.parts.get(k, 0) / GIB:>12.2f}" for k in keys)
              + f" {peak_bytes(m) / GIB:>8.2f}")


def print_verdict(card, lay: Layout, peak: int, seq: int, mb: int, training: memory.Training, gpu_memory_gib: float,
                  dp: int, micro_batches, cp_layout: str, kinds) -> None:
    need = peak * (1 + FRAGMENTATION) / GIB + RESERVED_GIB
    for cap in dict.fromkeys((gpu_memory_gib, 141.0)):
        verdict = "fits" if fits(peak, cap) else "does NOT fit"
        print(f"verdict on {cap:g} GiB cards: {verdict} (largest stage {peak / GIB:.1f} GiB allocated, "
              f"{need:.1f} GiB with {FRAGMENTATION:.0%} allocator slack and {RESERVED_GIB:g} GiB reserved, "
              f"expandable segments)")
    if not fits(peak, gpu_memory_gib):
        near = nearest_fit(card, lay, seq, mb, training, gpu_memory_gib, dp, micro_batches, cp_layout, kinds)
        if near is None:
            print(f"nearest layout that fits {gpu_memory_gib:g} GiB: none within PP x4, CP x4 and full recompute")
        else:
            print(f"nearest layout that fits {gpu_memory_gib:g} GiB: {near[0].describe()} "
                  f"(largest stage {near[1] / GIB:.1f} GiB)")
