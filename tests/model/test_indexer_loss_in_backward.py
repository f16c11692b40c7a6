"""The indexer KL loss formed in the attention's backward (``ops.SlotProbsGrad``) against the same
loss formed in the forward from the PyTorch target (softmax over the slots, summed over heads):
the indexer's gradients, the logged value, and megatron-core's loss-scale on that gradient."""

import pytest
import torch

from glm5_dsa_plugin.model import indexer, indexer_loss, visibility
from megatron_cpu import megatron_single_process  # noqa: F401
from tiny_models import core_attention

S, B = 20, 2


def _inputs(card):
    H, dq, v, lora = card["num_attention_heads"], card["kv_lora_rank"] + card["qk_rope_head_dim"], \
        card["v_head_dim"], card["kv_lora_rank"]
    g = torch.Generator().manual_seed(0)
    return dict(query=torch.randn(S, B, H, dq, generator=g), key=torch.randn(S, B, 1, dq, generator=g),
                x=torch.randn(S, B, card["hidden_size"], generator=g), qr=torch.randn(S, B, card["q_lora_rank"], generator=g),
                up_v=torch.randn(H, v, lora, generator=g) * 0.1, grad=torch.randn(S, B, H * v, generator=g))


def _forward_formed(att, d, coeff):
    """The loss from the forward's view: logits at the module's own top-k, target by the PyTorch
    definition (no lse, no attention backward), autograd through indexer_kl_loss."""
    vis = visibility.Visibility.uniform(B, S)
    xs, qrs = (t.transpose(0, 1).reshape(B * S, -1) for t in (d["x"], d["qr"]))
    qi, ki, wi = att.indexer.qkw(xs, qrs, vis.query_pos)
    idx = att.indexer.select_topk(qi.detach(), ki.detach(), wi.detach(), vis,
                                  key_order=indexer.reads_key_order(B * S))
    logits = indexer.selected_scores(qi, ki, wi, idx)
    q = d["query"].transpose(0, 1).reshape(B * S, *d["query"].shape[2:])
    kv = d["key"].transpose(0, 1).reshape(B * S, -1)
    target = indexer_loss.attention_target_reference(q, kv, idx, att.softmax_scale)
    return indexer_loss.indexer_kl_loss_from_target(logits, target, idx, coeff)


@pytest.mark.parametrize("scale", [None, 0.25])
def test_backward_formed_loss_equals_the_forward_formed_one(megatron_single_process, monkeypatch, scale):
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

    from glm5_dsa_plugin.checkpoints import cards

    card = cards.load_card("tiny")
    coeff = 0.5
    cfg = cards.card_to_transformer_config(card, mtp_num_layers=None, dsa_indexer_loss_coeff=coeff)
    monkeypatch.setattr(DSAIndexerLossAutoScaler, "main_loss_backward_scale",
                        None if scale is None else torch.tensor(scale))
    att = core_attention(cfg).train()
    d = _inputs(card)
    q = d["query"].clone().requires_grad_(True)
    out = att(q, d["key"], None, None, d["x"], d["qr"], up_v_weight=d["up_v"])
    assert getattr(att, "last_indexer_loss", None) is None  # formed in the backward, not before
    out.backward(d["grad"])
    got = {n: p.grad.clone() for n, p in att.indexer.named_parameters()}
    assert got and all(bool((g != 0).any()) for g in got.values())
    att.zero_grad(set_to_none=True)
    want_loss = _forward_formed(att, d, coeff)
    (want_loss * (1.0 if scale is None else scale)).backward()
    torch.testing.assert_close(att.last_indexer_loss, want_loss.detach(), rtol=1e-5, atol=1e-7)
    for n, p in att.indexer.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)
