#!/usr/bin/env python
"""Train a full-width GLM-5.2 slice with the LoRA job on one GPU and set its peak memory beside the
dry run's plan of the same slice and layout.

The slice is the ``glm5.2`` card cut to 4 layers (3 dense + 1 MoE, the card's ``first_k_dense_replace``),
every width as the card has it, no MTP layer, bf16, TP = PP = EP = CP = 1, one sequence per step,
built as a GPTModel (``--model gpt``: each per-layer figure is one attention + MLP / MoE layer).
It is trained by the LoRA job's pieces (``train.core.prepare``, ``train.lora.apply_lora`` with
Megatron-Bridge PEFT, ``train.core.train``); the batch is made once per length so the step time is
the model's. Routed experts and, when even the fewest experts leave no room for the logits, the
vocabulary are cut to the largest counts the dry run (``train.planner``) fits on this GPU; each row
names what it ran.

Per length (``--seq-lens``): step time (median over the steps after the first), tokens/s, peak
memory allocated over the whole run (``torch.cuda.max_memory_allocated``, and the reserved peak
beside it, under the launchers' allocator settings ``alloc_conf`` of
:func:`glm5_dsa_plugin.train.core.cuda_alloc_conf`), the planner's peak for the same slice, and the
memory allocated after each layer's forward (its kept activations), the model's forward time per
layer (CUDA events, last step) and MFU from the model FLOPs of :func:`model_flops` over the card's
dense bf16 peak.

    python scripts/bench_lora_slice.py --out benchmarks/results     # on the GPU
    python scripts/bench_lora_slice.py --plan-only                  # re-plan the committed rows (CPU)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

GIB = 1024**3
EXPERTS = (256, 128, 64, 32, 16, 8)
VOCABS = (None, 65536, 32768, 16384)  # None: the card's vocabulary
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, SXM


def slice_card(experts: int, vocab: int | None, layers: int = 4, base: str = "glm5.2") -> dict:
    from glm5_dsa_plugin.checkpoints import cards

    over = dict(num_hidden_layers=layers, n_routed_experts=experts, num_nextn_predict_layers=0)
    if vocab:
        over["vocab_size"] = vocab
    return cards.with_overrides(cards.load_card(base), **over)


def init_state(device: str) -> None:
    """megatron-core's single-rank parallel state (the planner builds layers on the meta device)."""
    from glm5_dsa_plugin.train import core

    core.init_parallel(core.base_parser("state").parse_args(["--device", device]))


def planned_peak(card: dict, seq: int, recompute: str = "none", lora_dim: int = 8, fused_swiglu: bool = True) -> int:
    """The dry run's peak for the slice trained as this script trains it (one rank, the launchers' AdamW;
    ``fused_swiglu``: megatron-core's fused SwiGLU, as the launchers run on a GPU)."""
    from glm5_dsa_plugin.train import memory as mem
    from glm5_dsa_plugin.train import planner

    training = mem.Training(lora_dim=lora_dim, optimizer="launcher", recompute=recompute, fused_swiglu=fused_swiglu)
    key = card["n_routed_experts"]  # the layers' parameters depend on the expert count only
    if key not in _KINDS:
        _KINDS[key] = planner.layer_kind_params(card, 1, 1)
    peak, _ = planner.layout_peak(card, planner.Layout(1, 1, 1, 1, recompute), seq, 1, training,
                                  kinds=_KINDS[key])
    return peak


_KINDS: dict[int, dict] = {}


def choose(seq: int, gpu_gib: float) -> tuple[int, int | None, str]:
    """(experts, vocabulary, recompute): without recompute, then with megatron-core's full
    recompute, the most experts and then the largest vocabulary whose plan fits ``gpu_gib``."""
    from glm5_dsa_plugin.train import planner

    for recompute in ("none", "full"):
        for vocab in VOCABS:
            for e in EXPERTS:
                if planner.fits(planned_peak(slice_card(e, vocab), seq, recompute), gpu_gib):
                    return e, vocab, recompute
    return EXPERTS[-1], VOCABS[-1], "full"


def model_flops(card: dict, seq: int) -> float:
    """Model FLOPs of one fwd + bwd of one sequence (3 x forward for every matmul): the linears a
    token visits (attention projections, dense MLP, the top-k routed and the shared experts, the
    output layer) 2 * params per token; sparse attention 2 * topk * H * (576 + 512) per token; the
    indexer's scores (forward only, causal half) seq * Hi * Di per token."""
    h, H, L = card["hidden_size"], card["num_attention_heads"], card["num_hidden_layers"]
    dn, dr, dv = card["qk_nope_head_dim"], card["qk_rope_head_dim"], card["v_head_dim"]
    qr, kr = card["q_lora_rank"], card["kv_lora_rank"]
    Hi, Di, K = card["index_n_heads"], card["index_head_dim"], card["index_topk"]
    attn = h * qr + qr * H * (dn + dr) + h * (kr + dr) + kr * H * (dn + dv) + H * dv * h \
        + qr * Hi * Di + h * Di + h * Hi
    k_dense = card["first_k_dense_replace"]
    f = card["moe_intermediate_size"]
    mlp = k_dense * 3 * h * card["intermediate_size"] \
        + (L - k_dense) * 3 * h * f * (card["num_experts_per_tok"] + card["n_shared_experts"])
    linear = L * attn + mlp + h * card["vocab_size"]
    sparse = L * 2 * min(K, seq) * H * (kr + dr + kr)
    indexer = L * seq * Hi * Di  # 2 * (seq / 2) keys per query on average
    return seq * (3 * 2 * linear + 3 * sparse + indexer)


def run_slice(experts: int, vocab: int | None, recompute: str, seqs: list[int], steps: int,
              backend: str = "tilelang", device: str = "cuda", out: str | None = None, base: str = "glm5.2"
              ) -> list[dict]:
    """Build the slice once and train ``steps`` LoRA steps at each length; one row per length
    (``base="tiny"`` on the CPU: a smoke run of the whole path, memory figures 0)."""
    import torch

    from glm5_dsa_plugin.train import core, lora

    cuda = device == "cuda"
    mem_now = torch.cuda.memory_allocated if cuda else (lambda: 0)
    argv = ["--model", "gpt", "--card", base, "--card-override", "num_hidden_layers=4", "--card-override",
            f"n_routed_experts={experts}", "--card-override", "num_nextn_predict_layers=0", "--backend", backend,
            "--device", device, "--dtype", "bf16" if cuda else "fp32", "--seq-len", str(max(seqs)), "--batch-size", "1",
            "--steps", str(steps), "--lr", "1e-4"]
    if vocab:
        argv += ["--card-override", f"vocab_size={vocab}"]
    ap = core.base_parser("LoRA slice")
    ap.add_argument("--lora-dim", type=int, default=8)
    args = ap.parse_args(argv)
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if recompute == "full" else {}
    card, model = core.prepare(args, mtp_num_layers=None, use_cpu_initialization=not cuda, **extra)  # init on the GPU
    _, model = lora.apply_lora(model, args.lora_dim, 16)
    model.to(device)
    weights_gib = mem_now() / GIB
    layers = [m for n, m in model.named_modules() if type(m).__name__ == "TransformerLayer"]
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    rows = []
    for seq in seqs:
        args.seq_len = seq
        g = torch.Generator().manual_seed(seq)
        tok = torch.randint(0, card["vocab_size"], (1, seq + 1), generator=g).to(device)
        inp, labels = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
        pos = torch.arange(seq, device=device)[None]
        probe = dict(on=False, mem=[], ev=[])

        def pre(_m, _a, probe=probe):
            if probe["on"] and cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                probe["ev"].append([e])

        def post(_m, _a, _o, probe=probe):
            if probe["on"] and cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                probe["ev"][-1].append(e)
                probe["mem"].append(torch.cuda.memory_allocated())

        hooks = [m.register_forward_pre_hook(pre) for m in layers] + [m.register_forward_hook(post) for m in layers]

        def step(i: int, probe=probe) -> core.StepResult:
            probe["on"] = i == steps - 1
            probe["mem"].clear()
            probe["ev"].clear()
            before = mem_now()
            loss = model(inp, pos, None, labels=labels).float().mean()
            if probe["on"]:
                probe["before"], probe["after_fwd"] = before, mem_now()
            loss.backward()
            return core.StepResult(float(loss.detach()), seq)

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        log = core.train(args, model, card, step)
        for h in hooks:
            h.remove()
        peak = torch.cuda.max_memory_allocated() if cuda else 1
        reserved = torch.cuda.max_memory_reserved() if cuda else 0
        step_s = [seq / r["tokens_per_s"] for r in log]
        times = step_s[1:] or step_s
        step_ms = statistics.median(times) * 1e3
        plan_card = slice_card(experts, vocab, base=base)
        fused = bool(model.config.bias_activation_fusion)
        planned = planned_peak(plan_card, seq, recompute, fused_swiglu=fused)
        layer_fwd_ms = [a.elapsed_time(b) for a, b in probe["ev"]]
        kept = [b - a for a, b in zip([probe["before"]] + probe["mem"][:-1], probe["mem"])]
        card_name = "H200" if "H200" in gpu else "H100" if "H100" in gpu else gpu
        flops = model_flops(plan_card, seq)
        rows.append(dict(card=f"{base} (4 layers: 3 dense + 1 MoE)", layers=4, experts=experts,
                         vocab=vocab or card["vocab_size"], recompute=recompute, fused_swiglu=fused, T=seq, steps=len(log), step_ms=round(step_ms, 1),
                         tokens_per_s=round(seq / step_ms * 1e3, 1), peak_gib=round(peak / GIB, 2),
                         reserved_gib=round(reserved / GIB, 2),
                         planned_peak_gib=round(planned / GIB, 2),
                         planned_over_measured=round(planned / peak, 3), gpu=card_name, gpu_name=gpu,
                         mfu=round(flops / (step_ms / 1e3) / (PEAK_TFLOPS.get(card_name, 989.0) * 1e12), 4),
                         model_tflops_per_step=round(flops / 1e12, 2), weights_gib=round(weights_gib, 2),
                         kept_after_forward_gib=round((probe["after_fwd"] - probe["before"]) / GIB, 2),
                         layer_kept_gib=[round(x / GIB, 3) for x in kept],
                         layer_fwd_ms=[round(x, 2) for x in layer_fwd_ms],
                         losses=[round(r["loss"], 4) for r in log], backend=backend,
                         lora="Megatron-Bridge PEFT LoRA rank 8 on the MLA projections",
                         date=datetime.date.today().isoformat()))
        print(json.dumps(rows[-1]), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
        del inp, labels, tok
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results"))
    ap.add_argument("--seq-lens", default="16384,65536")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default: the most the plan fits)")
    ap.add_argument("--plan-only", action="store_true", help="recompute planned_peak_gib of --out's rows (CPU)")
    a = ap.parse_args()
    path = os.path.join(a.out, "lora_slice.json")
    if a.plan_only:
        init_state("cpu")
        rows = json.load(open(path))
        for r in rows:
            vocab = r["vocab"] if r["vocab"] != 154880 else None
            r.setdefault("fused_swiglu", False)  # rows measured before the launchers fused the SwiGLU
            r["planned_peak_gib"] = round(planned_peak(slice_card(r["experts"], vocab), r["T"], r["recompute"],
                                                       fused_swiglu=r["fused_swiglu"]) / GIB, 2)
            if r.get("peak_gib"):  # an out-of-memory row has no measured peak
                r["planned_over_measured"] = round(r["planned_peak_gib"] / r["peak_gib"], 3)
        json.dump(rows, open(path, "w"), indent=1)
        print_table(rows)
        return 0
    import torch

    from glm5_dsa_plugin.train import core

    alloc_conf = core.cuda_alloc_conf()  # the launchers' allocator settings, before CUDA starts
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    init_state("cuda")
    seqs = [int(s) for s in a.seq_lens.split(",")]
    groups: dict[tuple, list[int]] = {}
    for s in seqs:
        key = (a.experts, None, "none") if a.experts else choose(s, gpu_gib)
        groups.setdefault(key, []).append(s)
    print(f"{gpu_gib:.1f} GiB GPU; planned slices (experts, vocab, recompute): {groups}", flush=True)
    rows = []
    os.makedirs(a.out, exist_ok=True)
    for (e, v, r), ss in sorted(groups.items(), key=lambda kv: kv[1][0]):
        for attempt in range(3):  # out of memory: half the experts, at most twice
            try:
                rows += [dict(row, alloc_conf=alloc_conf) for row in run_slice(e, v, r, ss, a.steps, out=path + "l")]
                break
            except torch.OutOfMemoryError as err:
                print(f"out of memory at experts={e} vocab={v} recompute={r}: {str(err)[:200]}", flush=True)
                e //= 2
            except Exception as err:  # noqa: BLE001  (keep the other lengths' rows)
                print(f"failed at experts={e} vocab={v} recompute={r}: {type(err).__name__}: {err}", flush=True)
                import traceback

                traceback.print_exc()
                break
            finally:
                import gc

                gc.collect()
                torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    json.dump(rows, open(path, "w"), indent=1)
    print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    print(f"{'gpu':>5} {'experts':>7} {'vocab':>7} {'T':>6} {'step ms':>8} {'tok/s':>8} {'MFU':>6} "
          f"{'peak GiB':>8} {'planned':>8} {'ratio':>6}")
    for r in rows:
        if r.get("error"):
            print(f"{r['gpu']:>5} {r['experts']:>7} {r['vocab']:>7} {r['T']:>6} {r['error'][:60]} "
                  f"(planned {r['planned_peak_gib']:.2f})")
            continue
        print(f"{r['gpu']:>5} {r['experts']:>7} {r['vocab']:>7} {r['T']:>6} {r['step_ms']:>8.0f} "
              f"{r['tokens_per_s']:>8.0f} {r['mfu']:>6.3f} {r['peak_gib']:>8.2f} {r['planned_peak_gib']:>8.2f} "
              f"{r['planned_over_measured']:>6.3f}")


if __name__ == "__main__":
    sys.exit(main())
