"""GLM-5.x layer patterns for megatron-core's HybridModel (``--hybrid-layer-pattern``).

One pattern symbol is one layer: ``D`` is our DSA attention layer, ``-`` a dense MLP layer, ``E``
an MoE layer; ``|`` cuts pipeline stages and each ``/`` starts one MTP depth (the symbols after
it). A GLM-5.x decoder layer ``i`` (GPTModel's ``decoder.layers.i``) is two symbols: ``D-`` for the
first ``first_k_dense_replace`` layers, ``DE`` for the others; each MTP layer is ``/DE``.

DSA layer numbers: index sharing (``index_topk_freq`` / ``index_skip_topk_offset``) counts the DSA
layers of the main pattern, 1-based, in the pattern's order: the n-th ``D`` is DSA layer n, which
is GPTModel's layer n. Inside an MTP depth the count restarts at 1 (GPTModel's MTP layer is
layer 1 too). The hybrid layer number (every symbol counted) stays what megatron-core uses for
checkpoint keys; only the attention's index sharing reads the DSA layer number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..model.index_sharing import computes_indices, index_source_layer
from ..model.layer_pattern import SYMBOLS, split_pattern  # noqa: F401  (the pattern grammar, re-exported)

__all__ = ["SYMBOLS", "glm5_hybrid_layer_pattern", "split_pattern", "dsa_layer_number", "check_index_sharing"]


def _fields(card_or_hf_config) -> Mapping:
    if isinstance(card_or_hf_config, Mapping):
        return card_or_hf_config
    if hasattr(card_or_hf_config, "to_dict"):  # transformers config
        return card_or_hf_config.to_dict()
    raise TypeError(f"expected a model card or an HF config, got {type(card_or_hf_config).__name__}")


def glm5_hybrid_layer_pattern(card_or_hf_config, stage_layers: Sequence[int] | None = None,
                              mtp: bool = True) -> str:
    """``D-`` x dense layers, ``DE`` x MoE layers, then ``/DE`` per MTP layer (when ``mtp``).

    ``stage_layers``: decoder layers (GPT layers, two symbols each) per pipeline stage; their sum
    must be ``num_hidden_layers``; a ``|`` goes between stages. E.g. the tiny card (2 dense, 2 MoE,
    1 MTP) gives ``"D-D-DEDE/DE"``, and with ``stage_layers=[1, 3]`` ``"D-|D-DEDE/DE"``."""
    d = _fields(card_or_hf_config)
    n, k = int(d["num_hidden_layers"]), int(d.get("first_k_dense_replace") or 0)
    if not 0 <= k <= n:
        raise ValueError(f"first_k_dense_replace={k} is outside [0, num_hidden_layers={n}]")
    layers = ["D-"] * k + ["DE"] * (n - k)
    if stage_layers is None:
        main = "".join(layers)
    else:
        counts = [int(c) for c in stage_layers]
        if sum(counts) != n or any(c < 1 for c in counts):
            raise ValueError(f"stage_layers {counts} must be positive and sum to num_hidden_layers={n}")
        cuts, start = [], 0
        for c in counts:
            cuts.append("".join(layers[start:start + c]))
            start += c
        main = "|".join(cuts)
    depths = int(d.get("num_nextn_predict_layers") or 0) if mtp else 0
    return main + "/DE" * depths


def dsa_layer_number(pattern: str, layer_number: int, mtp: bool = False) -> int:
    """The DSA layer number of hybrid layer ``layer_number`` (1-based, every symbol of the main
    pattern counted, ``|`` not; with ``mtp`` the layer's number inside one MTP depth)."""
    segments, depths = split_pattern(pattern)
    if mtp:
        if not depths:
            raise ValueError(f"hybrid layer pattern {pattern!r} has no MTP depth ('/')")
        symbols = depths[0]
    else:
        symbols = "".join(segments)
    if not 1 <= layer_number <= len(symbols) or symbols[layer_number - 1] != "D":
        where = "MTP depth" if mtp else "main pattern"
        found = symbols[layer_number - 1] if 1 <= layer_number <= len(symbols) else "nothing"
        raise ValueError(f"hybrid layer pattern {pattern!r}: layer {layer_number} of the {where} {symbols!r} is "
                         f"{found!r}, not a DSA layer 'D' (is the pattern the one the model was built from?)")
    return symbols[:layer_number].count("D")


def check_index_sharing(pattern: str, topk_freq: int = 1, skip_offset: int = 0) -> None:
    """Each pipeline stage's first DSA layer must compute its own indices: a layer that reuses an
    earlier one's top-k needs that layer on its own stage. Raises naming the layer and the fix."""
    segments, depths = split_pattern(pattern)
    before_layers, before_dsa = 0, 0
    for s, seg in enumerate(segments):
        first = seg.find("D")
        if first >= 0:
            dsa = before_dsa + 1
            if not computes_indices(dsa, topk_freq, skip_offset):
                src = index_source_layer(dsa, topk_freq, skip_offset)
                raise ValueError(
                    f"hybrid layer pattern {pattern!r}: pipeline stage {s} starts its DSA layers at layer "
                    f"{before_layers + first + 1} (DSA layer {dsa}), which reuses the indices of DSA layer {src} on "
                    f"an earlier stage (index_topk_freq={topk_freq}, index_skip_topk_offset={skip_offset}); move the "
                    f"'|' so the stage starts at DSA layer {src} or {src + topk_freq}")
        before_layers += len(seg)
        before_dsa += seg.count("D")
    for depth in depths:  # an MTP depth computes its first DSA layer's indices itself (layer 1)
        if depth != depths[0]:
            raise ValueError(f"hybrid layer pattern {pattern!r}: MTP depths differ ({depths}); megatron-core needs "
                             f"them identical")
