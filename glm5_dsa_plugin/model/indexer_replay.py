"""Indexer replay: train on the top-k keys the rollout engine picked, not on the trainer's own.

The rollout format (SGLang's ``meta_info["indexer_topk"]``, miles' ``sample.rollout_indexer_topk``)
is one int32 array per sample, ``[n_tokens - 1, n_layers, topk]``:

* row ``i`` is the query at position ``i`` of the sample (prompt + response); the last token ran no
  forward in the engine, so it has no row (a record with ``n_tokens`` rows is accepted too);
* values are key positions inside the same sample (0-based), or ``-1`` for an empty slot; a valid
  value ``v`` of row ``i`` satisfies ``0 <= v <= i`` (causal);
* the layer axis holds either the index-computing layers only, in order, or every decoder layer
  (SGLang captures a slot per layer and repeats the source layer's top-k in index-sharing layers);
  only the index-computing layers are kept, since the sharing layers reuse them as in training;
* ``topk`` narrower than the model's is padded with ``-1``; wider is refused.

Rows a record does not hold (each sample's last token, THD padding) keep the trainer's own top-k:
no log-prob depends on the last token's row, and padding sees no key. An MTP layer always computes
its own indices (the engine's capture covers the decoder layers).

:func:`pack_indexer_topk` turns one micro-batch's records into an :class:`IndexerReplay` in the
coordinates the attention uses (packed rows; under context parallelism only this rank's rows, in
all-gathered kv coordinates), validating every value first. :func:`attach_indexer_replay` hands
it to the model for that micro-batch; the attention reads it from the same per-micro-batch object
that carries its index-sharing state (``PackedSeqParams``, else the attention mask, else the
config), so activation recompute replays the same indices.
"""

from __future__ import annotations

import base64
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from . import micro_batch
from .index_sharing import computes_indices

__all__ = ["IndexerReplay", "IndexerReplayError", "IndexerTopkRecorder", "attach_indexer_replay",
           "attach_indexer_topk_recorder", "carries_several_replays", "computing_layers", "decode_indexer_topk",
           "encode_indexer_topk", "indexer_replay_of", "indexer_topk_overlap", "pack_indexer_topk", "topk_overlap"]

REPLAY_ATTR = "_glm5_dsa_indexer_replay"
RECORDER_ATTR = "_glm5_dsa_indexer_topk_recorder"
_REPLACED_ATTR = "_glm5_dsa_indexer_replay_replaced"  # True once a carrier's replay gave way to another
_SERIALS = itertools.count(1)  # IndexerReplay.serial: unique per object, never reused (unlike id())
OVERLAP_THRESHOLD = 0.8  # a row whose shared fraction is below this counts as mismatched (miles' CI bound)


class IndexerReplayError(ValueError):
    """A replayed top-k record that does not fit the micro-batch or the causal rule."""


# --------------------------------------------------------------------------- wire format
def decode_indexer_topk(data, num_layers: Optional[int] = None, n_rows: Optional[int] = None,
                        topk: Optional[int] = None) -> torch.Tensor:
    """One sample's record as an int32 CPU tensor ``[rows, layers, topk]``.

    ``data``: SGLang's base64 string (or bytes) of little-endian int32 in C order, with
    ``num_layers`` (``meta_info["indexer_topk_num_layers"]``) and one of ``n_rows``
    (``n_tokens - 1``) or ``topk``; or an array / tensor / nested list of that shape."""
    if isinstance(data, (str, bytes, bytearray)):
        raw = base64.b64decode(data, validate=True)
        if len(raw) % 4:
            raise IndexerReplayError(f"indexer_topk: {len(raw)} bytes is not a whole number of int32 values")
        flat = torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int32))
        if num_layers is None or (n_rows is None and topk is None):
            raise IndexerReplayError("indexer_topk as base64 needs num_layers (indexer_topk_num_layers) and "
                                     "n_rows (n_tokens - 1) or topk")
        per_row = None if n_rows is None else n_rows * num_layers
        if topk is None:
            if per_row == 0 or flat.numel() % per_row:
                raise IndexerReplayError(f"indexer_topk: {flat.numel()} values do not split into {n_rows} rows x "
                                         f"{num_layers} layers")
            topk = flat.numel() // per_row
        if flat.numel() % (num_layers * topk):
            raise IndexerReplayError(f"indexer_topk: {flat.numel()} values do not split into rows of {num_layers} "
                                     f"layers x {topk}")
        return flat.view(-1, num_layers, topk)
    t = data if isinstance(data, torch.Tensor) else torch.as_tensor(np.asarray(data))
    if t.dim() != 3:
        raise IndexerReplayError(f"indexer_topk must be [rows, layers, topk], got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex():
        raise IndexerReplayError(f"indexer_topk must hold integers, got {t.dtype}")
    return t.to("cpu", torch.int32)


def encode_indexer_topk(record: torch.Tensor) -> str:
    """``[rows, layers, topk]`` int32 -> SGLang's base64 string (little-endian int32, C order)."""
    return base64.b64encode(record.to("cpu", torch.int32).contiguous().numpy().astype("<i4").tobytes()).decode()


def computing_layers(num_layers: int, topk_freq: int = 1, skip_offset: int = 0) -> list[int]:
    """1-based decoder layers that run their own indexer (the others reuse one of these)."""
    return [n for n in range(1, num_layers + 1) if computes_indices(n, topk_freq, skip_offset)]


# --------------------------------------------------------------------------- the packed replay
@dataclass
class LayerOverlap:
    """Top-k agreement of one layer in one micro-batch: ``shared`` is the sum over rows of the
    fraction of replayed members the trainer's own top-k also picked; ``rows`` the rows counted
    (those with at least one replayed member); ``below`` the rows under the threshold."""

    shared: float = 0.0
    rows: int = 0
    below: int = 0


@dataclass
class IndexerReplay:
    """One micro-batch's replayed top-k, as the attention consumes it.

    ``indices[layer]``: int32 ``[R, topk]`` for each index-computing global layer number (1-based)
    kept, in packed kv coordinates (under CP: all-gathered global packed rows), ``-1`` empty;
    ``rows``: int64 ``[R]`` the global packed row of each (this rank's query rows, in local order);
    ``own_rows``: int64 ``[F]`` positions in ``0..R-1`` of real tokens the record does not hold
    (each sample's last token), which take the trainer's own top-k. With ``measure_overlap`` the
    attention also computes its own top-k everywhere and fills ``overlap``."""

    indices: dict[int, torch.Tensor]
    rows: torch.Tensor
    own_rows: torch.Tensor
    topk: int
    measure_overlap: bool = False
    overlap: dict[int, LayerOverlap] = field(default_factory=dict)
    serial: int = field(default_factory=lambda: next(_SERIALS), init=False, compare=False)

    def layer(self, layer_number: int, device) -> Optional[torch.Tensor]:
        """The layer's indices on ``device`` (None if this replay has no such layer)."""
        t = self.indices.get(layer_number)
        if t is None:
            return None
        if t.device != torch.device(device):
            t = t.to(device, non_blocking=True)
            self.indices[layer_number] = t
        return t

    def to(self, device, non_blocking: bool = True) -> "IndexerReplay":
        """Copy every layer to ``device`` now (asynchronously from pinned host memory)."""
        for k, t in self.indices.items():
            self.indices[k] = t.to(device, non_blocking=non_blocking)
        self.own_rows = self.own_rows.to(device, non_blocking=non_blocking)
        return self

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.indices.values())

    def record_overlap(self, layer_number: int, replayed: torch.Tensor, own: torch.Tensor) -> None:
        frac, counted = topk_overlap(replayed, own)
        o = self.overlap.setdefault(layer_number, LayerOverlap())
        o.shared += float(frac[counted].sum())
        o.rows += int(counted.sum())
        o.below += int((frac[counted] < OVERLAP_THRESHOLD).sum())


def _fail(msg: str):
    raise IndexerReplayError(f"indexer replay: {msg}")


def _layer_axis(L: int, num_layers: int, computing: list[int], sample: int) -> list[int]:
    """Position on the record's layer axis of each computing layer."""
    if L == len(computing):
        return list(range(L))
    if L == num_layers:
        return [n - 1 for n in computing]
    _fail(f"sample {sample}: the record has {L} layers; this model has {num_layers} decoder layers of which "
          f"{len(computing)} compute indices (send either count)")


def _check_values(rec: torch.Tensor, pos: torch.Tensor, sample: int, layer_numbers: Sequence[int]) -> None:
    """Every value -1 or in [0, row]; no key twice in a row. rec [r, L, K] sample-local values of
    the sample's rows ``pos`` [r] (positions in the sample)."""
    bound = pos.to(torch.int32)[:, None, None]
    bad = (rec < -1) | (rec > bound)
    if bool(bad.any()):
        r, li, s = (int(v) for v in bad.nonzero()[0])
        v, row = int(rec[r, li, s]), int(pos[r])
        why = "below -1" if v < -1 else f"after its row (a query at position {row} sees keys 0..{row})"
        _fail(f"sample {sample}, layer {layer_numbers[li]}, row {row}, slot {s}: value {v} is {why}")
    for li in range(rec.shape[1]):  # one layer at a time: the sort's copy stays [r, K]
        srt = rec[:, li].sort(dim=-1).values
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if bool(dup.any()):
            r, s = (int(v) for v in dup.nonzero()[0])
            _fail(f"sample {sample}, layer {layer_numbers[li]}, row {int(pos[r])}: key {int(srt[r, s + 1])} "
                  f"appears twice")


def pack_indexer_topk(records: Iterable, cu_seqlens: torch.Tensor, *, num_layers: int, topk: int,
                      topk_freq: int = 1, skip_offset: int = 0, cu_seqlens_padded: Optional[torch.Tensor] = None,
                      layers: Optional[Iterable[int]] = None, rows: Optional[torch.Tensor] = None,
                      measure_overlap: bool = False, pin_memory: Optional[bool] = None) -> IndexerReplay:
    """One micro-batch's records -> :class:`IndexerReplay` (host memory; pinned when CUDA is present).

    ``records``: one record per sample, in packing order (anything :func:`decode_indexer_topk`
    takes as an array, or an already decoded tensor); ``cu_seqlens`` [n + 1] the real lengths as
    ``PackedSeqParams.cu_seqlens_q`` (bshd: ``[0, s, 2s, ...]``); ``cu_seqlens_padded`` the padded
    layout when there is one. ``num_layers``, ``topk``, ``topk_freq``, ``skip_offset``: the model's
    decoder depth and DSA geometry. ``layers``: keep only these global layer numbers (a pipeline
    stage's); ``rows``: this rank's query rows as global packed rows (context parallel, see
    :func:`glm5_dsa_plugin.model.cp_layout.local_row_ids`; None: every row). Only those rows are
    validated and kept: ``len(rows) x kept layers x topk x 4`` bytes.

    Raises :class:`IndexerReplayError` before anything is built on a record that does not fit: a
    value outside its row's causal range or repeated, a wrong row, layer or top-k count."""
    cu = torch.as_tensor(cu_seqlens).to("cpu", torch.int64)
    starts = torch.as_tensor(cu_seqlens_padded).to("cpu", torch.int64) if cu_seqlens_padded is not None else cu
    if starts.shape != cu.shape:
        _fail(f"cu_seqlens_padded has {starts.numel()} entries, cu_seqlens {cu.numel()}")
    lens = (cu[1:] - cu[:-1]).tolist()
    recs = [decode_indexer_topk(r) for r in records]
    if len(recs) != len(lens):
        _fail(f"{len(recs)} records for {len(lens)} sequences in the micro-batch")
    computing = computing_layers(num_layers, topk_freq, skip_offset)
    wanted = set(computing if layers is None else layers)
    keep = [li for li, n in enumerate(computing) if n in wanted]
    T = int(starts[-1])
    rows_t = torch.arange(T, dtype=torch.int64) if rows is None else torch.as_tensor(rows).to("cpu", torch.int64)
    if rows_t.numel() and (int(rows_t.min()) < 0 or int(rows_t.max()) >= T):
        _fail(f"rows must lie in [0, {T}) (the micro-batch's packed rows)")
    R = rows_t.numel()
    out = torch.full((len(keep), R, topk), -1, dtype=torch.int32)
    own = torch.zeros(R, dtype=torch.bool)
    for i, (rec, n, a) in enumerate(zip(recs, lens, starts[:-1].tolist())):
        if rec.shape[0] not in (n - 1, n) or (n == 0 and rec.shape[0]):
            _fail(f"sample {i}: the record has {rec.shape[0]} rows; its sequence has {n} tokens "
                  f"(send {max(n - 1, 0)})")
        if rec.shape[-1] > topk:
            _fail(f"sample {i}: the record holds top-{rec.shape[-1]}; the model's index_topk is {topk}")
        axis = _layer_axis(rec.shape[1], num_layers, computing, i)
        mine = ((rows_t >= a) & (rows_t < a + n)).nonzero()[:, 0]  # this rank's rows of sample i
        pos = rows_t[mine] - a
        held = pos < rec.shape[0]
        own[mine[~held]] = True  # the last token (no row in the record)
        mine, pos = mine[held], pos[held]
        sub = rec[pos][:, axis]  # [r, n_computing, K_rec]
        _check_values(sub, pos, i, computing)
        sub = sub[:, keep]
        out[:, mine, :sub.shape[-1]] = torch.where(sub >= 0, sub + a, sub).transpose(0, 1)
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    indices = {computing[li]: (out[j].pin_memory() if pin else out[j]) for j, li in enumerate(keep)}
    return IndexerReplay(indices, rows_t, own.nonzero()[:, 0], topk, measure_overlap)


# --------------------------------------------------------------------------- model hooks
def attach_indexer_replay(carrier, replay: Optional[IndexerReplay]) -> None:
    """Hand ``replay`` to the model for one micro-batch: ``carrier`` is that micro-batch's
    ``PackedSeqParams`` (THD), else its attention mask, else the model's ``TransformerConfig``
    (bshd without a mask: attach before each micro-batch). A carrier that holds the replays of more
    than one micro batch in turn (the config, a mask reused by every micro batch) is checked: a
    recomputed forward that finds another micro batch's replay there raises. None detaches."""
    obj = micro_batch.as_carrier(carrier)
    held = getattr(obj, REPLAY_ATTR, None)
    if replay is not None and held is not None and held.serial != replay.serial:
        setattr(obj, _REPLACED_ATTR, True)
    setattr(obj, REPLAY_ATTR, replay)


def carries_several_replays(carrier) -> bool:
    """Whether one replay on ``carrier`` was replaced by another (the carrier is shared by micro batches)."""
    return getattr(micro_batch.as_carrier(carrier), _REPLACED_ATTR, False)


def indexer_replay_of(carrier) -> Optional[IndexerReplay]:
    return getattr(micro_batch.as_carrier(carrier), REPLAY_ATTR, None)


class IndexerTopkRecorder:
    """Collects the top-k each index-computing layer picks in a forward (stands in for the rollout
    engine's capture). Attach with :func:`attach_indexer_topk_recorder`, run the forward, then
    :meth:`records` gives one ``[n_tokens - 1, n_computing_layers, topk]`` int32 tensor per sample."""

    def __init__(self):
        self.by_layer: dict[int, torch.Tensor] = {}  # layer -> int32 [R, topk], packed kv coordinates
        self.rows: Optional[torch.Tensor] = None  # the global packed row of each recorded row

    def add(self, layer_number: int, indices: torch.Tensor, query_index: torch.Tensor) -> None:
        self.by_layer[layer_number] = indices.detach().to("cpu", torch.int32)
        self.rows = query_index.detach().to("cpu", torch.int64)

    def records(self, cu_seqlens: torch.Tensor, cu_seqlens_padded: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Per sample ``[n - 1, layers, topk]`` in sample-local positions (needs every row: CP 1)."""
        if self.rows is None or not torch.equal(self.rows, torch.arange(self.rows.numel())):
            raise RuntimeError("per-sample records need every query row on one rank (context parallel 1)")
        cu = torch.as_tensor(cu_seqlens).to("cpu", torch.int64)
        starts = torch.as_tensor(cu_seqlens_padded).to("cpu", torch.int64) if cu_seqlens_padded is not None else cu
        layers = [self.by_layer[k] for k in sorted(self.by_layer)]
        if not layers:
            raise RuntimeError("no index-computing layer ran while the recorder was attached")
        stacked = torch.stack(layers, dim=1)  # [T, L, K]
        out = []
        for n, a in zip((cu[1:] - cu[:-1]).tolist(), starts[:-1].tolist()):
            r = stacked[a:a + max(n - 1, 0)]
            out.append(torch.where(r >= 0, r - a, r).contiguous())
        return out


def attach_indexer_topk_recorder(carrier, recorder: Optional[IndexerTopkRecorder]) -> None:
    """Record the top-k of the next forward that uses ``carrier`` (see :func:`attach_indexer_replay`)."""
    setattr(micro_batch.as_carrier(carrier), RECORDER_ATTR, recorder)


# --------------------------------------------------------------------------- the mismatch
def topk_overlap(replayed: torch.Tensor, own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the fraction of ``replayed``'s members (``-1`` ignored) that ``own`` also holds.
    replayed, own [R, K] int -> (fraction fp32 [R], counted bool [R]: rows with a replayed member)."""
    own_sorted = own.to(torch.int64).sort(dim=-1).values.contiguous()
    rep = replayed.to(torch.int64).contiguous()
    pos = torch.searchsorted(own_sorted, rep).clamp(max=own_sorted.shape[-1] - 1)
    valid = rep >= 0
    hit = (own_sorted.gather(1, pos) == rep) & valid
    n = valid.sum(-1)
    frac = hit.sum(-1).float() / n.clamp_min(1).float()
    return frac, n > 0


def indexer_topk_overlap(replays: IndexerReplay | Sequence[IndexerReplay], group=None) -> dict:
    """The replay mismatch over one or more micro-batches (those forwarded with ``measure_overlap``):
    ``{"mean": mean over layers of the mean shared fraction, "rows_below_0_8": rows under 0.8 over all
    layers, "per_layer": {layer: {"shared": fraction, "rows_below_0_8": n, "rows": n}}}``. With
    ``group`` (e.g. the CP or data-parallel group) the counts are summed over its ranks first."""
    replays = [replays] if isinstance(replays, IndexerReplay) else list(replays)
    acc: dict[int, list[float]] = {}
    for r in replays:
        for layer, o in r.overlap.items():
            a = acc.setdefault(layer, [0.0, 0.0, 0.0])
            a[0] += o.shared
            a[1] += o.rows
            a[2] += o.below
    layers = sorted(acc)
    if group is not None and torch.distributed.is_initialized():
        t = torch.tensor([acc[k] for k in layers], dtype=torch.float64).reshape(-1)
        torch.distributed.all_reduce(t, group=group)
        for i, k in enumerate(layers):
            acc[k] = t[3 * i:3 * i + 3].tolist()
    per = {k: {"shared": acc[k][0] / max(acc[k][1], 1), "rows_below_0_8": int(acc[k][2]), "rows": int(acc[k][1])}
           for k in layers}
    mean = sum(v["shared"] for v in per.values()) / len(per) if per else float("nan")
    return {"mean": mean, "rows_below_0_8": sum(v["rows_below_0_8"] for v in per.values()), "per_layer": per}
