"""The attention probabilities at the slots, summed over heads, formed in the TileLang backward
(``SlotProbsGrad``), against the PyTorch definition (pytest -m gpu; skipped without sm_90)."""

import pytest
import torch

from glm5_dsa_plugin.ops import SlotProbsGrad, op, sparse_mla
from glm5_dsa_plugin.ops import reference as ref
from glm5_dsa_plugin.ops.workloads import w2_indices

pytestmark = pytest.mark.gpu
SCALE = 256**-0.5


def _call(q, kv, idx, grad, probs_out=None):
    """sparse_mla fwd + bwd (TileLang); with ``probs_out`` (a list) a SlotProbsGrad whose grad_from
    keeps p and returns 2 * p as the gradient of its input."""
    qq, kk = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    spg, logits = None, None
    if probs_out is not None:
        logits = torch.zeros(idx.shape[0], idx.shape[-1], device="cuda", requires_grad=True)

        def grad_from(p):
            probs_out.append(p.clone())
            return 2 * p[:, 0]
        spg = SlotProbsGrad(logits, grad_from)
    out, lse = sparse_mla(qq, kk, idx, SCALE, d_v=512, backend="tilelang", slot_probs_grad=spg)
    out.backward(grad)
    return out.detach(), lse, qq.grad, kk.grad, logits


@pytest.mark.parametrize("H,topk,fused", [(64, 2048, True), (64, 2000, True), (16, 2048, False)])
def test_slot_probs_from_the_backward_match_the_definition(H, topk, fused, monkeypatch):
    """H = 64: formed by the backward kernel (the op's own pass is not run); topk 2000 is padded to
    the slot blocks and cut back; H = 16: the op's pass after the backward. Rows of the W2 workload
    are ragged (padding, empty rows). The attention's own gradients are those of a call without it."""
    T = 3072  # rows past 2048 fill all their slots; earlier ones end in padding blocks
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(T, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = w2_indices(T, topk, gen)
    grad = torch.randn(T, H, 512, generator=gen, device="cuda", dtype=torch.bfloat16)
    if fused:
        def no_pass(*a, **k):
            raise AssertionError("the op computed the slot probabilities after the backward")
        monkeypatch.setattr(op, "_slot_probs", no_pass)
    probs = []
    out, lse, dq, dkv, logits = _call(q, kv, idx, grad, probs)
    out0, lse0, dq0, dkv0, _ = _call(q, kv, idx, grad)
    assert len(probs) == 1 and probs[0].shape == (T, 1, topk) and probs[0].dtype == torch.float32
    p = probs[0][:, 0]
    want = ref.slot_probs(q[None].float(), kv[None].float(), idx[None], lse[None], SCALE)[0, :, 0]
    torch.testing.assert_close(p, want, rtol=2e-3, atol=2e-5)
    valid = idx[:, 0] >= 0
    assert torch.all(p[~valid] == 0)
    # each row's probabilities sum to its head count (rows with a key), 0 for empty rows
    torch.testing.assert_close(p.sum(-1), valid.any(-1).float() * H, rtol=2e-3, atol=1e-3)
    torch.testing.assert_close(logits.grad, 2 * p)
    assert torch.equal(out, out0) and torch.equal(lse, lse0) and torch.equal(dq, dq0)
    torch.testing.assert_close(dkv, dkv0, rtol=1e-2, atol=1e-2)
