"""value_up_projection against torch.einsum: values, gradients and token-major (contiguous) layouts."""

import pytest
import torch

from glm5_dsa_plugin.model.value_projection import value_up_projection


def _check(device, dtype, tol):
    g = torch.Generator(device=device).manual_seed(0)
    T, H, C, D = 37, 6, 40, 24
    o = torch.randn(T, H, C, device=device, dtype=dtype, generator=g).requires_grad_(True)
    w = torch.randn(H, D, C, device=device, dtype=dtype, generator=g).requires_grad_(True)
    dy = torch.randn(T, H, D, device=device, dtype=dtype, generator=g)
    seen = []
    o.register_hook(lambda grad: seen.append(grad))
    y = value_up_projection(o, w)
    assert y.shape == (T, H, D) and y.is_contiguous()
    y.backward(dy)
    assert seen[0].is_contiguous()  # what the sparse-MLA backward receives: no copy there
    o2, w2 = o.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    want = torch.einsum("thc,hdc->thd", o2, w2)
    want.backward(dy.float())
    torch.testing.assert_close(y.float(), want, **tol)
    torch.testing.assert_close(o.grad.float(), o2.grad, **tol)
    torch.testing.assert_close(w.grad.float(), w2.grad, **tol)


def test_value_up_projection_matches_einsum_cpu():
    _check("cpu", torch.float32, dict(rtol=1e-5, atol=1e-5))


@pytest.mark.gpu
def test_value_up_projection_matches_einsum_gpu():
    _check("cuda", torch.bfloat16, dict(rtol=2e-2, atol=2e-1))


def test_value_up_projection_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"o \[T, H, C\] and w \[H, D, C\].*o \(4, 3, 8\) and w \(2, 5, 8\)"):
        value_up_projection(torch.zeros(4, 3, 8), torch.zeros(2, 5, 8))
