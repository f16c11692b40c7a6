"""Check and time one GLM-5 DSA transformer layer: ours against megatron-core 0.19.2's own DSA layer.

The layer is full-width GLM-5 (hidden 6144, 64 heads, q_lora 2048, kv_lora 512, indexer 32 x 128,
top-k 2048; dense: ffn 12288; MoE: the 744B's expert shape with fewer experts so it fits one GPU),
bf16, TP 1, local linears, indexer loss on. Implementations, same weights, same run:

    ours          glm5_dsa_plugin.spec's layer (our indexer, loss and sparse_mla)
    mcore_sparse  megatron-core's layer from ``get_dsa_module_spec_for_backend`` with its TileLang
                  kernels and ``dsa_indexer_use_sparse_loss=True`` (the loss ours computes)
    mcore_dense   the same with megatron-core's default dense indexer loss
    ours_replay   ours training on replayed indices (its own recorded top-k, handed back through
                  ``glm5_dsa_plugin.model.indexer_replay``: the indexer's top-k is skipped, the
                  indices come from pinned host memory and stay on the GPU once copied)
    ours_rollout  ours with the rollout-matched numerics (``dsa_indexer_precision="fp8"``: the FP8
                  indexer top-k; ``dsa_kv_fp8_qat=True``: sparse MLA reads the FP8-cache latent)
    ours_te       ours with ``transformer_impl="transformer_engine"`` (TE linears and norms)
    mcore_te      mcore_sparse on TransformerEngine modules (megatron-core's TE DSA spec)

The ``*_te`` rows need TransformerEngine (not in the default ``--impls``). ``--merge`` keeps the
rows of an existing ``--out`` that this run does not measure (each row carries its run's ``date``),
so a TE run can join a local one; rows of one (layer, T) are always measured in the same run.

Per (layer, T, impl): fwd and fwd+bwd ms (median of CUDA-event timings), peak GiB allocated during
fwd+bwd (weights and their grads included), model TFLOP/s over fwd+bwd and its MFU against the card's
bf16 peak. Every row carries ``floor``: each part's model FLOPs, minimum HBM bytes and floor ms (the
larger of FLOPs at ``--floor-tflops`` and bytes at the card's HBM bandwidth). With ``--breakdown``
ours' rows also carry ``breakdown``: each part timed alone at the layer's shapes (fwd + bwd where it
has one; ``projections_mlp`` is the layer minus the other parts), printed beside its floor, and on
a GPU ``kernels``: the kernel time of one fwd + bwd step inside the layer by kernel group
(``KERNEL_GROUPS``: sparse MLA forward / backward / passes, indexer scores, top-k select, indexer
loss, GEMMs, norms, the rest as glue), with ``busy`` and ``span``.
An out-of-memory or other failure is a row with ``error`` set. Before timing, ours is checked against
megatron-core's layer with the same indices (both built as index-reusing layers and handed the same
top-k): output and every gradient.

Model FLOPs: :mod:`glm5_dsa_plugin.model.flops` (causal selected and visible pairs; every matmul with
a gradient 3 x its forward; MoE counts the routed experts a token visits plus the shared expert).

    python scripts/bench_layer.py --breakdown            # H200: JSON + chart under benchmarks/results/
    python scripts/bench_layer.py --tiny --device cpu    # a CPU smoke run of the whole script
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kernel_events, bench_layer_report

from bench_layer_report import (IMPLS, breakdown_table, chart, kernels_table, markdown_table,  # noqa: E402
                                merge_rows)
from kernel_events import KERNEL_GROUPS, kernel_group, kernel_split  # noqa: E402,F401

GLM5 = dict(hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
            qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048,
            intermediate_size=12288, moe_intermediate_size=2048, n_routed_experts=32, num_experts_per_tok=8,
            n_shared_experts=1)
TINY = dict(hidden_size=128, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=32, v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=16,
            intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1)


def make_config(dims, layer: str, impl: str, device: str, reuse: bool = False):
    from glm5_dsa_plugin.checkpoints import cards
    from glm5_dsa_plugin.train.core import device_config

    card = cards.with_overrides(cards.load_card("glm5"), **dims, num_hidden_layers=2 if reuse else 1,
                                first_k_dense_replace=0 if layer == "moe" else 2,
                                index_topk_freq=2 if reuse else 1, index_skip_topk_offset=1 if reuse else 0)
    over = dict(params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=device == "cpu",
                **device_config(device),  # as the launchers set it
                transformer_impl="transformer_engine" if impl.endswith("_te") else "local",
                moe_token_dispatcher_type="allgather", mtp_num_layers=None, moe_router_enable_expert_bias=False,
                dsa_indexer_use_sparse_loss=impl != "mcore_dense")
    if impl.startswith("mcore") and device == "cuda":
        over["dsa_kernel_backend"] = "tilelang"
    cfg = cards.card_to_transformer_config(card, **over)
    if impl == "ours_rollout":  # attributes, as the launchers set them (megatron-core's dataclass has neither)
        cfg.dsa_indexer_precision, cfg.dsa_kv_fp8_qat = "fp8", True
    return cfg


def build_layer(cfg, layer: str, impl: str, layer_number: int = 1):
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.transformer.spec_utils import build_module, ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from glm5_dsa_plugin.megatron import spec

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    te = impl.endswith("_te")
    provider = spec._backend(cfg) if te else spec._LocalProvider()
    subs = spec.layer_submodules(cfg, layer == "moe", provider)
    if impl.startswith("mcore"):
        subs = copy.copy(subs)
        attn = get_dsa_module_spec_for_backend(cfg, provider)
        if not te:
            # without TransformerEngine, AbsorbedMLASelfAttention takes its down projections only as
            # ColumnParallelLinear (as our spec builds them); everything else is megatron-core's spec
            attn.submodules.linear_q_down_proj = ColumnParallelLinear
            attn.submodules.linear_kv_down_proj = ColumnParallelLinear
        subs.self_attention = attn
    return build_module(ModuleSpec(module=TransformerLayer, submodules=subs), config=cfg, layer_number=layer_number)


def layer_parts(dims, layer: str, T: int) -> dict:
    """Model FLOPs (fwd + bwd) of one layer over one causal sequence of T tokens, by part."""
    from glm5_dsa_plugin.model import flops

    return flops.layer_flops(flops.DSAShape(**dims), [T], moe=layer == "moe")


def model_flops(dims, layer: str, T: int) -> float:
    return layer_parts(dims, layer, T)["total"]


# the breakdown's parts: model-FLOPs parts of :mod:`glm5_dsa_plugin.model.flops` each covers (the
# loss's target, ``indexer_target``, is formed in the sparse-MLA backward from its own probabilities:
# no floor of its own)
PART_FLOPS = {"indexer": ("indexer_projections",), "topk": ("indexer_scores",), "sparse_mla": ("sparse_mla",),
              "indexer_loss": ("indexer_loss",), "projections_mlp": ("projections", "mlp", "moe")}


def part_bytes(dims, layer: str, T: int) -> dict:
    """Minimum HBM bytes of each part's fwd + bwd: every input read once and every output written
    once per pass, no intermediate of size T x topk or T x T (bf16 activations, int32 indices)."""
    d = dims
    h, H, Hi, Di = d["hidden_size"], d["num_attention_heads"], d["index_n_heads"], d["index_head_dim"]
    dqk, dv, K = d["kv_lora_rank"] + d["qk_rope_head_dim"], d["kv_lora_rank"], min(d["index_topk"], T)
    idx_act = T * (Hi * Di + Di + Hi)  # indexer q, k, w
    if layer == "moe":  # every expert's weights are read, whichever tokens it gets
        ffn = 3 * h * d["moe_intermediate_size"] * (d["n_routed_experts"] + d["n_shared_experts"]) + h * d["n_routed_experts"]
    else:
        ffn = 3 * h * d["intermediate_size"]
    fl1 = layer_parts(dims, layer, 1)
    params = fl1["projections"] / 6 + ffn  # the linears' weights: read in fwd and bwd, gradient written
    return {  # bf16 = 2 bytes; int32 indices and fp32 lse = 4 bytes
        # x and q_lora read in fwd and bwd, their gradients written; q, k, w written, their gradients read
        "indexer": 2 * (3 * T * (h + d["q_lora_rank"]) + 2 * idx_act),
        # q, k, w read; the indices written
        "topk": 2 * idx_act + 4 * T * K,
        # q and kv read twice, their gradients written; o written, o and do read; indices read twice; lse out and
        # in; the loss's target (fp32 [T, K]) written
        "sparse_mla": 2 * (3 * T * H * dqk + 3 * T * dqk + 3 * T * H * dv) + 3 * 4 * T * K + 2 * 4 * T * H,
        # indexer q, k, w read twice, gradients written; the target read, indices read 3 times
        "indexer_loss": 2 * 3 * idx_act + 4 * (4 * T * K),
        # the linears' weights read in fwd and bwd, their gradients written; the layer's input, output and gradients
        "projections_mlp": 2 * 3 * params + 2 * 4 * T * h,
    }


def floors(dims, layer: str, T: int, floor_tflops: float, hbm_bytes_per_s: float | None) -> dict:
    """{part: {gflop, gbyte, floor_ms}}: the larger of FLOPs at ``floor_tflops`` and bytes at the HBM
    bandwidth (FLOPs only when the bandwidth is unknown), and ``total``."""
    fl = layer_parts(dims, layer, T)
    by = part_bytes(dims, layer, T)
    out = {}
    for part, names in PART_FLOPS.items():
        f = sum(fl[n] for n in names)
        ms = f / (floor_tflops * 1e12) * 1e3
        if hbm_bytes_per_s:
            ms = max(ms, by[part] / hbm_bytes_per_s * 1e3)
        out[part] = dict(gflop=f / 1e9, gbyte=by[part] / 1e9, floor_ms=ms)
    out["total"] = dict(gflop=sum(v["gflop"] for v in out.values()), gbyte=sum(v["gbyte"] for v in out.values()),
                        floor_ms=sum(v["floor_ms"] for v in out.values()))
    return out


def timed(fn, warmup: int, rep: int, device: str) -> float:
    for _ in range(warmup):
        fn()
    if device != "cuda":
        t = []
        for _ in range(rep):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(t)
    times = []
    for _ in range(rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def layer_steps(lay, x, grad):
    def fwd():
        with torch.no_grad():
            lay(hidden_states=x, attention_mask=None)

    def fwd_bwd():
        out = lay(hidden_states=x, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
        for p in lay.parameters():
            p.grad = None
        for m in lay.modules():
            if hasattr(m, "main_grad"):
                m.main_grad = None
    return fwd, fwd_bwd


def reset_index_holders(cfg):
    from glm5_dsa_plugin.model import shared_topk

    shared_topk.forget(cfg)
    for attr in ("_dsa_index_share_topk_holder", "_dsa_index_share_topk_length_holder"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)


def breakdown_ours(lay, x, dims, device, warmup, rep) -> dict:
    """Each DSA part of our layer timed alone at the layer's shapes (fwd + bwd where it has one)."""
    from glm5_dsa_plugin.model import indexer, indexer_loss, visibility
    from glm5_dsa_plugin.ops import SlotProbsGrad, sparse_mla

    attn = lay.self_attention
    core = attn.core_attention
    T = x.shape[0]
    H, dqk, dv = dims["num_attention_heads"], dims["kv_lora_rank"] + dims["qk_rope_head_dim"], dims["kv_lora_rank"]
    gen = torch.Generator(device=device).manual_seed(0)
    xs = x[:, 0].detach()
    qr = torch.randn(T, dims["q_lora_rank"], device=device, dtype=x.dtype, generator=gen)
    vis = visibility.Visibility.causal(T, device=device)
    out = {}
    with torch.no_grad():
        qi, ki, wi = core.indexer.qkw(xs, qr, vis.query_pos)

    def indexer_proj():
        a, b, c = core.indexer.qkw(xs, qr, vis.query_pos)
        (a.float().sum() + b.float().sum() + c.float().sum()).backward()
    out["indexer"] = timed(indexer_proj, warmup, rep, device)
    key_order = indexer.reads_key_order(T)  # the slot order the layer's attention and loss read
    out["topk"] = timed(lambda: indexer.select_topk(qi, ki, wi, core.indexer.topk, vis, check=False,
                                                    key_order=key_order), warmup, rep, device)
    att_idx = indexer.select_topk(qi, ki, wi, core.indexer.topk, vis, check=False, key_order=key_order)
    q = (torch.randn(T, H, dqk, device=device, generator=gen) * 0.5).to(x.dtype).requires_grad_(True)
    kv = (torch.randn(T, 1, dqk, device=device, generator=gen) * 0.5).to(x.dtype).requires_grad_(True)
    g = torch.randn(T, H, dv, device=device, generator=gen).to(x.dtype)

    logits_leaf = torch.zeros(T, att_idx.shape[-1], device=device, requires_grad=True)
    kept = {}

    def keep_target(p):  # the slot probabilities the attention's backward hands the loss
        kept["target"] = p[:, 0]
        return torch.zeros_like(p[:, 0])

    def mla():  # as the layer calls it: the loss's target formed in this backward
        o, _ = sparse_mla(q, kv, att_idx[:, None], core.softmax_scale, d_v=dv, backend=core.backend, validate=False,
                          slot_probs_grad=SlotProbsGrad(logits_leaf, keep_target))
        o.backward(g)
    out["sparse_mla"] = timed(mla, warmup, rep, device)
    target = kept["target"]
    qil, kil, wil = (t.detach().requires_grad_(True) for t in (qi, ki, wi))

    def loss():  # the indexer's logits at the slots, the KL against that target, their backward
        logits = indexer.selected_scores(qil, kil, wil, att_idx)
        _, grad = indexer_loss.indexer_kl_loss_and_grad(logits, target.clone(), att_idx, 1e-3)
        logits.backward(grad)
    out["indexer_loss"] = timed(loss, warmup, rep, device)
    return out


def check_same_indices(dims, layer: str, T: int, device: str) -> dict:
    """Ours vs megatron-core's layer as index-reusing layers handed the same top-k: output and grads."""
    from glm5_dsa_plugin.model import indexer, visibility
    from glm5_dsa_plugin.model.shared_topk import SharedTopk

    cfgs = {impl: make_config(dims, layer, impl, device, reuse=True) for impl in ("ours", "mcore_sparse")}
    torch.manual_seed(0)
    ours = build_layer(cfgs["ours"], layer, "ours", layer_number=2).to(device=device, dtype=torch.bfloat16)
    theirs = build_layer(cfgs["mcore_sparse"], layer, "mcore_sparse", layer_number=2).to(device=device,
                                                                                         dtype=torch.bfloat16)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    missing = [m for m in missing if not m.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"state dicts differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(T, 1, dims["hidden_size"], device=device, generator=gen).to(torch.bfloat16)
    iq = torch.randn(T, 4, 32, device=device, generator=gen)
    ik, iw = torch.randn(T, 32, device=device, generator=gen), torch.randn(T, 4, device=device, generator=gen)
    idx = indexer.select_topk(iq, ik, iw, dims["index_topk"], visibility.Visibility.causal(T, device=device))
    grad = torch.randn(T, 1, dims["hidden_size"], device=device, generator=gen).to(torch.bfloat16)
    res = {}
    for name, lay, cfg in (("ours", ours, cfgs["ours"]), ("mcore", theirs, cfgs["mcore_sparse"])):
        reset_index_holders(cfg)
        SharedTopk(1, 1).publish(cfg, idx)  # layer 1's top-k, as a computing layer writes it
        setattr(cfg, "_dsa_index_share_topk_holder", {1: idx[None]})
        lay.train()
        xx = x.clone().requires_grad_(True)
        out = lay(hidden_states=xx, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
        res[name] = (out.detach().float(), xx.grad.float(),
                     {n: p.grad.float() for n, p in lay.named_parameters() if p.grad is not None})
        reset_index_holders(cfg)
    (o1, x1, g1), (o2, x2, g2) = res["ours"], res["mcore"]

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    grads = {n: rel(g1[n], g2[n]) for n in g2 if n in g1 and g2[n].norm() > 0}
    worst = max(grads.items(), key=lambda kv: kv[1]) if grads else (None, 0.0)
    return dict(layer=layer, T=T, out_rel=rel(o1, o2), dx_rel=rel(x1, x2), worst_param_grad=worst[0],
                worst_param_grad_rel=worst[1], params_compared=len(grads),
                params_only_one_side=sorted(set(g1) ^ set(g2)))


def attach_own_replay(lay, cfg, x) -> None:
    """Record the layer's own top-k in one no-grad forward and attach it as the replay of every
    later forward (the carrier is the config: the benchmark passes no mask or packed params)."""
    from glm5_dsa_plugin.model import indexer_replay as ir
    from glm5_dsa_plugin.model.dsa_fields import dsa_geometry

    rec = ir.IndexerTopkRecorder()
    ir.attach_indexer_topk_recorder(cfg, rec)
    with torch.no_grad():
        lay(hidden_states=x, attention_mask=None)
    ir.attach_indexer_topk_recorder(cfg, None)
    T = x.shape[0]
    cu = torch.tensor([0, T])
    g = dsa_geometry(cfg)
    replay = ir.pack_indexer_topk(rec.records(cu), cu, num_layers=cfg.num_layers, topk=g.topk,
                                  topk_freq=g.topk_freq, skip_offset=g.skip_offset)
    ir.attach_indexer_replay(cfg, replay)


def run_one(dims, layer, T, impl, device, warmup, rep, breakdown: bool) -> dict:
    row = dict(layer=layer, T=T, impl=impl, fwd_ms=None, fwd_bwd_ms=None, peak_gib=None, tflops=None, mfu=None,
               breakdown=None, kernels=None, floor=None, error=None, date=None)
    lay = None
    try:
        cfg = make_config(dims, layer, impl, device)
        torch.manual_seed(0)
        lay = build_layer(cfg, layer, impl).to(device=device, dtype=torch.bfloat16)
        lay.train()
        gen = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(T, 1, dims["hidden_size"], device=device, generator=gen).to(torch.bfloat16)
        x.requires_grad_(True)
        grad = torch.randn(T, 1, dims["hidden_size"], device=device, generator=gen).to(torch.bfloat16)
        if impl == "ours_replay":
            attach_own_replay(lay, cfg, x)
        fwd, fwd_bwd = layer_steps(lay, x, grad)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        if device == "cuda":
            torch.cuda.synchronize()
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["fwd_ms"] = timed(fwd, warmup, rep, device)
        row["fwd_bwd_ms"] = timed(fwd_bwd, warmup, rep, device)
        if breakdown and impl in ("ours", "ours_te"):
            parts = breakdown_ours(lay, x, dims, device, warmup, rep)
            parts["projections_mlp"] = max(0.0, row["fwd_bwd_ms"] - sum(parts.values()))
            row["breakdown"] = parts
            if device == "cuda":
                row["kernels"] = kernel_split(fwd_bwd)
    except Exception as exc:  # noqa: BLE001 - an out-of-memory is a row, not a crash
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        if not isinstance(exc, torch.OutOfMemoryError):
            traceback.print_exc()
    finally:
        del lay
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def add_derived(row: dict, dims, gpu: str, floor_tflops: float) -> dict:
    """Model TFLOP/s, MFU and the per-part floors of a row, from its shape and its fwd+bwd time
    (also for rows merged from an earlier run)."""
    from glm5_dsa_plugin.model import flops

    peaks = flops.device_peaks(gpu)
    row["floor"] = floors(dims, row["layer"], row["T"], floor_tflops, peaks[1] if peaks else None)
    row["floor"]["floor_tflops"] = floor_tflops
    if row.get("fwd_bwd_ms"):
        f = model_flops(dims, row["layer"], row["T"])
        row["tflops"] = f / (row["fwd_bwd_ms"] * 1e-3) / 1e12
        row["mfu"] = flops.mfu(f, row["fwd_bwd_ms"] * 1e-3, gpu)
    return row


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in ("torch", "triton", "tilelang", "megatron-core", "transformers", "glm5-dsa-plugin"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="4096,16384,65536", help="comma-separated token counts")
    ap.add_argument("--layers", default="dense,moe")
    ap.add_argument("--impls", default="ours,mcore_sparse,mcore_dense")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (a smoke run of the script)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rep", type=int, default=5)
    ap.add_argument("--check-T", type=int, default=4096, help="T of the same-indices check (0: skip)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_layer.json"))
    ap.add_argument("--chart", default=None, help="PNG path (default: beside --out)")
    ap.add_argument("--chart-only", action="store_true", help="redraw the chart of an existing --out JSON")
    ap.add_argument("--table", action="store_true",
                    help="print the markdown table (and the breakdown against the floors) of an existing --out JSON")
    ap.add_argument("--budget-s", type=float, default=0, help="skip the remaining rows after this many seconds")
    ap.add_argument("--breakdown", action="store_true",
                    help="time ours' parts alone and print them beside their floors (JSON: breakdown per row)")
    ap.add_argument("--floor-tflops", type=float, default=600.0,
                    help="matmul rate of the FLOP floors (default 600: a sustained bf16 GEMM on Hopper at 700 W)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows (and checks) of an existing --out that this run does not measure")
    a = ap.parse_args(argv)
    png = a.chart or os.path.splitext(a.out)[0] + ".png"
    if a.chart_only or a.table:
        with open(a.out) as f:
            result = json.load(f)
        if a.table:
            print("\n\n".join(t for t in (markdown_table(result), breakdown_table(result), kernels_table(result)) if t))
        else:
            chart(result, png)
        return 0
    t_start = time.time()

    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    if a.device == "cpu" and not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # megatron-core asks for it while building RoPE
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    if a.device == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)

    dims = TINY if a.tiny else GLM5
    Ts = [int(t) for t in a.T.split(",")]
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result = dict(gpu=torch.cuda.get_device_name() if a.device == "cuda" else "cpu", versions=versions(),
                  date=now, dims=dims, checks=[], rows=[])
    old = None
    if a.merge and os.path.exists(a.out):
        with open(a.out) as f:
            old = json.load(f)
        if old.get("dims") != dims or old.get("gpu") != result["gpu"]:
            raise SystemExit(f"--merge: {a.out} was measured with other dims or on another GPU ({old.get('gpu')})")
        for r in old["rows"] + old["checks"]:
            r.setdefault("date", old.get("date"))
    new_rows, new_checks = [], []

    def save():
        result["rows"] = merge_rows(old["rows"], new_rows) if old else list(new_rows)
        result["checks"] = (merge_rows(old["checks"], new_checks, key=("layer",)) if old else list(new_checks))
        for r in result["rows"]:
            add_derived(r, dims, result["gpu"], a.floor_tflops)
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    if a.check_T:
        for layer in a.layers.split(","):
            try:
                new_checks.append(check_same_indices(dims, layer, min(a.check_T, Ts[0]) if a.tiny else a.check_T,
                                                     a.device))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                new_checks.append(dict(layer=layer, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            new_checks[-1]["date"] = now
            print("check:", new_checks[-1], flush=True)
    for T in Ts:
        for layer in a.layers.split(","):
            for impl in a.impls.split(","):
                if a.budget_s and time.time() - t_start > a.budget_s:
                    row = dict(layer=layer, T=T, impl=impl, fwd_ms=None, fwd_bwd_ms=None, peak_gib=None,
                               tflops=None, mfu=None, breakdown=None, floor=None, error="not run: time budget spent")
                else:
                    row = run_one(dims, layer, T, impl, a.device, a.warmup, a.rep, breakdown=a.breakdown)
                row["date"] = now
                new_rows.append(add_derived(row, dims, result["gpu"], a.floor_tflops))
                print(json.dumps(row), flush=True)
                save()
    save()
    try:
        chart(result, png)
    except ImportError as exc:
        print("no chart:", exc)
    if a.breakdown:
        print("\n" + "\n\n".join(t for t in (breakdown_table(result), kernels_table(result)) if t))
    print(f"\n{'layer':6} {'T':>6} {'impl':13} {'fwd ms':>9} {'f+b ms':>9} {'peak GiB':>9} {'TF/s':>6}  error")
    for r in result["rows"]:
        f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        print(f"{r['layer']:6} {r['T']:>6} {r['impl']:13} {f(r['fwd_ms']):>9} {f(r['fwd_bwd_ms']):>9} "
              f"{f(r['peak_gib'], 2):>9} {f(r['tflops'], 0):>6}  {(r['error'] or '')[:60]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
