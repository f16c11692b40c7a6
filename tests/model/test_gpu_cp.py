"""Allgather CP = 2 against CP = 1 on one GPU: two processes share the H200 and talk through gloo
(CUDA tensors staged through the host). Same cases and checks as tests/model/test_cp_cpu.py on the CUDA
paths: the reference attention in fp32 (exact checks; the fused Triton indexer scores with local
query rows against the gathered keys), and the TileLang kernels in bf16 (bf16 tolerances). Also the
whole self-attention module under slime's contiguous layout (tests/model/test_cp_mla_cpu.py's cases
and checks, fp32 reference attention, RoPE on the GPU), also with megatron-core's selective recompute
of the MLA up projections."""

import tempfile

import pytest
import torch
import torch.multiprocessing as mp

import test_cp_mla_cpu as mla
from test_cp_cpu import CASES, _worker, check_parity

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["reference", "tilelang"])
def gpu_cp_results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"cp_gpu_{request.param}")
    store = tempfile.NamedTemporaryFile(prefix="glm5_dsa_cp_gpu_", delete=False).name
    mp.spawn(_worker, args=(store, str(out), 2, (1, 2), "cuda", request.param), nprocs=2, join=True)
    return request.param, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_cp2_matches_cp1(gpu_cp_results, name):
    variant, results = gpu_cp_results
    check_parity(results, name, 2, 2, bf16=variant == "tilelang")


# megatron-core's selective recompute of the MLA up projections and RoPE (CUDA RNG states: GPU only)
MLA_CONFIGS = {"plain": {}, "recompute_mla_up_proj": dict(recompute_granularity="selective",
                                                         recompute_modules=["mla_up_proj"])}


@pytest.fixture(scope="module", params=list(MLA_CONFIGS))
def gpu_mla_cp_results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"cp_mla_gpu_{request.param}")
    store = tempfile.NamedTemporaryFile(prefix="glm5_dsa_cp_mla_gpu_", delete=False).name
    mp.spawn(mla._worker, args=(store, str(out), 2, (1, 2), "cuda", MLA_CONFIGS[request.param]), nprocs=2,
             join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("name", list(mla.CASES))
def test_gpu_contiguous_cp2_mla_matches_cp1(gpu_mla_cp_results, name):
    mla.check_parity(gpu_mla_cp_results, name, 2, 2)
    layer = mla.LAYERS_SHARING[0]  # and q / k rotated by zigzag positions miss it
    ref = gpu_mla_cp_results[0][(name, 1)][layer]["out"]
    for res in gpu_mla_cp_results:
        rows = res[(name, 2)]["rows"]
        with pytest.raises(AssertionError):
            mla._close(res[(name, 2)][layer]["zigzag_rope_out"], ref[rows], "zigzag-rotated out")
