"""Launcher input errors are one line on stderr and exit status 2 (``--debug``: the traceback);
``--log-json`` replaces its file unless ``--log-json-append``; the progress bar names the job."""

import argparse
import io
import subprocess
import sys

import pytest
import torch

from glm5_dsa_plugin.train import cli, core, lora, mtp
from megatron_cpu import megatron_single_process  # noqa: F401


def _logged(logger: str, *messages: str) -> list[str]:
    """The lines ``logger`` prints for ``messages`` (warnings) with the launchers' filters installed."""
    import logging

    stream = io.StringIO()
    log = logging.getLogger(logger)
    handler = logging.StreamHandler(stream)
    log.addHandler(handler)
    try:
        for m in messages:
            log.warning(m)
    finally:
        log.removeHandler(handler)
    return stream.getvalue().splitlines()


def _launch(main, argv, capsys):
    rc = cli.launch(main, argv, prog="train_x.py")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    return rc, lines


def test_unknown_card_is_one_line(capsys):
    rc, lines = _launch(mtp.main, ["--card", "glm6", "--steps", "1"], capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("train_x.py: error: --card 'glm6'") and "glm5.2" in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for a machine without a GPU")
def test_tilelang_without_gpu_is_one_line(capsys):
    rc, lines = _launch(lora.main, ["--card", "tiny", "--backend", "tilelang", "--device", "cpu"], capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert "--backend tilelang" in lines[0] and "--backend reference" in lines[0]


def test_pipeline_split_breaking_index_sharing_is_one_line(capsys, megatron_single_process):
    # glm5.2 reuses indices within groups of 4 layers from layer 4 on: a stage cannot start at layer 9
    rc, lines = _launch(lora.main, ["--card", "glm5.2", "--dry-run", "--pp", "8",
                                    "--decoder-first-pipeline-num-layers", "8"], capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert "layer 9" in lines[0] and "move the stage boundary" in lines[0]


def test_gpt_spec_provider_under_the_hybrid_default_is_one_line(capsys, megatron_single_process):
    # a GPT layer-spec provider given to the default --model hybrid (which takes a stack ModuleSpec)
    rc, lines = _launch(lora.main, ["--card", "tiny", "--device", "cpu", "--steps", "1", "--spec",
                                    "glm5_dsa_plugin.spec", "get_glm5_dsa_mtp_spec"], capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert "not a hybrid stack ModuleSpec" in lines[0] and "--model gpt" in lines[0]


def test_debug_keeps_the_traceback():
    with pytest.raises(cli.LauncherInputError, match="no such model card"):
        cli.launch(mtp.main, ["--card", "glm6", "--debug"])


def test_missing_file_is_one_line(tmp_path, capsys):
    rc, lines = _launch(mtp.main, ["--card", "tiny", "--load", str(tmp_path / "nothing")], capsys)
    assert rc == 2 and len(lines) == 1 and "--load" in lines[0], lines


def test_a_bug_keeps_its_traceback():
    def main(argv):
        raise KeyError("not an input error")

    with pytest.raises(KeyError):
        cli.launch(main, [])


def test_filters_are_narrow():
    """A filtered message is dropped; the same category from another message still shows."""
    import logging
    import warnings

    cli.install_filters()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("default")
        cli.install_filters()  # after simplefilter: the launch order
        mod = {"__name__": "megatron.core.optimizer"}
        exec("import warnings\nwarnings.warn('Transformer Engine and Apex are not installed. x')\n"
             "warnings.warn('something else from megatron')", mod)
    assert [str(w.message) for w in rec] == ["something else from megatron"]
    assert _logged("megatron.bridge.utils.import_utils",
                   "Import of FP8GlobalStateManager from megatron.core.extensions.transformer_engine failed with: x",
                   "Import of other failed") == ["Import of other failed"]


def _tiny_train_args(tmp_path, *extra):
    ap = core.base_parser("t", job="PPO")
    return ap.parse_args(["--device", "cpu", "--steps", "2", "--log-json", str(tmp_path / "log.jsonl"), *extra])


def test_log_json_replaces_unless_append(tmp_path, capsys):
    model = torch.nn.Linear(3, 1)

    def step(i):
        loss = model(torch.ones(1, 3)).pow(2).sum()
        loss.backward()
        return core.StepResult(float(loss), 1)

    for _ in range(2):
        core.train(_tiny_train_args(tmp_path), model, {"vocab_size": 8}, step)
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 2
    core.train(_tiny_train_args(tmp_path, "--log-json-append"), model, {"vocab_size": 8}, step)
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 4
    bar = capsys.readouterr().err
    assert "PPO (first step: warm-up)" in bar and "PPO:" in bar and "Linear" not in bar


def test_script_error_exits_2_without_traceback():
    out = subprocess.run([sys.executable, "scripts/train_ppo.py", "--card", "no_such_card"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("train_ppo.py: error: --card 'no_such_card'")


def test_doctor_input_error_is_one_line(monkeypatch, capsys):
    import glm5_dsa_plugin.__main__ as entry
    import glm5_dsa_plugin.ops.doctor as doctor

    def broken(print_fn=print):
        raise FileNotFoundError(2, "No such file or directory", "/nonexistent/tilelang")

    monkeypatch.setattr(doctor, "run", broken)
    assert entry.main(["doctor"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "/nonexistent/tilelang" in lines[0], lines
    with pytest.raises(FileNotFoundError):
        entry.main(["doctor", "--debug"])


def test_gpt_model_deprecation_is_one_short_line():
    import logging

    cli.install_filters()
    assert _logged("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED. GPTModel is only accepting "
                   "critical bug fixes, no new features.") == [cli.LOG_SUMMARIES[0][2]]
