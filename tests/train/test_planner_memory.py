"""The dry run's per-rank memory: each term against figures computed by hand for the tiny card,
``--seq-len`` read as training reads it, the verdict and the nearest layout that fits."""

import contextlib
import io

import pytest

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.train import lora
from glm5_dsa_plugin.train import attention_memory, planner
from glm5_dsa_plugin.train import memory as mem
from tests.megatron_cpu import megatron_single_process  # noqa: F401  (fixture)

GIB = 1024**3


@pytest.fixture
def tiny(megatron_single_process):
    return cards.load_card("tiny")


def test_lora_and_optimizer_terms_match_hand_counts(tiny):
    # tiny: h 64, q_lora 32, kv_lora 32, rope 16, nope 16, v 16, 4 heads; rank 8:
    # q_down 8*(64+32) + q_up 8*(32+4*32) + kv_down 8*(64+48) + kv_up 8*(32+4*32) + proj 8*(4*16+64)
    assert mem.lora_params_per_layer(tiny, 8, 1) == 768 + 1280 + 896 + 1280 + 1024
    # TP2 splits q_up / kv_up outputs (64 each) and proj's input (32)
    assert mem.lora_params_per_layer(tiny, 8, 2) == 768 + 8 * (32 + 64) + 896 + 8 * (32 + 64) + 8 * (32 + 64)
    assert mem.optimizer_bytes(1000, 0, mem.Training(optimizer="launcher"), 1, 1, 1, 1) == dict(grads=2000,
                                                                                                  optimizer=4000)
    dist = mem.Training(distributed_optimizer=True)
    assert mem.optimizer_bytes(1000, 400, dist, 2, 2, 4, 2) == dict(grads=5600, optimizer=12000 // 4 + 4800 // 2)
    assert mem.logits_bytes(tiny, 1, 1, 64, 1) == dict(softmax_fp32=64 * 256 * 4, logits_bf16=64 * 256 * 2)


def test_layer_kept_terms_match_hand_counts(tiny):
    # tiny: h 64, q_lora 32, kv_lora 32, rope 16, nope 16, v 16, 4 heads, ffn 128, 4 experts of 32, top-2, 1 shared
    lora8 = mem.Training(lora_dim=8, fused_swiglu=False)
    t = 64
    dense = mem.layer_kept_parts(tiny, 1, 1, t, 1, False, True, lora8)
    # layer input + normed input, q latent before / after its norm, kv latent with RoPE part (once), q heads
    # before absorption, k's RoPE cos / sin, bf16; 3 fp32 rstd; 4 LoRA intermediates of rank 8
    assert dense["projections"] == (2 * t * 64 + 2 * t * 32 + t * 48 + t * 4 * 32 + 2 * t * 16) * 2 + 3 * t * 4 \
        + 4 * t * 8 * 2
    # pre-MLP norm input + rstd; SwiGLU input (2 ffn) and the activation's two operands (2 ffn); frozen linears
    assert dense["mlp"] == (t * 64 + 4 * t * 128) * 2 + t * 4
    fused = mem.layer_kept_parts(tiny, 1, 1, t, 1, False, True, mem.Training(lora_dim=8))
    assert fused["mlp"] == (t * 64 + 2 * t * 128) * 2 + t * 4  # the fused SwiGLU keeps its input only
    full = mem.layer_kept_parts(tiny, 1, 1, t, 1, False, True, mem.Training(lora_dim=None, fused_swiglu=False))
    assert full["mlp"] == dense["mlp"] + (t * 64 + t * 128) * 2  # + fc1 and fc2 inputs
    # the frozen indexer keeps nothing (LoRA without --lora-indexer); trained, its q / k / w and loss gradient
    frozen = attention_memory.attention_activation_parts(tiny, 1, 1, t, True, indexer_trains=False)
    trained = attention_memory.attention_activation_parts(tiny, 1, 1, t, True)
    assert frozen["indexer"] == frozen["indexer_loss_grad"] == 0
    assert trained["indexer_loss_grad"] == t * 8 * 4 and trained["indexer"] == t * 2 * 32 * 2 + t * 32 * 2 + t * 2 * 4
    assert dense["attention"] == sum(frozen.values())
    moe = mem.layer_kept_parts(tiny, 1, 1, t, 1, True, True, lora8)
    # norm input + normed router input, rstd, router / dispatcher maps (10 E + 32 k + 12 B), per routed copy
    # 5 x 32 (SwiGLU input, two operands, the probability-scaled activation), shared 4 x 32
    assert moe["moe"] == 2 * t * 64 * 2 + t * 4 + t * (10 * 4 + 32 * 2 + 12) + t * 2 * 5 * 32 * 2 + t * 4 * 32 * 2
    # fused: per routed copy and in the shared expert the SwiGLU input only
    assert mem.layer_kept_parts(tiny, 1, 1, t, 1, True, True, mem.Training(lora_dim=8))["moe"] == \
        2 * t * 64 * 2 + t * 4 + t * (10 * 4 + 32 * 2 + 12) + t * 2 * 2 * 32 * 2 + t * 2 * 32 * 2
    assert mem.layer_kept_parts(tiny, 1, 1, t, 1, True, True, mem.Training(recompute="full")) == dict(
        layer_input=t * 64 * 2)
    two = mem.layer_kept_parts(tiny, 1, 1, t, 2, False, True, lora8)  # micro batch of 2 sequences: twice
    assert all(two[k] == 2 * dense[k] for k in dense)


def test_stage_terms_shared_topk_and_final_norm(tiny):
    shared = cards.with_overrides(tiny, index_topk_freq=4, index_skip_topk_offset=3)
    full, none = mem.Training(recompute="full"), mem.Training()
    # full recompute: the computing layers' top-k stay on the carrier for the reusing layers ([t, topk] int32)
    assert mem.stage_kept_parts(shared, 1, 1, 64, 1, full, 3, False) == dict(index_holder=3 * 64 * 8 * 4, final_norm=0)
    # without recompute they are the computing layers' kept indices (counted there); without sharing not held
    assert mem.stage_kept_parts(shared, 1, 1, 64, 1, none, 3, False)["index_holder"] == 0
    assert mem.stage_kept_parts(tiny, 1, 1, 64, 1, full, 3, False)["index_holder"] == 0
    # last stage: the final norm's bf16 input and fp32 rstd, under recompute too
    assert mem.stage_kept_parts(tiny, 1, 1, 64, 1, full, 1, True)["final_norm"] == 64 * 64 * 2 + 64 * 4


def _saved_per_layer(T: int, fused_swiglu: bool = False) -> tuple[list[int], dict]:
    """(bytes each decoder layer keeps for backward outside the DSA core, with norms counted as
    torch's fused CUDA rms_norm keeps them; the index-sharing holder) of the tiny card cut to
    3 dense + 1 MoE layers with GLM-5.2's index sharing, LoRA rank 8, bf16, CPU, one sequence of T."""
    import torch

    from glm5_dsa_plugin.train import core

    over = ["num_hidden_layers=4", "first_k_dense_replace=3", "index_topk_freq=4", "index_skip_topk_offset=3",
            "num_nextn_predict_layers=0", "index_topk=64", "hidden_size=96", "q_lora_rank=40",
            "qk_nope_head_dim=24", "v_head_dim=20", "intermediate_size=136", "moe_intermediate_size=36"]
    argv = ["--model", "gpt", "--backend", "reference", "--device", "cpu", "--dtype", "bf16", "--seq-len", str(T),
            "--batch-size", "1"]
    for o in over:
        argv += ["--card-override", o]
    args = core.base_parser("count").parse_args(argv)
    # bias_activation_fusion: the launchers' setting on a GPU (fused) or on the CPU (unfused)
    card, model = core.prepare(args, mtp_num_layers=None, bias_activation_fusion=fused_swiglu)
    _, model = lora.apply_lora(model, 8, 16)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layers = [m for m in model.modules() if type(m).__name__.endswith("TransformerLayer")]
    assert len(layers) == 4
    state = dict(layer=None, skip=0)
    seen, kept = set(), [0] * 4

    def enter(i):
        return lambda _m, _a: state.update(layer=i)

    for i, m in enumerate(layers):
        m.register_forward_pre_hook(enter(i))
        m.register_forward_hook(lambda _m, _a, _o: state.update(layer=None))
        core_attn = m.self_attention.core_attention
        core_attn.register_forward_pre_hook(lambda _m, _a: state.update(skip=state["skip"] + 1))
        core_attn.register_forward_hook(lambda _m, _a, _o: state.update(skip=state["skip"] - 1))
        for name, sub in m.named_modules():
            if isinstance(sub, torch.nn.RMSNorm):  # CUDA's fused rms_norm keeps its bf16 input and an fp32 rstd per row
                sub.register_forward_pre_hook(lambda _m, a, i=i: kept.__setitem__(
                    i, kept[i] + a[0].untyped_storage().nbytes() + a[0].numel() // a[0].shape[-1] * 4))
                sub.register_forward_pre_hook(lambda _m, _a: state.update(skip=state["skip"] + 1))
                sub.register_forward_hook(lambda _m, _a, _o: state.update(skip=state["skip"] - 1))

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if state["layer"] is not None and not state["skip"] and key not in params and key not in seen:
            seen.add(key)
            kept[state["layer"]] += st.nbytes()
        return t

    tok = torch.randint(0, card["vocab_size"], (1, T + 1), generator=torch.Generator().manual_seed(T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tok[:, :-1].contiguous(), torch.arange(T)[None], None, labels=tok[:, 1:].contiguous())
    holder = getattr(model.config, "_glm5_dsa_index_share_holder", {})
    return kept, card, {k: v.nbytes for k, v in holder.items()}


@pytest.mark.parametrize("fused_swiglu", [False, True], ids=["unfused", "fused_swiglu"])
def test_layer_kept_terms_match_counted_saved_tensors(megatron_single_process, fused_swiglu):
    """What the layers keep per token outside the DSA core (norms, MLA projections, LoRA, MLP, MoE,
    the value projection's output) against the count of autograd's saved tensors at two lengths (the
    difference drops the constant, weight-sized tensors), with megatron-core's unfused and fused SwiGLU."""
    lora8 = mem.Training(lora_dim=8, fused_swiglu=fused_swiglu)
    (a, card, _), (b, _, holder) = _saved_per_layer(128, fused_swiglu), _saved_per_layer(256, fused_swiglu)

    def planned(T, moe, comp):
        parts = mem.layer_kept_parts(card, 1, 1, T, 1, moe, comp, lora8)
        return parts["projections"] + parts.get("mlp", 0) + parts.get("moe", 0) \
            + attention_memory.attention_activation_parts(card, 1, 1, T, comp, indexer_trains=False)["value_out"]

    kinds = [(False, True)] * 3 + [(True, False)]
    counted = [y - x for x, y in zip(a, b)]
    want = [planned(256, *k) - planned(128, *k) for k in kinds]
    assert counted[:3] == want[:3]  # dense layers: to the byte
    # the MoE layer: megatron-core's router helpers run through torch.compile, and what they keep
    # depends on how they ran (of ~2.8 KB per token here): compiled for static shapes, the plan to
    # the byte; recompiled for dynamic shapes after other tests' lengths, 4 bytes per token more;
    # eagerly (a helper past its recompile limit, or TORCHDYNAMO_DISABLE=1), 32 bytes per token less.
    # The bound takes all three; a missing [T, hidden] tensor (192 bytes per token) still fails it.
    assert abs(counted[3] - want[3]) <= 40 * 128, (counted, want)
    # the top-k of the three computing layers stays on the carrier, [T, topk] int32 each
    assert holder == {1: 256 * 64 * 4, 2: 256 * 64 * 4, 3: 256 * 64 * 4}
    assert sum(holder.values()) == mem.stage_kept_parts(card, 1, 1, 256, 1, mem.Training(recompute="full"), 3,
                                                        False)["index_holder"]


def _dry(*argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert lora.main(["--card", "tiny", "--dry-run", *argv]) == 0
    return out.getvalue()


def test_seq_len_is_the_dry_runs_length(tiny):
    a = _dry("--seq-len", "1024", "--batch-size", "1")
    assert "micro batch 1 x 1024 tokens" in a and "1024 local of 1024 tokens" in a
    assert _dry("--micro-batch-seq", "1024", "--batch-size", "1") == a  # the old flag is an alias
    b = _dry("--seq-len", "4096", "--batch-size", "1")
    peak = lambda text: float(text.split("largest stage ")[1].split(" GiB")[0])  # noqa: E731
    assert peak(b) > peak(a)


def test_verdict_flips_at_the_planned_need(tiny):
    training = mem.Training(lora_dim=8)
    peak, _ = planner.layout_peak(tiny, planner.Layout(1, 2, 1, 1), 8192, 1, training)
    need = peak * (1 + planner.FRAGMENTATION) / GIB + planner.RESERVED_GIB
    assert planner.fits(peak, need + 0.01) and not planner.fits(peak, need - 0.01)
    text = _dry("--seq-len", "8192", "--batch-size", "1", "--pp", "2", "--gpu-memory-gib", f"{need - 0.01:.4f}")
    assert "does NOT fit" in text.splitlines()[-3] and "nearest layout that fits" in text


def test_nearest_fit_fits_by_the_planners_own_count(tiny):
    training = mem.Training(lora_dim=8)
    base = planner.Layout(1, 1, 1, 1)
    peak, _ = planner.layout_peak(tiny, base, 16384, 1, training)
    cap = peak * 0.8 * (1 + planner.FRAGMENTATION) / GIB + planner.RESERVED_GIB  # 20% short
    assert not planner.fits(peak, cap)
    near, near_peak = planner.nearest_fit(tiny, base, 16384, 1, training, cap)
    assert near != base
    again, _ = planner.layout_peak(tiny, near, 16384, 1, training)
    assert again == near_peak and planner.fits(again, cap)


def test_glm52_slice_plans_against_its_measured_rows(megatron_single_process):
    """The full-width GLM-5.2 slice of ``benchmarks/results/lora_slice.json``: every measured row (16K
    on the H100, 64K on the H200) within 10% of its plan, and the 64K row that ran out of memory on the
    H100 not passing the verdict."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import bench_lora_slice as bench

    rows = json.load(open(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results",
                                       "lora_slice.json")))
    for r in rows:
        vocab = r["vocab"] if r["vocab"] != 154880 else None  # the card's own, or the row's cut
        planned = bench.planned_peak(bench.slice_card(r["experts"], vocab), r["T"], r["recompute"],
                                     fused_swiglu=r["fused_swiglu"])  # the SwiGLU the row ran
        assert round(planned / GIB, 2) == r["planned_peak_gib"]
        if r.get("peak_gib"):
            assert abs(planned / GIB / r["peak_gib"] - 1) < 0.10
        else:  # measured: out of memory on the 79.18 GiB card
            assert not planner.fits(planned, 79.18)
