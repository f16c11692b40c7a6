"""Nonfinite guard around fast sparse-MLA backends: detection, row-granular repair, dumps.

Policy (per process): env ``GLM5_DSA_NONFINITE=fallback|raise|off`` or :func:`configure`
(``config``).

Detection (``checks``): after each fast-backend call, one device-side finiteness pass over the
outputs (out/lse forward, dq/dkv backward; Triton on CUDA) into the call's int32 flag buffer
(``slots``). A backend with ``reports_nonfinite`` sets the backward's flag itself, in work it
does anyway (TileLang: dq tested in the warp-specialised kernel's registers, dKV in its
conversion pass). A backend with ``finite_out_lse_bound`` flags suspect kv during its forward;
the forward's pass then reads lse, and out only when kv is suspect (out is d_v times the size of
lse), and marks the rows the backend does not vouch for (an lse beyond its bound, or an empty
row that has a valid slot: every score came out -inf) as nonfinite, so that they are recomputed
like any other bad row. The forward's flags also carry the deferred index-validation flag of a
backend memory-safe for any index (``backends.Backend.memory_safe_on_any_index``).

When the flags are read (``pending``): on CUDA under ``fallback`` (and ``off``, for the index
flag) no call that autograd records reads them itself. The repair runs on the device behind the
kernels (``row_repair``: launches that only read the flag on the happy path) and the flags
travel to pinned host memory behind it. A forward's flags are settled by its own backward,
after the backward's kernels are queued (an index violation raises there, before gradients are
returned); a backward's flags, and those of a forward whose backward never runs, at the next
guarded call once they have arrived, or by :func:`stats`. Settling counts, warns, dumps, and
raises when even the repair was nonfinite (``events``). ``raise``, CPU tensors, graph capture
and forwards without a backward to come (no grad) read the flags before returning and repair on
the host (``repair``); the last can read late too (``configure(forward_flags="deferred")`` /
``GLM5_DSA_FORWARD_FLAGS``). What is still pending at interpreter exit is settled then, and an
error it raises is printed.

Repair (``fallback``): the bad query rows of out / lse / dq are recomputed with the reference; a
bad kv row of dkv is rebuilt from the reference contributions of every query row that selected
it; good rows are left bit for bit (``repair``; on CUDA the same method in ``row_repair``'s
Triton kernels, whose dump holds bad outputs recomputed at settling, flagged
``bad_outputs_recomputed``). If a repaired value is still nonfinite the inputs themselves are
bad: the guard raises ``FloatingPointError`` with the dump path.
"""

from .config import configure, policy
from .events import GuardStats, environment_record, reset_stats, stats
from .pending import settle_through
from .run import run_backward, run_forward
from .slots import FLAG_SLOTS, Flag

__all__ = ["FLAG_SLOTS", "Flag", "GuardStats", "configure", "environment_record", "policy", "reset_stats",
           "run_backward", "run_forward", "settle_through", "stats"]
