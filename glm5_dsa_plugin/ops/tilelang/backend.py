"""The TileLang backend: availability, the prepared inputs kept for the backward, kernel launch."""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch

from ..backend_base import Backend
from ..contract import Problem, SparseMLAInputError
from ..row_groups import group_keys
from .passes import finish_backward, prepare_indices
from .plan import (BWD_MIN_HEADS, FWD_MIN_HEADS, BlockCountsOfLastCall, RowGroupChoice, forward_launches, pad_heads,
                   pad_topk, padded_heads_per_group, padded_topk, unpad_heads, whole_waves)
from .shapes import BLOCK_TOPK, check_split, row_group_geometry

__all__ = ["MIN_CAPABILITY", "TileLangBackend"]

MIN_CAPABILITY = (9, 0)


@functools.lru_cache(maxsize=None)
def _import_status() -> tuple[bool, str]:
    try:
        import tilelang  # noqa: F401

        from . import bwd, bwd_ws, fwd, fwd_ws  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - report the reason to the user
        return False, f"tilelang does not import: {type(exc).__name__}: {exc}"
    return True, f"tilelang {tilelang.__version__}"


@functools.lru_cache(maxsize=None)
def _device_status(index: int) -> tuple[bool, str]:
    """Whether the kernels run on CUDA device ``index`` (asked once per device: the op checks it per call)."""
    cap = torch.cuda.get_device_capability(index)
    if cap < MIN_CAPABILITY:
        return False, f"GPU compute capability {cap} < sm_90 (kernels use Hopper wgmma)"
    return True, f"{_import_status()[1]} on {torch.cuda.get_device_name(index)} (sm_{cap[0]}{cap[1]})"


def _kernel_lists(saved: tuple, prob: Problem) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R, keys, members, extent) the kernels read, from a forward's ``saved``: the row groups'
    lists when it ran them (R = their width / the padded topk), else the one-row indices
    (members not read)."""
    idx, extent = saved[1], saved[2]
    if len(saved) == 3:
        return 1, idx, idx, extent
    keys, members, group_extent = saved[3:]
    return keys.shape[-1] // padded_topk(prob.topk), keys, members, group_extent


@dataclasses.dataclass(frozen=True)
class _KernelChoices:
    """Which kernels and launch shapes the backend runs. The defaults are what it ships with
    (docs/kernels.md gives the measurements behind them); the other values exist for benchmarks
    and tests that compare the variants (``TileLangBackend._with_choices``)."""

    #: kernels memory-safe for any index (sentinel kv row, rewritten indices); False runs the raw
    #: kernels, to measure what that safety costs, and turns off everything built on it
    safe: bool = True
    #: smallest head tile of the one-row forward (heads per kv group are zero-padded up to it)
    fwd_min_heads: int = FWD_MIN_HEADS
    #: threads and slots per block of the forward on 16-row head tiles
    fwd_threads_16: int = 256
    fwd_block_16: int = 64
    #: the single-warpgroup forward also maps invalid slots to the sentinel row itself (False:
    #: it trusts ``prepare_indices``' rewrite)
    fwd_select_in_kernel: bool = False
    #: forward launches per call on 16/32-row tiles, by slot blocks needed (1: no tail skipping)
    fwd_buckets: int = 4
    #: the same for 64-row tiles, single-stage (``plan.forward_launches``; 1: one two-stage launch;
    #: "auto": per call from the rows' block counts of the last call of that shape)
    fwd_buckets_64: int | str = "auto"
    #: the warp-specialised forward for every 64-row tile (>= 64 heads per kv group, row groups)
    fwd_warp_specialized: bool = True
    #: the warp-specialised backward for every 64-row tile with atomic dKV
    bwd_warp_specialized: bool = True
    #: deterministic mode's row chunks as whole waves of the warp-specialised kernel
    #: (``plan.whole_waves``; False: as many rows as ``slot_buffer_bytes`` allows)
    chunk_whole_waves: bool = True
    #: row groups' deterministic slot buffer holds the longest list per group (one host read per
    #: call; False: the full R * topk width)
    compact_group_slots: bool = True

    def __post_init__(self):
        if self.fwd_block_16 not in (32, 64):
            raise ValueError("fwd_block_16: 32 or 64 slots (topk is padded to a multiple of 64 once per call)")
        if self.fwd_buckets_64 != "auto" and not (isinstance(self.fwd_buckets_64, int) and self.fwd_buckets_64 >= 1):
            raise ValueError(f"fwd_buckets_64: an int >= 1 or 'auto', got {self.fwd_buckets_64!r}")
        for f in dataclasses.fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name}: True or False, got {getattr(self, f.name)!r}")


class TileLangBackend(Backend):
    """Fixed TileLang kernels; bf16, CUDA sm_90."""

    name = "tilelang"
    # the backward sets the guard's nonfinite flag itself: dq tested in the warp-specialised
    # kernel's registers (else in the dKV conversion pass), dKV in the pass that converts it
    reports_nonfinite = True

    def __init__(self, deterministic: bool = False, row_groups: bool | str = "auto",
                 slot_buffer_bytes: int = 2 << 30):
        """``deterministic``: dq / dkv bitwise reproducible (dKV from per-slot contributions
        reduced per kv row in a fixed order instead of fp32 atomics), query rows processed in
        chunks whose slot buffer stays under ``slot_buffer_bytes``. ``row_groups`` (fewer than 64
        heads per kv group): blocks of R = 64 / hg consecutive query rows over the union of their
        keys: True, False, or "auto" (per shape, from the last counted call's group entries vs
        slots, see ``plan.RowGroupChoice``)."""
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic: True or False, got {deterministic!r}")
        if not (isinstance(row_groups, bool) or row_groups == "auto"):
            raise ValueError(f"row_groups: True, False or 'auto', got {row_groups!r}")
        if not isinstance(slot_buffer_bytes, int) or isinstance(slot_buffer_bytes, bool) or slot_buffer_bytes < 1:
            raise ValueError(f"slot_buffer_bytes: an int >= 1, got {slot_buffer_bytes!r}")
        self.deterministic, self.row_groups, self.slot_buffer_bytes = deterministic, row_groups, slot_buffer_bytes
        self._choices = _KernelChoices()
        self._new_caches()

    def _new_caches(self) -> None:
        self._block_counts: dict[tuple, BlockCountsOfLastCall] = {}
        self._row_group_choice: dict[tuple, RowGroupChoice] = {}
        self._scratch_flags: dict[torch.device, torch.Tensor] = {}
        self._scratch_probs: dict[torch.device, torch.Tensor] = {}  # the backward's unused HeadProbs
        self._built_plans: set[tuple] = set()  # forward plans whose kernels were built (forward_kernels)

    def _with_choices(self, **changes) -> "TileLangBackend":
        """A copy of this backend with other kernel choices (``_KernelChoices``' fields), for
        benchmarks and tests that compare the kernels' variants."""
        variant = copy.copy(self)
        variant._choices = dataclasses.replace(self._choices, **changes)
        variant._new_caches()
        return variant

    def deterministic_variant(self, device: torch.device | None = None) -> "TileLangBackend":
        """The same kernels (every setting kept) with a backward whose dq/dkv are bitwise reproducible."""
        variant = copy.copy(self)
        variant.deterministic = True
        return variant

    @property
    def memory_safe_on_any_index(self) -> bool:
        """True when no index value can make the kernels touch memory out of bounds (``safe`` mode)."""
        return self._choices.safe

    def finite_out_lse_bound(self, prob: Problem) -> float | None:
        """For the guard's forward check (``guard.device_checks.check_forward``): a bound B such that a
        row whose lse is finite with |lse| <= B is finite and exact (to the kernels' rounding)
        when ``forward_saving(..., kv_flag=f)`` left ``f`` clear, and so is a row that came out
        empty (lse EMPTY_ROW_LSE) without a valid slot (:meth:`row_extent`). ``f`` is set, in the
        copy of kv that index preparation makes anyway, when a kv entry is NaN, +-inf or >=
        ``KV_SUSPECT_BOUND`` (2^100) in magnitude. The guard reads out only when ``f`` is set and
        has the reference recompute the rows left over. None (no such bound: the guard scans out)
        with ``safe=False`` or topk >= 2^20.

        Why, for these kernels (running max m starts at -inf, exponents taken from 0 while it is
        -inf; raw scores; p = exp2(s * c - M), c = sm_scale * log2(e), M = m * c rounded, so every
        p of a row carries the same factor 2^e, |e| <= ulp(m * c) / 2, which cancels in out and
        lse): a NaN score makes its p, the row sum and lse NaN; a +inf score makes m +inf and
        exp2(inf - inf) NaN. Otherwise, while |m * c| < 2^27 (|e| <= 4), every p lies in [0, 16],
        the row sum is at least the max slot's p >= 1/16, and out (the p-weighted sum of < 2^20
        kv rows below 2^100, < 2^124, times the reciprocal row sum) is finite and exact. The
        regimes left: |m * c| >= 2^27 has |lse| >= 2^27 * ln 2 - 104 (or an empty lse); every
        score -inf (fp32 overflow) an empty lse on a row with a valid slot. Hence B = min(2^29 *
        sm_scale, 2^26). A row whose scores all lie far below zero comes out right, with
        |lse| > B, and the guard still recomputes it. The GPU tests compare the check with a full
        scan over poisoned and extreme q and kv."""
        if not self._choices.safe or prob.topk >= 2**20:
            return None
        return min(2.0**29 * prob.sm_scale, 2.0**26)

    def saved_bytes(self, prob: Problem, itemsize: int) -> dict[str, int]:
        """As the Backend protocol, for :meth:`forward_saving`'s ``saved`` (an upper bound over
        ``row_groups="auto"``'s choice): ``kv`` with the zero sentinel row [B, T_kv + 1, G, Dqk];
        ``indices``, the rewritten [B, T, G, K_pad] int32 copy, kept unless the kernels read the
        caller's indices (``_kernels_read_caller_indices``: topk a multiple of 64, not
        deterministic); ``extent`` [B, T, G] int32; with row groups (fewer than 64 heads per kv
        group, ``rows_per_block``), ``key_lists``, the groups' int32 keys and uint8 members
        [B, ceil(T / R), G, R * K_pad] each, and ``key_list_extent`` [B, ceil(T / R), G] int32."""
        B, T, G, k_pad = prob.batch, prob.seq_len, prob.kv_groups, padded_topk(prob.topk)
        kv_rows = prob.seq_len_kv + 1 if self._choices.safe else prob.seq_len_kv
        own_indices = not self._choices.safe or self.deterministic or k_pad != prob.topk
        out = {"kv": B * kv_rows * G * prob.d_qk * itemsize, "indices": B * T * G * k_pad * 4 * own_indices,
               "extent": B * T * G * 4}
        _, R = self.rows_per_block(prob.heads_per_group)
        groups = -(-T // R)
        out["key_lists"] = B * groups * G * R * k_pad * (4 + 1) if R > 1 else 0
        out["key_list_extent"] = B * groups * G * 4 if R > 1 else 0
        return out

    def backward_bytes(self, prob: Problem, itemsize: int) -> dict[str, int]:
        """As the Backend protocol: ``dkv_fp32``, the fp32 accumulator [B, T_kv + 1, G, Dqk] (the
        sentinel row included; in deterministic mode the per-kv-row sums), ``dkv`` the result in
        kv's dtype [B, T_kv, G, Dqk]; deterministic mode adds ``slot_buffer``, the per-slot
        contributions of one chunk of query rows (at most ``slot_buffer_bytes``, or one row block
        when that alone is larger; never more than every block at once)."""
        B, G, Dqk = prob.batch, prob.kv_groups, prob.d_qk
        kv_rows = prob.seq_len_kv + 1 if self._choices.safe else prob.seq_len_kv
        out = {"dkv_fp32": B * kv_rows * G * Dqk * 4, "dkv": B * prob.seq_len_kv * G * Dqk * itemsize}
        if self.deterministic:
            _, R = self.rows_per_block(prob.heads_per_group)
            one_row = (self._geometry(prob, BWD_MIN_HEADS)[2], 1)
            buffers = []
            for hg_pad, r in ((64 // R, R), one_row) if R > 1 else (one_row,):  # (row groups are chosen per call)
                per_block = B * G * row_group_geometry(hg_pad, r)[1] * r * padded_topk(prob.topk) * Dqk * 4
                n_blocks = -(-prob.seq_len // r)
                buffers.append(min(max(self.slot_buffer_bytes, per_block), n_blocks * per_block))
            out["slot_buffer"] = max(buffers)
        return out

    def row_extent(self, saved) -> torch.Tensor:
        """int32 [B, T, G] from :meth:`forward_saving`'s ``saved``: 1 + the last valid slot of each
        query row and kv group, 0 for a row without any (what the guard's forward check needs to
        tell an empty row from one whose scores all came out -inf)."""
        return saved[2]

    def available(self) -> tuple[bool, str]:
        ok, reason = _import_status()
        if not ok:
            return False, reason
        if not torch.cuda.is_available():
            return False, "no CUDA device"
        return _device_status(torch.cuda.current_device())

    def _check(self, q, prob: Problem):
        if q.dtype != torch.bfloat16:
            raise SparseMLAInputError(f"sparse_mla backend 'tilelang' needs bf16 q/kv, got {q.dtype}")
        if not q.is_cuda:
            raise SparseMLAInputError(f"sparse_mla backend 'tilelang' needs CUDA tensors, got {q.device}")
        check_split(prob.d_v, prob.d_tail)

    def save(self, kv, indices, prob: Problem, index_flag=None, block_counts=None,
             block=64, rewrite=True, kv_flag=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prepared inputs both kernels read, built once per call (forward) and kept for the
        backward in place of (kv, indices): (kv with the zero sentinel row [B, T_kv + 1, G, Dqk],
        kernel indices [B, T, G, K_pad] in [0, T_kv], extent [B, T, G]); K_pad is topk rounded up
        to ``BLOCK_TOPK``. ``index_flag`` (int32 [1]) is set when an index breaks the rule;
        ``block_counts`` (see ``prepare_indices``) counts rows by their blocks of ``block`` slots.
        ``rewrite=False``: the caller's ``indices`` in place of the kernel indices (for kernels that
        read them as they are, ``_kernels_read_caller_indices``). ``kv_flag`` (int32 [1]): see
        :meth:`finite_out_lse_bound`.
        With ``safe=False`` (fix-cost measurement only): raw kv, -1 padding, full extent."""
        k_pad = padded_topk(prob.topk)
        if self._choices.safe:
            idx, extent, kv_k = prepare_indices(indices, prob.seq_len_kv, k_pad, index_flag, kv=kv,
                                                block_counts=block_counts, block=block, rewrite=rewrite,
                                                kv_flag=kv_flag)
            return kv_k, idx, extent
        if kv_flag is not None:
            raise ValueError("TileLangBackend(safe=False) sets no kv_flag (finite_out_lse_bound is None)")
        idx = pad_topk(indices, BLOCK_TOPK)
        return kv.contiguous(), idx, torch.full(idx.shape[:-1], k_pad, dtype=torch.int32, device=idx.device)

    def originals(self, saved, prob: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv, indices) back from :meth:`save`'s tensors (the guard's reference repair); slots the
        rewrite sent to the sentinel read as -1 (the same as the kernels treat them)."""
        kv, idx = self.padded_views(saved, prob)
        return (kv, torch.where(idx == prob.seq_len_kv, -1, idx)) if self._choices.safe else (kv, idx)

    def padded_views(self, saved, prob: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv, indices) as views of :meth:`save`'s tensors, no copy and no launch: a slot is valid
        iff 0 <= index < T_kv (the rewrite's sentinel T_kv reads as padding, like -1). What the
        guard's device-side repair reads (``row_repair``)."""
        kv_k, idx = saved[:2]
        if not self._choices.safe:
            return kv_k, idx[..., : prob.topk]
        return kv_k[:, : prob.seq_len_kv], idx[..., : prob.topk]

    def _geometry(self, prob: Problem, minimum):
        """(kv groups, heads per group, heads per group padded to the kernels' ``minimum``)."""
        hg = prob.heads_per_group
        return prob.kv_groups, hg, padded_heads_per_group(hg, minimum)

    def rows_per_block(self, hg: int) -> tuple[int, int]:
        """(padded heads per group, R) of the row-group kernels: R > 1 consecutive query rows share a
        block when hg < 64 and ``row_groups`` is on (hg padded to 8, 16 or 32; R * hg_pad = 64,
        see ``row_groups.group_keys``), else R = 1 (one-row blocks)."""
        if (not self.row_groups or hg >= 64 or not self._choices.safe
                or (self.deterministic and not self._choices.bwd_warp_specialized)):
            return padded_heads_per_group(hg, self._choices.fwd_min_heads), 1
        hg_pad = padded_heads_per_group(hg, 8)
        return hg_pad, 64 // hg_pad

    def _choose_row_groups(self, prob: Problem) -> tuple[bool, RowGroupChoice | None]:
        """-> (run row groups in this call, the choice to record counts into or None), per
        indices shape [B, T, G, topk]."""
        if self.row_groups is True or prob.seq_len == 0:
            return True, None
        shape = (prob.batch, prob.seq_len, prob.kv_groups, prob.topk)
        choice = self._row_group_choice.get(shape)
        if torch.cuda.is_current_stream_capturing():  # no event queries or host copies there
            return (choice.use if choice is not None else True), None
        if choice is None:
            choice = self._row_group_choice[shape] = RowGroupChoice()
        use, count = choice.choose()
        return use, choice if count else None

    def forward(self, q, kv, indices, prob: Problem, index_flag=None):
        """As the Backend protocol; ``index_flag`` (int32 [1], device): set to nonzero when some
        index breaks the rule (the kernels are memory-safe for any index, so the caller reads
        it after the call)."""
        return self.forward_saving(q, kv, indices, prob, index_flag)[:2]

    def _head_probs_out(self, head_probs, k_pad: int, device) -> torch.Tensor:
        """The warp-specialised backward's ``HeadProbs`` argument: the caller's buffer (a
        zero-filled padded copy when topk is not a multiple of the slot block), else a one-element
        placeholder the kernel does not touch (one per device)."""
        if head_probs is None:
            placeholder = self._scratch_probs.get(device)
            if placeholder is None:
                placeholder = self._scratch_probs[device] = torch.zeros(1, dtype=torch.float32, device=device)
            return placeholder
        if head_probs.shape[-1] == k_pad:
            return head_probs
        return head_probs.new_zeros(*head_probs.shape[:-1], k_pad)

    def _ws_backward_flag(self, device, nonfinite_flag=None) -> torch.Tensor:
        """The int32 [1] the warp-specialised backward sets when dq holds NaN / inf: the caller's
        ``nonfinite_flag``, else a scratch one (written, never read; one per device)."""
        if nonfinite_flag is not None:
            return nonfinite_flag
        flags = self._scratch_flags.get(device)
        if flags is None:
            flags = self._scratch_flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return flags

    def forward_saving(self, q, kv, indices, prob: Problem, index_flag=None, kv_flag=None):
        """-> (out, lse, saved): ``saved`` is what :meth:`backward_saved` needs: :meth:`save`'s three
        tensors, then (keys, members, extent) of ``group_keys`` when this call ran row groups. The
        rewritten indices give way to the caller's ``indices`` where the backward can read those
        as they are (``_kernels_read_caller_indices``): autograd then keeps no second
        index-sized tensor per call (1 GB per layer at T = 128K, topk 2048); where the
        warp-specialised forward reads them too (one row per block), no rewritten copy is made
        at all. ``kv_flag`` (int32 [1], device): see :meth:`finite_out_lse_bound`."""
        self._check(q, prob)
        G, hg = prob.kv_groups, prob.heads_per_group
        group_heads, group_rows = self.rows_per_block(hg)
        use_groups, count_into = self._choose_row_groups(prob) if group_rows > 1 else (False, None)
        hg_pad = group_heads if use_groups else padded_heads_per_group(hg, self._choices.fwd_min_heads)
        block = self._fwd_block(hg_pad)
        k_pad = padded_topk(prob.topk)
        n_blocks = k_pad // block
        ws = self._warp_specialized(hg_pad, use_groups)
        buckets_64, counts, last = self._plan_64(indices, hg_pad, n_blocks, q.device)
        caller_ok = self._kernels_read_caller_indices(indices, prob, use_groups)
        # the one-row warp-specialised forward reads them too: no rewritten copy at all (>= 64 heads
        # per group, where no row-group lists are built from rewritten indices)
        saved = self.save(kv, indices, prob, index_flag, block_counts=counts, block=block,
                          rewrite=not (caller_ok and ws and not use_groups), kv_flag=kv_flag)
        if use_groups or count_into is not None:  # (counting builds the lists in one-row calls too)
            lists = group_keys(saved[1], prob.seq_len_kv, group_rows)
            if count_into is not None:  # group entries vs the slots one-row blocks run
                count_into.record(torch.stack([lists[2].sum(dtype=torch.int64), saved[2].sum(dtype=torch.int64)]))
            if use_groups:
                saved = saved + lists
        kv_k = saved[0]
        R, keys, members, ext = _kernel_lists(saved, prob)
        qp = pad_heads(q, G, hg, hg_pad)
        B, T, Hp = prob.batch, prob.seq_len, G * hg_pad
        out = torch.empty(B, T, Hp, prob.d_v, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, T, Hp, dtype=torch.float32, device=q.device)
        if T > 0:
            # (the kernels read the padded width k_pad: saved[1] is k_pad wide, or the caller's
            # indices when topk is already a multiple of the block)
            for kernel in self.forward_kernels(Hp, prob.d_v, prob.d_tail, k_pad, G, prob.sm_scale, hg_pad,
                                               buckets_64, rows_per_block=R, warp_specialized=ws):
                kernel(qp, kv_k, keys, ext, members, out, lse)
        if last is not None:
            last.record(counts)
        if caller_ok:
            saved = (saved[0], indices, *saved[2:])
        return unpad_heads(out, G, hg, hg_pad), unpad_heads(lse, G, hg, hg_pad), saved

    def _kernels_read_caller_indices(self, indices, prob: Problem, row_groups: bool) -> bool:
        """Whether the backward (and the warp-specialised forward) may read the caller's indices
        instead of rewritten ones: those kernels map every slot outside [0, T_kv) to the sentinel
        row themselves and mask it (the gathers, the scores, the dKV atomics; ``valid_slot``
        compares in int64), and row groups read their key lists (the indices are then only the
        guard's). Not with topk short of a multiple of 64 (one-row kernels read the padded
        width), the deterministic backward (its per-key sums need the sentinel) or
        ``safe=False``; and only int32 contiguous indices (what the kernels take)."""
        return (self._choices.safe and not self.deterministic and indices.dtype == torch.int32
                and indices.is_contiguous() and (row_groups or prob.topk == padded_topk(prob.topk)))

    def _warp_specialized(self, hg_pad: int, row_groups: bool, backward: bool = False) -> bool:
        """Whether this direction runs its warp-specialised kernel (``sparse_mla_fwd_ws_kernel`` /
        ``sparse_mla_bwd_ws_kernel``) with atomic dKV: 64-row tiles (>= 64 heads per group, or row
        groups), safe mode, its flag on; not in deterministic mode (whose per-slot variant
        ``_backward_deterministic`` chooses)."""
        c = self._choices
        flag = c.bwd_warp_specialized and not self.deterministic if backward else c.fwd_warp_specialized
        return self._choices.safe and flag and (row_groups or hg_pad >= 64)

    def _fwd_block(self, hg_pad: int) -> int:
        """Slots per forward block: ``fwd_block_16`` for 16-row head tiles, else ``BLOCK_TOPK``
        (row groups always run ``BLOCK_TOPK``; their plan needs no block count)."""
        return self._choices.fwd_block_16 if hg_pad == 16 else BLOCK_TOPK

    def forward_kernels(self, Hp: int, d_v: int, d_tail: int, k_pad: int, G: int, sm_scale: float, hg_pad: int,
                        buckets_64: int, target: str | None = None, rows_per_block: int = 1,
                        warp_specialized: bool = False) -> list:
        """The forward's kernels for one launch plan (``forward_launches``), in launch order.
        The first time a plan is asked for, its kernels are built in parallel threads (TileLang
        compiles outside the GIL): the call that first switches a shape to 8 single-stage row
        buckets builds them at once, not one after another. ``target``: build only (CPU tests).
        ``rows_per_block`` > 1: one launch over every row group's own number of blocks.
        ``warp_specialized``: the one launch of ``sparse_mla_fwd_ws_kernel`` (64-row tiles)."""
        from .fwd import sparse_mla_fwd_kernel
        from .fwd_ws import sparse_mla_fwd_ws_kernel

        to = {} if target is None else {"target": target}
        if warp_specialized:
            return [sparse_mla_fwd_ws_kernel(Hp, d_v, d_tail, k_pad, G, sm_scale, rows_per_block=rows_per_block,
                                             **to)]
        if rows_per_block > 1:
            return [sparse_mla_fwd_kernel(Hp, d_v, d_tail, k_pad, G, sm_scale, self._choices.safe, num_stages=1,
                                          select_in_kernel=self._choices.fwd_select_in_kernel,
                                          rows_per_block=rows_per_block, **to)]
        small = hg_pad == 16
        block = self._fwd_block(hg_pad)
        n_blocks = k_pad // block
        plan = forward_launches(hg_pad, n_blocks, self._choices.fwd_buckets, buckets_64)

        def build(launch):
            lo, hi, stages = launch
            return sparse_mla_fwd_kernel(Hp, d_v, d_tail, k_pad, G, sm_scale, self._choices.safe,
                                         block_i=block, num_stages=stages,
                                         threads=self._choices.fwd_threads_16 if small else 256,
                                         select_in_kernel=self._choices.fwd_select_in_kernel,
                                         blocks=None if (lo, hi) == (0, n_blocks) else (lo, hi), **to)

        key = (Hp, d_v, d_tail, k_pad, G, sm_scale, hg_pad, buckets_64, target)
        if len(plan) > 1 and key not in self._built_plans:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(len(plan), 8)) as pool:
                kernels = list(pool.map(build, plan))
            self._built_plans.add(key)
            return kernels
        return [build(launch) for launch in plan]

    def _plan_64(self, indices, hg_pad, n_blocks, device):
        """-> (buckets_64 for this call, zeroed row-count buffer to fill or None, its
        ``BlockCountsOfLastCall`` or None). Counting runs only for ``fwd_buckets_64="auto"`` on
        64-row tiles with topk >= 8 blocks and nonempty input, outside CUDA graph capture (no
        event queries or host copies there), and never for the warp-specialised forward (it has no
        plan: one launch whose loop stops at each row's last block)."""
        if self._warp_specialized(hg_pad, row_groups=False):
            return 1, None, None
        if self._choices.fwd_buckets_64 != "auto":
            return self._choices.fwd_buckets_64, None, None
        if (hg_pad < 64 or n_blocks < 8 or indices.shape[1] == 0 or not self._choices.safe
                or torch.cuda.is_current_stream_capturing()):
            return 1, None, None
        key = (tuple(indices.shape), n_blocks)
        last = self._block_counts.get(key)
        if last is None:
            last = self._block_counts[key] = BlockCountsOfLastCall(n_blocks + 1)
        return last.choose(n_blocks), torch.zeros(n_blocks + 1, dtype=torch.int32, device=device), last

    def backward(self, q, kv, indices, out, lse, grad_out, prob: Problem):
        return self.backward_saved(q, self.save(kv, indices, prob), out, lse, grad_out, prob)

    def head_probs_in_backward(self, saved, prob: Problem) -> bool:
        """Whether :meth:`backward_saved` can fill ``head_probs`` for this call: the warp-specialised
        backward with atomic dKV on one-row blocks of exactly 64 heads per kv group (one block
        holds all of a row's heads, so the column sums need no second pass)."""
        hg_pad = self._geometry(prob, BWD_MIN_HEADS)[2]
        return (hg_pad == 64 and len(saved) == 3 and not self.deterministic
                and self._warp_specialized(hg_pad, False, backward=True))

    def backward_saved(self, q, saved, out, lse, grad_out, prob: Problem, nonfinite_flag=None, head_probs=None):
        """-> (dq, dkv) from :meth:`save`'s tensors; ``nonfinite_flag`` (int32 [1], device) becomes
        nonzero when dq or dkv holds NaN/inf (dq tested in the warp-specialised kernel's registers,
        else in the dKV conversion pass with dkv; no extra launch). ``head_probs`` (only where
        :meth:`head_probs_in_backward`): fp32 [B, T, G, topk] zero-filled, receives each slot's
        attention probabilities summed over the group's heads (0 at padding)."""
        from .bwd import sparse_mla_bwd_kernel
        from .bwd_ws import sparse_mla_bwd_ws_kernel

        self._check(q, prob)
        kv_k = saved[0]  # [B, T_kv + 1, G, Dqk] with the sentinel row (safe mode), else [B, T_kv, G, Dqk]
        n_kv, d_v = prob.seq_len_kv, prob.d_v
        R, keys, members, ext = _kernel_lists(saved, prob)
        G, hg, hg_pad = self._geometry(prob, BWD_MIN_HEADS)
        if R > 1:  # the forward ran row groups: R rows of 64 / R (padded) heads per block
            hg_pad = 64 // R
        if hg == hg_pad:  # (the common case: no padding ops on the host path)
            qp, dop, outp, lsep = q.contiguous(), grad_out.contiguous(), out.contiguous(), lse.contiguous()
        else:
            qp, dop, outp = (pad_heads(x, G, hg, hg_pad) for x in (q, grad_out, out))
            lsep = pad_heads(lse.unsqueeze(-1), G, hg, hg_pad).squeeze(-1).contiguous()
        T, Hp = prob.seq_len, G * hg_pad
        dq_checked = False  # whether the kernel tested dq itself (the warp-specialised one)
        if self.deterministic:
            dq, dkv, dq_checked = self._backward_deterministic(qp, kv_k, dop, (R, keys, members, ext), lsep, outp,
                                                               G, hg_pad, prob, nonfinite_flag)
        else:
            k_pad = padded_topk(prob.topk)  # (the caller's indices may be unpadded: row groups)
            ws = self._warp_specialized(hg_pad, R > 1, backward=True)
            if head_probs is not None:
                if not self.head_probs_in_backward(saved, prob):
                    raise ValueError("head_probs: this call's backward cannot fill them (head_probs_in_backward)")
                if head_probs.shape != (prob.batch, T, G, prob.topk) or head_probs.dtype != torch.float32:
                    raise ValueError(f"head_probs must be fp32 {(prob.batch, T, G, prob.topk)}, got "
                                     f"{head_probs.dtype} {tuple(head_probs.shape)}")
            if ws:
                kernel = sparse_mla_bwd_ws_kernel(Hp, d_v, prob.d_tail, k_pad, G, prob.sm_scale, rows_per_block=R,
                                                  head_probs=head_probs is not None)
            else:
                kernel = sparse_mla_bwd_kernel(Hp, d_v, prob.d_tail, k_pad, G, prob.sm_scale, self._choices.safe,
                                               **({"rows_per_block": R} if R > 1 else {}))
            dq = torch.empty_like(qp)
            dkv = torch.zeros(kv_k.shape, dtype=torch.float32, device=q.device)
            if T > 0:
                flag = (self._ws_backward_flag(q.device, nonfinite_flag), self._head_probs_out(head_probs, k_pad, q.device)) \
                    if ws else ()
                kernel(qp, kv_k, dop, keys, lsep, outp, ext, members, dq, dkv, *flag)
                if head_probs is not None and flag[1] is not head_probs:
                    head_probs.copy_(flag[1][..., : prob.topk])
            dq_checked = ws and T > 0
        dq = unpad_heads(dq, G, hg, hg_pad)
        return dq, finish_backward(dkv, n_kv, kv_k.dtype, None if dq_checked else dq, nonfinite_flag)

    def _backward_deterministic(self, qp, kv_k, dop, lists, lsep, outp, G, hg_pad, prob: Problem,
                                nonfinite_flag=None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """dq as usual (no atomics); dkv from per-slot contributions summed per kv row by
        ``segment_sum_rows`` in slot order, chunk after chunk of query rows (row groups: of groups).
        ``lists`` = ``_kernel_lists``' (R, keys, members, extent): one-row blocks (R = 1, keys the
        prepared indices) or row groups (keys [B, NG, G, R * topk], one contribution per entry of a
        group's list, far fewer than R * topk slots where the rows share keys; the slot buffer holds
        the longest list's extent per group). 64-row head tiles run the warp-specialised kernel (its
        drain stores each valid slot's contribution instead of adding it; it tests dq itself and
        sets ``nonfinite_flag``), others the single-warpgroup one. -> (dq, dkv fp32 with the
        sentinel row, whether dq was tested)."""
        from ..segment_sum import segment_sum_rows
        from .bwd import sparse_mla_bwd_kernel
        from .bwd_ws import sparse_mla_bwd_ws_kernel

        if not self._choices.safe:
            raise ValueError("deterministic mode needs safe=True (host-rewritten indices)")
        R, keys, members, ext = lists
        B, T, Hp, Dqk = qp.shape  # (heads padded: Hp = G * hg_pad)
        d_v = prob.d_v
        K, n_kv = keys.shape[-1], prob.seq_len_kv  # K: slots per block's list (R * padded topk)
        h_blk, nh = row_group_geometry(hg_pad, R)
        ws = self._choices.bwd_warp_specialized and h_blk >= 64  # (safe mode checked above)
        if ws:
            kernel = sparse_mla_bwd_ws_kernel(Hp, d_v, prob.d_tail, K // R, G, prob.sm_scale, rows_per_block=R,
                                              dkv_per_slot=True)
            flag = (self._ws_backward_flag(qp.device, nonfinite_flag), self._head_probs_out(None, K, qp.device))
        elif R == 1:
            kernel = sparse_mla_bwd_kernel(Hp, d_v, prob.d_tail, K, G, prob.sm_scale, self._choices.safe,
                                           dkv_per_slot=True)
            flag = ()
        else:  # (rows_per_block keeps row groups off in deterministic mode without the ws backward)
            raise ValueError("deterministic row groups need the warp-specialised backward")
        dq = torch.empty_like(qp)
        n_rows = B * kv_k.shape[1] * G
        dkv = torch.zeros(n_rows, Dqk, dtype=torch.float32, device=qp.device)
        n_blocks = keys.shape[1]  # query rows (R = 1) or groups of R rows
        if (R > 1 and n_blocks > 0 and self._choices.compact_group_slots
                and not (qp.is_cuda and torch.cuda.is_current_stream_capturing())):
            # a group's list holds R * topk slots, mostly padding: the slot buffer keeps only the
            # longest list's extent per group, read here (one host read per call; in CUDA graph
            # capture the full width, so other chunks and bits), so that a chunk of full-width
            # groups does not shrink to a fraction of a wave
            KS = max(1, int(ext.max()))
        else:
            KS = K  # slots per block in the slot buffer
        per_block = B * G * nh * KS * Dqk * 4
        blocks = max(1, self.slot_buffer_bytes // per_block)
        dev = qp.device
        if ws and self._choices.chunk_whole_waves:
            blocks = whole_waves(blocks, B * G * nh, torch.cuda.get_device_properties(dev).multi_processor_count)
        key_dtype = torch.int32 if n_rows < 2**31 else torch.int64  # (int32: the sort's radix passes halve)
        b_off = (torch.arange(B, device=dev, dtype=key_dtype) * kv_k.shape[1]).view(B, 1, 1, 1)
        g_off = torch.arange(G, device=dev, dtype=key_dtype).view(1, 1, G, 1)
        # slot (b, n, g*nh + hb, j) adds to kv row (b, keys[b, n, g, j], g); padding slots (the
        # sentinel index n_kv) get key n_rows, which drops them (no host sync in the sum). Built once
        # for every chunk: the host's launches per chunk are what small-H calls wait for.
        # (over the slot buffer's KS entries per block only: each chunk's slice then needs no copy)
        lists_ks = keys[..., :KS]
        key_all = torch.where(lists_ks < n_kv, (b_off + lists_ks.to(key_dtype)) * G + g_off, n_rows)
        # one slot buffer for every chunk (under torch's deterministic algorithms each torch.empty
        # is filled; the kernels leave padding slots unwritten and the sum never reads them)
        slot_buf = torch.empty(B * min(blocks, n_blocks) * G * nh * KS * Dqk, dtype=torch.float32, device=dev)
        for n0 in range(0, n_blocks, blocks):
            n1 = min(n_blocks, n0 + blocks)
            t0, t1 = n0 * R, min(T, n1 * R)
            rows = lambda x: x[:, t0:t1].contiguous()  # noqa: E731
            keys_c, members_c, ext_c = (x[:, n0:n1].contiguous() for x in (keys, members, ext))
            slots = slot_buf[: B * (n1 - n0) * G * nh * KS * Dqk].view(B, n1 - n0, G * nh, KS, Dqk)
            dq_c = dq[:, t0:t1]  # written in place where contiguous (B = 1), else through a copy
            direct = dq_c.is_contiguous()
            if not direct:
                dq_c = torch.empty(B, t1 - t0, Hp, Dqk, dtype=qp.dtype, device=dev)
            kernel(rows(qp), kv_k, rows(dop), keys_c, rows(lsep), rows(outp), ext_c, members_c, dq_c, slots, *flag)
            if not direct:
                dq[:, t0:t1] = dq_c
            key = key_all[:, n0:n1].unsqueeze(3).expand(B, n1 - n0, G, nh, KS).reshape(-1)
            segment_sum_rows(slots.view(-1, Dqk), key, dkv, n_keys=n_rows)
        return dq, dkv.view(B, kv_k.shape[1], G, Dqk), ws and T > 0
