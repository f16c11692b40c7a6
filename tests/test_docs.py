"""Every command and snippet in README.md and docs/ matches the program.

* Python blocks compile; their ``glm5_dsa_plugin`` imports resolve; the self-contained ones run
  (the op's call on small CPU tensors, the README's ``sparse_mla_torch`` against the shipped
  reference, the model-card round trip); the import lines of a block that needs a checkpoint
  (``path``) run in a fresh interpreter, as a new user would.
* Shell commands: a repository script's flags are parsed by that script's own parser (its
  ``main`` is run until ``parse_args`` returns); ``--spec MODULE FUNCTION`` of our package
  resolves; ``python -c`` code runs. Commands of other programs (``train.py ...``) and the set-up
  lines are checked only for our ``--spec`` and modules.
* The README's LoRA command and ``doctor`` run as written (outputs moved to a temporary folder).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import runpy
import shlex
import subprocess
import sys
import threading
from pathlib import Path
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`((?:\.venv/bin/)?python3? (?:-m glm5_dsa_plugin|scripts/)[^`]*)`")
PY_C = re.compile(r"python3? -c '([^']*)'", re.S)
SETUP = ("python3.12 -m venv", "-m pytest", "pip ")


def _blocks(lang: set[str]) -> list[tuple[str, str]]:
    out = []
    for f in DOCS:
        text = f.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) in lang:
                out.append((f"{f.name}:{text[: m.start()].count(chr(10)) + 1}", m.group(2)))
    return out


def _commands() -> list[tuple[str, str]]:
    """(where, one logical shell line) for every fenced shell line and inline python command."""
    out = []
    for where, body in _blocks({"bash", "sh"}):
        body = PY_C.sub("PYTHON_C", body)
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                out.append((where, line))
    for f in DOCS:
        for m in INLINE.finditer(f.read_text()):
            out.append((f"{f.name} (inline)", m.group(1)))
    return out


def _argv(line: str) -> list[str]:
    """shlex words with doc notation resolved: ``[--a x|y]`` -> ``--a x``."""
    line = re.sub(r"\[([^\]]*)\]", r"\1", line)
    return [w.split("|")[0] if w.count("|") == 1 and not w.startswith("'") else w for w in shlex.split(line)]


# --------------------------------------------------------------------------- flags against parsers
class _Parsed(Exception):
    pass


_inside = threading.local()


def parse_with_script_parser(argv: list[str]) -> argparse.Namespace:
    """Run ``python ARGV`` (a repository script or ``-m module``) until its parser returns; the
    parser's error (unknown flag, bad value) fails the test with argparse's message."""
    real_args, real_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def parse_args(self, args=None, namespace=None):
        _inside.on = True
        try:
            ns = real_args(self, args, namespace)
        finally:
            _inside.on = False
        raise _Parsed(ns)

    def parse_known_args(self, args=None, namespace=None):
        res = real_known(self, args, namespace)
        if getattr(_inside, "on", False):
            return res
        raise _Parsed(res[0])

    err = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse_known_args), \
            contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            if argv[0] == "-m":
                with mock.patch.object(sys, "argv", [argv[1], *argv[2:]]):
                    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                with mock.patch.object(sys, "argv", argv):
                    runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
        except _Parsed as p:
            return p.args[0]
        except SystemExit as e:
            pytest.fail(f"python {' '.join(argv)}: exit {e.code}: {err.getvalue().strip()[-500:]}")
    pytest.fail(f"python {' '.join(argv)}: no argument parser was called")


def _spec_refs(argv: list[str]) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, w in enumerate(argv[:-2]) if w == "--spec"]


def _python_argv(line: str) -> list[str] | None:
    """The arguments after ``python`` of a command line, or None when it runs no python."""
    words = _argv(line)
    for i, w in enumerate(words):
        if re.fullmatch(r"(\S*/)?python3?(\.\d+)?", w):
            return words[i + 1 :]
    return None


COMMANDS = _commands()


@pytest.mark.parametrize("where,line", COMMANDS, ids=[f"{w} {l[:60]}" for w, l in COMMANDS])
def test_documented_command_matches_its_parser(where, line, monkeypatch):
    monkeypatch.chdir(ROOT)
    if any(s in line for s in SETUP):
        return  # the set-up and test commands: CI runs exactly these
    words = _argv(line)
    for module, fn in _spec_refs(words):  # our --spec providers resolve, wherever they are passed
        if module.startswith("glm5_dsa_plugin"):
            assert hasattr(importlib.import_module(module), fn), f"{where}: --spec {module} {fn} does not resolve"
    argv = _python_argv(line)
    if argv is None or not argv:
        return
    if argv[0] == "-m":
        assert importlib.util.find_spec(argv[1]) is not None, f"{where}: no module {argv[1]}"
    elif not (ROOT / argv[0]).is_file():
        assert not argv[0].startswith("scripts/"), f"{where}: {argv[0]} does not exist"
        return  # another program's script (train.py, pretrain_gpt.py): only our --spec checked
    if any(w.endswith("...") for w in argv):
        return  # a wrapper around another program's command line
    parse_with_script_parser(argv)


def test_documented_cards_are_listed_in_help():
    from glm5_dsa_plugin.train import core

    help_text = core.base_parser("t").format_help()
    for alias in ("glm5", "glm5.1", "glm5.2", "tiny"):
        assert re.search(rf"\b{re.escape(alias)}\b", help_text), alias


def test_python_c_code_runs(monkeypatch):
    codes = [m.group(1) for _, body in _blocks({"bash", "sh"}) for m in PY_C.finditer(body)]
    assert codes, "the docs' python -c lines were not found"
    for code in codes:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<python -c>", "exec"), {})
        assert out.getvalue().strip()


# --------------------------------------------------------------------------- python snippets
PY_BLOCKS = _blocks({"python"})


def _op_inputs(T=6, H=2, topk=4, d_v=512, d_tail=64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, d_v + d_tail, generator=g)
    kv = torch.randn(T, 1, d_v + d_tail, generator=g)
    idx = torch.randint(-1, T, (T, 1, topk), generator=g, dtype=torch.int32)
    idx[2] = -1  # one row with no valid slot
    return dict(q=q, kv=kv, indices=idx, sm_scale=(d_v // 2) ** -0.5, torch=torch)


@pytest.mark.parametrize("where,code", PY_BLOCKS, ids=[w for w, _ in PY_BLOCKS])
def test_python_snippet(where, code):
    compile(code, where, "exec")
    if "megatron.bridge" in code:
        return  # its imports run in a fresh interpreter (test_bridge_snippet_imports), not in this worker
    for m in re.finditer(r"^\s*(?:from (glm5_dsa_plugin[\w.]*) import ([\w, ]+)|import (glm5_dsa_plugin[\w.]*))",
                         code, re.M):
        module = importlib.import_module(m.group(1) or m.group(3))
        for name in (m.group(2) or "").replace(" ", "").split(","):
            if name:
                assert hasattr(module, name) or importlib.util.find_spec(f"{module.__name__}.{name}"), \
                    f"{where}: {module.__name__}.{name} does not exist"
    if re.search(r"\bpath\b", code):
        return  # needs an HF checkpoint
    ns = _op_inputs()
    exec(compile(code, where, "exec"), ns)
    if "sparse_mla_torch" in ns:  # the README's definition is the shipped reference
        from glm5_dsa_plugin.ops import sparse_mla

        args = _op_inputs(T=9, H=4, topk=5)
        out, lse = ns["sparse_mla_torch"](args["q"], args["kv"], args["indices"], args["sm_scale"])
        ref_out, ref_lse = sparse_mla(args["q"], args["kv"], args["indices"], args["sm_scale"], backend="reference")
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    if "out" in ns and "lse" in ns:
        assert ns["out"].shape[-1] == 512 and torch.isfinite(ns["out"]).all()


@pytest.mark.slow
def test_bridge_snippet_imports():
    """The Megatron-Bridge snippets' import lines, in a fresh interpreter on the README's set-up."""
    lines = sorted({line.split("#")[0].strip() for _, code in PY_BLOCKS if "megatron.bridge" in code
                    for line in code.splitlines() if line.startswith(("import ", "from "))})
    assert lines
    for line in lines:
        res = subprocess.run([sys.executable, "-c", line], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"{line}: {res.stderr[-800:]}"


# --------------------------------------------------------------------------- commands run as written
def _quiet_output_lines(text: str) -> list[str]:
    """Output lines other than the progress bar and the job's own result line."""
    lines = [s.strip() for chunk in text.splitlines() for s in chunk.split("\r")]
    return [s for s in lines if s and not re.match(r"^(LoRA|PPO|MTP)\b.*(\||it/s)", s) and not s.startswith("merged ")]


@pytest.mark.slow
def test_readme_lora_command_runs_quietly(tmp_path):
    """The README's LoRA command as written (its outputs under tmp_path): exit 0, no traceback, at
    most 3 lines besides the progress bar and the result line."""
    readme = (ROOT / "README.md").read_text()
    line = next(line for _, line in COMMANDS if "train_lora.py --card tiny" in line and "README" in _)
    argv = _python_argv(line)
    argv = [str(tmp_path / w) if w.startswith("runs/") else w for w in argv]
    assert "runs/" in readme and any(w.startswith(str(tmp_path)) for w in argv)
    res = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    noise = _quiet_output_lines(out)
    assert len(noise) <= 3, "\n".join(noise)
    assert (tmp_path / "runs" / "lora" / "adapters.pt").is_file() and (tmp_path / "runs" / "merged" / "merged.pt").is_file()


def test_doctor_command_runs():
    res = subprocess.run([sys.executable, "-m", "glm5_dsa_plugin", "doctor"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "backend='auto' picks" in res.stdout and "Traceback" not in res.stderr


def test_examples_write_under_an_ignored_path():
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()}
    for where, line in COMMANDS:
        words = _argv(line)
        for flag in ("--save", "--merge-to", "--out"):
            if flag in words:
                target = words[words.index(flag) + 1]
                if target.startswith(("benchmarks/", "$", "DIR", "/")):
                    continue  # result files that are committed, or the user's own folder
                assert target.split("/")[0] in ignored, f"{where}: {flag} {target} is not git-ignored"


def test_parser_check_catches_an_unknown_flag(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --no-such-flag"):
        parse_with_script_parser(["scripts/train_mtp.py", "--card", "tiny", "--no-such-flag"])
