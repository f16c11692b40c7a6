"""Sparse-MLA ops: contract, reference, kernels, guard. Knows nothing of Megatron."""

from .backends import explain_auto, get_backend, register_backend, registered_backends, unregister_backend
from .contract import EMPTY_ROW_LSE, SparseMLAInputError
from .guard import configure, policy as guard_policy, reset_stats as reset_guard_stats, stats as guard_stats
from .op import SlotProbsGrad, sparse_mla

__all__ = [
    "EMPTY_ROW_LSE",
    "SlotProbsGrad",
    "SparseMLAInputError",
    "configure",
    "explain_auto",
    "get_backend",
    "guard_policy",
    "guard_stats",
    "register_backend",
    "registered_backends",
    "reset_guard_stats",
    "sparse_mla",
    "unregister_backend",
]
