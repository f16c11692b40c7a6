"""Narrow TransformerEngine compatibility guard for Megatron-Bridge 0.6.2 on boxes without TE.

Megatron-Bridge 0.6.2 imports TE unconditionally in exactly one module,
``megatron.bridge.peft.lora_layers`` (reached from ``models.conversion`` and ``peft.lora``);
it only *uses* TE inside ``TEFusedLoRALinear``. :func:`install` registers an import hook for
that one module name, active only when TE is absent: while that module's own top-level code
runs, ``transformer_engine`` / ``transformer_engine.pytorch`` resolve to placeholders, and they
are removed from ``sys.modules`` again right after, so every other ``try: import
transformer_engine`` still sees TE as missing. Any use of a placeholder symbol (call,
instantiation, isinstance check) raises :class:`TransformerEngineUnavailable`.
:func:`correct_bridge_peft_flags` fixes the one TE flag Megatron-Bridge computes wrongly without TE.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

__all__ = ["TARGET", "TransformerEngineUnavailable", "te_available", "install", "active", "correct_bridge_peft_flags"]

TARGET = "megatron.bridge.peft.lora_layers"
_TARGET_DEPS = ("megatron.core.transformer.moe.moe_utils", "megatron.bridge.peft.adapter_wrapper",
                "megatron.bridge.peft.lora_merge")
_STUB_NAMES = ("transformer_engine", "transformer_engine.pytorch")


class TransformerEngineUnavailable(ImportError):
    """A TransformerEngine symbol was used on a machine without TransformerEngine."""


class _MissingTE(type):
    """Metaclass of placeholder symbols: attribute chains resolve (module import works), use raises."""

    def _fail(cls, how: str):
        raise TransformerEngineUnavailable(
            f"{cls._te_path} was {how}, but TransformerEngine is not installed. glm5_dsa_plugin's TE "
            f"compatibility guard only lets {TARGET} import; install TransformerEngine for TE-fused paths "
            f"(e.g. Megatron-Bridge's TEFusedLoRALinear) or use the local (non-TE) model path.")

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls._te_path}.{name}")

    def __call__(cls, *args, **kwargs):
        cls._fail("called")

    def __instancecheck__(cls, obj):
        cls._fail("used in an isinstance check")

    def __subclasscheck__(cls, sub):
        cls._fail("used in an issubclass check")


def _placeholder(path: str):
    return _MissingTE(path.rsplit(".", 1)[-1], (), {"_te_path": path})


def _stub_modules() -> dict[str, types.ModuleType]:
    mods = {}
    for name in _STUB_NAMES:
        m = types.ModuleType(name, "glm5_dsa_plugin placeholder: TransformerEngine is not installed")
        m.__getattr__ = (lambda n, _p=name: _placeholder(f"{_p}.{n}") if not n.startswith("__")
                         else (_ for _ in ()).throw(AttributeError(n)))
        m.__glm5_dsa_placeholder__ = True
        mods[name] = m
    mods["transformer_engine"].pytorch = mods["transformer_engine.pytorch"]
    return mods


class _GuardedLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        for dep in _TARGET_DEPS:  # imported normally, before any placeholder exists
            importlib.import_module(dep)
        saved = {n: sys.modules.get(n) for n in _STUB_NAMES}
        sys.modules.update(_stub_modules())
        try:
            self.inner.exec_module(module)
        finally:
            for n, old in saved.items():
                if old is None:
                    sys.modules.pop(n, None)
                else:
                    sys.modules[n] = old


class _LoraLayersFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _GuardedLoader(spec.loader)
                return spec
        return None


_FINDER = _LoraLayersFinder()


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def install() -> bool:
    """Activate the guard if (and only if) TransformerEngine is absent. Returns whether it is active."""
    if te_available():
        return False
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return True


def active() -> bool:
    return _FINDER in sys.meta_path


def correct_bridge_peft_flags() -> None:
    """Without TE, megatron-core exposes its TE wrapper classes as ``MagicMock`` placeholders and
    Megatron-Bridge 0.6.2's ``safe_import_from`` reports them as found, so ``peft.utils.HAVE_TE``
    is wrongly True and LoRA's ``isinstance`` checks fail on a local model. Set it to the truth
    (no-op when TE is installed)."""
    if te_available():
        return
    import megatron.bridge.peft.utils as peft_utils

    peft_utils.HAVE_TE = False
