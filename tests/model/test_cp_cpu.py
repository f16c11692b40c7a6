"""Allgather context parallelism of the DSA core attention on CPU (gloo): CP = 2 and CP = 4
against CP = 1, in one spawn of four processes (CP = 2 runs as two CP groups of two).

The ranks' inputs are cut with megatron-core 0.19.2's own layout functions (zigzag, packed THD
and bshd) and with slime's ``--allgather-cp`` slicing (``tensor.chunk(cp)[rank]`` of the packed
stream). Gradients follow megatron-core's convention: the main loss is scaled by ``cp`` (so each
rank's upstream gradient is ``cp`` times its rows of the CP = 1 one) and parameter gradients are
averaged over CP; each rank's indexer loss is the mean over its own query rows, and the logged
loss is their CP average. So: activation gradients / cp and parameter gradients averaged over CP
equal the CP = 1 ones; the mean of the ranks' indexer losses equals the CP = 1 loss; each rank's
top-k indices are the CP = 1 indices of its rows (gathered-kv coordinates = global packed rows).

Index sharing uses GLM-5.2's schedule (freq 4, offset 3): layer 3 computes, layer 4 reuses.
"""

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.model.shared_topk import HOLDER_ATTR

WORLD = 4
# name: (format, layout, real lengths (THD) or (s, b) (bshd), padded lengths or None, index sharing)
CASES = {
    "thd_zigzag_padded_sharing": ("thd", "zigzag", [13, 7, 20], [16, 8, 24], True),
    "thd_zigzag": ("thd", "zigzag", [16, 8, 24], None, False),
    "thd_slime_contiguous_sharing": ("thd", "contiguous", [13, 7, 20, 8], None, True),
    "bshd_zigzag_sharing": ("bshd", "zigzag", (16, 2), None, True),
    "bshd_contiguous": ("bshd", "contiguous", (16, 2), None, False),
}
LAYERS_SHARING, LAYERS_PLAIN = (3, 4), (1,)
# the attention backend, dtype and card overrides of a run: the reference in fp32 (CPU and GPU), and
# the TileLang kernels in bf16 (GPU; shapes they take, top-k covering every visible key)
VARIANTS = {
    "reference": dict(backend="reference", dtype=torch.float32, card={}),
    "tilelang": dict(backend="tilelang", dtype=torch.bfloat16,
                     card=dict(hidden_size=256, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=128,
                               kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                               index_n_heads=4, index_head_dim=64, index_topk=64)),
}


def _card(sharing, variant="reference"):
    card = cards.with_overrides(cards.load_card("tiny"), indexer_loss_coeff=1.0,  # loss gradients above tolerance
                                **VARIANTS[variant]["card"])
    if sharing:
        card = cards.with_overrides(card, index_topk_freq=4, index_skip_topk_offset=3, num_hidden_layers=8)
    return card


def _local_rows(fmt, layout, sizes, padded, cp, rank):
    """Rows of the global tensors this rank holds, from megatron-core's / slime's own slicing."""
    from megatron.core.transformer.experimental_attention_variant import dsa_layout

    if fmt == "thd":
        lens = padded or sizes
        T = sum(lens)
        if cp == 1:
            return torch.arange(T)
        if layout == "contiguous":  # slime get_batch(allgather_cp=True): tokens.chunk(cp_size)[cp_rank]
            return torch.arange(T).chunk(cp)[rank]
        cu = torch.tensor([0] + lens).cumsum(0)
        return dsa_layout.build_packed_allgather_cp_local_positions(cu, cp, rank, torch.device("cpu"),
                                                                    output_size=T // cp, cu_seqlens_cover_output=True)
    S, _ = sizes
    if layout == "contiguous":
        return torch.arange(S).chunk(cp)[rank]
    return dsa_layout.build_zigzag_cp_local_positions(S, cp, rank, torch.device("cpu"))


def _inputs(card, fmt, sizes, padded, g):
    H, lora, dv = card["num_attention_heads"], card["kv_lora_rank"], card["v_head_dim"]
    dq = lora + card["qk_rope_head_dim"]
    S, B = (sum(padded or sizes), 1) if fmt == "thd" else sizes
    t = dict(query=torch.randn(S, B, H, dq, generator=g), key=torch.randn(S, B, 1, dq, generator=g),
             x=torch.randn(S, B, card["hidden_size"], generator=g),
             qr=torch.randn(S, B, card["q_lora_rank"], generator=g),
             up_v=torch.randn(H, dv, lora, generator=g) * 0.2, grad=torch.randn(S, B, H * dv, generator=g))
    return t


def _packed(sizes, padded, device):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + list(sizes)).cumsum(0).to(device, torch.int32)
    cu_pad = None if padded is None else torch.tensor([0] + list(padded)).cumsum(0).to(device, torch.int32)
    mx = int(max(padded or sizes))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                           cu_seqlens_kv_padded=cu_pad, max_seqlen_q=mx, max_seqlen_kv=mx)


def _forward_backward(att, t: dict, rows, psp, cp: int) -> dict:
    """One rank's forward and backward of ``att`` on its ``rows`` of the inputs ``t``: the output,
    the indexer loss and every gradient."""
    loc = {k: t[k][rows].clone().requires_grad_(True) for k in ("query", "key", "x", "qr")}
    up_v = t["up_v"].clone().requires_grad_(True)
    out = att(loc["query"], loc["key"], None, None, loc["x"], loc["qr"], packed_seq_params=psp, up_v_weight=up_v)
    out.backward(t["grad"][rows] * cp)
    r = dict(out=out.detach(), up_v=up_v.grad, loss=getattr(att, "last_indexer_loss", None),
             params={n: p.grad for n, p in att.named_parameters()})
    r.update({f"d{k}": v.grad for k, v in loc.items()})
    return r


def _run_case(name, cp, rank, device="cpu", variant="reference"):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from glm5_dsa_plugin.megatron.spec import dsa_attention_spec

    fmt, layout, sizes, padded, sharing = CASES[name]
    var = VARIANTS[variant]
    card = _card(sharing, variant)
    cfg = cards.card_to_transformer_config(card, mtp_num_layers=None, context_parallel_size=cp,
                                           cp_comm_type="allgather" if cp > 1 else None, params_dtype=var["dtype"],
                                           bf16=var["dtype"] == torch.bfloat16)
    pgc = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    cp_rank = torch.distributed.get_rank(pgc.cp) if cp > 1 else 0
    rows = _local_rows(fmt, layout, sizes, padded, cp, cp_rank)
    psp = _packed(sizes, padded, device) if fmt == "thd" else None
    g = torch.Generator().manual_seed(1)
    res = {"rows": rows}
    for layer in LAYERS_SHARING if sharing else LAYERS_PLAIN:
        torch.manual_seed(layer)
        core = dsa_attention_spec(cfg, cp_layout=layout).submodules.core_attention
        att = build_module(core, config=cfg, layer_number=layer, attn_mask_type=AttnMaskType.causal,
                           attention_type="self", softmax_scale=32**-0.5, cp_comm_type="allgather",
                           pg_collection=pgc).train().to(device, var["dtype"])
        att.backend = var["backend"]
        t = {k: v.to(device, var["dtype"]) for k, v in _inputs(card, fmt, sizes, padded, g).items()}
        r = _forward_backward(att, t, rows, psp, cp)
        carrier = psp if psp is not None else cfg
        holder = getattr(carrier, HOLDER_ATTR, {})
        r["indices"] = holder.get(layer)
        res[layer] = _to_cpu(r)
    return res


def _to_cpu(x):
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return x.cpu() if isinstance(x, torch.Tensor) else x


def run_cp_cases(rank, store, out_dir, world, cps, device, cases, run_case):
    """One spawned rank: for every CP size in ``cps`` (world // cp CP groups) and every case,
    ``run_case(name, cp)``; the results go to ``out_dir/rank{rank}.pt``. gloo (CUDA tensors go
    through the host)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if device == "cpu":
        torch.cuda.current_device = lambda: "cpu"  # megatron-core asks CUDA for a device (tests/megatron_cpu.py)
    else:
        torch.cuda.set_device(0)  # all ranks share the one GPU
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    res = {}
    for cp in cps:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(context_parallel_size=cp)
        for name in cases:
            res[(name, cp)] = run_case(name, cp)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _worker(rank, store, out_dir, world=WORLD, cps=(1, 2, 4), device="cpu", variant="reference"):
    """Every CP size in ``cps``, every case (:func:`run_cp_cases`)."""
    run_cp_cases(rank, store, out_dir, world, cps, device, CASES,
                 lambda name, cp: _run_case(name, cp, rank, device, variant))


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    store = tempfile.NamedTemporaryFile(prefix="glm5_dsa_cp_", delete=False).name
    mp.spawn(_worker, args=(store, str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _close(a, b, what, bf16=False):
    """fp32: elementwise (rtol 1e-4); bf16: relative L2 error below 2e-2."""
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one side has no gradient"
        return
    if bf16:
        a, b = a.float(), b.float()
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err < 2e-2, f"{what}: relative L2 error {err:.3g}"
        return
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_cp_matches_cp1(cp_results, name, cp):
    check_parity(cp_results, name, cp, WORLD)


def check_parity(cp_results, name, cp, world, bf16=False):
    """Every CP group of ``cp`` ranks against the CP = 1 run of rank 0 (see the module docstring).
    ``bf16``: tolerances of bf16 kernels, and each row's selected keys compared as a set (the
    TileLang variant's top-k covers every visible key; only the order of near-equal scores may move)."""
    sharing = CASES[name][4]
    groups = [list(range(g, g + cp)) for g in range(0, world, cp)]
    for group in groups:
        for layer in LAYERS_SHARING if sharing else LAYERS_PLAIN:
            ref = cp_results[0][(name, 1)][layer]
            locs = [cp_results[r][(name, cp)] for r in group]
            for r, loc in zip(group, locs):
                rows, got = loc["rows"], loc[layer]
                what = f"{name} CP={cp} rank {r} layer {layer}"
                _close(got["out"], ref["out"][rows], f"{what} out", bf16)
                for k in ("dquery", "dkey", "dx", "dqr"):
                    _close(None if got[k] is None else got[k] / cp,
                           None if ref[k] is None else ref[k][rows], f"{what} {k}", bf16)
                if ref["indices"] is not None or got["indices"] is not None:
                    assert got["indices"] is not None and ref["indices"] is not None, what
                    packed_rows = rows if CASES[name][0] == "thd" else torch.cat(  # bshd: batch-major rows
                        [b * CASES[name][2][0] + rows for b in range(CASES[name][2][1])])
                    want = ref["indices"][packed_rows]
                    if bf16:
                        got_i, want = got["indices"].sort(-1).values, want.sort(-1).values
                    else:
                        got_i = got["indices"]
                    assert torch.equal(got_i, want), f"{what} indices"
            # parameters (and up_v, an input shared by all ranks): megatron averages over CP
            what = f"{name} CP={cp} ranks {group} layer {layer}"
            _close(sum(loc[layer]["up_v"].float() for loc in locs) / cp, ref["up_v"].float(), f"{what} d up_v", bf16)
            for n, p in ref["params"].items():
                grads = [loc[layer]["params"][n] for loc in locs]
                if p is None:
                    assert all(x is None for x in grads), f"{what} {n}"
                    continue
                _close(sum(x.float() for x in grads) / cp, p.float(), f"{what} grad {n}", bf16)
            if ref["loss"] is not None:
                torch.testing.assert_close(sum(loc[layer]["loss"].float() for loc in locs) / cp, ref["loss"].float(),
                                           rtol=1e-2 if bf16 else 1e-5, atol=1e-8,
                                           msg=lambda m: f"{what} indexer loss: {m}")
