#!/usr/bin/env python
"""Per-rank peak memory of the DSA core attention under allgather context parallelism, measured
against the dry-run planner's estimate (``train.attention_memory.layer_peak_bytes``).

The ``--cp`` ranks are processes sharing one GPU, talking through gloo (CUDA tensors staged
through the host), so a single H200 measures what each rank of a CP group allocates: one layer
that computes its indices (indexer, top-k over all gathered keys, sparse MLA, the indexer loss),
GLM-5's attention geometry from ``--card`` at TP 1, bf16, zigzag bshd layout, batch 1. Peak is
``torch.cuda.max_memory_allocated`` over the forward and backward, above what the rank held
before (weights, its local inputs but the absorbed query, which the planner counts as the layer's),
in the second step at each length (the first also holds one-time buffers: kernel autotuning's
benchmark allocations), after the guard has settled the previous step's flags (what a queued
call keeps for a possible dump, at most ``pending_bytes``, is released; the planner adds it).
An out-of-memory is a row with ``error``, not a crash.

    python scripts/bench_cp_memory.py --cp 2 --seq 16384,32768,65536,131072 --out benchmarks/results

Writes ``bench_cp_memory.json`` (and ``bench_cp_memory.png`` with matplotlib) under ``--out``.
On CPU (``--device cpu``, for tests) the reference backend runs and no peak is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from glm5_dsa_plugin.checkpoints import cards  # noqa: E402
from glm5_dsa_plugin.train.attention_memory import layer_peak_bytes  # noqa: E402

GIB = 2**30


def _core_attention(card: dict, cp: int, device: str):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from glm5_dsa_plugin.megatron.spec import dsa_attention_spec

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = cards.card_to_transformer_config(card, mtp_num_layers=None, context_parallel_size=cp,
                                           cp_comm_type="allgather" if cp > 1 else None, params_dtype=dtype,
                                           bf16=dtype == torch.bfloat16)
    pgc = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    core = dsa_attention_spec(cfg, cp_layout="zigzag").submodules.core_attention
    scale = (card["qk_nope_head_dim"] + card["qk_rope_head_dim"]) ** -0.5
    att = build_module(core, config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                       softmax_scale=scale, cp_comm_type="allgather", pg_collection=pgc).train().to(device, dtype)
    att.backend = "tilelang" if device == "cuda" else "reference"
    return att, dtype


def _step(att, card: dict, s_loc: int, device: str, dtype) -> int | None:
    """One forward and backward over ``s_loc`` local rows -> peak bytes above the start (CUDA)."""
    H, lora, dv = card["num_attention_heads"], card["kv_lora_rank"], card["v_head_dim"]
    dq = lora + card["qk_rope_head_dim"]

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(True)

    key = rand(s_loc, 1, 1, dq)
    x, qr = rand(s_loc, 1, card["hidden_size"]), rand(s_loc, 1, card["q_lora_rank"])
    up_v = (torch.randn(H, dv, lora, device=device, dtype=dtype) * 0.05).requires_grad_(True)
    grad = torch.randn(s_loc, 1, H * dv, device=device, dtype=dtype)
    if device == "cuda":
        from glm5_dsa_plugin.ops import guard_stats

        guard_stats()  # settles the previous step's queued flags: what they kept is released
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    query = rand(s_loc, 1, H, dq)  # counted: the planner keeps the absorbed q as the layer's activation
    out = att(query, key, None, None, x, qr, packed_seq_params=None, up_v_weight=up_v)
    out.backward(grad)
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _worker(rank: int, store: str, args, card: dict, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if args.device == "cpu":
        torch.cuda.current_device = lambda: "cpu"  # megatron-core asks CUDA for a device
    else:
        torch.cuda.set_device(0)  # every rank on the one GPU
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.cp)
    ps.initialize_model_parallel(context_parallel_size=args.cp)
    att, dtype = _core_attention(card, args.cp, args.device)
    rows = []
    for seq in (int(s) for s in args.seq.split(",")):
        row = dict(seq=seq, cp=args.cp, rank=rank, peak_gib=None, error=None)
        try:
            _step(att, card, seq // args.cp, args.device, dtype)  # warm-up: one-time buffers
            att.zero_grad(set_to_none=True)
            peak = _step(att, card, seq // args.cp, args.device, dtype)
            row["peak_gib"] = None if peak is None else peak / GIB
        except torch.OutOfMemoryError as e:
            row["error"] = f"out of memory: {str(e).splitlines()[0]}"
        att.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        failed = torch.tensor([row["error"] is not None], dtype=torch.int32)
        dist.all_reduce(failed)  # every rank stops at the first length one of them cannot hold
        if int(failed):
            break
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def _chart(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in result["rows"] if r["measured_peak_gib"] is not None]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["measured_peak_gib"] for r in rows], 0.4, label="measured (max over ranks)")
    ax.bar([x + 0.2 for x in xs], [r["planned_peak_gib"] for r in rows], 0.4, label="planner estimate")
    ax.set_xticks(list(xs), [f"{r['seq'] // 1024}K" for r in rows])
    ax.set_xlabel(f"global tokens (CP = {result['cp']}, {result['card']})")
    ax.set_ylabel("per-rank peak, GiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--card", default="glm5_744b_a40b")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq", default="16384,32768,65536,131072", help="comma-separated global lengths")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    card = cards.load_card(args.card)
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), args, card, tmp), nprocs=args.cp, join=True)
        per_rank = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(args.cp)]
    rows = []
    for i, first in enumerate(per_rank[0]):
        ranks = [pr[i] for pr in per_rank if i < len(pr)]
        errors = [r["error"] for r in ranks if r["error"]]
        peaks = [r["peak_gib"] for r in ranks if r["peak_gib"] is not None]
        planned, phase = layer_peak_bytes(card, tp=1, cp=args.cp, seq=first["seq"], computes=True)
        rows.append(dict(seq=first["seq"], measured_peak_gib=max(peaks) if peaks and not errors else None,
                         per_rank_peak_gib=[r["peak_gib"] for r in ranks], planned_peak_gib=planned / GIB,
                         planned_phase=phase, error=errors[0] if errors else None))
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    result = dict(card=args.card, cp=args.cp, layout="zigzag", gpu=gpu, torch=torch.__version__, rows=rows)
    path = os.path.join(args.out, "bench_cp_memory.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    _chart(result, os.path.join(args.out, "bench_cp_memory.png"))
    print(f"{'global T':>9} {'measured GiB':>13} {'planned GiB':>12} phase / error")
    for r in rows:
        m = "-" if r["measured_peak_gib"] is None else f"{r['measured_peak_gib']:.2f}"
        print(f"{r['seq']:>9} {m:>13} {r['planned_peak_gib']:>12.2f} {r['error'] or r['planned_phase']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
