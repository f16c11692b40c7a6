"""The indexer's Triton kernels (selected-slot scores and their gradients, the loss target, the KL
loss rows, the top-k keys) against the PyTorch definitions, run by Triton's interpreter on CPU in a subprocess."""

from triton_interpreter import run_interpreted

SLOT_SCORES = r"""
import torch
from glm5_dsa_plugin.model import indexer, visibility
from glm5_dsa_plugin.ops.indexer.slot_scores import slot_scores_forward, slot_scores_backward

g = torch.Generator().manual_seed(0)
T, Hi, Di, K = 37, 3, 32, 9
vis = visibility.Visibility.from_cu_seqlens(torch.tensor([0, 20, 37]))
q, k, w = torch.randn(T, Hi, Di, generator=g), torch.randn(T, Di, generator=g), torch.randn(T, Hi, generator=g)
idx = indexer.select_topk(q, k, w, K, vis)                  # rows 0..7 of each sequence carry -1 padding
assert (idx < 0).any() and (idx >= 0).any()
got = slot_scores_forward(q, k, w, idx, block_slots=4)
want = indexer.selected_scores_reference(q, k, w, idx)
assert torch.equal(torch.isinf(got), idx < 0), "padding slots must be -inf, valid slots finite"
torch.testing.assert_close(got[idx >= 0], want[idx >= 0], rtol=1e-5, atol=1e-5)

grad = torch.randn(T, K, generator=g)
qr, kr, wr = (t.clone().requires_grad_(True) for t in (q, k, w))
indexer.selected_scores_reference(qr, kr, wr, idx).masked_fill(idx < 0, 0.0).mul(grad).sum().backward()
dq, dk, dw = slot_scores_backward(q, k, w, idx, grad.masked_fill(idx < 0, 1e30), block_slots=4)  # padding grads ignored
for name, a, b in (("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dw", dw, wr.grad)):
    assert b.abs().sum() > 0, name
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)
# keys selected by many rows accumulate every row's contribution
assert (torch.bincount(idx[idx >= 0].long(), minlength=T) > 3).any()
# the fixed-order dk: a workspace of 5 rows (8 blocks), same dq / dw, dk equal to the definition
dq2, dk2, dw2 = slot_scores_backward(q, k, w, idx, grad.masked_fill(idx < 0, 1e30), block_slots=4,
                                     deterministic=True, workspace_bytes=5 * K * Di * 4)
assert torch.equal(dq2, dq) and torch.equal(dw2, dw)
torch.testing.assert_close(dk2, kr.grad, rtol=1e-4, atol=1e-4, msg="deterministic dk")
print("OK")
"""

TARGET = r"""
import torch
from glm5_dsa_plugin.model import indexer, indexer_loss, visibility
from glm5_dsa_plugin.ops.indexer.attention_target import head_prob_sum

g = torch.Generator().manual_seed(1)
T, H, D, K, scale = 29, 5, 40, 7, 0.3
vis = visibility.Visibility.causal(T)
idx = indexer.select_topk(torch.randn(T, 2, 16, generator=g), torch.randn(T, 16, generator=g),
                     torch.randn(T, 2, generator=g), K, vis)
idx[3] = -1                                            # a row with no valid slot
q, kv = torch.randn(T, H, D, generator=g), torch.randn(T, D, generator=g)
valid = idx >= 0
s = torch.einsum("thd,tkd->thk", q, kv[idx.clamp(min=0).long()]) * scale
lse = s.masked_fill(~valid[:, None, :], float("-inf")).logsumexp(-1)
lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, -1.0e30))  # the op's empty-row lse
got = head_prob_sum(q, kv, lse, idx, scale, block_slots=4, block_d=16)
want = indexer_loss.attention_target_reference(q, kv, idx, scale)
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
assert torch.equal(got[3], torch.zeros(K)) and torch.equal(got[~valid], torch.zeros_like(got[~valid]))
torch.testing.assert_close(got.sum(-1)[valid.any(-1)], torch.full((int(valid.any(-1).sum()),), float(H)))
print("OK")
"""

KL_ROWS = r"""
import torch
from glm5_dsa_plugin.ops.indexer.kl_rows import kl_rows

g = torch.Generator().manual_seed(3)
T, K, eps = 11, 13, 1e-10                               # K not a power of two: the row block is masked
logits = torch.randn(T, K, generator=g) * 3
target = torch.rand(T, K, generator=g) * 5
idx = torch.randint(0, 40, (T, K), generator=g, dtype=torch.int32)
idx[2, 5:] = -1
idx[4] = -1                                             # a row without a valid slot: loss 0, grad 0
target[6] = 0.0                                         # a row whose target is all zero: p = 0
logits[2, 5:] = 1e4                                     # padding slots' logits and targets are ignored
target[2, 5:] = 1e4
valid = idx >= 0
# the definition, by autograd
leaf = logits.clone().requires_grad_(True)
p = target.masked_fill(~valid, 0.0)
p = p / p.sum(-1, keepdim=True).clamp_min(eps)
logq = torch.log_softmax(leaf.masked_fill(~valid, float("-inf")), -1).masked_fill(~valid, 0.0)
want = (p * (torch.log(p.clamp_min(eps)) - logq)).masked_fill(~valid, 0.0).sum(-1)
want.sum().backward()
buf = target.clone()
got = kl_rows(logits, buf, idx, eps)
torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
torch.testing.assert_close(buf, leaf.grad, rtol=1e-5, atol=1e-7)  # the gradient, written over the target
assert got[4] == 0 and torch.equal(buf[4], torch.zeros(K)) and torch.equal(buf[6], torch.zeros(K))
assert torch.equal(buf[~valid], torch.zeros_like(buf[~valid]))
assert (got > 0).sum() >= T - 2
print("OK")
"""

KEYS = r"""
import torch
from glm5_dsa_plugin.model import indexer, visibility
from glm5_dsa_plugin.ops.indexer.masked_scores import masked_index_scores

g = torch.Generator().manual_seed(2)
cu = torch.tensor([0, 13, 40])
vis = visibility.Visibility.from_cu_seqlens(cu)
T, Hi, Di, K = 40, 2, 16, 10
# small integers: many exactly tied scores, so the order among ties is tested
q = torch.randint(-1, 2, (T, Hi, Di), generator=g).float()
k = torch.randint(-1, 2, (T, Di), generator=g).float()
w = torch.randint(-1, 2, (T, Hi), generator=g).float()
keys = masked_index_scores(q, k, w, vis.query_seq, vis.query_pos, vis.qidx, vis.key_seq, vis.key_pos,
                           block_t=16, block_s=16, keys=True)
scores = indexer.index_scores(q, k, w).masked_fill(~vis.mask(), float("-inf"))
vals, order = torch.sort(scores, dim=-1, descending=True, stable=True)  # ties: lower key index first
want = torch.where(vals[:, :K] == float("-inf"), -1, order[:, :K]).to(torch.int32)
assert torch.equal(indexer.topk_from_keys(keys, K), want)
print("OK")
"""


def test_selected_slot_scores_and_gradients_match_torch():
    run_interpreted(SLOT_SCORES)


def test_loss_target_from_lse_matches_torch():
    run_interpreted(TARGET)


def test_kl_loss_rows_and_gradient_match_autograd():
    run_interpreted(KL_ROWS)


def test_fused_topk_keys_match_a_stable_sort():
    run_interpreted(KEYS)
