"""Nonfinite guard around fast sparse-MLA backends: detection, row-granular repair, dumps.

Policy (per process): env ``GLM5_DSA_NONFINITE=fallback|raise|off`` or :func:`configure`.

Detection: after each fast-backend call, one device-side finiteness pass over the outputs
(out/lse forward, dq/dkv backward; Triton on CUDA) into an int32 flag buffer. A backend with
``reports_nonfinite`` sets the backward's flag itself, in work it does anyway (TileLang: dq
tested in the warp-specialised kernel's registers, dKV in its conversion pass). A backend with
``finite_out_lse_bound`` flags suspect kv during its forward; the forward's pass then reads lse,
and out only when kv is suspect (TileLang: out is d_v times the size of lse; 17-19 us instead
of 73 at T = 4096, H = 64, exp52), and marks the rows the backend does not vouch for (an lse beyond its
bound, or an empty row that has a valid slot: every score came out -inf) as nonfinite, so that
they are recomputed like any other bad row. The forward's
flags also carry the deferred index-validation flag of a backend memory-safe for any index (see
``backends.Backend``).

When the flags are read: on CUDA under ``fallback`` (and ``off``, for the index flag) no call
that autograd records reads them itself. The repair runs on the device behind the kernels
(``row_repair``: launches that only read the flag on the happy path) and the flags travel to
pinned host memory behind it. A forward's flags are settled by its own backward, after the
backward's kernels are queued (an index violation raises there, before gradients are returned);
a backward's flags, and those of a forward whose backward never runs, at the next guarded call
once they have arrived, or by :func:`stats`. Settling counts, warns, dumps, and raises when even
the repair was nonfinite. Until then a queued call keeps the tensors a dump of it would need
(its inputs and grad_out; outputs are recomputed if a dump is due). At most ``MAX_PENDING``
calls wait unsettled, and at most ``pending_bytes`` of tensors that only the queue keeps alive
(``configure(pending_bytes=...)`` / ``GLM5_DSA_PENDING_BYTES``, default 2 GiB; the newest call
always stays queued); past either, the oldest is waited for. ``raise``, CPU tensors, graph capture
and forwards without a backward to come (no grad) read the flags before returning; the last
can read late too (``configure(forward_flags="deferred")`` / ``GLM5_DSA_FORWARD_FLAGS``). What is
still pending at interpreter exit is settled then, and an error it raises is printed.

Repair method (``fallback``):
  * forward: the query rows (b, t) whose out or lse holds a nonfinite value are recomputed
    with the reference and written back; every other row is left bit for bit.
  * backward, dq: the query rows whose dq is nonfinite are recomputed with the reference.
  * backward, dkv: a kv row (b, s) with a nonfinite entry is rebuilt from scratch as the sum of
    the reference contributions of *every* query row that selected it (found from ``indices``),
    so the repaired row is the exact reference value, not a patch on a poisoned sum.
  Good rows of dq/dkv are untouched. If a repaired value is still nonfinite the inputs
  themselves are bad: the guard raises ``FloatingPointError`` with the dump path (for a
  device-side backward repair, when its flags are settled: at a later call or ``stats()``).
  On CUDA the backward repair is the same method computed by ``row_repair``'s Triton kernels
  (fp32 accumulation, exact bf16 products; see there) instead of ``reference.backward``; a dump of such an event holds
  bad outputs recomputed at settling (the call's own were repaired in place), flagged
  ``bad_outputs_recomputed``.

Dumps: on the first event and every ``dump_every``-th, one ``torch.save`` file in
``GLM5_DSA_DUMP_DIR`` (default ``./glm5_dsa_dumps``) with the call's inputs, grad_out, the bad
outputs and an environment record; replay it with ``scripts/replay_sparse_mla.py``.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch

from . import reference
from .contract import EMPTY_ROW_LSE, SparseMLAInputError, check_indices

POLICIES = ("fallback", "raise", "off")
FORWARD_FLAGS = ("eager", "deferred")


@dataclass
class GuardStats:
    calls_checked: int = 0
    events: int = 0
    rows_repaired: int = 0
    kv_rows_repaired: int = 0
    dumps: list[str] = field(default_factory=list)


@dataclass
class _Config:
    policy: str = "fallback"
    dump_dir: str = "glm5_dsa_dumps"
    dump_every: int = 100
    forward_flags: str = "eager"
    pending_bytes: int = 2 << 30
    warned: bool = False


# setting -> (environment variable, its rule, what the rule expects)
_SETTINGS = {
    "policy": ("GLM5_DSA_NONFINITE", lambda v: v in POLICIES, f"one of {POLICIES}"),
    "forward_flags": ("GLM5_DSA_FORWARD_FLAGS", lambda v: v in FORWARD_FLAGS, f"one of {FORWARD_FLAGS}"),
    "dump_every": ("GLM5_DSA_DUMP_EVERY", lambda v: v >= 1, ">= 1"),
    "pending_bytes": ("GLM5_DSA_PENDING_BYTES", lambda v: v >= 0, "bytes >= 0"),
}


def _checked(name: str, value, label: str):
    """``value`` of setting ``name`` if its rule holds, else a ValueError naming ``label`` (the
    argument or the environment variable) and the value."""
    _, rule, expected = _SETTINGS[name]
    if not rule(value):
        raise ValueError(f"{label}={value!r}: expected {expected}")
    return value


def _from_env(name: str, default):
    """Setting ``name`` from its environment variable (``default`` when unset), checked."""
    var = _SETTINGS[name][0]
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    if isinstance(default, int):
        try:
            raw = int(raw)
        except ValueError:
            raise ValueError(f"{var}={raw!r}: expected an integer") from None
    else:
        raw = raw.lower()
    return _checked(name, raw, var)


_cfg = _Config(
    policy=_from_env("policy", "fallback"),
    dump_dir=os.environ.get("GLM5_DSA_DUMP_DIR", "glm5_dsa_dumps"),
    dump_every=_from_env("dump_every", 100),
    forward_flags=_from_env("forward_flags", "eager"),
    pending_bytes=_from_env("pending_bytes", 2 << 30),
)
_stats = GuardStats()


def configure(policy: str | None = None, dump_dir: str | None = None, dump_every: int | None = None,
              forward_flags: str | None = None, pending_bytes: int | None = None) -> None:
    """Set the process-wide guard policy (``fallback``/``raise``/``off``), dump folder, dump period,
    and when a forward that no backward follows (no grad) reads its flags: ``eager`` (default:
    before it returns) or ``deferred`` (like a recorded forward's: repaired on the device, the
    flags settled by a later guarded call, :func:`stats` or at exit; for forward-only passes such
    as RL log-probs, where the read would stall the GPU once per layer). ``pending_bytes``: how
    many bytes of tensors that only unsettled calls keep alive (for their dumps) may accumulate
    before the oldest call is waited for (module docstring). Each is checked by the rule its
    environment variable is checked by."""
    for name, value in (("policy", policy), ("forward_flags", forward_flags), ("dump_every", dump_every),
                        ("pending_bytes", pending_bytes)):
        if value is not None:
            setattr(_cfg, name, _checked(name, type(getattr(_cfg, name))(value), name))
    if dump_dir is not None:
        _cfg.dump_dir = str(dump_dir)


def policy() -> str:
    return _cfg.policy


def stats() -> dict:
    """Counters for training logs: calls_checked, events, rows_repaired, kv_rows_repaired, dumps.
    Settles every pending device-side repair first (waits for their flags; raises the deferred
    FloatingPointError if one of them found its inputs bad)."""
    _pending.settle(wait_all=True)
    return asdict(_stats)


def reset_stats() -> None:
    global _stats
    _pending.settle(wait_all=True)
    _stats = GuardStats()
    _cfg.warned = False


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
        from .tilelang.compile import PASS_CONFIGS

        rec["pass_configs"] = {str(k): v for k, v in PASS_CONFIGS.items()}
    except Exception as exc:  # noqa: BLE001
        rec["pass_configs"] = f"unavailable: {exc}"
    return rec


def _dump(kind: str, backend_name: str, inputs: dict, bad: dict | None, extra: dict | None = None) -> str | None:
    """``bad`` may be a callable returning the bad outputs (computed only when a dump is due)."""
    if (_stats.events - 1) % _cfg.dump_every != 0:
        return None
    if callable(bad):
        bad = bad()
    os.makedirs(_cfg.dump_dir, exist_ok=True)
    path = os.path.join(_cfg.dump_dir, f"sparse_mla_{kind}_pid{os.getpid()}_event{_stats.events}.pt")
    cpu = lambda d: {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}  # noqa: E731
    torch.save({"kind": kind, "backend": backend_name, "inputs": cpu(inputs), "bad_outputs": cpu(bad),
                "env": environment_record(), **(extra or {})}, path)
    _stats.dumps.append(path)
    return path


def _event(kind: str, backend, inputs: dict, bad, n_rows: int, extra: dict | None = None) -> str | None:
    """Count and dump an event (``raise``: raise here) -> the dump's path. The caller warns with
    ``_warn_repaired`` once the repair is known to be finite: a repair that stays nonfinite
    raises instead, and a warning saying "repaired" before that error would be wrong."""
    _stats.events += 1
    path = _dump(kind, backend.name, inputs, bad, extra)
    if _cfg.policy == "raise":
        raise FloatingPointError(
            f"sparse_mla {kind} ({backend.name}) produced nonfinite values (or, forward, rows outside the range its "
            f"kernels are exact in) in {n_rows} row(s); inputs dumped to "
            f"{path or (_stats.dumps[-1] if _stats.dumps else 'nowhere (dump_every)')}"
        )
    return path


def _warn_repaired(kind: str, backend, n_rows: int, path: str | None, stacklevel: int) -> None:
    """The first repaired event's warning (later ones are only counted); ``stacklevel`` as the
    caller would pass it to ``warnings.warn``."""
    if not _cfg.warned:
        _cfg.warned = True
        warnings.warn(
            f"sparse_mla {kind} ({backend.name}) produced nonfinite values (or, forward, rows outside the range its "
            f"kernels are exact in) in {n_rows} row(s); repaired "
            f"row-wise with the reference (GLM5_DSA_NONFINITE=fallback). Dump: {path}. Further events are "
            f"counted in glm5_dsa_plugin.ops.guard_stats() without warning.",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


def _flag_nonfinite(flags: torch.Tensor, slot: int, a: torch.Tensor, b: torch.Tensor | None = None) -> None:
    """flags[slot] becomes nonzero if a (or b) holds NaN/inf; device-side, no host sync.
    CUDA: one Triton pass over both; elsewhere (fault-injection tests on CPU) plain torch."""
    if a.is_cuda:
        from .triton_helpers import flag_nonfinite

        flag_nonfinite(a, flags, slot, b)
        return
    for t in (a,) if b is None else (a, b):
        flags[slot : slot + 1] += (~torch.isfinite(t)).any().to(torch.int32)


def _check_forward(flags: torch.Tensor, slot: int, out: torch.Tensor, lse: torch.Tensor, gate: int,
                   lse_bound: float, extent: torch.Tensor | None) -> None:
    """The forward check for a backend with ``finite_out_lse_bound`` (``triton_helpers.check_forward``):
    lse (contiguous, written in place) of the rows the backend does not vouch for (|lse| >
    ``lse_bound`` other than EMPTY_ROW_LSE; EMPTY_ROW_LSE on a row whose ``extent`` [B, T, G] is
    > 0) becomes NaN, and flags[slot] becomes nonzero when such a row exists, lse is NaN / inf, or
    (read only when flags[gate] is set) out is. Device-side, no host sync."""
    hg = lse.shape[-1] // extent.shape[-1] if extent is not None else 1
    if out.is_cuda:
        from .triton_helpers import check_forward

        check_forward(out, lse, flags, slot, gate, lse_bound, EMPTY_ROW_LSE, extent, hg)
        return
    rows = lse.view(-1)
    doubtful = (rows.abs() > lse_bound) & (rows != EMPTY_ROW_LSE)
    if extent is not None:
        doubtful |= (rows == EMPTY_ROW_LSE) & (extent.reshape(-1).repeat_interleave(hg) > 0)
    bad = (~torch.isfinite(rows)).any() | doubtful.any()
    if bool(flags[gate] != 0):
        bad |= (~torch.isfinite(out)).any()
    rows[doubtful] = float("nan")
    flags[slot : slot + 1] += bad.to(torch.int32)


def _read(flags: torch.Tensor) -> list[int]:
    """The one host read of a flags buffer; a clear error inside CUDA graph capture, where no
    host read is allowed."""
    if _capturing(flags.device):
        raise RuntimeError(
            "sparse_mla reads a device flag (nonfinite guard / deferred index validation), which CUDA graph "
            "capture forbids: set GLM5_DSA_NONFINITE=off (or ops.configure(policy='off')) and call sparse_mla "
            "with validate=False (the spec's attention does so itself when the policy is off) to capture it"
        )
    return flags.tolist()


def _reads_late(device: torch.device) -> bool:
    """Whether a call's flags may travel to the host behind its kernels and be read later (CUDA,
    outside graph capture)."""
    return device.type == "cuda" and not _capturing(device)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


FLAG_SLOTS = 8  # [index rule violated, some output nonfinite, row_repair's slots 2..4, kv suspect, spare]
KV_SUSPECT_SLOT = 5  # set by a backend with ``finite_out_lse_bound`` (the forward's gated check)


class _FlagPool:
    """Zeroed int32 [FLAG_SLOTS] flag buffers, each used
    once, cut from a zeroed block of ``SLOTS`` per (device, stream); a new block (one fill) when
    it runs out. One allocation + fill per call was a visible part of the host time that a
    guard sync exposes. Per stream, so the block's fill is ordered before every kernel that
    sets one of its flags."""

    SLOTS = 2048

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, device: torch.device) -> torch.Tensor:
        key = (device, torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else (device,)
        free = self._free.get(key)
        if not free:
            block = torch.zeros(self.SLOTS, FLAG_SLOTS, dtype=torch.int32, device=device)
            free = self._free[key] = list(reversed(block.unbind(0)))
        return free.pop()


_flag_pool = _FlagPool()


def _new_flags(device: torch.device) -> torch.Tensor:
    """int32 [FLAG_SLOTS], zero: [index rule violated, some output nonfinite, ...], read with one host copy."""
    return _flag_pool.take(device)


def _all_finite(a: torch.Tensor, b: torch.Tensor) -> bool:
    flags = _new_flags(a.device)
    _flag_nonfinite(flags, 1, a, b)
    return not _read(flags)[1]


def _storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage once)."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[(t.device, st.data_ptr())] = st.nbytes()
    return sum(seen.values())


def _bad_rows(t: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> bool [B, T]: rows with any nonfinite entry."""
    return ~torch.isfinite(t).flatten(2).all(-1)


def _forward(backend, q, kv, indices, sm_scale, d_v, index_flag, kv_flag=None):
    """-> (out, lse, saved): ``saved`` is what the backward needs in place of (kv, indices) for a
    backend that prepares its inputs once per call (``forward_saving``), else (kv, indices)."""
    kw = {} if index_flag is None else {"index_flag": index_flag}
    if kv_flag is not None:  # (only backends with finite_out_lse_bound, all of which save)
        kw["kv_flag"] = kv_flag
    return backend.forward_saving(q, kv, indices, sm_scale, d_v, **kw)


def originals(backend, saved: tuple, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv, indices) of the call whose forward returned ``saved``."""
    return backend.originals(saved, topk)


def run_forward(backend, q, kv, indices, sm_scale, d_v, defer_index_check: bool = False,
                backward_follows: bool = False):
    """Forward through ``backend`` with the nonfinite check -> (out, lse, saved, pending): ``saved``
    as in ``_forward``; ``pending`` is None, or the queued flags that the call's backward must
    settle (``settle_through``) before it returns gradients.

    ``defer_index_check`` (only for backends memory-safe on any index): the backend sets the
    index-rule flag during the call; it travels with the finiteness flag. A violation raises the
    usual SparseMLAInputError (naming the first bad entry).

    ``backward_follows`` (autograd recorded the call) on CUDA under ``fallback`` / ``off``: no
    host read here. Bad out / lse rows are repaired on the device (``row_repair``) and the flags
    travel to pinned host memory behind the kernels; they are settled at the latest by this
    call's backward, else by a later guarded call or :func:`stats`, so an index violation raises
    there instead of from this call. The same without grad under ``forward_flags="deferred"``
    (settled by a later call, :func:`stats` or at exit). Otherwise (no backward to come,
    ``raise``, CPU, graph capture) the flags are read before returning, as the backward does in
    those cases."""
    check = _cfg.policy != "off" and backend.name != "reference"
    flags = _new_flags(q.device) if (check or defer_index_check) else None
    lse_bound = backend.finite_out_lse_bound(sm_scale, indices.shape[-1]) if check else None
    kv_flag = None if lse_bound is None else flags[KV_SUSPECT_SLOT : KV_SUSPECT_SLOT + 1]
    out, lse, saved = _forward(backend, q, kv, indices, sm_scale, d_v, flags[0:1] if defer_index_check else None,
                               kv_flag)
    if flags is None:
        return out, lse, saved, None
    if check:
        if lse_bound is None:
            _flag_nonfinite(flags, 1, out, lse)
        else:  # (rows the backend does not vouch for get lse NaN: the repair below recomputes them)
            lse = lse.contiguous()
            _check_forward(flags, 1, out, lse, KV_SUSPECT_SLOT, lse_bound, backend.row_extent(saved))
    read_late = backward_follows or _cfg.forward_flags == "deferred"
    if read_late and _cfg.policy != "raise" and _reads_late(q.device):
        if check:
            from .row_repair import repair_forward_rows

            out, lse = out.contiguous(), lse.contiguous()
            repair_forward_rows(q, kv, indices, sm_scale, d_v, out, lse, flags)
            _stats.calls_checked += 1
        call = (backend, q, kv, indices, sm_scale, d_v)
        # a recorded call's inputs stay alive for its backward anyway, which settles these flags
        held = 0 if backward_follows else _storage_bytes(q, kv, indices)
        return out, lse, saved, _pending.push(flags, lambda values: _settle_forward_event(values, call), held)
    bad_index, nonfinite = _read(flags)[:2]  # the one host read
    _pending.settle()  # earlier calls' flags have arrived by now (may raise for such a call)
    if bad_index:
        _raise_index_error(indices, kv.shape[1])
    if not check:
        return out, lse, saved, None
    _stats.calls_checked += 1
    if not nonfinite:
        return out, lse, saved, None
    bad = _bad_rows(out) | _bad_rows(lse)
    rows = bad.nonzero()
    if rows.shape[0] == 0:
        return out, lse, saved, None
    path = _event("forward", backend, dict(q=q, kv=kv, indices=indices, sm_scale=sm_scale, d_v=d_v),
                  dict(out=out, lse=lse), rows.shape[0])
    out, lse = out.clone(), lse.clone()
    for b in rows[:, 0].unique().tolist():
        r = rows[rows[:, 0] == b, 1]
        o_r, l_r = reference.forward(q[b : b + 1, r], kv[b : b + 1], indices[b : b + 1, r], sm_scale, d_v)
        out[b, r], lse[b, r] = o_r[0], l_r[0]
    if not _all_finite(out, lse):
        raise FloatingPointError(f"sparse_mla forward is nonfinite even in the reference: inputs are bad (dump: {path})")
    _warn_repaired("forward", backend, rows.shape[0], path, stacklevel=3)
    _stats.rows_repaired += rows.shape[0]
    return out, lse, saved, None


def _raise_index_error(indices: torch.Tensor, n_kv: int, settled_late: bool = False) -> None:
    """The index rule was broken: SparseMLAInputError naming the first bad entry (``settled_late``:
    the flag was read after the call had returned, which the message says)."""
    late = (" (found when the forward's flags were settled, after the call returned: in its backward, "
            "a later sparse_mla call or guard_stats())") if settled_late else ""
    try:
        check_indices(indices, n_kv)
    except SparseMLAInputError as exc:
        raise SparseMLAInputError(f"{exc}{late}") from None
    raise SparseMLAInputError(f"sparse_mla: indices hold an entry outside {{-1}} U [0, T_kv){late}")


def _settle_forward_event(values: list[int], call: tuple) -> None:
    """A forward whose flags were read late: the index error, or count / warn / dump a
    device-repaired forward (and raise if even the repair was nonfinite)."""
    backend, q, kv, indices, sm_scale, d_v = call
    if values[0]:
        _raise_index_error(indices, kv.shape[1], settled_late=True)
    if not values[1]:
        return
    _stats.rows_repaired += values[3]

    def recompute_bad():
        out, lse, _ = _forward(backend, q, kv, indices, sm_scale, d_v, None)
        return dict(out=out, lse=lse)

    _device_repair_event("forward", backend, dict(q=q, kv=kv, indices=indices, sm_scale=sm_scale, d_v=d_v),
                         recompute_bad, values[3], bool(values[2]))


def _device_repair_event(kind: str, backend, inputs: dict, recompute_bad, n_rows: int, still_bad: bool) -> None:
    """Count / warn / dump a device-repaired call once its flags are settled (its bad outputs were
    repaired in place, so ``recompute_bad`` rebuilds them for the dump); raise if the repair itself
    stayed nonfinite (``still_bad``: the inputs are bad)."""
    path = _event(kind, backend, inputs, recompute_bad, n_rows, extra={"bad_outputs_recomputed": True})
    if not still_bad:
        _warn_repaired(kind, backend, n_rows, path, stacklevel=3)
    else:
        raise FloatingPointError(
            f"sparse_mla {kind} is nonfinite even in the reference repair: inputs are bad (dump: {path}); "
            "raised when the device-side repair's flags were settled, after the call itself returned")


def _backward(backend, q, saved, out, lse, grad_out, sm_scale, d_v, flags):
    """-> (dq, dkv) with flags[1] set when either is nonfinite (``flags`` None: no check)."""
    own = flags is not None and backend.reports_nonfinite
    dq, dkv = backend.backward_saved(q, saved, out, lse, grad_out, sm_scale, d_v,
                                     **({"nonfinite_flag": flags[1:2]} if own else {}))
    if flags is not None and not own:
        _flag_nonfinite(flags, 1, dq, dkv)
    return dq, dkv


def run_backward(backend, q, saved, topk, out, lse, grad_out, sm_scale, d_v):
    """Backward from the forward's ``saved`` tensors (``topk``: the caller's indices width)."""
    if _cfg.policy == "off" or backend.name == "reference":
        return _backward(backend, q, saved, out, lse, grad_out, sm_scale, d_v, None)
    flags = _new_flags(q.device)
    dq, dkv = _backward(backend, q, saved, out, lse, grad_out, sm_scale, d_v, flags)
    _stats.calls_checked += 1
    if _cfg.policy == "fallback" and _reads_late(q.device):
        from .row_repair import repair_backward_rows

        dq, dkv = dq.contiguous(), dkv.contiguous()
        kv_v, idx_v = backend.padded_views(saved, topk)
        repair_backward_rows(q, kv_v, idx_v, grad_out, sm_scale, d_v, dq, dkv, flags)
        # what a dump needs; out and lse (as large as grad_out) are recomputed if one is due
        call = (backend, q, saved, topk, grad_out, sm_scale, d_v)
        _pending.push(flags, lambda values: _settle_backward_event(values, call), _storage_bytes(q, grad_out, *saved))
        return dq, dkv
    if not _read(flags)[1]:  # the one host read
        return dq, dkv
    kv, indices = originals(backend, saved, topk)
    bad_q = _bad_rows(dq)  # [B, T]
    bad_kv = _bad_rows(dkv)  # [B, T_kv]
    # query rows that selected any bad kv row (in any group) contribute to it
    B, T_kv = bad_kv.shape
    sel_bad = torch.zeros_like(bad_q)
    for b in bad_kv.any(-1).nonzero().flatten().tolist():
        idx = indices[b].long()
        hit = bad_kv[b][idx.clamp(min=0)] & (idx >= 0)
        sel_bad[b] = hit.flatten(1).any(-1)
    rows = (bad_q | sel_bad).nonzero()
    if rows.shape[0] == 0:
        return dq, dkv
    path = _event("backward", backend,
                  dict(q=q, kv=kv, indices=indices, grad_out=grad_out, sm_scale=sm_scale, d_v=d_v),
                  dict(dq=dq, dkv=dkv), int(bad_q.sum()) + int(bad_kv.sum()))
    ref_dq, ref_dkv = reference.backward(q, kv, indices, grad_out, sm_scale, d_v, rows=rows)
    dq, dkv = dq.clone(), dkv.clone()
    dq[bad_q] = ref_dq[bad_q]
    dkv[bad_kv] = ref_dkv[bad_kv]
    if not _all_finite(dq, dkv):
        raise FloatingPointError(f"sparse_mla backward is nonfinite even in the reference: inputs are bad (dump: {path})")
    _warn_repaired("backward", backend, int(bad_q.sum()) + int(bad_kv.sum()), path, stacklevel=3)
    _stats.rows_repaired += int(bad_q.sum())
    _stats.kv_rows_repaired += int(bad_kv.sum())
    return dq, dkv


class _PendingRepairs:
    """Flags of calls read late (device-repaired backwards; forwards whose backward will settle
    them) on their way to pinned host memory, oldest first, each with the function that settles
    it. ``settle`` handles those whose copy is done (``Event.query``); it never waits unless
    asked, or unless more than ``MAX_PENDING`` are queued: then it waits for the oldest, and the
    later calls' kernels stay queued on the GPU meanwhile (so the wait does not drain it)."""

    MAX_PENDING = 4

    def __init__(self):
        self._queue: list[tuple] = []  # (device, pinned flags, event, settle(values), held bytes)
        self._spare: dict[torch.device, list[tuple]] = {}  # per device: (pinned int32 [FLAG_SLOTS], event)
        self.held_bytes = 0  # of tensors that only queued entries keep alive

    # where the flags go and how their arrival is tracked (a CPU test replaces these three)
    @staticmethod
    def _host_buffer() -> torch.Tensor:
        return torch.empty(FLAG_SLOTS, dtype=torch.int32, pin_memory=True)

    _new_event = staticmethod(torch.cuda.Event)
    _stream = staticmethod(torch.cuda.current_stream)

    def push(self, flags: torch.Tensor, settle, held_bytes: int = 0) -> tuple:
        """Queue ``flags`` (copied behind the work on their stream); ``settle(values)`` runs once
        they have arrived, never within this push (a forward's flags are settled by its backward
        or later, whatever the GPU's progress). ``held_bytes``: tensors that only this entry
        keeps alive until then. Past ``MAX_PENDING`` entries or ``pending_bytes`` held, the
        oldest are waited for (never the new one). -> the queue entry (for ``settle_through``)."""
        self.settle()  # the earlier calls' flags that have arrived
        spare = self._spare.setdefault(flags.device, [])
        host, event = spare.pop() if spare else (self._host_buffer(), self._new_event())
        host.copy_(flags, non_blocking=True)
        event.record(self._stream(flags.device))
        entry = (flags.device, host, event, settle, int(held_bytes))
        self._queue.append(entry)
        self.held_bytes += int(held_bytes)
        while len(self._queue) > 1 and (len(self._queue) > self.MAX_PENDING or self.held_bytes > _cfg.pending_bytes):
            self._settle_oldest()
        return entry

    def settle(self, wait_all: bool = False) -> None:
        while self._queue:
            if not (wait_all or self._queue[0][2].query()):
                return
            self._settle_oldest()

    def settle_through(self, entry: tuple) -> None:
        """Wait for and settle every queued call up to and including ``entry`` (nothing if it
        was settled already)."""
        while any(e is entry for e in self._queue):
            self._settle_oldest()

    def _settle_oldest(self) -> None:
        device, host, event, settle, held = self._queue.pop(0)
        self.held_bytes -= held
        if not event.query():
            event.synchronize()
        values = host.tolist()
        self._spare[device].append((host, event))
        settle(values)


_pending = _PendingRepairs()


def _settle_at_exit() -> None:
    """atexit: settle what is still queued; an error a call's flags raise is printed (an exit
    hook cannot raise into the program), one line per call."""
    while _pending._queue:
        try:
            _pending.settle(wait_all=True)
        except Exception as exc:  # noqa: BLE001 - report every pending error, then go on
            print(f"glm5_dsa_plugin: at exit, a sparse_mla call's deferred flags raised {type(exc).__name__}: {exc}",
                  file=sys.stderr)


atexit.register(_settle_at_exit)


def settle_through(entry: tuple) -> None:
    """Settle a forward's flags queued by ``run_forward`` (and everything queued before them)."""
    _pending.settle_through(entry)


def _settle_backward_event(values: list[int], call: tuple) -> None:
    """Count, warn, dump (and raise if even the repair was nonfinite) for a device-repaired backward."""
    backend, q, saved, topk, grad_out, sm_scale, d_v = call
    if not values[1]:
        return
    _stats.rows_repaired += values[3]
    _stats.kv_rows_repaired += values[4]
    kv, indices = originals(backend, saved, topk)

    def recompute_bad():
        out, lse, saved_again = _forward(backend, q, kv, indices, sm_scale, d_v, None)
        dq, dkv = _backward(backend, q, saved_again, out, lse, grad_out, sm_scale, d_v, None)
        return dict(dq=dq, dkv=dkv)

    _device_repair_event("backward", backend,
                         dict(q=q, kv=kv, indices=indices, grad_out=grad_out, sm_scale=sm_scale, d_v=d_v),
                         recompute_bad, values[3] + values[4], bool(values[2]))
