"""Tensor parallel TP=2 on CPU (gloo, world size 2, two processes), at the level megatron-core
allows without TransformerEngine: megatron-core 0.19.2's AbsorbedMLA requires sequence parallel
for TP > 1, and its torch norms refuse sequence parallel, so a whole local-path GPTModel cannot run
TP=2; the DSA core attention can. With heads split over the ranks and x / qr sequence-parallel,
each rank's output equals its heads of the TP=1 output, and the indexer loss (its target summed
over all heads by an all-reduce) equals the TP=1 loss."""

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from glm5_dsa_plugin.checkpoints import cards
from tiny_models import core_attention

S, B = 24, 2


def _worker(rank, store, out_dir):
    torch.cuda.current_device = lambda: "cpu"
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    card = cards.load_card("tiny")
    H, dq, v, lora = card["num_attention_heads"], card["kv_lora_rank"] + card["qk_rope_head_dim"], \
        card["v_head_dim"], card["kv_lora_rank"]
    g = torch.Generator().manual_seed(0)
    query = torch.randn(S, B, H, dq, generator=g)
    key = torch.randn(S, B, 1, dq, generator=g)
    x = torch.randn(S, B, card["hidden_size"], generator=g)
    qr = torch.randn(S, B, card["q_lora_rank"], generator=g)
    up_v = torch.randn(H, v, lora, generator=g)
    grad = torch.randn(S, B, H * v, generator=g)
    res = {}
    for tp in (1, 2):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        cfg = cards.card_to_transformer_config(card, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                                               mtp_num_layers=None)
        att = core_attention(cfg).train()
        h0, h1 = (0, H) if tp == 1 else (rank * H // 2, (rank + 1) * H // 2)
        rows = slice(None) if tp == 1 else slice(rank * S // 2, (rank + 1) * S // 2)
        q = query[:, :, h0:h1].clone().requires_grad_(True)
        out = att(q, key, None, None, x[rows], qr[rows], up_v_weight=up_v[h0:h1])
        out.backward(grad.view(S, B, H, v)[:, :, h0:h1].reshape(S, B, -1))
        res[tp] = dict(out=out.detach(), dq=q.grad, loss=att.last_indexer_loss, heads=(h0, h1))
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_core_attention_tp2_matches_tp1(tmp_path):
    store = tempfile.NamedTemporaryFile(prefix="glm5_dsa_tp2_", delete=False).name
    mp.spawn(_worker, args=(store, str(tmp_path)), nprocs=2, join=True)
    card = cards.load_card("tiny")
    v = card["v_head_dim"]
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        h0, h1 = r[2]["heads"]
        full = r[1]["out"].view(S, B, -1, v)[:, :, h0:h1].reshape(S, B, -1)
        # fp32 matmuls over 2x fewer heads block their sums differently: ~1e-6 apart, a wrong head ~1e-1
        torch.testing.assert_close(r[2]["out"], full, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r[2]["dq"], r[1]["dq"][:, :, h0:h1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r[2]["loss"], r[1]["loss"], rtol=1e-5, atol=1e-9)
