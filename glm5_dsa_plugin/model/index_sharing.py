"""GLM-5.2's index sharing: which decoder layers run their indexer and which reuse an earlier
layer's top-k (``index_topk_freq`` / ``index_skip_topk_offset``, the same rule as HF
``indexer_types`` and megatron-core), and what that means for pipeline stage boundaries.
Layers are 1-indexed."""

from __future__ import annotations

__all__ = ["computes_indices", "index_source_layer", "check_stage_layers"]


def computes_indices(layer_number: int, topk_freq: int = 1, skip_offset: int = 0) -> bool:
    """1-indexed layer: True if it runs its indexer, False if it reuses the last computing layer's
    indices (GLM-5.2: freq 4, offset 3; same rule as HF ``indexer_types`` and megatron-core)."""
    if layer_number < 1 or topk_freq < 1 or skip_offset < 0:
        raise ValueError(f"bad index-sharing arguments: layer {layer_number}, freq {topk_freq}, offset {skip_offset}")
    return max(layer_number - max(skip_offset, 1), 0) % topk_freq == 0


def index_source_layer(layer_number: int, topk_freq: int = 1, skip_offset: int = 0) -> int:
    """The computing layer whose indices ``layer_number`` uses (itself if it computes)."""
    L = layer_number
    while not computes_indices(L, topk_freq, skip_offset):
        L -= 1
    return L


def check_stage_layers(first_layer: int, last_layer: int, topk_freq: int = 1, skip_offset: int = 0) -> None:
    """A pipeline stage owning 1-indexed layers [first, last] must not start on a reusing layer:
    its source layer's indices live on another stage."""
    if not computes_indices(first_layer, topk_freq, skip_offset):
        src = index_source_layer(first_layer, topk_freq, skip_offset)
        raise ValueError(
            f"pipeline stage starting at layer {first_layer} would reuse the DSA indices of layer {src}, "
            f"which is on an earlier stage (index_topk_freq={topk_freq}, index_skip_topk_offset={skip_offset}); "
            f"move the stage boundary to a layer that computes indices "
            f"(e.g. layer {src} or {src + topk_freq})"
        )
