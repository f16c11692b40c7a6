"""Megatron-Bridge end to end (tests/bridge_e2e.py in its own process): AutoBridge on a checkpoint
written by transformers, training steps, a torch_dist save / load that resumes bit-exactly, and
Megatron-Bridge PEFT LoRA. CPU at one gloo process; the GPU run uses the kernels' head shape."""

import importlib.util
import json
import math
import subprocess
import sys

import pytest
from single_rank_env import ROOT, single_rank_env


pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.bridge") is None,
                                reason="megatron-bridge not installed")


def _run(tmp_path, gpu: bool, **card_over):
    from tiny_models import tiny_hf

    _, hf = tiny_hf(seed=5, **card_over)
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir)
    env = single_rank_env(CUBLAS_WORKSPACE_CONFIG=":4096:8")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "bridge_e2e.py"), str(hf_dir), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-8000:]
    return json.loads((tmp_path / "result.json").read_text())


def _check(r, n_layers: int):
    assert r["n_cores"] == n_layers  # our DSA core attention in every decoder layer
    assert all(math.isfinite(x) for x in r["losses_a"] + r["lora_losses"])
    assert r["losses_b"] == r["losses_a"][:2]
    assert r["losses_c"] == r["losses_a"][2:], (r["losses_a"], r["losses_c"])  # resumed bit-exactly
    assert r["mismatched"] == []
    assert any(f.endswith(".distcp") for f in r["ckpt_files"]) and "metadata.json" in r["ckpt_files"]
    assert r["trainable"] and all("adapter" in n for n in r["trainable"])
    assert r["base_changed"] == []
    assert r["adapters_moved"]
    if r["transformer_impl"] == "transformer_engine":  # LoRA wrapped TransformerEngine's linears
        assert all(w.split("(")[1].startswith("TE") for w in r["lora_wrapped"]), r["lora_wrapped"]
    print("bridge e2e:", r["transformer_impl"], r["lora_wrapped"], "losses", r["losses_a"], "lora", r["lora_losses"])


def test_bridge_train_save_load_lora_cpu(tmp_path):
    _check(_run(tmp_path, gpu=False), n_layers=4)


@pytest.mark.gpu
def test_bridge_train_save_load_lora_gpu(tmp_path):
    # d_v = kv_lora_rank 256 and d_tail = qk_rope_head_dim 64: a head shape the TileLang kernels take
    # (the indexer head at least as wide as its 64 RoPE channels)
    r = _run(tmp_path, gpu=True, kv_lora_rank=256, qk_rope_head_dim=64, num_attention_heads=16, index_topk=64,
             index_head_dim=64)
    _check(r, n_layers=4)
