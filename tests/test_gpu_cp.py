"""Allgather CP = 2 against CP = 1 on one GPU: two processes share the H200 and talk through gloo
(CUDA tensors staged through the host). Same cases and checks as tests/test_cp_cpu.py, on the CUDA
paths (the fused Triton indexer scores with local query rows against the gathered keys)."""

import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from test_cp_cpu import CASES, _worker, check_parity

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_cp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_gpu")
    store = tempfile.NamedTemporaryFile(prefix="glm5_dsa_cp_gpu_", delete=False).name
    mp.spawn(_worker, args=(store, str(out), 2, (1, 2), "cuda"), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_cp2_matches_cp1(gpu_cp_results, name):
    check_parity(gpu_cp_results, name, 2, 2)
