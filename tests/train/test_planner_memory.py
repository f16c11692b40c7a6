"""The dry run's per-rank memory: each term against figures computed by hand for the tiny card,
``--seq-len`` read as training reads it, the verdict and the nearest layout that fits."""

import contextlib
import io

import pytest

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.train import lora
from glm5_dsa_plugin.train import memory as mem
from glm5_dsa_plugin.train import planner
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
    lora8 = mem.Training(lora_dim=8)
    dense = mem.layer_kept_parts(tiny, 1, 1, 64, 1, False, True, lora8)
    # projections: 2*t*h + 2*t*q_lora + 2*t*(kv_lora+rope) + t*H*(nope+rope), bf16
    assert dense["projections"] == (2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 * 48 + 64 * 4 * 32) * 2
    assert dense["mlp"] == (2 * 64 * 64 + 2 * 64 * 128) * 2  # layer input + norm, SwiGLU input (frozen MLP)
    full = mem.layer_kept_parts(tiny, 1, 1, 64, 1, False, True, mem.Training(lora_dim=None))
    assert full["mlp"] == dense["mlp"] + (64 * 128 + 64 * 64) * 2  # + SwiGLU output and fc1 input
    moe = mem.layer_kept_parts(tiny, 1, 1, 64, 1, True, True, lora8)
    # residual + norm, fp32 router scores (4 experts, twice), top-2 SwiGLU inputs (32), routed outputs, shared
    assert moe["moe"] == 2 * 64 * 64 * 2 + 2 * 64 * 4 * 4 + 64 * 2 * 2 * 32 * 2 + 64 * 2 * 64 * 2 + 64 * 2 * 32 * 2
    assert mem.layer_kept_parts(tiny, 1, 1, 64, 1, True, True, mem.Training(recompute="full")) == dict(
        layer_input=64 * 64 * 2)
    two = mem.layer_kept_parts(tiny, 1, 1, 64, 2, False, True, lora8)  # micro batch of 2 sequences: twice
    assert all(two[k] == 2 * dense[k] for k in dense)


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
