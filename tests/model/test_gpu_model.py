"""GLM-5-shaped model through our spec on the H200: TileLang backend vs the reference backend (bf16)."""

import pytest
import torch

from glm5_dsa_plugin.checkpoints import cards
from megatron_cpu import megatron_single_process  # noqa: F401

pytestmark = pytest.mark.gpu

# Discrete choices (indexer top-k, MoE top-k routing) turn bf16 rounding differences between two
# correct backends into different selections, and then into O(1) gradient differences in the
# parameters behind them. Here the indexer's top-k (256) covers every visible key of the
# 256-token rows (so row t still has t+1 valid slots and 2048-style -1 padding after them) and
# every token is routed to all experts: the two models differ only by the attention kernels.
# Sparse selection itself is proven against the reference in test_gpu_sparse_mla.py.
SEQ = 256
SMALL = dict(hidden_size=256, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=128, kv_lora_rank=512,
             qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, index_n_heads=4, index_head_dim=64,
             index_topk=SEQ, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=4,
             num_experts_per_tok=4, num_hidden_layers=4, first_k_dense_replace=2, vocab_size=512)


def test_tilelang_model_matches_reference_model(megatron_single_process):
    from megatron.core.models.gpt import GPTModel

    from glm5_dsa_plugin.megatron import spec
    from glm5_dsa_plugin.model.attention import GLM5DSAttention

    card = cards.with_overrides(cards.load_card("tiny"), **SMALL)
    cfg = cards.card_to_transformer_config(card, moe_token_dispatcher_type="allgather", mtp_num_layers=None,
                                           params_dtype=torch.bfloat16, bf16=True)
    models = {}
    for backend in ("tilelang", "reference"):
        torch.manual_seed(0)
        m = GPTModel(config=cfg, transformer_layer_spec=spec.get_glm5_dsa_spec(None, cfg), vocab_size=512,
                     max_sequence_length=512, position_embedding_type="none").cuda().bfloat16()
        for mod in m.modules():
            if isinstance(mod, GLM5DSAttention):
                mod.backend = backend
        models[backend] = m
    tok = torch.randint(0, 512, (2, SEQ), device="cuda")
    pos = torch.arange(SEQ, device="cuda")[None].expand(2, SEQ)
    labels = torch.randint(0, 512, (2, SEQ), device="cuda")
    out = {}
    for backend, m in models.items():
        m.train()
        loss = m(tok, pos, None, labels=labels)
        loss.float().mean().backward()
        out[backend] = (loss.detach().float(), {n: p.grad.float() for n, p in m.named_parameters()})
    (l_t, g_t), (l_r, g_r) = out["tilelang"], out["reference"]
    assert torch.isfinite(l_t).all()
    assert ((l_t - l_r).norm() / l_r.norm()).item() < 1e-2
    errs = sorted((((g_t[n] - g_r[n]).norm() / g_r[n].norm()).item(), n) for n in g_r if g_r[n].norm() > 0)
    assert errs[-1][0] < 5e-2, f"largest per-parameter gradient errors: {errs[-5:]}"


@pytest.mark.parametrize("seq", [4096, 16384])
def test_glm5_indexer_geometry_trains_at_length(megatron_single_process, seq):
    """GLM-5's indexer (32 x 128, top-k 2048 < seq) in a 4-layer model at training lengths: every
    layer's selected indices are valid and visible, the indexer loss is on, and a few AdamW steps
    keep loss and gradients finite while the LM loss falls."""
    from megatron.core.models.gpt import GPTModel

    from glm5_dsa_plugin.model import indexer
    from glm5_dsa_plugin.megatron import spec
    from glm5_dsa_plugin.model.attention import GLM5DSAttention

    dims = dict(SMALL, index_n_heads=32, index_head_dim=128, index_topk=2048, num_experts_per_tok=2)
    card = cards.with_overrides(cards.load_card("tiny"), **dims)
    cfg = cards.card_to_transformer_config(card, moe_token_dispatcher_type="allgather", mtp_num_layers=None,
                                           params_dtype=torch.bfloat16, bf16=True)
    torch.manual_seed(0)
    m = GPTModel(config=cfg, transformer_layer_spec=spec.get_glm5_dsa_spec(None, cfg), vocab_size=512,
                 max_sequence_length=seq, position_embedding_type="none").cuda().bfloat16()
    seen = []
    real_select = indexer.select_topk

    def checked_select(*a, **kw):
        out = real_select(*a, **kw)
        indexer.check_topk(out, a[4])
        seen.append(float((out >= 0).all(-1).float().mean()))  # rows that see more keys than top-k
        return out

    indexer.select_topk = checked_select
    try:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        tok = torch.randint(0, 512, (1, seq), device="cuda")
        tok[:, seq // 2:] = tok[:, : seq - seq // 2]  # a repeat the model can learn
        pos = torch.arange(seq, device="cuda")[None]
        labels = torch.roll(tok, -1, dims=1)
        losses = []
        for _ in range(4):
            opt.zero_grad()
            loss = m(tok, pos, None, labels=labels).float().mean()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            assert torch.isfinite(loss) and torch.isfinite(norm)
            opt.step()
            losses.append(loss.item())
    finally:
        indexer.select_topk = real_select
    assert seen and min(seen) > 0.4  # most rows choose 2048 of more visible keys
    ind = [mod.last_indexer_loss for mod in m.modules() if isinstance(mod, GLM5DSAttention)
           and getattr(mod, "last_indexer_loss", None) is not None]
    assert ind and all(torch.isfinite(v) for v in ind)
    assert losses[-1] < losses[0], losses
