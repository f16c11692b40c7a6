import pytest
import torch


def _has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def pytest_collection_modifyitems(config, items):
    # Tests marked ``slow`` run first (a stable sort: the same order in every xdist worker), so
    # that under ``pytest -n 2`` the long ones start early and the short ones fill in behind them
    # instead of one worker finishing a long test alone at the end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if _has_sm90():
        return
    skip = pytest.mark.skip(reason="needs a CUDA sm_90 GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_deterministic_backend():
    """Registers "no_det": the reference's math behind a backend with no deterministic mode."""
    from glm5_dsa_plugin.ops import register_backend
    from glm5_dsa_plugin.ops.backends import Backend, ReferenceBackend, unregister_backend

    class NoDeterministic(Backend):
        name = "no_det"
        _ref = ReferenceBackend()

        def available(self):
            return True, "test"

        def forward(self, *a):
            return self._ref.forward(*a)

        def backward(self, *a):
            return self._ref.backward(*a)

    register_backend("no_det", NoDeterministic, replace=True)
    yield "no_det"
    unregister_backend("no_det")
