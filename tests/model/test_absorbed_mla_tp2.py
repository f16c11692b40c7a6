"""``GLM5AbsorbedMLA`` at TP = 2 with sequence parallel (gloo, two processes on CPU) against
megatron-core's ``AbsorbedMLASelfAttention`` on the same weights: the down projections' gathers and
scatters, the latent's sequence-parallel gather and the head-sharded query. megatron-core's torch
norms refuse sequence parallel, so the config has no q / kv norms (``qk_layernorm=False``)."""

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

S, B = 12, 2


def _worker(rank, store, out_dir):
    torch.cuda.current_device = lambda: "cpu"
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention
    from megatron.core.transformer.spec_utils import build_module

    from glm5_dsa_plugin.checkpoints import cards
    from glm5_dsa_plugin.megatron.spec import dsa_attention_spec
    from glm5_dsa_plugin.model import absorbed_mla

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    calls = []
    real = absorbed_mla.absorbed_query
    absorbed_mla.absorbed_query = lambda *a: calls.append(1) or real(*a)
    card = cards.load_card("tiny")
    cfg = cards.card_to_transformer_config(card, tensor_model_parallel_size=2, sequence_parallel=True,
                                           qk_layernorm=False, mtp_num_layers=None)
    spec = dsa_attention_spec(cfg)
    torch.manual_seed(0)
    ours = build_module(spec, config=cfg, layer_number=1)
    spec.module = AbsorbedMLASelfAttention
    ref = build_module(spec, config=cfg, layer_number=1)
    g = torch.Generator().manual_seed(1 + rank)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ref.load_state_dict(ours.state_dict())
    hidden = torch.randn(S // 2, B, cfg.hidden_size, generator=torch.Generator().manual_seed(7 + rank))
    res = {}
    for name, m in (("ours", ours), ("ref", ref)):
        h = hidden.clone().requires_grad_(True)
        outs = m.get_query_key_value_tensors(h)
        gg = torch.Generator().manual_seed(3)
        loss = sum((t * torch.randn(t.shape, generator=gg)).sum() for t in outs)
        params = [p for _, p in sorted(m.named_parameters())]
        grads = torch.autograd.grad(loss, [h] + params, allow_unused=True)
        res[name] = ([t.detach() for t in outs], [None if x is None else x.detach() for x in grads])
    res["calls"] = len(calls)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_glm5_absorbed_mla_tp2_sequence_parallel_equals_megatron_cores(tmp_path):
    store = tempfile.NamedTemporaryFile(prefix="glm5_dsa_absorbed_tp2_", delete=False).name
    mp.spawn(_worker, args=(store, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["calls"] == 1, "GLM5AbsorbedMLA took megatron-core's path"
        (got, got_g), (want, want_g) = r["ours"], r["ref"]
        assert [t.shape for t in got] == [t.shape for t in want]
        for a, b in zip(got + got_g, want + want_g):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
