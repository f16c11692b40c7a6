"""Lightning indexer: parity with HF transformers' GlmMoeDsaIndexer, THD, CP split, sharing, loss, bounds."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm5_dsa_plugin.model import index_sharing, indexer, indexer_loss, rope, visibility
from megatron_cpu import megatron_single_process  # noqa: F401


def brute_topk(scores, topk):
    """Stable full sort: score desc, ties by ascending index, -inf -> -1."""
    vals, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    order = order[:, :topk].to(torch.int32)
    order[vals[:, :topk] == float("-inf")] = -1
    if topk > scores.shape[1]:
        order = torch.nn.functional.pad(order, (0, topk - scores.shape[1]), value=-1)
    return order


@settings(max_examples=80, deadline=None)
@given(T=st.integers(1, 40), topk=st.integers(1, 50), levels=st.sampled_from([1, 2, 3, 1000]),
       scale=st.sampled_from([1e-30, 1.0, 1e30]), seed=st.integers(0, 2**31 - 1))
def test_topk_bounds_ties_and_order(T, topk, levels, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (T, T), generator=gen).float() * scale  # many exact ties
    vis = visibility.Visibility.causal(T)
    scores = scores.masked_fill(~vis.mask(), float("-inf"))
    got = indexer.deterministic_topk(scores, topk)
    assert got.shape == (T, topk) and got.dtype == torch.int32
    assert torch.equal(got, brute_topk(scores, topk))
    indexer.check_topk(got, vis)
    n_valid = (got >= 0).sum(-1)
    assert torch.equal(n_valid, torch.clamp(torch.arange(T) + 1, max=topk))
    # valid slots first
    first_pad = torch.where(got < 0, torch.arange(topk), topk).amin(-1)
    assert torch.equal(first_pad, n_valid)


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 30), topk=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_key_topk_on_signed_scores_and_signed_zeros(T, topk, seed):
    """Negative scores, +0.0 and -0.0 (equal as floats, so tied by index) through the packed keys."""
    gen = torch.Generator().manual_seed(seed)
    vals = torch.tensor([-3.0, -1e-30, -0.0, 0.0, 1e-30, 2.5, float("inf")])
    scores = vals[torch.randint(0, len(vals), (T, T), generator=gen)]
    scores = scores.masked_fill(~visibility.Visibility.causal(T).mask(), float("-inf"))
    assert torch.equal(indexer.deterministic_topk(scores, topk), brute_topk(scores, topk))


def test_check_topk_rejects_bad_indices():
    vis = visibility.Visibility.causal(4)
    with pytest.raises(RuntimeError, match="index 4"):
        indexer.check_topk(torch.tensor([[0, -1], [0, 1], [2, 1], [3, 4]], dtype=torch.int32), vis)
    with pytest.raises(RuntimeError, match="invisible to row 1"):
        indexer.check_topk(torch.tensor([[0, -1], [2, 1], [2, 1], [3, 0]], dtype=torch.int32), vis)
    with pytest.raises(RuntimeError, match="twice in row 2"):
        indexer.check_topk(torch.tensor([[0, -1], [0, 1], [1, 1], [3, 0]], dtype=torch.int32), vis)



def test_slots_in_key_order_keeps_every_value_and_puts_padding_last():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randperm(1000, generator=g)[:12].to(torch.int32) for _ in range(5)]
    idx = torch.stack(rows)
    idx[1, 5:] = -1  # padding in the middle of the row (the top-k puts it last; replay may not)
    idx[1, 2] = -1
    idx[3, 7] = -5  # a bad value: kept for index validation to refuse, not turned into padding
    idx[4, 0] = torch.iinfo(torch.int32).max
    out = indexer.slots_in_key_order(idx)
    assert out.dtype == torch.int32 and out.shape == idx.shape
    for r in range(idx.shape[0]):
        assert sorted(out[r].tolist()) == sorted(idx[r].tolist())  # the same multiset
        u = (out[r].to(torch.int64) & 0xFFFFFFFF).tolist()  # ascending as unsigned: -1 last
        assert u == sorted(u)
    assert out[1, 4:].eq(-1).all() and out[1, :4].ge(0).all()
    assert out[3, -1] == -5 and out[4, -1] == torch.iinfo(torch.int32).max
    assert torch.equal(indexer.slots_in_key_order(out), out)

# --------------------------------------------------------------------------- HF parity
def _hf_config(**kw):
    from transformers import GlmMoeDsaConfig

    base = dict(hidden_size=64, q_lora_rank=32, index_n_heads=4, index_head_dim=32, qk_rope_head_dim=16,
                index_topk=8, num_hidden_layers=2, num_attention_heads=4, rope_parameters={"rope_theta": 10000.0,
                                                                                          "rope_type": "default"})
    base.update(kw)
    return GlmMoeDsaConfig(**base)


def _ours_from_hf(idxr, x, qr, positions, theta, interleaved=True):
    """Our functional indexer driven by the HF module's weights."""
    Hi, Di, r = idxr.n_heads, idxr.head_dim, idxr.qk_rope_head_dim
    T = x.shape[0]
    cos, sin = rope.rope_cos_sin(positions, r, theta)
    q = rope.apply_rope_first((qr @ idxr.wq_b.weight.T).view(T, Hi, Di), cos, sin, interleaved)
    k = torch.nn.functional.layer_norm(x @ idxr.wk.weight.T, (Di,), idxr.k_norm.weight, idxr.k_norm.bias, 1e-6)
    k = rope.apply_rope_first(k[:, None, :], cos, sin, interleaved)[:, 0]
    w = (x @ idxr.weights_proj.weight.T) * Hi**-0.5
    return q, k, w


@pytest.mark.slow
def test_matches_hf_indexer_scores_and_selection(monkeypatch):
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer, GlmMoeDsaRotaryEmbedding

    torch.manual_seed(0)
    cfg = _hf_config()
    idxr = GlmMoeDsaIndexer(cfg, 0).float()
    for p in idxr.parameters():
        torch.nn.init.normal_(p, std=0.3)
    T = 24
    x, qr = torch.randn(1, T, 64), torch.randn(1, T, 32)
    pos = torch.arange(T)[None]
    hf_rope = GlmMoeDsaRotaryEmbedding(cfg)
    cos_sin = hf_rope(x, pos)
    captured = {}
    real_topk = torch.Tensor.topk

    def spy(self, *a, **k):
        captured["scores"] = self.detach().clone()
        return real_topk(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "topk", spy)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]  # [B, S, T], True = visible
    hf_idx = idxr(x, qr, cos_sin, causal, pos)[0]
    monkeypatch.setattr(torch.Tensor, "topk", real_topk)
    hf_scores = captured["scores"][0]  # [T, T] with -inf above the diagonal

    q, k, w = _ours_from_hf(idxr, x[0], qr[0], pos[0], cfg.rope_parameters["rope_theta"])
    vis = visibility.Visibility.causal(T)
    ours = indexer.index_scores(q, k, w).masked_fill(~vis.mask(), float("-inf"))
    finite = torch.isfinite(hf_scores)
    assert torch.equal(finite, torch.isfinite(ours))
    torch.testing.assert_close(ours[finite], hf_scores[finite], rtol=1e-5, atol=1e-5)

    our_idx = indexer.select_topk(q, k, w, cfg.index_topk, vis)
    for t in range(T):
        mine = our_idx[t][our_idx[t] >= 0].long()
        theirs = hf_idx[t].long()
        theirs = theirs[theirs <= t]  # HF pads short rows with masked (future) keys
        assert len(mine) == len(theirs) == min(t + 1, cfg.index_topk)
        torch.testing.assert_close(torch.sort(ours[t, mine]).values, torch.sort(hf_scores[t, theirs]).values,
                                   rtol=1e-5, atol=1e-5)
    # the half-split convention gives other scores: the comparison above sees the RoPE convention
    q2, k2, w2 = _ours_from_hf(idxr, x[0], qr[0], pos[0], cfg.rope_parameters["rope_theta"], interleaved=False)
    half = indexer.index_scores(q2, k2, w2).masked_fill(~vis.mask(), float("-inf"))
    assert (half[finite] - hf_scores[finite]).abs().max() > 1e-2


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_conventions_equal_megatron_core(interleaved, megatron_single_process):
    """apply_rope_first == megatron-core's RoPE with mla_rotary_interleaved (what its DSAIndexer applies
    for dsa_indexer_rope_interleaved), RoPE channels first and the rest passed through."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    torch.manual_seed(5)
    T, H, D, r, theta = 12, 3, 24, 8, 5000.0
    x = torch.randn(T, H, D, dtype=torch.float64)
    freqs = RotaryEmbedding(r, rotary_percent=1.0, rotary_base=theta, use_cpu_initialization=True)(T)  # [T, 1, 1, r]
    rot = _apply_rotary_pos_emb_bshd(x[:, None, :, :r], freqs.double(), mla_rotary_interleaved=interleaved)[:, 0]
    cos, sin = rope.rope_cos_sin(torch.arange(T), r, theta, dtype=torch.float64)
    ours = rope.apply_rope_first(x, cos, sin, interleaved)
    torch.testing.assert_close(ours[..., :r], rot, rtol=1e-6, atol=1e-6)
    assert torch.equal(ours[..., r:], x[..., r:])
    # interleaved pairs (2j, 2j+1) rotate as complex numbers by angle t * theta ** (-2j / r) (cos/sin are fp32)
    if interleaved:
        z = torch.view_as_complex(x[..., :r].reshape(T, H, r // 2, 2).contiguous())
        ang = torch.arange(T, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
        zr = z * torch.polar(torch.ones_like(ang), ang)[:, None, :]
        torch.testing.assert_close(torch.cat([zr.real, zr.imag], dim=-1), ours[..., :r], rtol=1e-6, atol=1e-6)


def test_thd_three_sequences_never_cross():
    torch.manual_seed(1)
    cu = torch.tensor([0, 5, 17, 30])
    T, Hi, Di = 30, 3, 16
    q, k, w = torch.randn(T, Hi, Di), torch.randn(T, Di), torch.randn(T, Hi)
    vis = visibility.Visibility.from_cu_seqlens(cu)
    idx = indexer.select_topk(q, k, w, 8, vis)
    for s in range(3):
        a, b = int(cu[s]), int(cu[s + 1])
        sub = indexer.select_topk(q[a:b], k[a:b], w[a:b], 8, visibility.Visibility.causal(b - a))
        expect = torch.where(sub >= 0, sub + a, sub)
        assert torch.equal(idx[a:b], expect)
    assert int((idx[:5] >= 0).sum(-1).max()) == 5  # short sequence padded with -1


def test_select_topk_in_key_order_holds_the_same_entries_sorted_by_key():
    """``key_order=True``: each row's entries of the score-ordered top-k, valid keys ascending, -1
    last; over several row blocks, three packed sequences and rows with fewer visible keys than k."""
    torch.manual_seed(4)
    cu = torch.tensor([0, 3, 17, 30])
    T, Hi, Di, K = 30, 3, 16, 8
    q, k, w = torch.randn(T, Hi, Di), torch.randn(T, Di), torch.randn(T, Hi)
    vis = visibility.Visibility.from_cu_seqlens(cu)
    ranked = indexer.select_topk(q, k, w, K, vis)
    for chunk in (None, 7):
        got = indexer.select_topk(q, k, w, K, vis, chunk_rows=chunk, key_order=True)
        want = torch.sort(torch.where(ranked >= 0, ranked, T), dim=-1).values  # -1 as T: last
        assert torch.equal(got, torch.where(want == T, -1, want).to(torch.int32)), chunk
        assert not torch.equal(got, ranked)  # the orders differ here
    assert (got[:3] == -1).sum(-1).tolist() == [7, 6, 5]


def test_context_parallel_split_agrees_with_full():
    """megatron-core allgather CP layout, cp=2: rank r holds chunks r and 2*cp-1-r of each
    sequence; its queries against the all-gathered keys (natural order) give the same indices."""
    torch.manual_seed(2)
    cu = torch.tensor([0, 16, 40])
    T, Hi, Di, cp = 40, 2, 16, 2
    q, k, w = torch.randn(T, Hi, Di), torch.randn(T, Di), torch.randn(T, Hi)
    vis = visibility.Visibility.from_cu_seqlens(cu)
    full = indexer.select_topk(q, k, w, 6, vis)
    for rank in range(cp):
        rows = []
        for s in range(2):
            a, b = int(cu[s]), int(cu[s + 1])
            chunk = (b - a) // (2 * cp)
            for c in (rank, 2 * cp - 1 - rank):
                rows.append(torch.arange(a + c * chunk, a + (c + 1) * chunk))
        rows = torch.cat(rows)
        local = indexer.select_topk(q[rows], k, w[rows], 6, vis.rows(rows))
        assert torch.equal(local, full[rows])


def test_index_sharing_pattern_matches_hf_and_guards_stage_starts():
    cfg = _hf_config(num_hidden_layers=12, index_topk_freq=4, index_skip_topk_offset=3)
    ours = ["full" if index_sharing.computes_indices(i + 1, 4, 3) else "shared" for i in range(12)]
    assert ours == cfg.indexer_types
    assert [index_sharing.index_source_layer(L, 4, 3) for L in range(1, 13)] == [1, 2, 3, 3, 3, 3, 7, 7, 7, 7, 11, 11]
    index_sharing.check_stage_layers(7, 12, 4, 3)
    with pytest.raises(ValueError, match="starting at layer 5 would reuse the DSA indices of layer 3"):
        index_sharing.check_stage_layers(5, 8, 4, 3)


@pytest.mark.parametrize("K", [6, 64])
def test_indexer_loss_equals_megatron_core(K):
    """K = 64 over 20 keys: the references skip the slot columns that are padding in every row."""
    from megatron.core.transformer.experimental_attention_variant.dsa import compute_dsa_indexer_loss

    torch.manual_seed(3)
    T, H, D = 20, 4, 24
    q, kv = torch.randn(T, H, D), torch.randn(T, D)
    iq, ik, iw = torch.randn(T, 2, 8), torch.randn(T, 8), torch.randn(T, 2)
    vis = visibility.Visibility.causal(T)
    idx = indexer.select_topk(iq, ik, iw, K, vis)
    dense = indexer.index_scores(iq, ik, iw).masked_fill(~vis.mask(), float("-inf"))
    logits = dense.gather(-1, idx.clamp(min=0).long()).masked_fill(idx < 0, float("-inf"))
    torch.testing.assert_close(indexer.selected_scores_reference(iq, ik, iw, idx), logits)
    ours = indexer_loss.indexer_kl_loss(logits, q, kv, idx, 0.2, 0.001)
    pg = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    theirs = compute_dsa_indexer_loss(dense[None].clone(), idx[None].long(), q[:, None], kv[:, None, None].expand(T, 1, H, D),
                                      0.2, 0.001, True, pg)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-9)
    # gradient flows to the indexer side only, and equals megatron-core's at the selected slots
    logits.requires_grad_(True)
    indexer_loss.indexer_kl_loss(logits, q, kv, idx, 0.2, 0.001).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    dense_leaf = dense[None].clone().requires_grad_(True)
    compute_dsa_indexer_loss(dense_leaf * 1.0, idx[None].long(), q[:, None], kv[:, None, None].expand(T, 1, H, D),
                             0.2, 0.001, True, pg).backward()
    want = dense_leaf.grad[0].gather(-1, idx.clamp(min=0).long()).masked_fill(idx < 0, 0.0)
    torch.testing.assert_close(logits.grad.masked_fill(idx < 0, 0.0), want, rtol=1e-5, atol=1e-10)


def test_indexer_kl_gradient_in_row_blocks_scaled_by_the_upstream_gradient():
    """The loss keeps only its [T, K] gradient, written block by block in the forward: row blocks
    smaller than T give the unblocked value and gradient, the upstream gradient scales it, and a
    second backward through the same graph is refused (the kept gradient was scaled in place)."""
    torch.manual_seed(4)
    T, K = 23, 7
    logits = torch.randn(T, K)
    idx = torch.randint(0, 50, (T, K))
    idx[3, 4:] = -1
    idx[5] = -1  # a row without a valid slot counts with KL 0
    target = torch.rand(T, K)
    valid = idx >= 0
    # plain autograd on the definition
    leaf = logits.clone().requires_grad_(True)
    p = target.masked_fill(~valid, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-10)
    logq = torch.log_softmax(leaf.masked_fill(~valid, float("-inf")), -1).masked_fill(~valid, 0.0)
    want = (p * (torch.log(p.clamp_min(1e-10)) - logq)).masked_fill(~valid, 0.0).sum() / T * 0.3
    (want * 2.5).backward()
    for rows in (3, 4096):
        x = logits.clone().requires_grad_(True)
        got = indexer_loss.indexer_kl_loss_from_target(x, target.clone(), idx, 0.3, chunk_rows=rows)
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-8)
        (got * 2.5).backward(retain_graph=True)
        torch.testing.assert_close(x.grad, leaf.grad, rtol=1e-5, atol=1e-8)
        with pytest.raises(RuntimeError, match="second backward"):
            got.backward()
    with torch.no_grad():  # no gradient asked: nothing kept, same value
        torch.testing.assert_close(indexer_loss.indexer_kl_loss_from_target(logits, target, idx, 0.3, chunk_rows=5), want.detach(),
                                   rtol=1e-6, atol=1e-8)


def test_indexer_kl_keeps_one_tk_tensor_for_backward():
    """What the loss keeps for its backward: its [T, K] fp32 gradient, nothing else (the planner's
    ``indexer_loss_grad``); not the logits, the target and the mask."""
    T, K = 16, 5
    logits = torch.randn(T, K, requires_grad=True)
    idx = torch.randint(0, 30, (T, K))
    kept = []

    def pack(t):
        kept.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = indexer_loss.indexer_kl_loss_from_target(logits, torch.rand(T, K), idx, 0.1)
    assert [(tuple(t.shape), t.dtype) for t in kept] == [((T, K), torch.float32)]
    loss.backward()
