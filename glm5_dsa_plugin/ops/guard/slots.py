"""The guard's flag buffer: one named slot per fact, pooled zeroed buffers, and the one host read.

A guarded call gets a zeroed int32 [FLAG_SLOTS] buffer on its device. The kernels and checks
of the call set its slots without a host sync; the guard reads the whole buffer with one small
device-to-host copy (now, or later behind the call's kernels: ``pending``).
"""

from __future__ import annotations

from enum import IntEnum

import torch

__all__ = ["Flag", "FLAG_SLOTS", "FlagPool", "new_flags", "read", "reads_late", "capturing"]


class Flag(IntEnum):
    """Slots of a guard flag buffer."""

    #: an index lies outside {-1} U [0, T_kv) (set by a backend memory-safe on any index)
    INDEX_RULE = 0
    #: some output is nonfinite, or (forward) a row the backend does not vouch for
    NONFINITE = 1
    #: a device-side repair came out nonfinite too: the inputs themselves are bad
    STILL_NONFINITE = 2
    #: query rows the device-side repair recomputed (a count)
    ROWS_REPAIRED = 3
    #: kv rows the device-side backward repair rebuilt (a count)
    KV_ROWS_REPAIRED = 4
    #: a kv entry is NaN, +-inf or huge (set by a backend with ``finite_out_lse_bound``; gates the
    #: forward's read of out)
    KV_SUSPECT = 5


FLAG_SLOTS = 8  # the Flag slots, and spare ones up to a 32-byte buffer


class FlagPool:
    """Zeroed int32 [FLAG_SLOTS] flag buffers, each used once, cut from a zeroed block of ``SLOTS``
    per (device, stream); a new block (one fill) when it runs out, instead of one allocation and
    fill per call (host time a guard read would expose). Per stream, so the block's fill is
    ordered before every kernel that sets one of its flags."""

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


_pool = FlagPool()


def new_flags(device: torch.device) -> torch.Tensor:
    """A zeroed int32 [FLAG_SLOTS] buffer on ``device`` (slots: :class:`Flag`)."""
    return _pool.take(device)


def read(flags: torch.Tensor) -> list[int]:
    """The one host read of a flags buffer; a clear error inside CUDA graph capture, where no
    host read is allowed."""
    if capturing(flags.device):
        raise RuntimeError(
            "sparse_mla reads a device flag (nonfinite guard / deferred index validation), which CUDA graph "
            "capture forbids: set GLM5_DSA_NONFINITE=off (or ops.configure(policy='off')) and call sparse_mla "
            "with validate=False (the spec's attention does so itself when the policy is off) to capture it"
        )
    return flags.tolist()


def reads_late(device: torch.device) -> bool:
    """Whether a call's flags may travel to the host behind its kernels and be read later (CUDA,
    outside graph capture)."""
    return device.type == "cuda" and not capturing(device)


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
