"""What the guard reports: counters, the first repaired event's warning, dumps, the index error.

Dumps: on the first event and every ``dump_every``-th, one ``torch.save`` file in
``GLM5_DSA_DUMP_DIR`` (default ``./glm5_dsa_dumps``) with the call's inputs, grad_out, the bad
outputs and an environment record; replay it with ``scripts/replay_sparse_mla.py``.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch

from ..contract import SparseMLAInputError, check_indices
from . import pending
from .config import cfg

__all__ = ["GuardStats", "stats", "reset_stats", "environment_record", "dump", "event", "warn_repaired",
           "device_repair_event", "raise_index_error"]


@dataclass
class GuardStats:
    calls_checked: int = 0
    events: int = 0
    rows_repaired: int = 0
    kv_rows_repaired: int = 0
    dumps: list[str] = field(default_factory=list)


counters = GuardStats()
_warned = False  # the first repaired event warned


def stats() -> dict:
    """Counters for training logs: calls_checked, events, rows_repaired, kv_rows_repaired, dumps.
    Settles every pending device-side repair first (waits for their flags; raises the deferred
    FloatingPointError if one of them found its inputs bad)."""
    pending.queue.settle(wait_all=True)
    return asdict(counters)


def reset_stats() -> None:
    global _warned
    pending.queue.settle(wait_all=True)
    vars(counters).update(vars(GuardStats()))
    _warned = False


def environment_record() -> dict:
    rec = {"torch": torch.__version__, "cuda": torch.version.cuda, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        import tilelang

        rec["tilelang"] = tilelang.__version__
    except Exception as exc:  # noqa: BLE001 - record why, never fail a dump
        rec["tilelang"] = f"unavailable: {exc}"
    if torch.cuda.is_available():
        rec["gpu"] = torch.cuda.get_device_name()
        rec["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    try:
        from ..tilelang.compile import PASS_CONFIGS

        rec["pass_configs"] = {str(k): v for k, v in PASS_CONFIGS.items()}
    except Exception as exc:  # noqa: BLE001
        rec["pass_configs"] = f"unavailable: {exc}"
    return rec


def dump(kind: str, backend_name: str, inputs: dict, bad: dict | None, extra: dict | None = None) -> str | None:
    """``bad`` may be a callable returning the bad outputs (computed only when a dump is due)."""
    if (counters.events - 1) % cfg.dump_every != 0:
        return None
    if callable(bad):
        bad = bad()
    os.makedirs(cfg.dump_dir, exist_ok=True)
    path = os.path.join(cfg.dump_dir, f"sparse_mla_{kind}_pid{os.getpid()}_event{counters.events}.pt")
    cpu = lambda d: {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}  # noqa: E731
    torch.save({"kind": kind, "backend": backend_name, "inputs": cpu(inputs), "bad_outputs": cpu(bad),
                "env": environment_record(), **(extra or {})}, path)
    counters.dumps.append(path)
    return path


def event(kind: str, backend, inputs: dict | None, bad, n_rows: int, extra: dict | None = None,
          no_dump: str | None = None) -> str | None:
    """Count and dump an event (``raise``: raise here) -> the dump's path. The caller warns with
    ``warn_repaired`` once the repair is known to be finite: a repair that stays nonfinite
    raises instead, and a warning saying "repaired" before that error would be wrong.
    ``inputs`` None: the call's tensors were not kept (``no_dump`` says why); no dump."""
    counters.events += 1
    path = f"none ({no_dump})" if inputs is None else dump(kind, backend.name, inputs, bad, extra)
    if cfg.policy == "raise":
        raise FloatingPointError(
            f"sparse_mla {kind} ({backend.name}) produced nonfinite values (or, forward, rows outside the range its "
            f"kernels are exact in) in {n_rows} row(s); inputs dumped to "
            f"{path or (counters.dumps[-1] if counters.dumps else 'nowhere (dump_every)')}"
        )
    return path


def warn_repaired(kind: str, backend, n_rows: int, path: str | None, stacklevel: int) -> None:
    """The first repaired event's warning (later ones are only counted); ``stacklevel`` as the
    caller would pass it to ``warnings.warn``."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"sparse_mla {kind} ({backend.name}) produced nonfinite values (or, forward, rows outside the range its "
            f"kernels are exact in) in {n_rows} row(s); repaired "
            f"row-wise with the reference (GLM5_DSA_NONFINITE=fallback). Dump: {path}. Further events are "
            f"counted in glm5_dsa_plugin.ops.guard_stats() without warning.",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


def device_repair_event(kind: str, backend, inputs: dict | None, recompute_bad, n_rows: int, still_bad: bool,
                        no_dump: str | None = None) -> None:
    """Count / warn / dump a device-repaired call once its flags are settled (its bad outputs were
    repaired in place, so ``recompute_bad`` rebuilds them for the dump); raise if the repair itself
    stayed nonfinite (``still_bad``: the inputs are bad). ``inputs`` None: the call's tensors were
    not kept (``no_dump`` says why), so the event is counted and reported without a dump."""
    path = event(kind, backend, inputs, recompute_bad, n_rows, extra={"bad_outputs_recomputed": True},
                 no_dump=no_dump)
    if not still_bad:
        warn_repaired(kind, backend, n_rows, path, stacklevel=3)
    else:
        raise FloatingPointError(
            f"sparse_mla {kind} is nonfinite even in the reference repair: inputs are bad (dump: {path}); "
            "raised when the device-side repair's flags were settled, after the call itself returned")


def raise_index_error(indices: torch.Tensor, n_kv: int, settled_late: bool = False) -> None:
    """The index rule was broken: SparseMLAInputError naming the first bad entry (``settled_late``:
    the flag was read after the call had returned, which the message says)."""
    late = (" (found when the forward's flags were settled, after the call returned: in its backward, "
            "a later sparse_mla call or guard_stats())") if settled_late else ""
    try:
        check_indices(indices, n_kv)
    except SparseMLAInputError as exc:
        raise SparseMLAInputError(f"{exc}{late}") from None
    raise SparseMLAInputError(f"sparse_mla: indices hold an entry outside {{-1}} U [0, T_kv){late}")
