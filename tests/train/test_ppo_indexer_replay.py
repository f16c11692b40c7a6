"""The PPO launcher's indexer replay (CPU, tiny card: index_topk 8 below the 9-15 keys its longer
rows see, so a replayed set can differ from the trainer's own)."""

import json

import pytest
import torch

from glm5_dsa_plugin.train import cli, ppo
from glm5_dsa_plugin.train import core
from megatron_cpu import megatron_single_process  # noqa: F401

FIXTURE = "tests/fixtures/rollouts_tiny.pt"
COMMON = ["--card", "tiny", "--backend", "reference", "--device", "cpu", "--rollouts", FIXTURE]


def _model():
    args = core.base_parser("t").parse_args(COMMON[:-2])
    card = core.load_card_from_args(args)
    torch.manual_seed(args.seed)
    return core.build_model(args, card, core.model_config(args, card, mtp_num_layers=None))


@pytest.mark.slow
def test_record_then_replay_trains_on_the_recorded_topk(tmp_path, megatron_single_process):
    rec_path = tmp_path / "roll.pt"
    assert ppo.main(COMMON + ["--record-indexer-topk", str(rec_path)]) == 0
    roll = torch.load(rec_path)
    lens = roll["seq_lens"].tolist()
    assert [tuple(r.shape) for r in roll["indexer_topk"]] == [(n - 1, 4, 8) for n in lens]  # 4 computing layers
    for r in roll["indexer_topk"]:  # sample-local, causal
        pos = torch.arange(r.shape[0])[:, None, None]
        assert bool(((r == -1) | ((r >= 0) & (r <= pos))).all())
        assert bool((r[8:] >= 0).all())  # rows seeing more than 8 keys fill every slot

    base = ["--rollouts", str(rec_path), "--steps", "2"]
    own, rep = tmp_path / "own.jsonl", tmp_path / "rep.jsonl"
    assert ppo.main(COMMON[:-2] + base + ["--log-json", str(own)]) == 0
    assert ppo.main(COMMON[:-2] + base + ["--indexer-replay", "--indexer-topk-overlap", "--log-json", str(rep)]) == 0
    own_log = [json.loads(line) for line in open(own)]
    rep_log = [json.loads(line) for line in open(rep)]
    # step 0 runs the recording's weights: the replayed top-k is the trainer's own, the loss the same
    assert rep_log[0]["loss"] == own_log[0]["loss"]
    assert rep_log[0]["indexer_topk_overlap"] == 1.0 and rep_log[0]["indexer_rows_below_0_8"] == 0
    assert 0.0 <= rep_log[1]["indexer_topk_overlap"] <= 1.0


@pytest.mark.slow
def test_a_changed_replayed_row_moves_only_its_own_sample(megatron_single_process):
    model = _model()
    roll = ppo.record_indexer_topk(model, torch.load(FIXTURE), "cpu")
    base = ppo.token_logprobs(model, roll, "cpu", replay=ppo.rollout_replay(model, roll))
    assert torch.equal(base, ppo.token_logprobs(model, roll, "cpu"))

    s, row = 3, 12  # sample 3 holds 15 tokens; its query at position 12 sees 13 keys, keeps 8
    rec = roll["indexer_topk"][s].clone()
    kept = rec[row, 0]
    others = torch.tensor([k for k in range(row + 1) if k not in kept.tolist()])  # the 5 it dropped
    rec[row, 0] = torch.cat([others, kept[: 8 - others.numel()]]).to(rec.dtype)
    changed = dict(roll, indexer_topk=[*roll["indexer_topk"][:s], rec, *roll["indexer_topk"][s + 1:]])
    logp = ppo.token_logprobs(model, changed, "cpu", replay=ppo.rollout_replay(model, changed))

    a = int(roll["cu_seqlens_padded"][s])
    n = int(roll["seq_lens"][s])
    moved = (logp != base).nonzero()[:, 0]
    assert moved.numel() > 0 and int(moved.min()) >= a + row and int(moved.max()) < a + n


def test_a_record_outside_its_row_is_one_line(tmp_path, capsys, megatron_single_process):
    roll = torch.load(FIXTURE)
    recs = [torch.full((int(n) - 1, 4, 8), -1, dtype=torch.int32) for n in roll["seq_lens"]]
    recs[1][2, 3, 5] = 7  # sample 1, layer 4, row 2: a query at position 2 sees keys 0..2
    torch.save(dict(roll, indexer_topk=recs), tmp_path / "bad.pt")
    rc = cli.launch(ppo.main, COMMON[:-1] + [str(tmp_path / "bad.pt"), "--indexer-replay", "--steps", "1"],
                    prog="train_ppo.py")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert "sample 1, layer 4, row 2, slot 5: value 7" in lines[0]


def test_replay_needs_a_recorded_batch(capsys, megatron_single_process):
    rc = cli.launch(ppo.main, COMMON + ["--indexer-replay", "--steps", "1"], prog="train_ppo.py")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "--record-indexer-topk" in lines[0], lines
    rc = cli.launch(ppo.main, COMMON + ["--indexer-topk-overlap", "--steps", "1"], prog="train_ppo.py")
    assert rc == 2


def test_the_record_runs_in_eval_mode_and_restores_the_models_mode(megatron_single_process):
    """The recorder is the rollout's side: its forward runs in eval mode (as an engine has no dropout,
    and a no-grad forward in training mode would be taken for a recompute's first pass), and the
    model comes back in the mode it was handed in."""
    model = _model()
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a: seen.append(m.training))
    for mode in (True, False):
        model.train(mode)
        ppo.record_indexer_topk(model, torch.load(FIXTURE), "cpu")
        assert model.training is mode
    hook.remove()
    assert seen and not any(seen)
