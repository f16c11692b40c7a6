"""CI builds the TileLang kernels for sm_90 without a GPU (nvcc 13.0), so a kernel that stops
compiling is caught here and not on a cluster."""

import json
import shutil

import pytest

tilelang = pytest.importorskip("tilelang")
SM90 = json.dumps({"kind": "cuda", "arch": "sm_90"})

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@pytest.mark.parametrize("heads,kv_group,d_v", [(64, 1, 512), (16, 1, 512), (64, 2, 256)])
def test_kernels_build_for_sm90(heads, kv_group, d_v):
    from glm5_dsa_plugin.ops.tilelang_kernels import PASS_CONFIGS, sparse_mla_bwd_kernel, sparse_mla_fwd_kernel

    fwd = sparse_mla_fwd_kernel(heads, d_v, 64, 2048, kv_group, 256**-0.5, target=SM90)
    bwd = sparse_mla_bwd_kernel(heads, d_v, 64, 2048, kv_group, 256**-0.5, target=SM90)
    fsrc, bsrc = fwd.get_kernel_source(), bwd.get_kernel_source()
    # gathers are asynchronous copies; dKV is accumulated with vector atomics
    assert "cp_async" in fsrc and "AtomicAddx4" in bsrc
    # the pass configs we chose on purpose are the ones in force
    key = tilelang.PassConfigKey
    assert PASS_CONFIGS[key.TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE] is False
    assert PASS_CONFIGS[key.TL_DISABLE_SAFE_MEMORY_ACCESS] is True


def test_bucketed_forward_keeps_async_gathers():
    """A launch for one bucket of rows (lo, hi] wraps the whole body in the row test; the pipelined
    loop inside must still gather with cp.async, and a row outside the bucket writes nothing."""
    from glm5_dsa_plugin.ops.tilelang_kernels import sparse_mla_fwd_kernel

    full = sparse_mla_fwd_kernel(64, 512, 64, 2048, 1, 256**-0.5, target=SM90, select_in_kernel=False)
    part = sparse_mla_fwd_kernel(64, 512, 64, 2048, 1, 256**-0.5, target=SM90, select_in_kernel=False,
                                 blocks=(8, 16))
    fsrc, psrc = full.get_kernel_source(), part.get_kernel_source()
    assert "cp_async" in psrc and "Extent" in psrc
    assert fsrc != psrc
    with pytest.raises(AssertionError):
        sparse_mla_fwd_kernel(64, 512, 64, 2048, 1, 256**-0.5, target=SM90, blocks=(16, 40))


def test_deterministic_backward_builds_without_atomics():
    from glm5_dsa_plugin.ops.tilelang_kernels import sparse_mla_bwd_kernel

    src = sparse_mla_bwd_kernel(128, 512, 64, 2048, 1, 256**-0.5, target=SM90, dkv_per_slot=True).get_kernel_source()
    assert "AtomicAdd" not in src


def test_unsupported_split_rejected_before_compiling():
    from glm5_dsa_plugin.ops.tilelang_kernels import check_split

    with pytest.raises(ValueError, match=r"supports \(d_v, d_tail\)"):
        check_split(384, 64)
    check_split(512, 64)


@pytest.mark.parametrize("heads", [16, 32])
def test_small_head_forward_has_a_barrier_before_the_p_tile_write(heads):
    """16/32-row head tiles: TileLang 0.1.15 aliases reduce_sum's cross-warp workspace with p_s;
    every write of p_s must come after a block-wide barrier (else a fast warp clobbers partial
    row sums that a slow warp is still reading)."""
    from glm5_dsa_plugin.ops.tilelang_kernels import sparse_mla_fwd_kernel

    src = sparse_mla_fwd_kernel(heads, 512, 64, 192, 1, 256**-0.5, target=SM90).get_kernel_source()
    lines = [ln.strip() for ln in src.splitlines() if ln.strip()]
    writes = [i for i, ln in enumerate(lines) if "stmatrix" in ln and "p_s" in ln]
    assert writes, "expected stmatrix writes of the P tile"
    for i in writes:
        assert lines[i - 1] == "__syncthreads();", lines[i - 1]
