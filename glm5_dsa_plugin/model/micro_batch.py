"""What one micro batch carries from layer to layer: index sharing's top-k, the CP shard, indexer
replay and its recorder, kept as attributes of an object the micro batch's every DSA layer sees.

The carrier, as megatron-core's DSA picks it: the micro batch's ``PackedSeqParams`` (THD), else its
attention mask, else the model's ``TransformerConfig``. For a mask the carrier is the mask's
storage, not the tensor: recompute (megatron-core's ``CheckpointFunction``) hands a layer
``mask.detach()``, a new tensor over the same storage, so state set on the tensor would be lost
in a recomputed forward while state on the storage is found again. The config is one object for
every micro batch (a mask object reused for every micro batch is too): what a micro batch leaves
on it is replaced by the next micro batch's forward.

That matters for a *recomputed* forward (megatron-core's full recompute, or selective recompute of
the core attention), which runs in backward: with pipeline parallelism 1F1B runs up to ``pp``
forwards between a micro batch's forward and its backward. :class:`RecomputeCheck` makes such a
read loud: a forward that will be recomputed (training, grad disabled: a reentrant checkpoint's
first pass) queues a token of what it read; the recompute pops it and the caller compares it with
what it reads now.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Hashable, Optional

import torch

__all__ = ["CP_SHARDS_ATTR", "VISIBILITY_ATTR", "NO_GRAD_TRAINING_HINT", "carrier", "as_carrier", "state", "graph_task", "RecomputeCheck"]

CP_SHARDS_ATTR = "_glm5_dsa_cp_shards"  # {(cp group, layout, rows, batch, device): the micro batch's CP shard}
VISIBILITY_ATTR = "_glm5_dsa_visibility"  # {"packed": (boundaries' identity, the boundaries, their Visibility)}
# the other cause of a failed pairing (see RecomputeCheck), ending the refusals that it can explain
NO_GRAD_TRAINING_HINT = ("(A forward under torch.no_grad() in training mode that is never recomputed, such as "
                         "log-probs computed without model.eval(), is taken for a recompute's first pass and also "
                         "leads here: run such passes in eval mode.)")


def carrier(packed_seq_params: Any, attention_mask: Optional[torch.Tensor], config: Any) -> Any:
    """The object a micro batch's DSA state rides on (see the module doc)."""
    return as_carrier(packed_seq_params if packed_seq_params is not None else
                      attention_mask if attention_mask is not None else config)


def as_carrier(obj: Any) -> Any:
    """``obj`` as state is kept on it: a tensor (a mask a client attaches replay to) by its storage."""
    return obj.untyped_storage() if isinstance(obj, torch.Tensor) else obj


def state(obj: Any, attr: str) -> dict:
    """The dict named ``attr`` on a carrier, created empty on first use."""
    found = getattr(obj, attr, None)
    if found is None:
        found = {}
        setattr(obj, attr, found)
    return found


def graph_task() -> int:
    """The running autograd graph task, ``-1`` outside backward (``torch.utils.checkpoint`` reads it
    the same way): a forward run with ``graph_task() != -1`` is a recompute."""
    return torch._C._current_graph_task_id()


class RecomputeCheck:
    """Pairs a layer's recomputed forward with the forward it repeats.

    :meth:`read` of the micro-batch state ``token`` a layer is about to use: in a forward (outside
    backward) it queues ``token`` when the forward will be recomputed (``training`` and grad
    disabled) and returns ``(False, None)``; in a recompute it returns ``(True, seen)``, ``seen``
    the oldest queued token (micro batches are recomputed in the order their forwards ran, per
    layer) or ``None`` when none was queued. The caller compares ``seen`` with ``token``.

    A forward under ``torch.no_grad()`` in training mode that is never recomputed (log-probs
    computed without ``model.eval()``) cannot be told from a reentrant checkpoint's first pass: it
    queues a token no recompute takes, and later pairings are off by one. Such passes belong in
    eval mode."""

    def __init__(self):
        self._queued: deque[Hashable] = deque()

    def read(self, token: Hashable, training: bool) -> tuple[bool, Optional[Hashable]]:
        if graph_task() == -1:
            if training and not torch.is_grad_enabled():
                self._queued.append(token)
            return False, None
        return True, (self._queued.popleft() if self._queued else None)
