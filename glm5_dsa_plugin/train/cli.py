"""The launchers' entry: an input error is one line and exit status 2, and upstream notices that do
not apply to a launcher run are silenced.

``scripts/train_{lora,ppo,mtp}.py`` call :func:`launch` with their job's ``main``. Input errors are
the ones a user fixes on the command line: :class:`LauncherInputError`, every ``ValueError`` (our
input checks, e.g. ``SparseMLAInputError`` and a pipeline split that breaks index sharing, and
megatron-core's config checks raise one) and a missing file. ``--debug`` re-raises them with the
traceback. Everything else (a bug) keeps its traceback.

The filters match one message from one module each (never a category or a whole package), so
an upstream notice that does apply still shows. This module imports nothing heavy: it runs before
torch, megatron-core and Megatron-Bridge are imported.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["INPUT_ERRORS", "LauncherInputError", "check_inputs", "install_filters", "launch"]


class LauncherInputError(ValueError):
    """A launcher input that cannot work (flag, card, file, machine); the message names the fix."""


INPUT_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)

# (message regex, module regex) of Python warnings that do not apply to a launcher run: a CPU or
# TE-free run uses torch optimizers / norms and local linears on purpose; megatron-core's own
# default config trips its "full scope" deprecation; absl is only a logging backend.
WARNING_FILTERS = [
    (r"Transformer Engine and Apex are not installed", r"megatron\."),
    (r"Apex is not installed\. Falling back to Torch Norm", r"megatron\."),
    (r"absl\.logging is not installed", r"megatron\.core\.hyper_comm_grid"),
    (r"full scope is deprecated", r"megatron\.core\.transformer\.transformer_config"),
    (r"Only transformer-engine>=1\.7\.0 supports MoE experts", r"megatron\.core\.extensions\."),
]

# (logger name, message regex) of log records that do not apply: torch looks for a CUDA toolkit
# at import; Megatron-Bridge logs a failed TE import with its traceback (TE is optional here), one
# line per LoRA-wrapped module, and a Gemma-2 capability note; HF configs carry ``torch_dtype``.
LOG_FILTERS = [
    ("torch.utils.cpp_extension", r"No CUDA runtime is found"),
    ("megatron.bridge.utils.import_utils", r"Import of FP8GlobalStateManager from megatron\.core\.extensions\."),
    ("megatron.bridge.peft.lora", r"Adding lora to: "),
    ("megatron.bridge.models.gemma.gemma2_provider", r"FlexAttention available"),
    ("transformers.configuration_utils", r"`torch_dtype` is deprecated"),
    ("transformers.modeling_utils", r"`torch_dtype` is deprecated"),
]


class _DropMessage(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


# (logger name, message regex, replacement) of notices that apply, said once in a line
LOG_SUMMARIES = [
    ("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED",
     "megatron-core deprecates GPTModel (--model gpt); the launchers' default, --model hybrid, builds HybridModel"),
]


class _Summarise(logging.Filter):
    def __init__(self, pattern: str, text: str):
        super().__init__()
        self.pattern, self.text = re.compile(pattern), text

    def filter(self, record: logging.LogRecord) -> bool:
        if self.pattern.search(record.getMessage()):
            record.msg, record.args = self.text, ()
        return True


def install_filters() -> None:
    """Install the narrow warning and log filters and the summaries above (idempotent)."""
    for message, module in WARNING_FILTERS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    for name, pattern in LOG_FILTERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.pattern.pattern == pattern for f in log.filters):
            log.addFilter(_DropMessage(pattern))
    for name, pattern, text in LOG_SUMMARIES:
        log = logging.getLogger(name)
        if not any(isinstance(f, _Summarise) for f in log.filters):
            log.addFilter(_Summarise(pattern, text))


def check_inputs(args) -> None:
    """Inputs a launcher can check before it builds anything; raises :class:`LauncherInputError`."""
    from ..checkpoints import cards

    if getattr(args, "hf", None):
        if not (Path(args.hf) / "config.json").is_file():
            raise LauncherInputError(f"--hf {args.hf}: no config.json there; give an HF checkpoint folder")
    elif getattr(args, "card", None) is not None:
        name = args.card
        known = name in cards.CARD_ALIASES or (cards.CARDS_DIR / f"{name}.json").is_file()
        if not known and not Path(name).is_file():
            raise LauncherInputError(f"--card {name!r}: no such model card; use one of "
                                     f"{', '.join(card_names())} or the path of a card .json")
    if getattr(args, "load", None) and not (Path(args.load) / "checkpoint.pt").is_file():
        raise LauncherInputError(f"--load {args.load}: no checkpoint.pt there; give a folder written by --save")
    device = str(getattr(args, "device", "cpu"))
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LauncherInputError(f"--device {device}: no CUDA device on this machine; use --device cpu")
    if getattr(args, "backend", None) == "tilelang":
        if not device.startswith("cuda"):
            raise LauncherInputError(f"--backend tilelang needs a CUDA sm_90 GPU and this run is on {device}; "
                                     "use --backend reference (or auto)")
        from ..ops.backends import get_backend

        ok, reason = get_backend("tilelang").available()
        if not ok:
            raise LauncherInputError(f"--backend tilelang is not available: {reason}; use --backend reference "
                                     "(or auto)")


def card_names() -> list[str]:
    """The names the docs use for the shipped cards (aliases first, then other card files)."""
    from ..checkpoints import cards

    names = ["glm5", "glm5.1", "glm5.2", "tiny"]
    aliased = {cards.CARD_ALIASES.get(n, n) for n in names}
    return names + [c for c in cards.available_cards() if c not in aliased]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError)) and exc.filename:
        text = f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    return text


def launch(main: Callable[[list[str] | None], int], argv: Sequence[str] | None = None, prog: str | None = None
           ) -> int:
    """Run a job's ``main`` as a command: filters installed; an input error -> one line on stderr
    and exit status 2 (``--debug``: re-raised with its traceback)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or os.path.basename(sys.argv[0] or "launcher")
    install_filters()
    try:
        return main(argv)
    except INPUT_ERRORS as exc:
        if "--debug" in argv:
            raise
        print(f"{prog}: error: {_one_line(exc)} (--debug shows the traceback)", file=sys.stderr)
        return 2
