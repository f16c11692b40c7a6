"""The grammar of megatron-core HybridModel layer patterns (``--hybrid-layer-pattern``) as this
plugin builds them: ``D`` our DSA attention layer, ``-`` a dense MLP layer, ``E`` an MoE layer,
``|`` a pipeline cut, each ``/`` one MTP depth (the symbols after it). GLM-5.x's patterns and layer
numbering are in :mod:`glm5_dsa_plugin.checkpoints.hybrid_pattern`."""

from __future__ import annotations

__all__ = ["SYMBOLS", "split_pattern"]

SYMBOLS = "D-E"  # the layer symbols this plugin builds (every other hybrid symbol is refused)


def split_pattern(pattern: str) -> tuple[list[str], list[str]]:
    """-> (pipeline segments of the main pattern, MTP depth patterns); refuses symbols outside
    ``D``, ``-``, ``E`` (naming the position), which this plugin's stack does not build."""
    for pos, sym in enumerate(pattern):
        if sym not in SYMBOLS + "|/":
            raise ValueError(f"hybrid layer pattern {pattern!r}: symbol {sym!r} at position {pos} is not one of "
                             f"D (DSA attention), - (MLP), E (MoE), | (pipeline cut), / (MTP depth)")
    main, *mtp = pattern.split("/")
    return main.split("|"), mtp
