"""Allgather context parallelism (CP) for the DSA core attention.

Each CP rank holds ``T / cp`` rows of the global packed sequence set (``T`` tokens). Queries stay
local; the latent kv and the indexer keys are all-gathered over the CP group into global packed
order (:func:`gather_sequence`, whose backward reduce-scatters their gradients), so top-k indices
are rows of the gathered kv. Nothing global-length is quadratic: the gathered kv / indexer keys are
``[T, ...]`` and the indexer scores only ever cover a chunk of local query rows.

Layouts (which global rows a rank holds, in its local order). bshd input ``[s, b, ...]`` is the
packed set of ``b`` rows of ``S = s * cp`` tokens flattened batch-major, so both formats share one
description in terms of *units* cut into equal chunks:

* ``"zigzag"``: megatron-core 0.19.2 allgather CP (``cp_comm_type="allgather"``, its dataloader's
  load-balanced split). A unit is one packed sequence (its padded extent, ``cu_seqlens_q_padded``
  when given) or one bshd row; it is cut into ``2 * cp`` chunks and rank ``r`` holds chunks ``r``
  and ``2 * cp - 1 - r``, unit after unit.
* ``"contiguous"``: slime's ``--allgather-cp``. The whole packed stream (sequences and the trailing
  pad slime appends as a last sequence) is one unit cut into ``cp`` contiguous slices; each bshd
  row is cut into ``cp`` slices.

``PackedSeqParams.cu_seqlens_*`` describe the global packed sequence in both layouts (as in
megatron-core and slime).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from . import visibility

__all__ = ["LAYOUTS", "layout_from_args", "check_layout", "units", "local_rows", "gather_order", "local_row_ids",
           "positions_in_sequence", "gather_sequence", "Shard", "shard", "indexer_loss_tracker_groups"]

LAYOUTS = ("zigzag", "contiguous")


def layout_from_args(args) -> str:
    """The layout a launcher's arguments ask for: slime's ``--allgather-cp`` is ``"contiguous"``."""
    return "contiguous" if getattr(args, "allgather_cp", False) else "zigzag"


def check_layout(layout: str, cp_comm_type: Optional[str]) -> None:
    """``zigzag`` is megatron-core's allgather CP and needs ``cp_comm_type == "allgather"``;
    ``contiguous`` is chosen explicitly (slime's flag) and ignores ``cp_comm_type``."""
    if layout not in LAYOUTS:
        raise ValueError(f"cp_layout must be one of {LAYOUTS}, got {layout!r}")
    kind = (cp_comm_type or "p2p").replace("_", "").lower()
    if layout == "zigzag" and kind != "allgather":
        raise ValueError(
            f"GLM5DSAttention: context parallelism is allgather CP; got cp_comm_type={cp_comm_type!r}. "
            f"Set cp_comm_type='allgather' (megatron-core's zigzag layout) or use slime's contiguous layout "
            f"(--allgather-cp, cp_layout='contiguous')")


# --------------------------------------------------------------------------- layout
def units(layout: str, total: int, batch: int = 1, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bounds [n_units + 1] (int64, CPU) of the units the layout cuts.

    ``cu_seqlens`` (the padded packed extents, global) for THD; None for bshd (``batch`` rows of
    ``total // batch`` tokens)."""
    if cu_seqlens is None:
        if total % batch:
            raise ValueError(f"bshd: {total} tokens do not split into {batch} rows")
        return torch.arange(batch + 1, dtype=torch.int64) * (total // batch)
    if layout == "contiguous":
        return torch.tensor([0, total], dtype=torch.int64)
    return cu_seqlens.detach().to("cpu", torch.int64)


def local_rows(bounds: torch.Tensor, cp: int, rank: int, layout: str) -> torch.Tensor:
    """Global packed row of each of ``rank``'s local rows, in local order: int64 [T / cp] (CPU).

    Raises naming the unit whose length the layout cannot cut into equal chunks."""
    if layout not in LAYOUTS:
        raise ValueError(f"cp layout must be one of {LAYOUTS}, got {layout!r}")
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} outside [0, {cp})")
    bounds = bounds.to("cpu", torch.int64)
    lens = bounds[1:] - bounds[:-1]
    parts = 2 * cp if layout == "zigzag" else cp
    bad = (lens % parts != 0).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        what = "padded sequence" if layout == "zigzag" else "unit"
        raise ValueError(f"{layout} CP={cp} cuts every {what} into {parts} equal chunks: unit {i} "
                         f"[{int(bounds[i])}, {int(bounds[i + 1])}) has length {int(lens[i])}")
    c = lens // parts
    if layout == "zigzag":
        starts = torch.stack([bounds[:-1] + rank * c, bounds[:-1] + (parts - 1 - rank) * c], 1).reshape(-1)
        seg = c.repeat_interleave(2)
    else:
        starts, seg = bounds[:-1] + rank * c, c
    n = int(seg.sum())
    seg_start = torch.repeat_interleave(starts, seg, output_size=n)
    offset = torch.arange(n) - torch.repeat_interleave(seg.cumsum(0) - seg, seg, output_size=n)
    return seg_start + offset


def gather_order(bounds: torch.Tensor, cp: int, layout: str) -> Optional[torch.Tensor]:
    """Permutation ``o`` with ``global[g] = gathered[o[g]]`` for a rank-major all-gather of the
    local rows (int64 [T], CPU); None when the gathered order already is the global one."""
    gathered = torch.cat([local_rows(bounds, cp, r, layout) for r in range(cp)])
    if torch.equal(gathered, torch.arange(gathered.numel())):
        return None
    return torch.argsort(gathered)


def local_row_ids(layout: str, cp: int, rank: int, local_tokens: int, batch: int = 1,
                  cu_seqlens: Optional[torch.Tensor] = None,
                  cu_seqlens_padded: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The global packed row of each of ``rank``'s local rows: int64 [local_tokens] (CPU), local
    order; equals ``shard(...).vis.query_index`` (bshd: row ``b * s + i``, batch-major).

    Arguments as in :func:`shard`: ``cu_seqlens`` describe the global packed sequence, which must
    hold exactly ``cp * local_tokens`` rows; None for bshd (``local_tokens = b * s_local``)."""
    total = cp * local_tokens
    if cu_seqlens is None:
        return local_rows(units(layout, total, batch), cp, rank, layout)
    extent = (cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens).detach().to("cpu", torch.int64)
    if int(extent[-1]) != total:
        name = "cu_seqlens_q_padded" if cu_seqlens_padded is not None else "cu_seqlens_q"
        raise ValueError(f"CP={cp}: {name}[-1] = {int(extent[-1])} global tokens, but this rank holds {local_tokens} "
                         f"rows ({total} over the CP group); cu_seqlens must describe the global packed sequence")
    return local_rows(units(layout, total, cu_seqlens=extent), cp, rank, layout)


def positions_in_sequence(layout: str, cp: int, rank: int, local_tokens: int, batch: int = 1,
                          cu_seqlens: Optional[torch.Tensor] = None,
                          cu_seqlens_padded: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RoPE position of each of ``rank``'s local rows: its offset inside its own sequence (THD:
    inside the padded extent, ``cu_seqlens_padded`` when given, as megatron-core counts it; bshd:
    inside its row). int64 [local_tokens] (CPU), local order; equals ``shard(...).vis.query_pos``.
    Arguments as in :func:`local_row_ids`."""
    rows = local_row_ids(layout, cp, rank, local_tokens, batch, cu_seqlens, cu_seqlens_padded)
    if cu_seqlens is None:
        return rows % (cp * local_tokens // batch)
    extent = (cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens).detach().to("cpu", torch.int64)
    seq = torch.searchsorted(extent, rows, right=True) - 1  # empty sequences share a start: the last one wins
    return rows - extent[seq]


# --------------------------------------------------------------------------- autograd all-gather
def _through_host(t: torch.Tensor, group) -> bool:
    """gloo moves CUDA tensors through host copies (tests run CP on one GPU that way)."""
    return t.is_cuda and dist.get_backend(group) == "gloo"


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    cp = dist.get_world_size(group)
    src = x.cpu() if _through_host(x, group) else x.contiguous()
    out = src.new_empty((cp * src.shape[0],) + tuple(src.shape[1:]))
    dist.all_gather_into_tensor(out, src, group=group)
    return out.to(x.device)


def _reduce_scatter(g: torch.Tensor, group) -> torch.Tensor:
    cp = dist.get_world_size(group)
    src = g.cpu() if _through_host(g, group) else g.contiguous()
    out = src.new_empty((src.shape[0] // cp,) + tuple(src.shape[1:]))
    dist.reduce_scatter_tensor(out, src, group=group)
    return out.to(g.device)


class _GatherSequence(torch.autograd.Function):
    """x [n, ...] local rows -> [cp * n, ...] in global order; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group, order):
        ctx.group, ctx.order = group, order
        out = _all_gather(x, group)
        return out if order is None else out.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.order is not None:  # back to rank-major order: gathered[order[g]] = global[g]
            grad = torch.empty_like(grad).index_copy_(0, ctx.order, grad)
        return _reduce_scatter(grad, ctx.group), None, None


def gather_sequence(x: torch.Tensor, group, order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """All-gather ``x`` [n, ...] along dim 0 over ``group`` (every rank holds n rows), reordered
    by ``order`` (see :func:`gather_order`, on x's device) into global order. The gradient of each
    rank's rows is the sum over ranks of the gathered gradient at those rows (reduce-scatter)."""
    return _GatherSequence.apply(x, group, order)


# --------------------------------------------------------------------------- one forward's shard
@dataclass(frozen=True)
class Shard:
    """This rank's share of one forward: ``rows`` [T_loc] global packed row of each local row,
    ``order`` the gather permutation (None: identity), ``vis`` local query rows against all ``T``
    gathered keys (``vis.query_index == rows``)."""

    group: object
    layout: str
    rows: torch.Tensor
    order: Optional[torch.Tensor]
    vis: visibility.Visibility

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[T_loc, ...] local rows -> [T, ...] global packed order (autograd: reduce-scatter back)."""
        if x.shape[0] != self.rows.shape[0]:
            raise ValueError(f"CP gather: tensor has {x.shape[0]} rows, this rank holds {self.rows.shape[0]}")
        return gather_sequence(x, self.group, self.order)


def shard(group, layout: str, local_tokens: int, batch: int = 1, cu_seqlens: Optional[torch.Tensor] = None,
          cu_seqlens_padded: Optional[torch.Tensor] = None, device=None) -> Shard:
    """The shard of one forward. THD: ``cu_seqlens`` (real lengths) and optional
    ``cu_seqlens_padded`` describe the global packed sequence, which must hold exactly
    ``cp * local_tokens`` rows. bshd: ``cu_seqlens`` None, ``local_tokens = b * s_local``."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    total = cp * local_tokens
    if cu_seqlens is None:
        vis = visibility.Visibility.uniform(batch, total // batch, device=device)
        bounds = units(layout, total, batch)
    else:
        # the boundaries on the host in one read (a GPU copy waits for the queued work): checked and
        # cut there, and handed to the visibility, which copies them back through pinned memory
        n = cu_seqlens.numel()
        both = [cu_seqlens.reshape(-1)] + ([cu_seqlens_padded.reshape(-1)] if cu_seqlens_padded is not None else [])
        host = torch.cat([t.to(torch.int64) for t in both]).cpu()
        cu_host, padded_host = host[:n], (host[n:] if cu_seqlens_padded is not None else None)
        extent = padded_host if padded_host is not None else cu_host
        covered = int(extent[-1])
        if covered != total:
            name = "cu_seqlens_q_padded" if cu_seqlens_padded is not None else "cu_seqlens_q"
            raise ValueError(f"CP={cp}: {name}[-1] = {covered} global tokens, but this rank holds {local_tokens} "
                             f"rows ({total} over the CP group); cu_seqlens must describe the global packed sequence")
        vis = visibility.Visibility.from_cu_seqlens(cu_host, device=device if device is not None else cu_seqlens.device,
                                                 cu_seqlens_padded=padded_host)
        bounds = units(layout, total, cu_seqlens=extent)
    rows = local_rows(bounds, cp, rank, layout)
    order = gather_order(bounds, cp, layout)
    dev = vis.key_seq.device
    rows = rows.to(dev)
    return Shard(group, layout, rows, None if order is None else order.to(dev), vis.rows(rows))


def indexer_loss_tracker_groups(cp_group, calculate_per_token_loss: bool) -> dict:
    """Groups for megatron-core's ``DSAIndexerLossLoggingHelper.save_loss_to_tracker``, as its
    DSAttention passes them: each CP rank's loss covers its own query rows (a mean over them, or a
    sum with ``calculate_per_token_loss``); the logged value averages (or sums) them over CP."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return {}
    return {"reduce_group": cp_group} if calculate_per_token_loss else {"avg_group": cp_group}
