"""LoRA / PPO / MTP launchers on the shared core (CPU, tiny card, reference backend)."""

import json
import subprocess
import sys

import pytest
import torch

from glm5_dsa_plugin.train import lora, mtp, ppo
from glm5_dsa_plugin.train import core
from glm5_dsa_plugin.megatron.hybrid_spec import GLM5HybridDSAttention
from megatron_cpu import megatron_single_process  # noqa: F401

COMMON = ["--card", "tiny", "--backend", "reference", "--device", "cpu", "--seq-len", "24", "--batch-size", "2"]
MAINS = {"lora": lora.main, "ppo": ppo.main, "mtp": mtp.main}


def _losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


@pytest.mark.slow
@pytest.mark.parametrize("job", ["lora", "ppo", "mtp"])
def test_job_runs_and_resumes_exactly(job, tmp_path, megatron_single_process):
    extra = ["--rollouts", "tests/fixtures/rollouts_tiny.pt"] if job == "ppo" else []
    run = lambda *a: MAINS[job](COMMON + extra + list(a))  # noqa: E731
    assert run("--steps", "3", "--log-json", str(tmp_path / "full.jsonl")) == 0
    assert run("--steps", "2", "--save", str(tmp_path / "ck"), "--log-json", str(tmp_path / "a.jsonl")) == 0
    assert run("--steps", "1", "--load", str(tmp_path / "ck"), "--log-json", str(tmp_path / "b.jsonl")) == 0
    full, a, b = _losses(tmp_path / "full.jsonl"), _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b.jsonl")
    assert all(torch.isfinite(torch.tensor(full)))
    assert a == full[:2]
    assert b[0] == pytest.approx(full[2], rel=1e-6, abs=1e-7)  # resume gives the same next-step loss


@pytest.mark.slow
def test_lora_adapters_save_load_merge(tmp_path, megatron_single_process):
    assert lora.main(COMMON + ["--steps", "2", "--save", str(tmp_path / "ck")]) == 0
    adapters = torch.load(tmp_path / "ck" / "adapters.pt")
    assert adapters and all(".adapter." in k for k in adapters)
    assert not any("indexer" in k for k in adapters)  # indexer excluded by default
    targets = {k.split(".self_attention.")[1].split(".adapter")[0] for k in adapters}
    assert targets == set(lora.MLA_LORA_TARGETS)

    args = core.base_parser("t").parse_args(COMMON)
    card = core.load_card_from_args(args)
    cfg = core.model_config(args, card, mtp_num_layers=None)
    model = core.build_model(args, card, cfg)
    _, model = lora.apply_lora(model)
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    assert not unexpected
    tok = torch.randint(0, card["vocab_size"], (1, 16))
    pos = torch.arange(16)[None]
    model.eval()
    with torch.no_grad():
        with_adapters = model(tok, pos, None)
        assert lora.merge_lora(model) == 20
        merged = model(tok, pos, None)
    torch.testing.assert_close(merged, with_adapters, rtol=1e-5, atol=1e-5)
    # adapters changed the model (so merging had something to merge)
    base = core.build_model(args, card, cfg).eval()
    with torch.no_grad():
        assert not torch.allclose(base(tok, pos, None), merged)


@pytest.mark.slow
def test_three_launchers_share_attention_and_kernel_entry(monkeypatch, megatron_single_process):
    import glm5_dsa_plugin.model.attention as att

    calls = {}
    real = att.sparse_mla
    current = {"job": None}

    def counting(*a, **k):
        calls[current["job"]] = calls.get(current["job"], 0) + 1
        return real(*a, **k)

    monkeypatch.setattr(att, "sparse_mla", counting)
    built = {}
    real_build = core.build_model

    def spy_build(*a, **k):
        m = real_build(*a, **k)
        built[current["job"]] = core.attention_classes(m)
        return m

    monkeypatch.setattr(core, "build_model", spy_build)
    for job in ("lora", "ppo", "mtp"):
        current["job"] = job
        assert MAINS[job](COMMON + ["--steps", "1"]) == 0
    # the default --model is hybrid: every job builds a HybridModel whose DSA layers are ours
    assert built == {"lora": {GLM5HybridDSAttention}, "ppo": {GLM5HybridDSAttention}, "mtp": {GLM5HybridDSAttention}}
    assert all(calls[j] > 0 for j in MAINS)


def test_ppo_fixture_has_all_padding_rows_with_exact_zero_gradients(megatron_single_process):
    from glm5_dsa_plugin.model import indexer, visibility

    roll = torch.load("tests/fixtures/rollouts_tiny.pt")
    psp = ppo.packed_params(roll, "cpu")
    vis = visibility.Visibility.from_cu_seqlens(psp.cu_seqlens_q, cu_seqlens_padded=psp.cu_seqlens_q_padded)
    pad_rows = ~vis.mask().any(-1)
    assert pad_rows.sum() >= 10  # pad tokens: their top-k is all -1
    idx = indexer.select_topk(torch.randn(88, 2, 8), torch.randn(88, 8), torch.randn(88, 2), 8, vis)
    assert torch.all(idx[pad_rows] == -1)
    args = core.base_parser("t").parse_args(COMMON)
    card = core.load_card_from_args(args)
    model = core.build_model(args, card, core.model_config(args, card, mtp_num_layers=None))
    logp = ppo.token_logprobs(model, roll, "cpu")
    loss = ppo.ppo_loss(logp, roll, kl_coef=0.01)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("max_len", [8, 15, 24, 64, 4096, 16384])
def test_generated_rollouts_fill_the_sequence_length(max_len):
    """PPO without --rollouts trains at --seq-len: every padded sequence is a multiple of pad_to,
    at most max_len and at least half of it; the loss mask covers exactly the response
    predictions (the last prompt token through the second-to-last response token)."""
    roll = ppo.make_rollouts({"vocab_size": 100}, n_seqs=3, seed=1, max_len=max_len)
    cu, lens = roll["cu_seqlens_padded"].tolist(), roll["seq_lens"].tolist()
    assert len(cu) == 4 and cu[0] == 0 and roll["tokens"].numel() == cu[-1]
    for i, n in enumerate(lens):
        width = cu[i + 1] - cu[i]
        assert width % 8 == 0 and n <= width < n + 8
        assert max_len // 2 <= n and width <= max_len, (n, width, max_len)
        mask = roll["loss_mask"][cu[i] : cu[i + 1]]
        first = int(mask.nonzero()[0])
        assert max_len // 8 - 1 <= first <= max_len // 4 - 1  # the last prompt token predicts the first response token
        assert mask[first : n - 1].eq(1).all() and mask[:first].eq(0).all() and mask[n - 1 :].eq(0).all()
    with pytest.raises(ValueError, match="max_len=4"):
        ppo.make_rollouts({"vocab_size": 100}, max_len=4)


@pytest.mark.slow
def test_help_shows_the_spec_line():
    for script in ("train_lora.py", "train_ppo.py", "train_mtp.py"):
        out = subprocess.run([sys.executable, f"scripts/{script}", "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "--spec glm5_dsa_plugin.spec get_glm5_dsa_spec" in out.stdout


@pytest.mark.slow
def test_dry_run_glm52_reported_layout():
    out = subprocess.run([sys.executable, "scripts/train_lora.py", "--card", "glm5.2", "--dry-run", "--tp", "4", "--pp",
                          "8", "--ep", "16", "--cp", "4"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit() and "compute [" in line]
    assert len(rows) == 8
    firsts = [int(r[1].split("-")[0]) for r in rows]
    from glm5_dsa_plugin.model.index_sharing import computes_indices

    assert all(computes_indices(f, 4, 3) for f in firsts) and rows[-1][-1] == "+MTP"
    assert int(rows[-1][1].split("-")[1]) == 78
    assert "nothing allocated" in out.stdout


@pytest.mark.slow
def test_dry_run_attention_memory_counts_what_the_backend_keeps():
    """The dry run's attention memory, index side, against the tensors themselves: the row-group
    key lists as ``group_keys`` lays them out (row groups below 64 heads per rank), the top-k once
    in the layer that computes it (reusing layers keep the same tensor), a padded copy per layer
    when topk is not a multiple of 64."""
    import torch

    from glm5_dsa_plugin.checkpoints import cards
    from glm5_dsa_plugin.ops.row_groups import group_keys_reference
    from glm5_dsa_plugin.train.attention_memory import attention_activation_bytes, attention_activation_parts

    card = cards.load_card("glm5.2")
    seq, topk = 40, card["index_topk"]
    idx = torch.randint(-1, seq, (1, seq, 1, topk), dtype=torch.int32).clamp(min=0)
    for tp, R in ((1, 1), (4, 4), (8, 8)):  # 64, 16, 8 heads per rank
        computing = attention_activation_parts(card, tp, 1, seq, True)
        reusing = attention_activation_parts(card, tp, 1, seq, False)
        assert computing["indices"] == idx.nbytes and reusing["indices"] == 0
        lists = group_keys_reference(idx, seq, R)[:2] if R > 1 else ()
        assert computing["key_lists"] == reusing["key_lists"] == sum(t.nbytes for t in lists)
        assert attention_activation_bytes(card, tp, 1, seq, False) == sum(reusing.values())
    odd = cards.with_overrides(card, index_topk=100)
    assert attention_activation_parts(odd, 1, 1, seq, False)["indices"] == seq * 128 * 4


def test_cuda_alloc_conf_defaults_to_expandable_segments_and_keeps_the_users(monkeypatch):
    """The launchers run with expandable segments (what the dry run's verdict assumes) unless the user
    set PYTORCH_CUDA_ALLOC_CONF, which is kept as given."""
    import os

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert core.cuda_alloc_conf() == "expandable_segments:True" == os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert core.cuda_alloc_conf() == "max_split_size_mb:512" == os.environ["PYTORCH_CUDA_ALLOC_CONF"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_launchers_fuse_the_swiglu_on_a_gpu(device, megatron_single_process):
    """On a GPU the launchers' config takes megatron-core's fused SwiGLU (Megatron-LM's default); on
    the CPU the unfused one (no torch.compile of the activation)."""
    args = core.base_parser("t").parse_args([device if a == "cpu" else a for a in COMMON])
    card = core.load_card_from_args(args)
    assert core.model_config(args, card, mtp_num_layers=None).bias_activation_fusion is (device == "cuda")
