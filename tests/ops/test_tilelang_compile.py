"""CI builds the TileLang kernels for sm_90 without a GPU (nvcc 13.0), so a kernel that stops
compiling is caught here and not on a cluster."""

import json
import re
import shutil

import pytest
import torch

tilelang = pytest.importorskip("tilelang")
SM90 = json.dumps({"kind": "cuda", "arch": "sm_90"})
SM90A = json.dumps({"kind": "cuda", "arch": "sm_90a"})  # setmaxnreg and wgmma need the "a" target

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@pytest.mark.slow
@pytest.mark.parametrize("heads,kv_group,d_v", [(64, 1, 512), (16, 1, 512), (64, 2, 256)])
def test_kernels_build_for_sm90(heads, kv_group, d_v):
    from glm5_dsa_plugin.ops.tilelang.bwd import sparse_mla_bwd_kernel
    from glm5_dsa_plugin.ops.tilelang.compile import PASS_CONFIGS
    from glm5_dsa_plugin.ops.tilelang.fwd import sparse_mla_fwd_kernel

    fwd = sparse_mla_fwd_kernel(heads, d_v, 64, 2048, kv_group, 256**-0.5, target=SM90)
    bwd = sparse_mla_bwd_kernel(heads, d_v, 64, 2048, kv_group, 256**-0.5, target=SM90)
    fsrc, bsrc = fwd.get_kernel_source(), bwd.get_kernel_source()
    # gathers are asynchronous copies; dKV is accumulated with vector atomics
    assert "cp_async" in fsrc and "AtomicAddx4" in bsrc
    # the pass configs we chose on purpose are the ones in force
    key = tilelang.PassConfigKey
    assert PASS_CONFIGS[key.TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE] is False
    assert PASS_CONFIGS[key.TL_DISABLE_SAFE_MEMORY_ACCESS] is True


HOPPER_MAX_DYN_SMEM = 227 * 1024  # per block, opt-in maximum on sm_90


def _requested_dyn_smem(kernel) -> int:
    """Dynamic shared memory the host code requests at launch (the largest int64 constant above
    64 KiB that is a multiple of 128 B in TileLang's generated host source)."""
    consts = [int(x) for x in re.findall(r"\(\(int64_t\)(\d+)\)", kernel.get_host_source())]
    smem = [c for c in consts if c > 65536 and c % 128 == 0]
    assert smem, "no shared-memory size found in the host source"
    return max(smem)


@pytest.mark.slow
@pytest.mark.parametrize("hg,buckets_64", [(16, 1), (32, 1), (64, 1), (128, 1), (64, 8), (128, 4)])
def test_every_forward_launch_fits_in_shared_memory(hg, buckets_64):
    """Each kernel of the backend's launch plan (row buckets included) asks for <= 227 KiB:
    the bucketed two-stage 64-row tile once asked for 230 KiB and failed at launch on the H200,
    so 64-row tiles are bucketed only single-stage (``fwd_buckets_64``)."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend
    from glm5_dsa_plugin.ops.tilelang.plan import forward_launches, padded_heads_per_group

    be = TileLangBackend()._with_choices(fwd_buckets_64=buckets_64)
    hg_pad = padded_heads_per_group(hg, be._choices.fwd_min_heads)
    block = be._choices.fwd_block_16 if hg_pad == 16 else 64
    n_blocks = 2048 // block
    plan = forward_launches(hg_pad, n_blocks, be._choices.fwd_buckets, be._choices.fwd_buckets_64)
    assert (len(plan) > 1) == (hg_pad < 64 or buckets_64 > 1)  # where tail skipping fits
    assert all(stages == (1 if hg_pad >= 64 and buckets_64 > 1 else 2) for _, _, stages in plan)
    # the backend's own builder (several launches: built in parallel threads)
    kernels = be.forward_kernels(hg_pad, 512, 64, 2048, 1, 256**-0.5, hg_pad, be._choices.fwd_buckets_64, target=SM90)
    assert len(kernels) == len(plan)
    for (lo, hi, stages), k in zip(plan, kernels):
        assert _requested_dyn_smem(k) <= HOPPER_MAX_DYN_SMEM, (hg, lo, hi, _requested_dyn_smem(k))
        assert "cp_async" in k.get_kernel_source()  # the bucket's row test kept async gathers


@pytest.mark.slow
def test_shared_memory_probe_sees_the_oversized_kernel():
    """The probe above can fail: the 64-row tile under a bucket's row test is over the limit."""
    from glm5_dsa_plugin.ops.tilelang.fwd import sparse_mla_fwd_kernel

    k = sparse_mla_fwd_kernel(64, 512, 64, 2048, 1, 256**-0.5, target=SM90, select_in_kernel=False, blocks=(8, 16))
    assert _requested_dyn_smem(k) > HOPPER_MAX_DYN_SMEM


def test_deterministic_backward_builds_without_atomics():
    from glm5_dsa_plugin.ops.tilelang.bwd import sparse_mla_bwd_kernel

    src = sparse_mla_bwd_kernel(128, 512, 64, 2048, 1, 256**-0.5, target=SM90, dkv_per_slot=True).get_kernel_source()
    assert "AtomicAdd" not in src


def _drain_writes(src: str, atomic: bool) -> list[str]:
    """The warp-specialised backward's dKV writes in generated CUDA ``src`` (16-byte atomics, or
    the per-slot kernel's 16-byte stores), checked for what the drain of each MMA warpgroup's
    chunk buffers does: its values read from the buffer into registers (16-byte vectors), the
    buffer freed, then one write per valid slot from those registers under the valid-slot test
    (none of the chunk's own writes ahead of its free)."""
    lines = src.splitlines()
    if atomic:
        writes = re.findall(r"AtomicAddx4\(\(&\(dKV\[[^;]*\(&\(drain_vals\[[^;]*;", src)
        at = [i for i, ln in enumerate(lines) if "AtomicAddx4((&(dKV[" in ln]
    else:
        writes = re.findall(r"\*\(float4\*\)\(dKV \+ [^;]*\) = \*\(float4\*\)\(drain_vals \+ [^;]*\);", src)
        at = [i for i, ln in enumerate(lines) if "*(float4*)(dKV + " in ln]
    assert len(writes) == 2, writes  # one per MMA warpgroup's chunk buffers
    assert len(at) == 2 and all("if ((0 <= drain_keys[" in lines[i - 1] for i in at)  # only valid slots
    for c, i in enumerate(at):
        reads = [j for j in range(i) if "*(float4*)(drain_vals + " in lines[j] and f"ch_s{c})" in lines[j]]
        frees = [j for j in range(i) if f"ch_free{c}" in lines[j] and ".arrive()" in lines[j]]
        assert reads and frees and reads[-1] < frees[-1] < i, (c, reads, frees, i)
    return writes


@pytest.mark.slow
def test_deterministic_warp_specialised_backward_stores_each_slot():
    """The per-slot warp-specialised backward (deterministic mode, 64-row tiles): the drain
    stores each staged chunk row in 16-byte vectors into the per-slot dKV (row-major [B, T, G*nh,
    topk, 576]: one slot row is 576 floats) and issues no atomic, under the same valid-slot test;
    the atomic kernel keeps its vector atomics (from registers, after the buffer's free: the
    same order, ``_drain_writes``). The same shared memory (<= 227 KiB)."""
    from glm5_dsa_plugin.ops.tilelang.bwd_ws import sparse_mla_bwd_ws_kernel

    per_slot = sparse_mla_bwd_ws_kernel(128, 512, 64, 2048, 1, 256**-0.5, target=SM90A, dkv_per_slot=True)
    atomic = sparse_mla_bwd_ws_kernel(128, 512, 64, 2048, 1, 256**-0.5, target=SM90A)
    src, atomic_src = per_slot.get_kernel_source(), atomic.get_kernel_source()
    assert "AtomicAdd" not in src and "AtomicAddx4" in atomic_src
    _drain_writes(atomic_src, atomic=True)
    stores = _drain_writes(src, atomic=False)
    assert all("(int64_t)576)" in st for st in stores)  # slot rows of 576 floats
    assert _requested_dyn_smem(per_slot) == _requested_dyn_smem(atomic) <= HOPPER_MAX_DYN_SMEM


def test_deterministic_row_group_backward_stores_each_group_entry():
    """Row groups (16 heads, R = 4) in deterministic mode: the per-slot warp-specialised backward
    stores each valid entry of a group's list (rows of 576 floats, slot_stride of them per group
    and head tile: the caller's, not R * topk) under the same valid-entry test, without atomics;
    the same shared memory as the atomic row-group kernel."""
    from glm5_dsa_plugin.ops.tilelang.bwd_ws import sparse_mla_bwd_ws_kernel

    per_slot = sparse_mla_bwd_ws_kernel(16, 512, 64, 2048, 1, 256**-0.5, rows_per_block=4, target=SM90A,
                                        dkv_per_slot=True)
    atomic = sparse_mla_bwd_ws_kernel(16, 512, 64, 2048, 1, 256**-0.5, rows_per_block=4, target=SM90A)
    src = per_slot.get_kernel_source()
    assert "AtomicAdd" not in src and "AtomicAddx4" in atomic.get_kernel_source()
    stores = _drain_writes(src, atomic=False)
    assert all("(int64_t)576)" in st and "slot_stride" in st and "4718592" not in st for st in stores)
    assert _requested_dyn_smem(per_slot) == _requested_dyn_smem(atomic) <= HOPPER_MAX_DYN_SMEM


def test_unsupported_split_rejected_before_compiling():
    from glm5_dsa_plugin.ops.tilelang.shapes import check_split

    with pytest.raises(ValueError, match=r"supports \(d_v, d_tail\)"):
        check_split(384, 64)
    check_split(512, 64)


@pytest.mark.parametrize("heads", [16, 32])
def test_small_head_forward_has_a_barrier_before_the_p_tile_write(heads):
    """16/32-row head tiles: TileLang 0.1.15 aliases reduce_sum's cross-warp workspace with p_s;
    every write of p_s must come after a block-wide barrier (else a fast warp clobbers partial
    row sums that a slow warp is still reading)."""
    from glm5_dsa_plugin.ops.tilelang.fwd import sparse_mla_fwd_kernel

    src = sparse_mla_fwd_kernel(heads, 512, 64, 192, 1, 256**-0.5, target=SM90).get_kernel_source()
    lines = [ln.strip() for ln in src.splitlines() if ln.strip()]
    writes = [i for i, ln in enumerate(lines) if "stmatrix" in ln and "p_s" in ln]
    assert writes, "expected stmatrix writes of the P tile"
    for i in writes:
        assert lines[i - 1] == "__syncthreads();", lines[i - 1]


def _forward_source(kind: str, heads: int, R: int) -> str:
    """CUDA source of a forward kernel at topk 2048, d_v 512: ``kind`` "ws" (warp-specialised,
    sm_90a) or "classic" (single warpgroup: two stages with one row per block, one with row groups)."""
    from glm5_dsa_plugin.ops.tilelang.fwd import sparse_mla_fwd_kernel
    from glm5_dsa_plugin.ops.tilelang.fwd_ws import sparse_mla_fwd_ws_kernel

    if kind == "ws":
        k = sparse_mla_fwd_ws_kernel(heads, 512, 64, 2048, 1, 256**-0.5, rows_per_block=R, target=SM90A)
    else:
        k = sparse_mla_fwd_kernel(heads, 512, 64, 2048, 1, 256**-0.5, num_stages=1 if R > 1 else 2,
                                  rows_per_block=R, target=SM90)
    return k.get_kernel_source()


@pytest.mark.parametrize("kind,heads,R", [("ws", 64, 1), ("ws", 8, 8), ("classic", 64, 1), ("classic", 16, 4)])
def test_forward_epilogue_keeps_a_nan_row_sum_nan(kind, heads, R):
    """Every forward epilogue finds empty rows by ``row_sum != 0``: a NaN row sum (NaN / inf among
    the row's inputs) fails ``0 < row_sum``, which would turn such rows into empty rows (out 0,
    lse -1e30), finite and invisible to the guard. The GPU test
    ``test_nonfinite_inputs_come_out_nonfinite`` checks the values."""
    src = _forward_source(kind, heads, R)
    tests = re.findall(r"\(row_sum\w*\[[^\]]*\] != 0x0p\+0f", src)
    # the reciprocal, out and lse (ws: per MMA warpgroup)
    assert len(tests) == (6 if kind == "ws" else 3), tests
    assert not re.search(r"< row_sum|row_sum\w*\[[^\]]*\] >", src)
    # one division per row, none per entry of out (a division per entry, each with its slow-path
    # branch, would make most of the kernel's code)
    divisions = re.findall(r"(\S+) / row_sum\w*\[", src)
    # the reciprocals: per MMA warpgroup (ws), once (classic)
    assert divisions == ["(0x1p+0f/*1.000000e+00*/"] * (2 if kind == "ws" else 1), divisions


@pytest.mark.parametrize("kind,heads,R", [("ws", 64, 1), ("ws", 8, 8), ("classic", 64, 1), ("classic", 16, 4)])
def test_forward_running_max_starts_at_minus_inf(kind, heads, R):
    """Every forward starts its running max at -inf and takes its exponents from 0 while the max
    is -inf (``tiles.exp_base``): the p of the block and the rescale of out (ws: at both folds of the
    block's max and in the softmax of each MMA warpgroup, and at warpgroup 0's rescale to the pair's
    max: 5; classic: the rescale and the softmax, in each copy of the loop the pipeliner makes). A
    finite start (-2^30) would give a row whose scores all lie 2048 below it out 0 and an empty
    row's lse. The GPU test ``test_rows_far_below_any_finite_max_start_are_exact_in_the_kernels``
    checks the values."""
    src = _forward_source(kind, heads, R)
    assert "0x1p+30f" not in src
    starts = re.findall(r"float broadcast_var_\d+ = (\S+);\n\s*\*\(float2\*\)\(m\d? \+ 0\)", src)
    assert starts == ["-CUDART_INF_F"] * (2 if kind == "ws" else 1), starts
    bases = re.findall(r"if \(\(\(?[^\n]*(?:m\w*\[|max_s\)\[)[^\n]* == -CUDART_INF_F\)\)", src)
    if kind == "ws":
        assert len(bases) == 5, bases
    else:
        assert len(bases) >= 2 and len(bases) % 2 == 0, bases


@pytest.mark.parametrize("ws,heads,R", [(True, 64, 1), (True, 8, 8), (False, 16, 1), (False, 16, 4)])
def test_backward_index_checks_cannot_wrap(ws, heads, R):
    """Every comparison of an index with kv_rows is made in int64: TVM rewrites ``idx < kv_rows - 1``
    into ``idx + 1 < kv_rows``, which in int32 lets 2**31 - 1 through to the dKV atomics; the
    backward reads the caller's indices, so such a value can reach it."""
    from glm5_dsa_plugin.ops.tilelang.bwd import sparse_mla_bwd_kernel
    from glm5_dsa_plugin.ops.tilelang.bwd_ws import sparse_mla_bwd_ws_kernel

    if ws:
        k = sparse_mla_bwd_ws_kernel(heads, 512, 64, 2048, 1, 256**-0.5, rows_per_block=R, target=SM90A)
    else:
        k = sparse_mla_bwd_kernel(heads, 512, 64, 2048, 1, 256**-0.5, rows_per_block=R, target=SM90)
    src = k.get_kernel_source()
    checks = re.findall(r"\(+(?:\(int64_t\))?[\w\[\]]*[^;{]{0,400}?\+ (?:\(int64_t\))?1\) < (?:\(\(int64_t\))?kv_rows", src)
    assert checks, "expected index checks against kv_rows"
    assert not re.search(r"\] \+ 1\) < kv_rows|key_\d+ \+ 1\) < kv_rows", src), "an int32 index check"


@pytest.mark.parametrize("hg,kv_group", [(8, 1), (16, 1), (32, 1), (8, 2)])
def test_row_group_kernels_build_and_fit(hg, kv_group):
    """Fewer than 64 heads per group: the backend's row-group kernels (R = 64 / hg rows per block)
    build for sm_90, fit in shared memory, keep the dKV vector atomics and read the member bits."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend
    from glm5_dsa_plugin.ops.tilelang.bwd import sparse_mla_bwd_kernel

    be = TileLangBackend()
    hg_pad, R = be.rows_per_block(hg)
    assert R * hg_pad == 64 and R > 1
    heads = hg_pad * kv_group
    (fwd,) = be.forward_kernels(heads, 512, 64, 2048, kv_group, 256**-0.5, hg_pad, 1, target=SM90, rows_per_block=R)
    bwd = sparse_mla_bwd_kernel(heads, 512, 64, 2048, kv_group, 256**-0.5, target=SM90, rows_per_block=R)
    for k in (fwd, bwd):
        assert _requested_dyn_smem(k) <= HOPPER_MAX_DYN_SMEM
        assert "Members" in k.get_kernel_source()
    assert "AtomicAddx4" in bwd.get_kernel_source()


@pytest.mark.parametrize("heads,R", [(64, 1), (128, 1), (8, 8), (16, 4), (32, 2)])
def test_warp_specialized_forward_builds_and_fits(heads, R):
    """The warp-specialised forward (64-row tiles: H64/H128 one row per block, row groups) builds
    for sm_90a within 227 KiB; its gather warpgroup copies Q and kv with cp.async and has no
    partial barrier; each MMA warpgroup has its own partial-barrier id (a shared id hangs the
    kernel); each MMA warpgroup computes its scores as two GEMMs over the kv buffer's
    column parts (each part has its own full / free mbarriers), runs one PV GEMM from registers
    (its own P) and one from shared memory (the other warpgroup's), the latter for warpgroup 1
    from buffer 0's rope-tail columns; warpgroup 0 never waits for part of its wgmma groups
    (a partial wait under its overlapped PV makes ptxas serialise every wgmma); one row
    per block stores out from the dead Q tile in 16-byte stores, row groups from the fragment;
    the setmaxnreg counts fit the 3 x 168 registers per thread given at launch."""
    from glm5_dsa_plugin.ops.tilelang.fwd_ws import sparse_mla_fwd_ws_kernel

    k = sparse_mla_fwd_ws_kernel(heads, 512, 64, 2048, 1, 256**-0.5, rows_per_block=R, target=SM90A)
    src = k.get_kernel_source()
    assert _requested_dyn_smem(k) <= HOPPER_MAX_DYN_SMEM
    mma = re.findall(r"warpgroup_reg_alloc<(\d+)>", src)
    (producer,) = re.findall(r"warpgroup_reg_dealloc<(\d+)>", src)
    assert len(mma) == 2 and sum(map(int, mma)) + int(producer) <= 3 * 168
    wg1 = src.index("warpgroup_reg_alloc", src.index("warpgroup_reg_alloc") + 1)
    gather = src.index("warpgroup_reg_dealloc")
    roles = src[:wg1], src[wg1:gather], src[gather:]
    assert "cp_async_gs<16>" in roles[2] and "cp_async" not in roles[0] + roles[1]
    assert "__sync_thread_partial" not in roles[2]
    ids = [set(re.findall(r"__sync_thread_partial\((\d+), 128\)", r)) for r in roles[:2]]
    assert all(len(i) == 1 for i in ids) and ids[0] != ids[1]
    for r in roles[:2]:
        assert r.count("wgmma_rs<") == 1 and r.count("wgmma_ss<") == 3 and r.count("64, 64, 16") == 2
    assert "wait_wgmma<1>" not in roles[0]
    # warpgroup 1's P0 V0: A at byte offset d_v * 64 * 2 of buffer 0 (its rope-tail columns)
    rope_tail_a = (r"initialize_wgmma_descriptor<1, 1, 64>\(desc_a_\d+, "
                   r"\(\(void\*\)\(\(char\*\)\(&\(\(\(bfloat16_t\*\)kv\w*\)\[0\]\)\) \+ 65536\)\)\)")
    assert re.search(rope_tail_a, roles[1])
    assert ("Members" in src) == (R > 1)
    for r in roles[:2]:
        staged = re.findall(r"\*\(uint4\*\)\(Out \+ .*= \*\(uint4\*\)\(\(\(bfloat16_t\*\)q_s\)", r)
        assert len(staged) == (R == 1) and ("*(uint1*)(Out + " in r) == (R > 1)
    # with one row per block the gathers select the sentinel themselves (the backend hands them
    # the caller's indices as they are); no nonfinite test here (the guard scans out and lse)
    assert ("+ (int64_t)1) < ((int64_t)kv_rows)" in roles[2]) == (R == 1)
    assert "Flags" not in src


@pytest.mark.parametrize("heads,R,d_v", [(64, 1, 512), (128, 1, 512), (8, 8, 512), (16, 4, 512), (32, 2, 512),
                                         (64, 1, 256)])
def test_warp_specialized_backward_builds_and_fits(heads, R, d_v):
    """The warp-specialised backward builds for sm_90a within 227 KiB; its gather/drain warpgroup
    copies with cp.async and issues the dKV vector atomics; TileLang's partial barriers in it
    use ids of their own; the three setmaxnreg counts fit the 3 x 168 registers per thread given
    at launch (more, and setmaxnreg.inc waits forever). The score side is split between the MMA
    warpgroups: warpgroup 0 computes all 32
    slots' scores (m64n32; with one row per block Q and kv are [rows, 576] tiles, so one 576-deep
    GEMM; row groups keep them split at d_v, two GEMMs), warpgroup 1 dO V^T (one m64n32 GEMM);
    no GEMM splits the slots between the warpgroups (m64n16). One row per block stores dq through
    the dead Q tile."""
    from glm5_dsa_plugin.ops.tilelang.bwd_ws import sparse_mla_bwd_ws_kernel

    k = sparse_mla_bwd_ws_kernel(heads, d_v, 64, 2048, 1, 256**-0.5, rows_per_block=R, target=SM90A)
    src = k.get_kernel_source()
    assert _requested_dyn_smem(k) <= HOPPER_MAX_DYN_SMEM
    (mma,) = re.findall(r"warpgroup_reg_alloc<(\d+)>", src)
    (producer,) = re.findall(r"warpgroup_reg_dealloc<(\d+)>", src)
    assert 2 * int(mma) + int(producer) <= 3 * 168
    drain = src.index("warpgroup_reg_dealloc")
    assert "cp_async_gs<16>" in src[drain:] and "AtomicAddx4" in src[drain:] and "AtomicAdd" not in src[:drain]
    # TileLang's partial barriers: the drain's (around its gathers: its chunk reads and the
    # gathers' cp.async land in one merged shared buffer) never share an id with the MMA
    # warpgroups' (one hardware barrier met by warps of two roles hangs the kernel)
    mma_ids, drain_ids = (set(re.findall(r"__sync_thread_partial\((\d+), ", part))
                          for part in (src[:drain], src[drain:]))
    assert mma_ids and not mma_ids & drain_ids, (mma_ids, drain_ids)
    assert "64, 16, 16" not in src
    wgmma = [line for line in src[:drain].splitlines() if "wgmma_ss<" in line]
    scores = [line for line in wgmma if "(acc_sp + 0)" in line]
    dp = [line for line in wgmma if "(acc_ds + 0)" in line]
    assert len(scores) == (1 if R == 1 else 2) and len(dp) == 1
    assert all(", 64, 32, 16, false, false," in line for line in scores + dp)
    assert ("Members" in src) == (R > 1)
    # dq tested for NaN / inf in registers, before its store (the guard makes no pass over it)
    nan_test = r"\((\w+)\[\w+\] != \1\[\w+\]\) \| \(\(fabsf\(\1\[\w+\]\) == CUDART_INF_F\)"
    assert set(re.findall(nan_test, src[:drain])) == {"acc_dq", "acc_dqt"} and not re.findall(nan_test, src[drain:])
    assert src.index("Flags[0] = 1;") < src.index("(dQ + ") and src.count("Flags[0] = 1;") == 2
    # the prologue: the gather warpgroup issues block 0's copies before the Q / dO tiles
    # load; the tiles load in 16-byte vectors (but for the rows ``vector_rows`` leaves over); dO is
    # read from global memory there only (the row delta reads the shared tile)
    prologue = src[:src.index("warpgroup_reg_alloc")]
    assert prologue.index("cp_async_gs<16>") < prologue.index("((bfloat16_t*)q_s)")
    for tile in ("q_s", "do_s"):
        assert f"*(uint4*)(((bfloat16_t*){tile})" in prologue
        assert prologue.count(f"*(uint1*)(((bfloat16_t*){tile})") <= 1  # the left-over rows' loop
    assert src.rfind("(dO + ") < len(prologue)
    # one row per block stores dq's d_v columns from the dead Q tile in 16-byte stores, behind a
    # barrier of both MMA warpgroups; row groups (and the rope tail) from the fragment
    staged = re.findall(r"\*\(uint4\*\)\(dQ \+ .*= \*\(uint4\*\)\(\(\(bfloat16_t\*\)q_s\)", src[:drain])
    assert len(staged) == (R == 1) and src[:drain].count("*(uint1*)(dQ + ") == (1 if R == 1 else 2)
    if R == 1:
        # both MMA warpgroups meet after the last wgmma that reads the Q tile and before dq goes
        # into it, and again before the tile is read back for the global stores
        to_tile = src.index("*(uint1*)(((bfloat16_t*)q_s)", src.index("Flags[0] = 1;"))
        last_q_read = src.rindex("(&(((bfloat16_t*)q_s)[0]))", 0, to_tile)
        assert ", 256);" in src[last_q_read:to_tile] and ", 256);" in src[to_tile:src.index(staged[0])]


@pytest.mark.parametrize("heads,d_v,R", [(64, 512, 1), (64, 256, 1), (16, 512, 4), (8, 512, 8)])
def test_warp_specialized_backward_places_its_own_proxy_fences(heads, d_v, R):
    """The warp-specialised backward is built without TileLang's InjectFenceProxy pass, which
    fences every step's GEMMs after the drain's fp32 chunk stores that no wgmma reads. Its CUDA
    holds exactly its own three
    fence.proxy.async, each after generic shared-memory stores that a wgmma reads: the prologue's
    Q / dO tiles (before the block's barrier), P (stmatrix into p_s) and dS (into dp_s), with no
    wgmma between a store and its fence. Other kernels keep the pass: the warp-specialised forward
    still gets its inserted fence before warpgroup 0's P0 V0, and the wrapper is installed once."""
    import tilelang.cuda.transform as tl_cuda_transform

    from glm5_dsa_plugin.ops.tilelang import compile as tl_compile
    from glm5_dsa_plugin.ops.tilelang.bwd_ws import sparse_mla_bwd_ws_kernel

    src = sparse_mla_bwd_ws_kernel(heads, d_v, 64, 2048, 1, 256**-0.5, rows_per_block=R, target=SM90A).get_kernel_source()
    fence = "tl::fence_proxy_async();"
    at = [i for i in range(len(src)) if src.startswith(fence, i)]
    assert len(at) == 3
    assert src[at[0]:].startswith(fence + "\n  __syncthreads();")
    prologue = src[:at[0]]
    assert "wgmma" not in prologue.split("__syncthreads();")[-1] and "((bfloat16_t*)do_s)" in prologue
    for i, tile in zip(at[1:], ("p_s", "dp_s")):
        store = src.rindex("ptx_stmatrix", 0, i)
        assert f"((bfloat16_t*){tile})" in src[store:store + 200] and "wgmma" not in src[store:i]
    assert src.count("wgmma_ss<") > 0 and src.index("wgmma_ss<") > at[0]
    # the pass's own fences sit between warpgroup_arrive and the wgmma they guard
    inserted = r"tl::warpgroup_arrive\(\);\s*tl::fence_proxy_async\(\);"
    assert not re.search(inserted, src)
    fwd = _forward_source("ws", 64, 1)
    assert fwd.count(fence) == 3 and len(re.findall(inserted, fwd)) == 1
    wrapped = tl_cuda_transform.InjectFenceProxy
    assert wrapped.explicit_fences_aware
    tl_compile._install_selective_fence_pass()
    assert tl_cuda_transform.InjectFenceProxy is wrapped


@pytest.mark.parametrize("heads,R", [(64, 1), (16, 4), (8, 8)])
def test_warp_specialized_backward_reads_lse_before_its_block_loop(heads, R):
    """Warpgroup 0 reads its rows' lse once, before the block loop: loaded after each step's score
    GEMM it would sit behind a wgmma wait no load can move above."""
    from glm5_dsa_plugin.ops.tilelang.bwd_ws import sparse_mla_bwd_ws_kernel

    src = sparse_mla_bwd_ws_kernel(heads, 512, 64, 2048, 1, 256**-0.5, rows_per_block=R, target=SM90A).get_kernel_source()
    loop = src.index("for (int blk = 0; blk < nb; ++blk)")
    assert "Lse[" in src[:loop] and "Lse[" not in src[loop:]


@pytest.mark.parametrize("rows,width,threads", [(64, 512, 384), (64, 576, 384), (64, 64, 384), (64, 512, 256),
                                                (48, 320, 384), (16, 64, 128)])
def test_vector_rows_splits_a_tile_into_whole_vectors(rows, width, threads):
    """``vector_rows`` leaves the largest leading row count whose elements divide into 8-element
    vectors for every thread, and fewer rows than one such step after it."""
    from glm5_dsa_plugin.ops.tilelang.bwd_ws import vector_rows

    split = vector_rows(rows, width, threads)
    assert 0 <= split <= rows and split * width % (threads * 8) == 0
    assert all((split + extra) * width % (threads * 8) for extra in range(1, rows - split + 1))


def test_warp_specialized_backward_choice():
    """``bwd_warp_specialized`` (default True) runs it for every 64-row tile with atomic dKV:
    >= 64 heads per kv group, and row groups; not for 16/32-row tiles, not when False, not in
    deterministic mode, not with safe=False; a non-bool is an error."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    cases = [(64, False), (128, False), (32, False), (16, False), (8, True), (16, True)]
    chosen = [TileLangBackend()._warp_specialized(h, rg, backward=True) for h, rg in cases]
    assert chosen == [True, True, False, False, True, True]
    for be in (TileLangBackend()._with_choices(bwd_warp_specialized=False), TileLangBackend(deterministic=True),
               TileLangBackend()._with_choices(safe=False)):
        assert not any(be._warp_specialized(h, rg, backward=True) for h, rg in cases)
    with pytest.raises(ValueError, match="bwd_warp_specialized"):
        TileLangBackend()._with_choices(bwd_warp_specialized=1)


def test_warp_specialized_forward_choice():
    """``fwd_warp_specialized`` (default True) runs it for every 64-row tile: >= 64 heads per kv
    group, and row groups; 16/32-row tiles never; False never; safe=False (fix-cost measurement)
    never; a non-bool is an error."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    cases = [(64, False), (128, False), (32, False), (16, False), (8, True), (16, True)]
    assert [TileLangBackend()._warp_specialized(h, rg) for h, rg in cases] == [True, True, False, False, True, True]
    classic = TileLangBackend()._with_choices(fwd_warp_specialized=False)
    assert not any(classic._warp_specialized(h, rg) for h, rg in cases)
    assert not TileLangBackend()._with_choices(safe=False)._warp_specialized(64, False)
    with pytest.raises(ValueError, match="fwd_warp_specialized"):
        TileLangBackend()._with_choices(fwd_warp_specialized="auto")


def test_warp_specialized_forward_has_no_bucket_plan():
    """A shape on the warp-specialised forward neither counts rows nor asks for row buckets, even
    with ``fwd_buckets_64`` set; with it off, the 64-row plan is the classic one."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    idx = torch.zeros(1, 8, 1, 2048, dtype=torch.int32)
    assert TileLangBackend()._with_choices(fwd_buckets_64=8)._plan_64(idx, 64, 32, "cpu") == (1, None, None)
    classic = TileLangBackend()._with_choices(fwd_buckets_64=8, fwd_warp_specialized=False)
    assert classic._plan_64(idx, 64, 32, "cpu") == (8, None, None)


def test_each_kernel_is_built_once_when_threads_ask_together():
    """The kernel builders are memoised per argument set and build once when several threads ask
    for the same kernel at the same time (concurrent TileLang builds of one kernel broke one of
    them); different arguments build side by side."""
    import threading
    import time

    from glm5_dsa_plugin.ops.tilelang import bwd, bwd_ws, fwd, fwd_ws
    from glm5_dsa_plugin.ops.tilelang.compile import built_once

    calls, running, overlap = [], [0], [0]
    lock = threading.Lock()

    @built_once
    def build(n, scale=1.0):
        with lock:
            calls.append((n, scale))
            running[0] += 1
            overlap[0] = max(overlap[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return object()

    results = {}

    def ask(i):
        results[i] = build(i % 2, scale=0.5)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == [(0, 0.5), (1, 0.5)] and overlap[0] == 2
    assert len({id(results[i]) for i in range(0, 8, 2)}) == 1 and len({id(results[i]) for i in range(1, 8, 2)}) == 1
    assert build(0, scale=0.5) is results[0] and build(0, scale=0.25) is not results[0]
    for builder in (fwd.sparse_mla_fwd_kernel, fwd_ws.sparse_mla_fwd_ws_kernel, bwd.sparse_mla_bwd_kernel,
                    bwd_ws.sparse_mla_bwd_ws_kernel):
        assert builder.__code__ is built_once(lambda: None).__code__  # the same wrapper


@pytest.mark.slow
def test_backward_with_head_probs_builds_and_syncs_its_reader():
    """The backward that also forms the slot probabilities: the gather warpgroup sums P's columns,
    stores them, and arrives at the step barrier (which then counts its 128 threads, or warpgroup 0
    would rewrite P under it); its four warps' partial sums meet behind their own barrier."""
    from glm5_dsa_plugin.ops.tilelang.bwd_ws import sparse_mla_bwd_ws_kernel

    plain = sparse_mla_bwd_ws_kernel(64, 512, 64, 2048, 1, 256**-0.5, target=SM90A).get_kernel_source()
    src = sparse_mla_bwd_ws_kernel(64, 512, 64, 2048, 1, 256**-0.5, target=SM90A, head_probs=True).get_kernel_source()
    assert "step_done[0].init(384)" in src and "step_done[0].init(256)" in plain
    assert "parts_ready[0].init(128)" in src and "parts_ready" not in plain
    assert "HeadProbs[" in src and "HeadProbs[" not in plain
    with pytest.raises(AssertionError, match="one query row per block"):
        sparse_mla_bwd_ws_kernel(16, 512, 64, 2048, 1, 256**-0.5, rows_per_block=4, target=SM90A, head_probs=True)
