"""Index sharing (GLM-5.2): a computing layer's top-k handed to the later layers that reuse it.

The top-k [rows, topk] int32 is kept in a dict on the micro batch's carrier
(:func:`.micro_batch.carrier`). A forward reads it right after the computing layer wrote it,
which is exact on any carrier. A recomputed forward reads it during backward: on a carrier shared
by micro batches (the config; a reused mask) another micro batch's forward may have replaced it
since, and the recompute would attend to another sequence's keys, the gradients silently wrong.
:class:`SharedTopk` refuses that read.

Each write bumps the source layer's serial on that carrier and records the autograd graph task
it ran in. A reusing layer's forward that will be recomputed queues the serial it read; its
recompute pops it. The read is the micro batch's own top-k when the source was recomputed in the
same backward (same graph task), or when no write came since the forward (popped serial ==
current serial; serials only grow, and the queue is in forward order, so a popped serial is at
most the micro batch's own).
"""

from __future__ import annotations

import torch

from .micro_batch import NO_GRAD_TRAINING_HINT, RecomputeCheck, graph_task, state

__all__ = ["HOLDER_ATTR", "SharedTopk", "StaleMicroBatchStateError", "forget"]

HOLDER_ATTR = "_glm5_dsa_index_share_holder"  # {layer: top-k} on the carrier
_STAMPS_ATTR = "_glm5_dsa_index_share_stamps"  # {layer: (serial, graph task) of its last write}


def forget(carrier) -> None:
    """Drop every top-k (and its write stamps) kept on ``carrier``."""
    for attr in (HOLDER_ATTR, _STAMPS_ATTR):
        if hasattr(carrier, attr):
            delattr(carrier, attr)


class StaleMicroBatchStateError(RuntimeError):
    """A recomputed forward would read what another micro batch's forward left on a shared carrier."""


class SharedTopk:
    """One DSA layer's side of index sharing: ``layer`` is its 1-indexed number, ``source`` the
    computing layer whose top-k it reuses (``layer`` itself for a computing layer)."""

    def __init__(self, layer: int, source: int):
        self.layer, self.source = layer, source
        self._check = RecomputeCheck()

    def publish(self, carrier, indices: torch.Tensor) -> None:
        """A computing layer's write of its top-k on the micro batch's carrier."""
        state(carrier, HOLDER_ATTR)[self.layer] = indices
        stamps = state(carrier, _STAMPS_ATTR)
        stamps[self.layer] = (stamps.get(self.layer, (0, -1))[0] + 1, graph_task())

    def read(self, carrier, training: bool, shared_carrier: bool) -> torch.Tensor:
        """A reusing layer's read of its source's top-k from the micro batch's carrier.
        ``shared_carrier``: the carrier is the model's config, one for every micro batch (a
        recompute that cannot be paired with its forward is then refused too)."""
        holder = state(carrier, HOLDER_ATTR)
        if self.source not in holder:
            raise RuntimeError(
                f"DSA layer {self.layer} reuses the indices of layer {self.source}, which did not run in this "
                f"forward (pipeline stage split on a reusing layer?)")
        indices = holder[self.source]
        serial, written_in = state(carrier, _STAMPS_ATTR)[self.source]
        recomputing, seen = self._check.read(serial, training)
        if (recomputing and written_in != graph_task() and seen != serial
                and (seen is not None or shared_carrier)):
            raise StaleMicroBatchStateError(
                f"DSA layer {self.layer} reuses the top-k of layer {self.source} in a recomputed forward, but another "
                f"micro batch's forward has replaced it since this micro batch's forward (write {serial}; this micro "
                f"batch's forward read write {seen}): the micro batches share one carrier (no packed sequences, no "
                f"attention mask of their own), so one top-k is kept for all. Pass packed sequences (THD) or an "
                f"attention mask per micro batch, recompute layers {self.source}..{self.layer} in one chunk, or "
                f"recompute no DSA layer. {NO_GRAD_TRAINING_HINT}")
        return indices
