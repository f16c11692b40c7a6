"""Indexer replay under allgather context parallelism on CPU (gloo): CP = 2 and CP = 4 against
CP = 1, zigzag and contiguous layouts, THD (padded, index sharing) and bshd.

Every rank packs the same per-sample records (sample-local positions, random causal picks that
differ from the indexer's own) with its own rows from ``cp_layout.local_row_ids``; the checks and
gradient conventions are those of tests/model/test_cp_cpu.py. Each rank's selected indices are
also checked to be the replayed ones, in gathered-kv coordinates."""

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.model.shared_topk import HOLDER_ATTR
from test_cp_cpu import CASES, LAYERS_PLAIN, LAYERS_SHARING, WORLD, _card, _forward_backward, _inputs, _local_rows, \
    _packed, _to_cpu, check_parity, run_cp_cases


def _records(card, fmt, sizes, padded, sharing):
    """One record per sample: [n - 1, computing layers, topk], K distinct random keys of 0..i."""
    g = torch.Generator().manual_seed(7)
    lens = list(sizes) if fmt == "thd" else [sizes[0]] * sizes[1]
    from glm5_dsa_plugin.model.indexer_replay import computing_layers

    L = len(computing_layers(card["num_hidden_layers"], card["index_topk_freq"], card["index_skip_topk_offset"]))
    K = card["index_topk"]
    recs = []
    for n in lens:
        r = torch.full((n - 1, L, K), -1, dtype=torch.int32)
        for i in range(n - 1):
            for li in range(L):
                k = min(K, i + 1)
                r[i, li, :k] = torch.randperm(i + 1, generator=g)[:k].to(torch.int32)
        recs.append(r)
    return lens, recs


def _run_case(name, cp, rank):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from glm5_dsa_plugin.megatron.spec import dsa_attention_spec
    from glm5_dsa_plugin.model import cp_layout
    from glm5_dsa_plugin.model import indexer_replay as rp

    fmt, layout, sizes, padded, sharing = CASES[name]
    card = _card(sharing)
    cfg = cards.card_to_transformer_config(card, mtp_num_layers=None, context_parallel_size=cp,
                                           cp_comm_type="allgather" if cp > 1 else None)
    pgc = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    cp_rank = torch.distributed.get_rank(pgc.cp) if cp > 1 else 0
    rows = _local_rows(fmt, layout, sizes, padded, cp, cp_rank)
    psp = _packed(sizes, padded, "cpu") if fmt == "thd" else None
    lens, recs = _records(card, fmt, sizes, padded, sharing)
    cu = torch.tensor([0] + lens).cumsum(0)
    cu_pad = torch.tensor([0] + list(padded)).cumsum(0) if padded else None
    local = len(rows) * (1 if fmt == "thd" else sizes[1])
    packed_rows = cp_layout.local_row_ids(layout, cp, cp_rank, local, batch=1 if fmt == "thd" else sizes[1],
                                          cu_seqlens=cu if fmt == "thd" else None, cu_seqlens_padded=cu_pad)
    want_rows = rows if fmt == "thd" else torch.cat([b * sizes[0] + rows for b in range(sizes[1])])
    assert torch.equal(packed_rows, want_rows), "local_row_ids disagrees with megatron-core's / slime's slicing"
    replay = rp.pack_indexer_topk(recs, cu, cu_seqlens_padded=cu_pad, num_layers=card["num_hidden_layers"],
                                  topk=card["index_topk"], topk_freq=card["index_topk_freq"],
                                  skip_offset=card["index_skip_topk_offset"], rows=packed_rows)
    carrier = psp if psp is not None else cfg
    g = torch.Generator().manual_seed(1)
    res = {"rows": rows}
    for layer in LAYERS_SHARING if sharing else LAYERS_PLAIN:
        rp.attach_indexer_replay(carrier, replay)
        recorder = rp.IndexerTopkRecorder()
        rp.attach_indexer_topk_recorder(carrier, recorder)
        torch.manual_seed(layer)
        core = dsa_attention_spec(cfg, cp_layout=layout).submodules.core_attention
        att = build_module(core, config=cfg, layer_number=layer, attn_mask_type=AttnMaskType.causal,
                           attention_type="self", softmax_scale=32**-0.5, cp_comm_type="allgather",
                           pg_collection=pgc).train()
        att.backend = "reference"
        t = _inputs(card, fmt, sizes, padded, g)
        r = _forward_backward(att, t, rows, psp, cp)
        holder = getattr(carrier, HOLDER_ATTR, {})
        r["indices"] = holder.get(layer)
        if layer in replay.indices:  # the layer attended to the replayed keys (each sample's last token aside)
            used = recorder.by_layer[layer]
            assert torch.equal(recorder.rows, packed_rows)
            own = torch.zeros(len(packed_rows), dtype=torch.bool)
            own[replay.own_rows.cpu()] = True
            assert torch.equal(used[~own], replay.indices[layer].cpu()[~own]), f"{name} CP={cp} layer {layer}"
        res[layer] = _to_cpu(r)
    return res


def _worker(rank, store, out_dir):
    run_cp_cases(rank, store, out_dir, WORLD, (1, 2, 4), "cpu", CASES, lambda name, cp: _run_case(name, cp, rank))


@pytest.fixture(scope="module")
def cp_replay_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_replay")
    store = tempfile.NamedTemporaryFile(prefix="glm5_dsa_cp_replay_", delete=False).name
    mp.spawn(_worker, args=(store, str(out)), nprocs=WORLD, join=True)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_replay_under_cp_matches_cp1(cp_replay_results, name, cp):
    check_parity(cp_replay_results, name, cp, WORLD)
