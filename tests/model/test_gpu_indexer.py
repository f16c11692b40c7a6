"""Indexer on the H200: the fused Triton score kernel against the torch path at GLM-5 sizes."""

import functools

import pytest
import torch

from glm5_dsa_plugin.model import indexer, indexer_loss, visibility

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("packed", [False, True])
def test_triton_scores_and_topk_on_gpu(packed):
    from glm5_dsa_plugin.ops.indexer.masked_scores import masked_index_scores

    T, Hi, Di = 4096, 32, 128
    g = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    q = torch.randn(T, Hi, Di, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, Di, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(T, Hi, generator=g, device="cuda", dtype=torch.bfloat16)
    vis = (visibility.Visibility.from_cu_seqlens(torch.tensor([0, 1000, 1001, 3000, 4096]), device="cuda") if packed
           else visibility.Visibility.causal(T, device="cuda"))
    rows = slice(0, 512)
    sub = vis.rows(torch.arange(512, device="cuda"))
    got = masked_index_scores(q[rows], k, w[rows], sub.query_seq, sub.query_pos, sub.qidx, sub.key_seq, sub.key_pos)
    want = indexer.index_scores(q[rows], k, w[rows]).masked_fill(~vis.mask(rows), float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert ((got[fin] - want[fin]).norm() / want[fin].norm()).item() < 1e-5
    idx = indexer.select_topk(q, k, w, 2048, vis)  # Triton path on CUDA; checked by check_topk inside
    assert idx.shape == (T, 2048)
    from glm5_dsa_plugin.ops import indexer as indexer_kernels

    assert indexer_kernels.triton_available()


def test_fused_topk_keys_equal_a_stable_sort_of_the_scores():
    """The fused-key top-k select_topk runs equals a stable sort of the same kernel's fp32 scores."""
    from glm5_dsa_plugin.ops.indexer.masked_scores import masked_index_scores

    T, Hi, Di, K = 4096, 32, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(T, Hi, Di, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(T, Di, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(T, Hi, generator=g, device="cuda").to(torch.bfloat16)
    vis = visibility.Visibility.from_cu_seqlens(torch.tensor([0, 1000, 1001, 3000, 4096]), device="cuda")
    args = (q, k, w, vis.query_seq, vis.query_pos, vis.qidx, vis.key_seq, vis.key_pos)
    vals, order = torch.sort(masked_index_scores(*args), dim=-1, descending=True, stable=True)
    want = torch.where(vals[:, :K] == float("-inf"), -1, order[:, :K]).to(torch.int32)
    assert torch.equal(indexer.select_topk(q, k, w, K, vis, chunk_rows=1000), want)
    assert ((want >= 0).sum(-1) < K).float().mean() > 0.4  # most rows see fewer than K keys: padding tested


def _glm5_indexer_inputs(seed: int):
    """GLM-5's indexer geometry at 4K tokens: q [T, 32, 128], k [T, 128], w [T, 32] bf16, causal
    top-2048 indices, and an fp32 gradient for the scores."""
    T, Hi, Di, K = 4096, 32, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, Hi, Di, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(T, Di, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(T, Hi, generator=g, device="cuda") * Hi ** -0.5).to(torch.bfloat16)
    idx = indexer.select_topk(q, k, w, K, visibility.Visibility.causal(T, device="cuda"))
    return q, k, w, idx, torch.randn(T, K, generator=g, device="cuda")


def _scores_and_grads(fn, q, k, w, idx, grad, dtype):
    qq, kk, ww = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, w))
    s = fn(qq, kk, ww, idx)
    s.masked_fill(idx < 0, 0.0).mul(grad).sum().backward()
    return s.detach(), qq.grad.float(), kk.grad.float(), ww.grad.float()


@pytest.mark.parametrize("deterministic", [False, True])
def test_selected_scores_kernels_match_reference_at_glm5_sizes(deterministic):
    q, k, w, idx, grad = _glm5_indexer_inputs(6)
    kernel = functools.partial(indexer.selected_scores, deterministic=deterministic)
    s1, *g1 = _scores_and_grads(kernel, q, k, w, idx, grad, torch.bfloat16)
    # the reference runs on fp32 copies: its index backward would accumulate dk in k's dtype (bf16)
    s2, *g2 = _scores_and_grads(indexer.selected_scores_reference, q, k, w, idx, grad, torch.float32)
    assert torch.equal(torch.isinf(s1), idx < 0) and torch.equal(torch.isinf(s2), idx < 0)
    v = idx >= 0
    assert ((s1[v] - s2[v]).norm() / s2[v].norm()).item() < 1e-5
    for name, a, b in zip(("dq", "dk", "dw"), g1, g2):
        err = ((a - b).norm() / b.norm()).item()
        assert err < 5e-3, (name, err)  # bf16 dS in the kernel's products: about 2e-3


def test_deterministic_selected_scores_backward_is_bitwise_reproducible():
    """The fixed-order dk: two backward passes agree bit for bit; dq and dw are the atomic path's
    bit for bit (same per-row programs), dk equals the atomic path's to summation order."""
    q, k, w, idx, grad = _glm5_indexer_inputs(9)
    det = functools.partial(indexer.selected_scores, deterministic=True)
    first, second = (_scores_and_grads(det, q, k, w, idx, grad, torch.bfloat16) for _ in range(2))
    for name, a, b in zip(("scores", "dq", "dk", "dw"), first, second):
        assert torch.equal(a, b), name
    atomic = _scores_and_grads(indexer.selected_scores, q, k, w, idx, grad, torch.bfloat16)
    assert torch.equal(first[1], atomic[1]) and torch.equal(first[3], atomic[3])
    # k's grad is returned in bf16 by both: equal up to one rounding of differently ordered fp32 sums
    assert ((first[2] - atomic[2]).norm() / atomic[2].norm()).item() < 4e-3


def test_loss_target_from_lse_matches_reference_at_glm5_sizes():
    from glm5_dsa_plugin.ops import sparse_mla
    from glm5_dsa_plugin.ops.indexer.attention_target import head_prob_sum

    T, H, D, dv, K = 4096, 64, 576, 512, 2048
    g = torch.Generator(device="cuda").manual_seed(7)
    q = (torch.randn(T, H, D, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    kv = (torch.randn(T, 1, D, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    vis = visibility.Visibility.causal(T, device="cuda")
    idx = indexer.select_topk(torch.randn(T, 4, 32, generator=g, device="cuda"), torch.randn(T, 32, generator=g,
                         device="cuda"), torch.randn(T, 4, generator=g, device="cuda"), K, vis)
    scale = 256 ** -0.5
    _, lse = sparse_mla(q, kv, idx[:, None], scale, d_v=dv)
    got = head_prob_sum(q, kv[:, 0], lse, idx.to(torch.int32).contiguous(), scale)  # the target pass after the backward
    want = indexer_loss.attention_target_reference(q, kv[:, 0], idx, scale, chunk_rows=256)
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    rows = (idx >= 0).any(-1)
    torch.testing.assert_close(got.sum(-1)[rows], torch.full_like(got.sum(-1)[rows], float(H)), rtol=1e-3, atol=0)


def test_kl_loss_kernel_matches_the_torch_path_at_glm5_sizes():
    """The one-pass KL kernel on CUDA against the chunked PyTorch path on CPU: value and gradient."""
    from glm5_dsa_plugin.ops import indexer as indexer_kernels

    T, K = 4096, 2048
    g = torch.Generator(device="cuda").manual_seed(11)
    vis = visibility.Visibility.causal(T, device="cuda")
    idx = indexer.select_topk(torch.randn(T, 4, 32, generator=g, device="cuda"), torch.randn(T, 32, generator=g,
                         device="cuda"), torch.randn(T, 4, generator=g, device="cuda"), K, vis)
    assert (idx < 0).any()  # rows 0..2046 carry padding
    logits = (torch.randn(T, K, generator=g, device="cuda") * 4).masked_fill(idx < 0, float("-inf"))
    target = torch.rand(T, K, generator=g, device="cuda") * 64
    got_x = logits.clone().requires_grad_(True)
    got = indexer_loss.indexer_kl_loss_from_target(got_x, target, idx, 1e-3)
    (got * 3.0).backward()
    want_x = logits.cpu().requires_grad_(True)
    want = indexer_loss.indexer_kl_loss_from_target(want_x, target.cpu(), idx.cpu(), 1e-3)
    (want * 3.0).backward()
    assert indexer_kernels.triton_available()
    torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-5, atol=0)
    grad, ref = got_x.grad.cpu(), want_x.grad
    assert ref.abs().sum() > 0 and torch.equal(grad[idx.cpu() < 0], torch.zeros_like(grad[idx.cpu() < 0]))
    assert ((grad - ref).norm() / ref.norm()).item() < 1e-5


def test_fp8_topk_kernel_selects_the_reference_fp8_set_at_glm5_sizes():
    """``select_topk(precision="fp8")`` (the Triton kernel on e4m3 operands widened to bf16) against the
    published FP8 definition in torch (fp8_index.fp8_select_topk) at GLM-5's indexer shape: the same set
    in every row, up to keys whose fp32 score ties the row's last selected score within summation-order
    rounding (1e-5 relative)."""
    from glm5_dsa_plugin.ops.indexer import fp8_index

    T, Hi, Di, K = 4096, 32, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(11)
    q = (torch.randn(T, Hi, Di, generator=g, device="cuda") * 3).to(torch.bfloat16)
    k = (torch.randn(T, Di, generator=g, device="cuda") * 3).to(torch.bfloat16)
    w = torch.randn(T, Hi, generator=g, device="cuda") * Hi**-0.5
    vis = visibility.Visibility.from_cu_seqlens(torch.tensor([0, 1000, 1001, 3000, 4096]), device="cuda")
    got = indexer.select_topk(q, k, w, K, vis, precision="fp8")
    ref = fp8_index.fp8_select_topk(q, k, w, K, vis.mask)
    assert torch.equal(got == -1, ref == -1)
    scores = fp8_index.fp8_index_scores(q, k, w).masked_fill(~vis.mask(), float("-inf"))
    kth = scores.gather(1, ref.long().clamp_min(0)).masked_fill(ref < 0, float("inf")).amin(1, keepdim=True)
    in_got = torch.zeros(T, T + 1, dtype=torch.bool, device="cuda").scatter_(1, got.long() % (T + 1), True)[:, :T]
    in_ref = torch.zeros(T, T + 1, dtype=torch.bool, device="cuda").scatter_(1, ref.long() % (T + 1), True)[:, :T]
    differ = in_got ^ in_ref
    tie = (scores - kth).abs() <= 1e-5 * kth.abs()
    assert not (differ & ~tie).any(), f"{int((differ & ~tie).sum())} members differ beyond a tie"
    agreement = 1 - differ.sum().item() / (2 * in_ref.sum().item())
    print(f"fp8 top-k member agreement with the reference: {agreement:.6f}")
    assert agreement > 0.9999


@pytest.mark.parametrize("packed", [False, True])
def test_radix_select_blocks_equal_a_stable_sort_of_the_scores(packed):
    """Blocks whose key prefix reaches RADIX_MIN_KEYS take the radix-select kernel; their rows equal
    a stable sort of the same kernel's fp32 scores, and the kernel did not fall back."""
    from glm5_dsa_plugin.ops import indexer as indexer_kernels
    from glm5_dsa_plugin.ops.indexer.masked_scores import masked_index_scores

    block, K = 1024, 2048
    T, Hi, Di = 8 * block, 32, 128
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(T, Hi, Di, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(T, Di, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(T, Hi, generator=g, device="cuda").to(torch.bfloat16)
    cu = torch.tensor([0, 3000, 3001, 6000, T]) if packed else torch.tensor([0, T])
    vis = visibility.Visibility.from_cu_seqlens(cu, device="cuda")
    idx = indexer.select_topk(q, k, w, K, vis, chunk_rows=block)
    assert indexer_kernels.triton_available(), indexer_kernels.status()
    radix_blocks = 0
    for t0 in range(0, T, block):
        m = t0 + block
        if m < indexer.RADIX_MIN_KEYS or m <= K:  # the blocks whose key prefix takes the radix select
            continue
        radix_blocks += 1
        sub = vis.rows(torch.arange(t0, m, device="cuda"))
        scores = masked_index_scores(q[t0:m], k[:m], w[t0:m], sub.query_seq, sub.query_pos, sub.qidx,
                                     sub.key_seq[:m], sub.key_pos[:m])
        vals, order = torch.sort(scores, dim=-1, descending=True, stable=True)
        want = torch.where(vals[:, :K] == float("-inf"), -1, order[:, :K]).to(torch.int32)
        assert torch.equal(idx[t0:m], want), t0
    assert radix_blocks >= 4
    # the attention's key order at long T: the same entries, written by key by the radix select
    keyed = indexer.select_topk(q, k, w, K, vis, chunk_rows=block, key_order=True)
    assert torch.equal(keyed, indexer.slots_in_key_order(idx))


def test_radix_topk_equals_deterministic_topk_on_wide_tied_rows():
    """64K-wide rows of a few distinct values (thousands of ties at the k-th), -inf tails and -0.0."""
    from glm5_dsa_plugin.ops.indexer.radix_topk import radix_topk

    g = torch.Generator(device="cuda").manual_seed(3)
    n, K = 65536, 2048
    scores = torch.randint(-3, 40, (64, n), generator=g, device="cuda").float() / 4
    scores[::3, n // 2:] = float("-inf")
    scores[1] = -0.0
    scores[2, : n - 100] = float("-inf")  # fewer visible keys than K
    want = indexer.deterministic_topk(scores, K)
    for stride in (8, 1):  # the sampled threshold and the full passes; key order as written
        assert torch.equal(radix_topk(scores, K, sample_stride=stride), want)
        assert torch.equal(radix_topk(scores, K, ordered=False, sample_stride=stride), indexer.slots_in_key_order(want))
