"""The indexer KL loss trains the indexer only (megatron-core detaches the indexer's inputs x and qr)."""

import torch

from glm5_dsa_plugin.model.attention import GLM5DSAttention
from megatron_cpu import megatron_single_process  # noqa: F401


def test_indexer_loss_gives_no_gradient_outside_the_indexer(megatron_single_process, monkeypatch):
    from tiny_models import build, tiny_config

    monkeypatch.setattr(GLM5DSAttention, "backend", "reference")
    card, cfg = tiny_config(mtp_num_layers=None, dsa_indexer_loss_coeff=10.0)
    model = build(cfg, card, mtp=False)
    model.train()
    B, S = 2, 24
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, card["vocab_size"], (B, S), generator=g)
    labels = torch.randint(0, card["vocab_size"], (B, S), generator=g)
    loss = model(tok, torch.arange(S)[None].expand(B, S), None, labels=labels)
    (loss.sum() * 0.0).backward()  # main loss zero: only the indexer losses send gradient
    trunk, indexer = {}, {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        (indexer if ".core_attention.indexer." in n else trunk)[n] = g
    assert len(indexer) == 4 * 5 and trunk  # 4 layers x (wq_b, wk, k_norm weight / bias, weights_proj)
    leaks = {n: float(g.abs().max()) for n, g in trunk.items() if bool((g != 0).any())}
    assert not leaks, f"the indexer loss trains the trunk: {leaks}"
    for n, g in indexer.items():
        assert torch.isfinite(g).all() and bool((g != 0).any()), n
