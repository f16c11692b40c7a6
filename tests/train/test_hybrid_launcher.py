"""The launchers' ``--model hybrid`` (HybridModel through glm5_dsa_hybrid_stack_spec) against
``--model gpt`` on the same HF checkpoint (CPU, tiny GLM-5.2-shaped card with index sharing and MTP,
reference backend): the same losses step by step."""

import json

import pytest
import torch

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.checkpoints import hf_megatron as conversion
from glm5_dsa_plugin.train import lora, mtp
from glm5_dsa_plugin.train.cli import LauncherInputError
from megatron_cpu import megatron_single_process  # noqa: F401
from tiny_models import tiny_hf, with_mtp


def _tiny_checkpoint(folder):
    card, hf = tiny_hf(index_topk_freq=2, index_skip_topk_offset=1)
    conversion.save_hf_safetensors(with_mtp(card, {k: v.detach() for k, v in hf.state_dict().items()}), folder)
    cards.card_to_hf_config(card).save_pretrained(folder)


def _losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


@pytest.mark.parametrize("job", ["mtp", "lora"])
def test_hybrid_job_matches_gpt_job_on_the_same_checkpoint(job, tmp_path, megatron_single_process):
    _tiny_checkpoint(tmp_path / "hf")
    main = {"mtp": mtp.main, "lora": lora.main}[job]
    common = ["--hf", str(tmp_path / "hf"), "--backend", "reference", "--device", "cpu", "--seq-len", "24",
              "--batch-size", "2", "--steps", "2"]
    for model in ("gpt", "hybrid"):
        assert main(common + ["--model", model, "--log-json", str(tmp_path / f"{model}.jsonl")]) == 0
    gpt, hybrid = _losses(tmp_path / "gpt.jsonl"), _losses(tmp_path / "hybrid.jsonl")
    assert len(gpt) == 2 and all(torch.isfinite(torch.tensor(gpt)))
    assert hybrid == pytest.approx(gpt, rel=1e-5, abs=1e-6)
    # each log line names the model class it trained
    classes = {m: {json.loads(line)["model"] for line in open(tmp_path / f"{m}.jsonl")} for m in ("gpt", "hybrid")}
    assert classes == {"gpt": {"GPTModel"}, "hybrid": {"HybridModel"}}


def test_hybrid_ppo_replays_its_own_record_like_gpt(tmp_path, megatron_single_process):
    """PPO with indexer replay on HybridModel, whose config counts MLP layers as layers too: the
    record holds its DSA layers, the replay finds them (overlap 1 on the first step), and the losses
    follow GPTModel's on the same checkpoint."""
    from glm5_dsa_plugin.train import ppo

    _tiny_checkpoint(tmp_path / "hf")
    common = ["--hf", str(tmp_path / "hf"), "--backend", "reference", "--device", "cpu", "--seq-len", "24",
              "--batch-size", "2", "--steps", "2"]
    logs = {}
    for model in ("gpt", "hybrid"):
        rec = str(tmp_path / f"roll_{model}.pt")
        assert ppo.main(common + ["--model", model, "--record-indexer-topk", rec]) == 0
        log = tmp_path / f"{model}.jsonl"
        assert ppo.main(common + ["--model", model, "--rollouts", rec, "--indexer-replay", "--indexer-topk-overlap",
                                  "--log-json", str(log)]) == 0
        logs[model] = [json.loads(line) for line in open(log)]
    assert logs["hybrid"][0]["indexer_topk_overlap"] == 1.0
    assert [r["loss"] for r in logs["hybrid"]] == pytest.approx([r["loss"] for r in logs["gpt"]], rel=1e-5, abs=1e-6)


def test_model_flops_shape_is_the_cards_for_either_model_class(megatron_single_process):
    """MFU counts the same model for GPTModel and HybridModel (whose config has twice the layers, the
    MLP ones included, and no moe_layer_freq of GPT's form): 2 dense then 2 MoE layers of the tiny
    card, no MTP when the job builds none."""
    from glm5_dsa_plugin.model.flops import DSAShape
    from glm5_dsa_plugin.train import core

    card = cards.load_card("tiny")
    want = DSAShape.from_card({**card, "num_nextn_predict_layers": 0})
    for model_class in ("gpt", "hybrid"):
        args = core.base_parser("t").parse_args(["--card", "tiny", "--device", "cpu", "--model", model_class,
                                                 "--backend", "reference"])
        _, model = core.prepare(args, mtp_num_layers=None)
        got = core.flops_shape(model, card)
        assert got == want and (got.num_hidden_layers, got.first_k_dense_replace) == (4, 2), model_class


def test_dry_run_pattern_follows_the_recipe_stages():
    from glm5_dsa_plugin.checkpoints.hybrid_pattern import glm5_hybrid_layer_pattern, split_pattern
    from glm5_dsa_plugin.train import core
    from glm5_dsa_plugin.train.hybrid_model import describe_pattern, pipeline_stage_layers

    card = cards.load_card("glm5.2")
    # the recipe's own description: "stages 14 + 6 x 8 + 16 layers"
    assert pipeline_stage_layers(card, 8, 14, 16) == [14] + [8] * 6 + [16]
    args = core.apply_recipe(core.base_parser("t").parse_args(["--card", "glm5.2", "--recipe", "slime-rl-64k"]), card)
    line = describe_pattern(args, card)
    assert "index sharing stays on each stage" in line
    args = core.base_parser("t").parse_args(["--card", "glm5.2", "--pp", "2"])  # a cut before GLM layer 40
    assert "refused" in describe_pattern(args, card) and "DSA layer 40" in describe_pattern(args, card)
    segments, _ = split_pattern(glm5_hybrid_layer_pattern(card, stage_layers=pipeline_stage_layers(card, 8, 14, 16)))
    assert [len(s) for s in segments] == [28] + [16] * 6 + [32]


def test_resuming_a_checkpoint_of_the_other_model_class_is_refused(tmp_path, megatron_single_process):
    """A launcher checkpoint of GPTModel resumed into HybridModel (their tensor names differ) used to load
    nothing and train on from fresh weights; it is refused, naming the --model it was saved with. The
    same class resumes."""
    common = ["--card", "tiny", "--backend", "reference", "--device", "cpu", "--seq-len", "16", "--batch-size", "1",
              "--steps", "1"]
    assert lora.main(common + ["--model", "gpt", "--save", str(tmp_path / "ck")]) == 0
    assert lora.main(common + ["--model", "gpt", "--load", str(tmp_path / "ck")]) == 0
    with pytest.raises(LauncherInputError,
                       match=r"does not fit this HybridModel .*saved from a GPTModel: pass --model gpt"):
        lora.main(common + ["--model", "hybrid", "--load", str(tmp_path / "ck")])
