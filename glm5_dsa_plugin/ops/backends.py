"""The one backend registry for sparse MLA.

A backend (see :class:`Backend`) is registered under its name with :func:`register_backend`.
``"auto"`` resolves here and nowhere else.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from . import reference
from .backend_base import Backend

__all__ = ["register_backend", "unregister_backend", "registered_backends", "get_backend", "explain_auto", "resolve",
           "ReferenceBackend"]


_REGISTRY: dict[str, Callable[[], Backend]] = {}
_INSTANCES: dict[str, Backend] = {}
_AUTO_WARNED = False


def register_backend(name: str, factory: Callable[[], Backend], *, replace: bool = False) -> None:
    """Register a backend factory (called lazily, once)."""
    if name == "auto":
        raise ValueError("'auto' is reserved")
    if name in _REGISTRY and not replace:
        raise ValueError(f"sparse-MLA backend {name!r} is already registered")
    _REGISTRY[name] = factory
    _INSTANCES.pop(name, None)


def unregister_backend(name: str) -> None:
    _REGISTRY.pop(name, None)
    _INSTANCES.pop(name, None)


def registered_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown sparse-MLA backend {name!r}; registered: {registered_backends()} or 'auto'")
    if name not in _INSTANCES:
        instance = _REGISTRY[name]()
        if not isinstance(instance, Backend):
            raise TypeError(f"the factory of sparse-MLA backend {name!r} returned a {type(instance).__name__}, "
                            "not a glm5_dsa_plugin.ops.backends.Backend")
        _INSTANCES[name] = instance
    return _INSTANCES[name]


def explain_auto(device: torch.device | None = None) -> tuple[str, str]:
    """Which backend ``"auto"`` picks for tensors on ``device``, and why."""
    if device is not None and device.type != "cuda":
        return "reference", f"inputs are on {device.type}, the TileLang kernels need CUDA sm_90"
    ok, reason = get_backend("tilelang").available()
    if ok:
        return "tilelang", reason
    return "reference", reason


def resolve(name: str, device: torch.device) -> Backend:
    """Map a requested backend name (or ``"auto"``) to a backend instance."""
    global _AUTO_WARNED
    if name != "auto":
        backend = get_backend(name)
        ok, reason = backend.available()
        if not ok:
            raise RuntimeError(f"sparse-MLA backend {name!r} is not available: {reason}")
        return backend
    chosen, reason = explain_auto(device)
    if chosen == "reference" and device.type == "cuda" and not _AUTO_WARNED:
        _AUTO_WARNED = True
        warnings.warn(f"sparse_mla backend='auto' fell back to the PyTorch reference: {reason}", stacklevel=3)
    return get_backend(chosen)


class ReferenceBackend(Backend):
    """Chunked PyTorch reference (CPU and CUDA, any float dtype)."""

    name = "reference"

    def available(self) -> tuple[bool, str]:
        return True, "pure PyTorch"

    def forward(self, q, kv, indices, prob):
        return reference.forward(q, kv, indices, prob.sm_scale, prob.d_v)

    def backward(self, q, kv, indices, out, lse, grad_out, prob):
        return reference.backward(q, kv, indices, grad_out, prob.sm_scale, prob.d_v)

    def deterministic_variant(self, device: torch.device | None = None) -> Backend:
        """Itself: index_add_ accumulates dkv deterministically on CPU and, on CUDA, only under
        torch.use_deterministic_algorithms(True) (megatron's --deterministic-mode sets it)."""
        if device is not None and device.type != "cpu" and not torch.are_deterministic_algorithms_enabled():
            raise ValueError("sparse_mla(deterministic=True): the reference backend's index_add_ uses atomics on "
                             f"{device.type}; use backend='tilelang' or torch.use_deterministic_algorithms(True)")
        return self


def _tilelang_factory() -> Backend:
    from .tilelang.backend import TileLangBackend

    return TileLangBackend()


register_backend("reference", ReferenceBackend)
register_backend("tilelang", _tilelang_factory)

