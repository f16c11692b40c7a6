"""The TileLang backend of sparse MLA (Hopper, bf16): kernels, their launch planning, the backend.

Layout: ``compile`` (pass configuration, fence pass, build memo), ``shapes`` (tile shapes, no
TileLang import), ``tiles`` (helpers shared by the kernels), one kernel per file (``fwd``,
``fwd_ws``, ``bwd``, ``bwd_ws``), ``plan`` (padding, row buckets, row-group choice) and
``backend`` (:class:`TileLangBackend`).

What keeps the kernels exact and memory-safe for any index value (the backend's ``safe`` mode,
the only one it runs; ``safe=False`` exists so a benchmark can measure what this costs):
  * padding slots: the host appends one all-zero *sentinel* row to kv (row T_kv of a
    [B, T_kv + 1, G, Dqk] tensor) and, in the same pass that pads topk, rewrites every slot
    outside [0, T_kv) (-1 padding, and anything index validation would reject) to T_kv
    (``passes.prepare_indices``, one launch). The backward and the warp-specialised
    forward with one row per block also select the sentinel themselves for any index outside
    [0, T_kv) (``tiles.gather_row``, ``tiles.valid_slot`` in int64), so the backend may hand
    them the caller's indices as they are (no rewritten copy is then made); the
    single-warpgroup forward can (``select_in_kernel``), but by default trusts the rewrite.
    Every gather address is a real row, the padding key/value is exactly zero, and no
    data-dependent branch sits on the load itself (the gathers stay asynchronous copies). A
    slot outside [0, T_kv) scores -inf and issues no dKV atomic (its dKV rows are exact zeros);
  * rows with no valid slot: out = 0, lse = EMPTY_ROW_LSE (finite), hence P = 0 and dq = 0;
  * no reliance on TileLang's safe-memory legalisation (disabled in ``compile.PASS_CONFIGS``):
    every global access is in bounds by construction (one query row per block, or a row group
    whose rows past the sequence are read as zeros and never written; heads padded and indices
    rewritten by the host, topk padded to a multiple of the block);
  * the aggressive shared-memory merge is off (``compile.PASS_CONFIGS``): TileLang 0.1.9-0.1.10
    aliased the dKV staging buffer with the live Q tile there and produced NaN dq/dkv from
    finite inputs;
  * the warp-specialised backward sets ``Flags[0]`` (int32 [1], its last argument) when dq holds
    a NaN / inf, tested in registers before the store: the guard's nonfinite check of dq
    without a pass over it.

Kernels: ``fwd.sparse_mla_fwd_kernel`` (one warpgroup; 16/32-row head tiles, and any tile when
asked), ``fwd_ws.sparse_mla_fwd_ws_kernel`` (warp-specialised: a gather warpgroup feeding two
MMA warpgroups; the backend's forward for every 64-row tile, row groups included),
``bwd.sparse_mla_bwd_kernel`` (16/32-row tiles, and ``safe=False``) and
``bwd_ws.sparse_mla_bwd_ws_kernel`` (warp-specialised: a warpgroup that gathers the next block
and drains the dKV atomics beside two MMA warpgroups; the backward for every 64-row tile).

Conventions: the kernels read/write natural-log lse [B, T, H] fp32 and use log2 internally.
Head layout: ``heads = G * Hg`` where ``Hg`` (heads per kv group) is 16, 32, 64 or a multiple of
64 (one query row per block), or 8, 16, 32 with ``rows_per_block`` = 64 / Hg (row groups: see
``shapes.row_group_geometry`` and ``row_groups.group_keys``). In a row group a slot masked for
one row still goes through the MMA, so a nonfinite kv row selected by one row of the group
reaches the other rows of its block as well (0 * NaN); the guard repairs them like any other
bad row.

Importing this package does not import TileLang; importing a kernel module does.
"""

from .backend import TileLangBackend

__all__ = ["TileLangBackend"]
