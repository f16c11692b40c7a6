"""Calls whose flags are read late: the queue of their flags on the way to pinned host memory.

On CUDA, a call autograd records (and, under ``forward_flags="deferred"``, a forward without
grad) does not read its flags itself: they are copied behind its kernels and settled once they
have arrived, by the call's own backward (a forward's flags), the next guarded call, ``stats()``
or at exit. Until then the queue keeps the tensors a dump of the call would need. At most
``MAX_PENDING`` calls wait unsettled, and at most ``cfg.pending_bytes`` of tensors that only the
queue keeps alive; past either, the oldest is waited for (never the newest).
"""

from __future__ import annotations

import atexit
import sys

import torch

from .config import cfg
from .slots import FLAG_SLOTS

__all__ = ["PendingRepairs", "settle_through", "storage_bytes", "settle_at_exit"]


class PendingRepairs:
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
        while len(self._queue) > 1 and (len(self._queue) > self.MAX_PENDING or self.held_bytes > cfg.pending_bytes):
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


queue = PendingRepairs()


def settle_through(entry: tuple) -> None:
    """Settle a forward's flags queued by ``run_forward`` (and everything queued before them)."""
    queue.settle_through(entry)


def storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage once)."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[(t.device, st.data_ptr())] = st.nbytes()
    return sum(seen.values())


def settle_at_exit() -> None:
    """atexit: settle what is still queued; an error a call's flags raise is printed (an exit
    hook cannot raise into the program), one line per call."""
    while queue._queue:
        try:
            queue.settle(wait_all=True)
        except Exception as exc:  # noqa: BLE001 - report every pending error, then go on
            print(f"glm5_dsa_plugin: at exit, a sparse_mla call's deferred flags raised {type(exc).__name__}: {exc}",
                  file=sys.stderr)


atexit.register(settle_at_exit)
