import pytest
import torch


def _has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def pytest_collection_modifyitems(config, items):
    if _has_sm90():
        return
    skip = pytest.mark.skip(reason="needs a CUDA sm_90 GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
