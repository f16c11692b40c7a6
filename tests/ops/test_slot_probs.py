"""``SlotProbsGrad``: the attention probabilities at each slot, summed over a kv group's heads,
handed to a loss in the op's backward (the reference path; the kernel's is tests/ops/test_gpu_slot_probs.py)."""

import torch

from glm5_dsa_plugin.ops import SlotProbsGrad, sparse_mla
from glm5_dsa_plugin.ops import reference as ref


def _softmax_sums(q, kv, idx, scale):
    """[T, G, K]: per head, softmax over the row's valid slots (repeats count per slot), summed over the group."""
    T, H, D = q.shape
    G, K = kv.shape[1], idx.shape[-1]
    out = torch.zeros(T, G, K, dtype=torch.float64)
    for t in range(T):
        for g in range(G):
            valid = idx[t, g] >= 0
            if not valid.any():
                continue
            keys = kv[idx[t, g, valid].long(), g].double()
            for h in range(g * (H // G), (g + 1) * (H // G)):
                out[t, g, valid] += torch.softmax(keys @ q[t, h].double() * scale, 0)
    return out


def test_slot_probs_reach_the_loss_in_the_backward():
    g = torch.Generator().manual_seed(0)
    T, H, G, K, D, dv = 9, 4, 2, 6, 12, 8
    q = torch.randn(T, H, D, generator=g, requires_grad=True)
    kv = torch.randn(T, G, D, generator=g, requires_grad=True)
    idx = torch.randint(0, T, (T, G, K), generator=g, dtype=torch.int32)
    idx[torch.rand(T, G, K, generator=g) < 0.3] = -1
    idx[2] = -1  # an empty row
    idx[4, 0, :2] = 3  # a repeated key
    logits = torch.zeros(T, K, requires_grad=True)
    seen = []

    def grad_from(p):
        seen.append(p.clone())
        return p.sum(1) * 3.0

    out, lse = sparse_mla(q, kv, idx, 0.3, d_v=dv, backend="reference", slot_probs_grad=SlotProbsGrad(logits, grad_from))
    assert not seen  # nothing in the forward
    out.sum().backward()
    want = _softmax_sums(q.detach(), kv.detach(), idx, 0.3)
    assert len(seen) == 1 and seen[0].shape == (T, G, K)
    torch.testing.assert_close(seen[0].double(), want, rtol=1e-5, atol=1e-7)
    assert torch.all(seen[0][2] == 0) and torch.all(seen[0][idx < 0] == 0)
    torch.testing.assert_close(logits.grad, seen[0].sum(1) * 3.0)
    # the attention's own gradients are those of a call without it
    q2, kv2 = q.detach().clone().requires_grad_(True), kv.detach().clone().requires_grad_(True)
    sparse_mla(q2, kv2, idx, 0.3, d_v=dv, backend="reference")[0].sum().backward()
    torch.testing.assert_close(q.grad, q2.grad)
    torch.testing.assert_close(kv.grad, kv2.grad)


def test_no_backward_no_call():
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(4, 2, 8, generator=g), torch.randn(4, 1, 8, generator=g)
    idx = torch.tensor([[[0, -1]], [[0, 1]], [[1, 2]], [[3, 0]]], dtype=torch.int32)
    logits = torch.zeros(4, 2, requires_grad=True)
    with torch.no_grad():
        sparse_mla(q, kv, idx, 0.5, d_v=4, backend="reference",
                   slot_probs_grad=SlotProbsGrad(logits, lambda p: (_ for _ in ()).throw(AssertionError("called"))))
    # batched input: the probabilities come batched
    seen = []
    sparse_mla(q[None], kv[None], idx[None], 0.5, d_v=4, backend="reference",
               slot_probs_grad=SlotProbsGrad(logits, lambda p: seen.append(p) or p[0, :, 0]))[0].sum().backward()
    assert seen[0].shape == (1, 4, 1, 2)
    torch.testing.assert_close(seen[0][0].double(), _softmax_sums(q, kv, idx, 0.5), rtol=1e-5, atol=1e-7)
