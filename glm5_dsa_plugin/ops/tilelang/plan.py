"""Launch planning of the TileLang backend: padding of heads and topk, the forward's row buckets
and the choices made from a previous call's counts (64-row buckets, row groups)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .shapes import BLOCK_TOPK, head_block

__all__ = ["FWD_MIN_HEADS", "BWD_MIN_HEADS", "padded_heads_per_group", "pad_heads", "unpad_heads", "padded_topk",
           "pad_topk", "whole_waves", "forward_buckets", "forward_launches", "SINGLE_STAGE_COST", "AUTO_BUCKETS_64",
           "cheaper_buckets_64", "CountsOfLastCall", "BlockCountsOfLastCall", "ENTRY_COST", "REPROBE_CALLS",
           "RowGroupChoice"]

# Smallest head tile per kernel (heads per kv group are zero-padded up to it). 16-row forward
# tiles need the barrier before the P-tile write (``fwd.sparse_mla_fwd_kernel``).
FWD_MIN_HEADS = 16
BWD_MIN_HEADS = 16


def padded_heads_per_group(hg: int, minimum: int = 16) -> int:
    """Heads per kv group as the kernels see them: a power of two in [minimum, 64], or a multiple of 64."""
    if hg <= 64:
        p = minimum
        while p < hg:
            p *= 2
        return p
    return -(-hg // 64) * 64


def pad_heads(x: torch.Tensor, groups: int, hg: int, hg_pad: int) -> torch.Tensor:
    """[B, T, G*hg, D] -> [B, T, G*hg_pad, D] with zero heads appended per group."""
    if hg == hg_pad:
        return x.contiguous()
    B, T, _, D = x.shape
    return F.pad(x.view(B, T, groups, hg, D), (0, 0, 0, hg_pad - hg)).view(B, T, groups * hg_pad, D)


def unpad_heads(x: torch.Tensor, groups: int, hg: int, hg_pad: int) -> torch.Tensor:
    if hg == hg_pad:
        return x
    B, T = x.shape[:2]
    rest = x.shape[3:]
    return x.view(B, T, groups, hg_pad, *rest)[:, :, :, :hg].reshape(B, T, groups * hg, *rest)


def padded_topk(topk: int) -> int:
    """topk as the kernels see it: rounded up to a multiple of ``BLOCK_TOPK`` (64)."""
    return -(-topk // BLOCK_TOPK) * BLOCK_TOPK


def pad_topk(indices: torch.Tensor, block: int) -> torch.Tensor:
    """[..., K] -> [..., ceil(K / block) * block] with -1 slots appended (contiguous)."""
    k = indices.shape[-1]
    if k % block == 0:
        return indices.contiguous()
    return F.pad(indices, (0, block - k % block), value=-1).contiguous()


def whole_waves(rows: int, ctas_per_row: int, n_sm: int) -> int:
    """Query rows per deterministic chunk: at most ``rows``, rounded down to whole waves of a
    kernel that runs one CTA per SM (``ctas_per_row`` CTAs per row), unless that leaves none.
    With one CTA per SM, a chunk of 3.45 waves idles most SMs through its last wave; the chunk
    boundaries set where dKV's per-chunk sums meet, so the bits depend on the GPU's SM count."""
    step = n_sm // math.gcd(n_sm, ctas_per_row)
    return rows // step * step if rows >= step else rows


def forward_buckets(n_blocks: int, buckets: int) -> list[tuple[int, int]]:
    """Split [0, n_blocks] slot blocks into ``buckets`` launches (lo, hi]: a row needing b blocks
    runs in the launch with lo < b <= hi (b = 0 in the first) and computes hi blocks, so the
    pure-padding tail of short rows is skipped while every loop stays static and pipelined."""
    edges = sorted({round(n_blocks * k / buckets) for k in range(buckets + 1)})  # includes 0 and n_blocks
    return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]


def forward_launches(hg_pad: int, n_blocks: int, buckets: int, buckets_64: int = 1) -> list[tuple[int, int, int]]:
    """The forward's launches (lo, hi, pipeline stages) for ``hg_pad`` heads per group and
    ``n_blocks`` slot blocks; one launch for short topk (< 8 blocks: little tail to skip, fewer
    kernels to compile).

    16/32-row head tiles: ``buckets`` launches, two-stage pipelined. 64-row tiles: one two-stage
    launch, or ``buckets_64`` single-stage launches. TileLang 0.1.15 stops reusing the
    reductions' shared workspaces once the pipelined loop sits under the bucket's row test, which
    takes the two-stage 64-row tile to 230 KB, over Hopper's 227 KB (the launch fails;
    tests/ops/test_tilelang_compile.py checks every plan); single-stage it is 156 KB.
    Single-stage buckets are faster on ragged rows (their out bitwise equal) and slower on full
    rows, hence an option, or a choice per call from row counts (``fwd_buckets_64="auto"``,
    ``cheaper_buckets_64``)."""
    if n_blocks < 8:
        return [(0, n_blocks, 2)]
    if head_block(hg_pad) >= 64:
        if buckets_64 > 1:
            return [(lo, hi, 1) for lo, hi in forward_buckets(n_blocks, buckets_64)]
        return [(0, n_blocks, 2)]
    return [(lo, hi, 2) for lo, hi in forward_buckets(n_blocks, buckets)]


# cost of one computed slot block of a 64-row tile, single-stage relative to two-stage (measured:
# docs/kernels.md)
SINGLE_STAGE_COST = 1.11
AUTO_BUCKETS_64 = 8  # buckets of the single-stage plan that ``fwd_buckets_64="auto"`` weighs


def cheaper_buckets_64(block_counts: list[int], n_blocks: int, buckets: int) -> int:
    """``buckets_64`` for a 64-row tile given how many rows need c slot blocks (``block_counts[c]``,
    c = 0..n_blocks): ``buckets`` single-stage launches when their cost-weighted computed blocks
    (each row runs its bucket's ``hi``) are fewer than one two-stage launch's (every row runs
    all blocks), else 1."""
    edges = forward_buckets(n_blocks, buckets)
    hi = [next(h for _, h in edges if c <= h) for c in range(n_blocks + 1)]
    single = SINGLE_STAGE_COST * sum(n * h for n, h in zip(block_counts, hi))
    return buckets if single < sum(block_counts) * n_blocks else 1


class CountsOfLastCall:
    """Counts from a previous call of one shape, copied to pinned host memory behind the kernels
    and read only once that copy is done (``Event.query``): a launch choice made from them never
    waits on the GPU. The choices they feed never change a result, so stale counts only cost speed."""

    def __init__(self, n: int, dtype=torch.int32):
        self.host = torch.zeros(n, dtype=dtype, pin_memory=torch.cuda.is_available())  # (CPU tests: unpinned)
        self.event = torch.cuda.Event()
        self.pending = False

    def arrived(self) -> list[int] | None:
        """The last recorded counts once their copy is done, each recording once; else None."""
        if self.pending and self.event.query():
            self.pending = False
            return self.host.tolist()
        return None

    def record(self, counts: torch.Tensor) -> None:
        self.host.copy_(counts, non_blocking=True)
        self.event.record()
        self.pending = True


class BlockCountsOfLastCall(CountsOfLastCall):
    """The rows' block counts of a previous call -> the 64-row forward plan (skipped blocks are pure
    padding, which adds exact zeros)."""

    def __init__(self, n: int):
        super().__init__(n)
        self.buckets_64 = 1  # two-stage until counts arrive

    def choose(self, n_blocks: int) -> int:
        counts = self.arrived()
        if counts is not None:
            self.buckets_64 = cheaper_buckets_64(counts, n_blocks, AUTO_BUCKETS_64)
        return self.buckets_64


# fwd+bwd cost of one row-group entry (64-row tile over R rows' union) relative to one slot of a
# one-row block (measured: docs/kernels.md); with 1.0 one-row blocks run only rows that share no
# key.
ENTRY_COST = 1.0
REPROBE_CALLS = 64  # a shape that chose one-row blocks builds the group lists again this often


class RowGroupChoice(CountsOfLastCall):
    """``row_groups="auto"``: row groups for a shape while its last counted call had
    ENTRY_COST * (group entries) < (slots the one-row kernels run, the rows' extents); rows
    sharing no keys run one row per block. A shape on one-row blocks is counted again every
    REPROBE_CALLS calls (building the lists once more)."""

    def __init__(self):
        super().__init__(2, torch.int64)
        self.use, self.since_count = True, 0  # row groups until counts say otherwise

    def choose(self) -> tuple[bool, bool]:
        """-> (run row groups, build the lists and record counts in this call)."""
        counts = self.arrived()
        if counts is not None:
            entries, slots = counts
            self.use = ENTRY_COST * entries < slots
        if self.use:
            return True, True
        self.since_count += 1
        if self.since_count >= REPROBE_CALLS:
            self.since_count = 0
            return False, True
        return False, False
