#!/usr/bin/env python
"""GPU proof for the launchers: 50 steps each (LoRA, PPO, MTP) of a small 4-layer GLM-5-shaped model
(GLM-5's indexer: 32 heads x 128, top-k 2048; narrow trunk) with the TileLang backend, at each
``--seq-len`` (default 4096 and 16384 tokens per sequence), built as the launchers' default model
class (HybridModel); per-step JSON lines (``launcher_{job}_{seq}.jsonl``), a summary of every log
under --out (each run's ``model`` class from its log) and a chart of the losses.

Job ``ppo-replay``: the PPO launcher records the rollout batch's indexer top-k with
``--record-indexer-topk`` (standing in for the rollout engine), then trains on it with
``--indexer-replay --indexer-topk-overlap``."""

import argparse
import glob
import itertools
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from glm5_dsa_plugin.train import cli, lora, mtp, ppo  # noqa: E402

SMALL = {"hidden_size": 512, "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 256,
         "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64, "index_n_heads": 32,
         "index_head_dim": 128, "index_topk": 2048, "intermediate_size": 1024, "moe_intermediate_size": 256,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4, "first_k_dense_replace": 1,
         "vocab_size": 1024}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="tilelang")
    ap.add_argument("--seq-len", default="4096,16384", help="comma-separated sequence lengths")
    ap.add_argument("--jobs", default="lora,ppo,mtp", help="comma-separated: lora, ppo, mtp, ppo-replay")
    ap.add_argument("--summarize-only", action="store_true", help="only rebuild the summary and chart from --out's logs")
    a = ap.parse_args()
    cli.install_filters()  # the launchers' own filters (upstream warnings and per-module LoRA lines)
    os.makedirs(a.out, exist_ok=True)
    over = sum((["--card-override", f"{k}={json.dumps(v)}"] for k, v in SMALL.items()), [])
    mains = {"lora": lora.main, "ppo": ppo.main, "mtp": mtp.main, "ppo-replay": ppo.main}
    if not a.summarize_only:
        for seq, job in itertools.product(a.seq_len.split(","), a.jobs.split(",")):
            common = ["--card", "tiny", "--backend", a.backend, "--device", a.device, "--seq-len", seq,
                      "--batch-size", str(max(1, 8192 // int(seq))), "--steps", str(a.steps), "--lr", "3e-4"] + over
            extra = ["--lr", "3e-3"] if job == "lora" else []
            if job == "ppo-replay":
                rollouts = os.path.join(tempfile.gettempdir(), f"rollouts_indexer_topk_{seq}.pt")  # 0.4 GB at 16K
                ppo.main(common + ["--record-indexer-topk", rollouts])
                extra = ["--rollouts", rollouts, "--indexer-replay", "--indexer-topk-overlap"]
            mains[job](common + extra + ["--log-json", os.path.join(a.out, f"launcher_{job}_{seq}.jsonl")])
    summary = summarize(a.out)
    for run, s in summary.items():
        print(f"{run:11s} steps {s['steps']} loss {s['first_loss']:.4f} -> {s['last_loss']:.4f} "
              f"grad-norm finite {s['all_grad_norms_finite']} (max {s['max_grad_norm']:.3f}) guard events "
              f"{s['guard_events']} tok/s {s['tokens_per_s_last']:.0f}"
              + (f" top-k overlap {s['indexer_topk_overlap_first']:.4f} -> {s['indexer_topk_overlap_last']:.4f}"
                 if "indexer_topk_overlap_last" in s else ""))


def summarize(out: str) -> dict:
    """launcher_summary.json (and launchers.png with matplotlib) from every launcher_{job}_{seq}.jsonl in ``out``."""
    logs = sorted(glob.glob(os.path.join(out, "launcher_*_*.jsonl")))
    runs = {}
    for log in logs:
        job, seq = os.path.basename(log)[len("launcher_"):-len(".jsonl")].rsplit("_", 1)
        runs[f"{job}@{seq}"] = [json.loads(x) for x in open(log)]
    summary = {}
    for run, rows in runs.items():
        losses = [r["loss"] for r in rows]
        k = max(1, len(losses) // 10)
        summary[run] = dict(
            steps=len(rows), first_loss=sum(losses[:k]) / k, last_loss=sum(losses[-k:]) / k,
            all_grad_norms_finite=all(r["grad_norm"] == r["grad_norm"] and abs(r["grad_norm"]) < 1e30 for r in rows),
            max_grad_norm=max(r["grad_norm"] for r in rows), guard_events=rows[-1]["guard_events"],
            tokens_per_s_last=rows[-1]["tokens_per_s"], model=rows[-1].get("model"))
        if "indexer_topk_overlap" in rows[-1]:
            summary[run]["indexer_topk_overlap_first"] = rows[0]["indexer_topk_overlap"]
            summary[run]["indexer_topk_overlap_last"] = rows[-1]["indexer_topk_overlap"]
    json.dump(summary, open(os.path.join(out, "launcher_summary.json"), "w"), indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return summary
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run, rows in runs.items():
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=run)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "launchers.png"), dpi=120)
    return summary


if __name__ == "__main__":
    main()
