"""The one backend registry for sparse MLA.

A backend (see :class:`Backend`) is registered under its name with :func:`register_backend`.
``"auto"`` resolves here and nowhere else.
"""

from __future__ import annotations

import warnings
from typing import Callable, Protocol

import torch

from . import reference


class Backend(Protocol):
    """A sparse-MLA implementation. A backend whose kernels are memory-safe for *any* index value
    may set ``memory_safe_on_any_index = True``; it then receives ``forward(..., index_flag=f)``
    (int32 [1] on the device, zero) and must make ``f`` nonzero when some index lies outside
    {-1} U [0, T_kv), without a host sync: the guard reads it after the kernel, with its own flag.

    Optional, for a backend that prepares its inputs (e.g. rewritten indices) once per call:
    ``forward_saving(...) -> (out, lse, saved)``, ``saved`` a tuple of tensors autograd keeps in
    place of (kv, indices); ``backward_saved(q, saved, out, lse, grad_out, sm_scale, d_v)``;
    ``originals(saved, topk) -> (kv, indices)`` for the guard's reference repair, and optionally
    ``padded_views(saved, topk) -> (kv, indices)`` as views without a copy, where a slot is valid
    iff 0 <= index < T_kv (the guard's device-side repair reads these on every backward). With
    ``reports_nonfinite = True`` its ``backward_saved`` also takes ``nonfinite_flag`` (int32 [1])
    and sets it when dq or dkv holds NaN/inf, so the guard makes no pass of its own. With
    ``finite_out_lse_bound(sm_scale, topk) -> float | None`` and ``row_extent(saved)``, its
    ``forward_saving`` also takes ``kv_flag`` (int32 [1]) and sets it when kv is suspect; a bound
    B promises that a row is finite and exact when its lse is finite with |lse| <= B, or when it
    is empty (EMPTY_ROW_LSE) with extent 0, while that flag is clear: the guard then reads only
    lse, and out when the flag is set, and recomputes the other rows (``guard._check_forward``)."""

    name: str

    def available(self) -> tuple[bool, str]: ...  # (usable here, reason)

    def forward(self, q, kv, indices, sm_scale: float, d_v: int): ...  # -> (out, lse), contract.py layout

    def backward(self, q, kv, indices, out, lse, grad_out, sm_scale: float, d_v: int): ...  # -> (dq, dkv)


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
        _INSTANCES[name] = _REGISTRY[name]()
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


class ReferenceBackend:
    """Chunked PyTorch reference (CPU and CUDA, any float dtype)."""

    name = "reference"

    def available(self) -> tuple[bool, str]:
        return True, "pure PyTorch"

    def forward(self, q, kv, indices, sm_scale, d_v):
        return reference.forward(q, kv, indices, sm_scale, d_v)

    def backward(self, q, kv, indices, out, lse, grad_out, sm_scale, d_v):
        return reference.backward(q, kv, indices, grad_out, sm_scale, d_v)


def _tilelang_factory() -> Backend:
    from .tilelang.backend import TileLangBackend

    return TileLangBackend()


register_backend("reference", ReferenceBackend)
register_backend("tilelang", _tilelang_factory)


def deterministic_variant(impl: Backend, device: torch.device) -> Backend:
    """The backend whose backward is bitwise reproducible, or a clear error when there is none."""
    if isinstance(impl, ReferenceBackend):
        # the reference accumulates dkv with index_add_, which is deterministic on CPU and, on CUDA,
        # only under torch.use_deterministic_algorithms(True) (megatron's --deterministic-mode sets it)
        if device.type != "cpu" and not torch.are_deterministic_algorithms_enabled():
            raise ValueError("sparse_mla(deterministic=True): the reference backend's index_add_ uses atomics on "
                             f"{device.type}; use backend='tilelang' or torch.use_deterministic_algorithms(True)")
        return impl
    make = getattr(impl, "deterministic_variant", None)
    if make is None:
        raise ValueError(f"sparse_mla(deterministic=True): backend {impl.name!r} has no deterministic mode")
    return make()
