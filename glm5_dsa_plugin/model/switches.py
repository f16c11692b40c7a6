"""A DSA attention call's three switches, resolved in one place from the config.

| switch | config field | environment override | default |
|---|---|---|---|
| sparse-MLA backend | ``dsa_sparse_mla_backend`` (ours; the launchers' ``--backend``) | ``GLM5_DSA_BACKEND`` | ``"auto"`` |
| deterministic dq / dkv | ``deterministic_mode`` (megatron-core's ``--deterministic-mode``) | none | False |
| nonfinite guard policy | ``dsa_nonfinite_policy`` (ours) | ``GLM5_DSA_NONFINITE`` | the guard's process setting (``"fallback"``) |

An environment variable, when set, overrides the config (it is read when the attention module is
built). A backend assigned in code to ``GLM5DSAttention.backend`` (class or instance) takes
precedence over both: tests and benchmarks pin a backend that way.

megatron-core's own ``dsa_kernel_backend`` (``"none"``, ``"tilelang"``, ``"cudnn"``) selects its
fused DSA kernels, which the GLM-5 DSA attention never runs: ``"none"`` (its default) is accepted
and changes nothing; any other value is refused when the module is built
(:func:`glm5_dsa_plugin.model.dsa_fields.check_dsa_config`), naming ``dsa_sparse_mla_backend`` as
the switch that picks this attention's kernels.

The guard's policy is process-wide (``ops.configure``): a config that sets
``dsa_nonfinite_policy`` sets it when its attention modules are built, unless
``GLM5_DSA_NONFINITE`` is set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..ops import guard
from ..ops.guard.config import POLICIES

FIELDS = ("dsa_sparse_mla_backend", "dsa_nonfinite_policy")
ENV_BACKEND = "GLM5_DSA_BACKEND"
ENV_POLICY = "GLM5_DSA_NONFINITE"
DEFAULT_BACKEND = "auto"

__all__ = ["CallSwitches", "DEFAULT_BACKEND", "ENV_BACKEND", "ENV_POLICY", "FIELDS", "apply_guard_policy",
           "check", "describe", "resolve_switches"]


@dataclass(frozen=True)
class CallSwitches:
    """The switches of one DSA attention's ``sparse_mla`` calls. ``backend``: a registered
    backend name or ``"auto"``; ``deterministic``: dq / dkv bitwise reproducible; ``guard_policy``:
    ``"fallback"``, ``"raise"`` or ``"off"``. ``sources`` says where each came from
    (``"config.<field>"``, ``"$<VARIABLE>"``, ``"default"``, or the guard's process setting)."""

    backend: str
    deterministic: bool
    guard_policy: str
    sources: dict = field(default_factory=dict, compare=False)


def _env(name: str) -> str | None:
    raw = os.environ.get(name, "").strip()
    return raw or None


def _check_backend(value, where: str) -> str:
    from ..ops.backends import registered_backends

    if not isinstance(value, str) or (value != "auto" and value not in registered_backends()):
        raise ValueError(f"glm5_dsa_plugin: {where}={value!r}: expected 'auto' or a registered sparse-MLA backend "
                         f"{registered_backends()}")
    return value


def _check_policy(value, where: str) -> str:
    if not isinstance(value, str) or value.lower() not in POLICIES:
        raise ValueError(f"glm5_dsa_plugin: {where}={value!r}: expected one of {POLICIES}")
    return value.lower()


def check(config) -> None:
    """ValueError naming the field and value when ``dsa_sparse_mla_backend`` or
    ``dsa_nonfinite_policy`` is set to something no call can run with."""
    backend = getattr(config, "dsa_sparse_mla_backend", None)
    if backend is not None:
        _check_backend(backend, "config.dsa_sparse_mla_backend")
    policy = getattr(config, "dsa_nonfinite_policy", None)
    if policy is not None:
        _check_policy(policy, "config.dsa_nonfinite_policy")


def _pick(config, env_name: str, field: str, check, default: tuple):
    """(value, source): the environment override, else the config field, else ``default``."""
    env = _env(env_name)
    if env is not None:
        return check(env, env_name), f"${env_name}"
    value = getattr(config, field, None)
    if value is not None:
        return check(value, f"config.{field}"), f"config.{field}"
    return default


def resolve_switches(config=None) -> CallSwitches:
    """The switches for ``config`` (a ``TransformerConfig``; None: no config, the defaults),
    each from its environment override, else its config field, else its default (module
    docstring). Raises ValueError naming the field or variable for a value that cannot run."""
    sources = {}
    backend, sources["backend"] = _pick(config, ENV_BACKEND, "dsa_sparse_mla_backend", _check_backend,
                                        (DEFAULT_BACKEND, "default"))
    deterministic = bool(getattr(config, "deterministic_mode", False))
    sources["deterministic"] = "config.deterministic_mode" if config is not None else "default"
    policy, sources["guard_policy"] = _pick(config, ENV_POLICY, "dsa_nonfinite_policy", _check_policy,
                                            (None, "process setting: ops.configure, else fallback"))
    if policy is None:
        policy = guard.policy()
    return CallSwitches(backend, deterministic, policy, sources)


def apply_guard_policy(switches: CallSwitches) -> None:
    """Set the process-wide guard policy to ``switches.guard_policy`` when a config chose it (an
    environment override is already the guard's setting; ``"process"`` leaves it as it is)."""
    if switches.sources.get("guard_policy") == "config.dsa_nonfinite_policy":
        guard.configure(policy=switches.guard_policy)


def describe(switches: CallSwitches) -> list[str]:
    """One line per switch: its value and where it came from (``python -m glm5_dsa_plugin doctor``)."""
    return [f"{name:22s} {getattr(switches, name)} ({switches.sources.get(name, 'default')})"
            for name in ("backend", "deterministic", "guard_policy")]
