"""Sparse MLA over key-ordered slots: the attention is unchanged, and with index sharing the reusing
layers read their source's key-ordered top-k instead of sorting it again.

The tiny card with GLM-5.2's sharing pattern (layers 2 and 4 reuse 1 and 3), fp32 on CPU, the
reference backend; ``KEY_ORDER_MIN_KEYS`` lowered so that these short sequences take the path."""

import torch

from glm5_dsa_plugin.model import attention as attn_mod
from glm5_dsa_plugin.model import indexer
from tests.megatron_cpu import megatron_single_process  # noqa: F401  (fixture)
from tests.tiny_models import build, tiny_config

S = 16
SHARING = dict(dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1)
REAL_MLA, REAL_SORT = attn_mod.sparse_mla, indexer.slots_in_key_order


def _loss_and_calls(monkeypatch, min_keys):
    monkeypatch.setattr(indexer, "KEY_ORDER_MIN_KEYS", min_keys)
    calls, sorts = [], []

    def mla(q, kv, idx, *a, **k):
        calls.append(idx[:, 0].clone())
        return REAL_MLA(q, kv, idx, *a, **k)

    def sort(idx):
        sorts.append(idx.shape)
        return REAL_SORT(idx)

    monkeypatch.setattr(attn_mod, "sparse_mla", mla)
    monkeypatch.setattr(indexer, "slots_in_key_order", sort)
    torch.manual_seed(0)
    card, cfg = tiny_config(mtp_num_layers=None, **SHARING)
    model = build(cfg, card, mtp=False).eval()
    toks = torch.randint(0, card["vocab_size"], (1, S), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(toks, torch.arange(S)[None], None, labels=toks).float().mean()
    return loss, calls, len(sorts)


def test_reusing_layers_read_the_key_ordered_topk_and_the_loss_is_unchanged(megatron_single_process, monkeypatch):
    loss_topk, calls_topk, sorts_topk = _loss_and_calls(monkeypatch, 1 << 30)  # top-k order
    loss_key, calls_key, sorts_key = _loss_and_calls(monkeypatch, 1)
    assert len(calls_key) == len(calls_topk) == 4 and sorts_topk == 0
    assert sorts_key == 2  # the two computing layers sort; the two reusing ones do not
    for got, src in zip(calls_key, calls_topk):
        assert torch.equal(got, indexer.slots_in_key_order(src))  # each layer's top-k, key-ordered
    assert not all(torch.equal(a, b) for a, b in zip(calls_key, calls_topk))  # the orders differ here
    assert torch.equal(calls_key[1], calls_key[0]) and torch.equal(calls_key[3], calls_key[2])
    torch.testing.assert_close(loss_key, loss_topk, rtol=1e-5, atol=1e-6)


def test_the_indexer_loss_reads_the_key_ordered_topk_with_the_same_value_and_gradients(megatron_single_process,
                                                                                        monkeypatch):
    """Training: the loss's kernels get the attention's key-ordered slots (one copy kept), and the
    loss and every gradient match the top-k order's."""
    real = indexer.selected_scores

    def run(min_keys):
        monkeypatch.setattr(indexer, "KEY_ORDER_MIN_KEYS", min_keys)
        seen = []

        def scores(q, k, w, idx, **kw):
            seen.append(idx.clone())
            return real(q, k, w, idx, **kw)

        monkeypatch.setattr(indexer, "selected_scores", scores)
        torch.manual_seed(0)
        card, cfg = tiny_config(mtp_num_layers=None, dsa_indexer_loss_coeff=1.0, **SHARING)
        model = build(cfg, card, mtp=False).train()
        toks = torch.randint(0, card["vocab_size"], (1, S), generator=torch.Generator().manual_seed(0))
        model(toks, torch.arange(S)[None], None, labels=toks).float().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        losses = [m.last_indexer_loss for m in model.modules() if getattr(m, "last_indexer_loss", None) is not None]
        return seen, grads, losses

    seen_topk, grads_topk, losses_topk = run(1 << 30)
    seen_key, grads_key, losses_key = run(1)
    assert len(seen_key) == len(seen_topk) == 2 and len(losses_key) == 2  # the two computing layers
    for got, src in zip(seen_key, seen_topk):
        assert not torch.equal(got, src)  # the orders differ here
        assert torch.equal(got, indexer.slots_in_key_order(src))
    for a, b in zip(losses_key, losses_topk):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert grads_key.keys() == grads_topk.keys() and any("indexer" in n for n in grads_key)
    for n in grads_key:
        torch.testing.assert_close(grads_key[n], grads_topk[n], rtol=1e-4, atol=1e-6, msg=n)
