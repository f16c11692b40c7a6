"""Tile shapes of the TileLang kernels, importable without TileLang (the host's launch planning
reads them)."""

__all__ = ["BLOCK_TOPK", "SUPPORTED_SPLITS", "check_split", "head_block", "bwd_block_slots", "row_group_geometry"]

BLOCK_TOPK = 64  # topk is padded with -1 to a multiple of this
SUPPORTED_SPLITS = {(512, 64), (256, 64)}  # (d_v, d_tail): the splits tested on Hopper


def check_split(d_v: int, d_tail: int) -> None:
    if (d_v, d_tail) not in SUPPORTED_SPLITS:
        raise ValueError(
            f"TileLang sparse-MLA supports (d_v, d_tail) in {sorted(SUPPORTED_SPLITS)}, got ({d_v}, {d_tail}); "
            f"use backend='reference' for other splits"
        )


def head_block(heads_per_group: int) -> int:
    return min(64, heads_per_group)


def bwd_block_slots(heads_per_group: int) -> int:
    """Slots per backward step: 8 warps split the [h_blk, BS] score tile along BS, >= 8 columns each."""
    return 32 if head_block(heads_per_group) == 64 else 64


def row_group_geometry(hg: int, rows_per_block: int) -> tuple[int, int]:
    """(tile rows, head tiles per group) for ``hg`` heads per kv group and R = ``rows_per_block``.
    R = 1: the tile holds one query row's heads (``head_block``). R > 1 (small hg): it holds R
    consecutive query rows' hg heads, R * hg = 64, tile row h = (row h // hg, head h % hg): the
    rows attend the union of their keys (one gather and, in the backward, one dKV atomic per key
    of the group instead of one per row), each row masked to its own keys by member bits."""
    if rows_per_block == 1:
        h_blk = head_block(hg)
        assert hg % h_blk == 0 and h_blk >= 16
        return h_blk, hg // h_blk
    assert hg * rows_per_block == 64, (hg, rows_per_block)
    return 64, 1
