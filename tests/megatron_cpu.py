"""The one CPU shim for megatron-core in tests, and a single-process gloo setup.

megatron-core 0.19.2 calls torch.cuda.current_device() while building RotaryEmbedding (and the
DSA loss tracker); on a machine without a GPU we point it at "cpu". Nothing else is patched."""

import pytest
import torch


@pytest.fixture(scope="session")
def megatron_single_process():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # see module docstring
    if not dist.is_initialized():
        import tempfile

        store = tempfile.NamedTemporaryFile(prefix="glm5_dsa_test_pg_", delete=False).name
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    yield
