"""The guard's process-wide settings, each from its environment variable or :func:`configure`,
checked by one rule either way."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["POLICIES", "FORWARD_FLAGS", "Config", "configure", "policy"]

POLICIES = ("fallback", "raise", "off")
FORWARD_FLAGS = ("eager", "deferred")


@dataclass
class Config:
    policy: str = "fallback"
    dump_dir: str = "glm5_dsa_dumps"
    dump_every: int = 100
    forward_flags: str = "eager"
    pending_bytes: int = 2 << 30


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


cfg = Config(
    policy=_from_env("policy", "fallback"),
    dump_dir=os.environ.get("GLM5_DSA_DUMP_DIR", "glm5_dsa_dumps"),
    dump_every=_from_env("dump_every", 100),
    forward_flags=_from_env("forward_flags", "eager"),
    pending_bytes=_from_env("pending_bytes", 2 << 30),
)


def configure(policy: str | None = None, dump_dir: str | None = None, dump_every: int | None = None,
              forward_flags: str | None = None, pending_bytes: int | None = None) -> None:
    """Set the process-wide guard policy (``fallback``/``raise``/``off``), dump folder, dump period,
    and when a forward that no backward follows (no grad) reads its flags: ``eager`` (default:
    before it returns) or ``deferred`` (like a recorded forward's: repaired on the device, the
    flags settled by a later guarded call, ``stats()`` or at exit; for forward-only passes such
    as RL log-probs, where the read would stall the GPU once per layer). ``pending_bytes``: how
    many bytes of tensors that only unsettled calls keep alive (for their dumps) may accumulate
    before the oldest call is waited for (``pending``). Each is checked by the rule its
    environment variable is checked by."""
    for name, value in (("policy", policy), ("forward_flags", forward_flags), ("dump_every", dump_every),
                        ("pending_bytes", pending_bytes)):
        if value is not None:
            setattr(cfg, name, _checked(name, type(getattr(cfg, name))(value), name))
    if dump_dir is not None:
        cfg.dump_dir = str(dump_dir)


def policy() -> str:
    return cfg.policy
