"""Indexer replay on CPU: the wire format, packing, every refusal, and a GPTModel on our spec
trained on replayed top-k (THD with padding, GLM-5.2-style index sharing, an MTP layer)."""

import pytest
import torch

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.model import indexer_replay as rp
from megatron_cpu import megatron_single_process  # noqa: F401
from tiny_models import build

LENS, PADDED = [13, 7, 20], [16, 8, 24]  # three sequences, each padded (THD)


# --------------------------------------------------------------------------- wire format and packing
def test_base64_round_trip_and_shape_inference():
    rec = torch.randint(-1, 50, (11, 3, 8), dtype=torch.int32)
    s = rp.encode_indexer_topk(rec)
    assert torch.equal(rp.decode_indexer_topk(s, num_layers=3, n_rows=11), rec)  # topk inferred, as SGLang clients do
    assert torch.equal(rp.decode_indexer_topk(s, num_layers=3, topk=8), rec)
    assert torch.equal(rp.decode_indexer_topk(rec.tolist()), rec)
    # the bytes are little-endian int32 in C order
    import base64
    import struct

    raw = base64.b64decode(s)
    assert struct.unpack_from("<i", raw, 4 * (1 * 24 + 2 * 8 + 5))[0] == int(rec[1, 2, 5])
    with pytest.raises(rp.IndexerReplayError, match="do not split"):
        rp.decode_indexer_topk(s, num_layers=3, n_rows=10)


def _causal_record(n, L, K, g):
    """Row i: K distinct keys of 0..i (fewer when i + 1 < K, padded with -1)."""
    rec = torch.full((n - 1, L, K), -1, dtype=torch.int32)
    for i in range(n - 1):
        for li in range(L):
            k = min(K, i + 1)
            rec[i, li, :k] = torch.randperm(i + 1, generator=g)[:k].to(torch.int32)
    return rec


def test_packing_offsets_each_sample_and_keeps_only_computing_layers():
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 13, 20, 40])
    pad = torch.tensor([0, 16, 24, 48])
    # 8 layers with freq 4, offset 3 (GLM-5.2's rule): layers 1, 2, 3, 7 compute
    assert rp.computing_layers(8, 4, 3) == [1, 2, 3, 7]
    recs = [_causal_record(n, 8, 4, g) for n in LENS]  # every layer captured, as SGLang does
    r = rp.pack_indexer_topk(recs, cu, cu_seqlens_padded=pad, num_layers=8, topk=6, topk_freq=4, skip_offset=3)
    assert sorted(r.indices) == [1, 2, 3, 7]
    t = r.indices[7]
    assert t.shape == (48, 6) and bool((t[:, 4:] == -1).all())  # narrower top-k padded with -1
    assert torch.equal(t[16 + 3, :4], torch.where(recs[1][3, 6] >= 0, recs[1][3, 6] + 16, -1))
    assert bool((t[13:16] == -1).all()) and bool((t[12] == -1).all())  # padding; the last token has no row
    assert r.own_rows.tolist() == [12, 22, 43]  # each sample's last token takes the trainer's own top-k
    # a pipeline stage keeps its layers; a CP rank its rows
    r2 = rp.pack_indexer_topk(recs, cu, cu_seqlens_padded=pad, num_layers=8, topk=6, topk_freq=4, skip_offset=3,
                              layers=[5, 6, 7, 8], rows=torch.tensor([40, 3, 12]))
    assert sorted(r2.indices) == [7] and torch.equal(r2.indices[7], t[[40, 3, 12]])
    assert r2.own_rows.tolist() == [2]
    # computing layers only is accepted too
    r3 = rp.pack_indexer_topk([x[:, [0, 1, 2, 6]] for x in recs], cu, cu_seqlens_padded=pad, num_layers=8, topk=6,
                              topk_freq=4, skip_offset=3)
    assert all(torch.equal(r3.indices[k], r.indices[k]) for k in r.indices)


@pytest.mark.parametrize("bad, msg", [
    ("future", r"sample 1, layer 2, row 3, slot 1: value 4 is after its row \(a query at position 3 sees keys 0..3\)"),
    ("negative", r"sample 1, layer 2, row 3, slot 1: value -2 is below -1"),
    ("repeat", r"sample 1, layer 2, row 3: key 0 appears twice"),
    ("rows", r"sample 1: the record has 5 rows; its sequence has 7 tokens \(send 6\)"),
    ("layers", r"sample 1: the record has 3 layers; this model has 4 decoder layers of which 4 compute"),
    ("wide", r"sample 1: the record holds top-9; the model's index_topk is 8"),
    ("count", r"2 records for 3 sequences"),
])
def test_every_refusal_names_what_is_wrong(bad, msg):
    g = torch.Generator().manual_seed(1)
    recs = [_causal_record(n, 4, 8, g) for n in LENS]
    r = recs[1]
    if bad == "future":
        r[3, 1, 1] = 4
    elif bad == "negative":
        r[3, 1, 1] = -2
    elif bad == "repeat":
        r[3, 1, :2] = 0
    elif bad == "rows":
        recs[1] = r[:5]
    elif bad == "layers":
        recs[1] = r[:, :3]
    elif bad == "wide":
        recs[1] = torch.cat([r, r[..., :1]], dim=-1)
    elif bad == "count":
        recs = recs[:2]
    with pytest.raises(rp.IndexerReplayError, match=msg):
        rp.pack_indexer_topk(recs, torch.tensor([0, 13, 20, 40]), num_layers=4, topk=8)


def test_overlap_counts_shared_members():
    rep = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1], [-1, -1, -1, -1]])
    own = torch.tensor([[3, 2, 9, 8], [5, 4, 7, 6], [1, 2, 3, 4]])
    frac, counted = rp.topk_overlap(rep, own)
    assert frac[:2].tolist() == [0.5, 1.0] and counted.tolist() == [True, True, False]


# --------------------------------------------------------------------------- through the model
def _model(seed=0):
    card = cards.with_overrides(cards.load_card("tiny"), index_topk_freq=2, index_skip_topk_offset=1,
                                num_hidden_layers=4, indexer_loss_coeff=1.0)
    cfg = cards.card_to_transformer_config(card, moe_token_dispatcher_type="allgather")
    assert cfg.mtp_num_layers == 1  # the MTP layer computes its own indices under replay
    return card, cfg, build(cfg, card, seed=seed).train()


def _batch(card, g):
    from megatron.core.packed_seq_params import PackedSeqParams

    T = sum(PADDED)
    tokens = torch.randint(0, card["vocab_size"], (1, T), generator=g)
    pos = torch.cat([torch.arange(p) for p in PADDED])[None]
    cu = torch.tensor([0] + LENS).cumsum(0).to(torch.int32)
    cu_pad = torch.tensor([0] + PADDED).cumsum(0).to(torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                          cu_seqlens_kv_padded=cu_pad, max_seqlen_q=24, max_seqlen_kv=24)
    labels = torch.roll(tokens, -1, 1)
    return tokens, pos, labels, psp, cu, cu_pad


def _fwd_bwd(model, tokens, pos, labels, psp):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, pos, None, labels=labels, packed_seq_params=psp)
    loss.float().sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _psp_copy(psp):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(**{k: getattr(psp, k) for k in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv",
                                                             "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                                                             "max_seqlen_q", "max_seqlen_kv")})


def _record(model, tokens, pos, psp, cu, cu_pad):
    rec = rp.IndexerTopkRecorder()
    p = _psp_copy(psp)
    rp.attach_indexer_topk_recorder(p, rec)
    with torch.no_grad():
        model(tokens, pos, None, packed_seq_params=p)
    return rec.records(cu, cu_pad)


def test_replaying_the_models_own_record_changes_nothing(megatron_single_process):
    card, cfg, model = _model()
    g = torch.Generator().manual_seed(3)
    tokens, pos, labels, psp, cu, cu_pad = _batch(card, g)
    records = _record(model, tokens, pos, psp, cu, cu_pad)
    assert [r.shape for r in records] == [(n - 1, 2, 8) for n in LENS]  # layers 1 and 3 compute (freq 2, offset 1)
    # the record is not trivial: some rows select fewer keys than they see
    assert int((records[2][-1] >= 0).sum(-1).min()) == 8 and LENS[2] - 1 > 8

    ref_loss, ref_grads = _fwd_bwd(model, tokens, pos, labels, _psp_copy(psp))
    p = _psp_copy(psp)
    replay = rp.pack_indexer_topk(records, cu, cu_seqlens_padded=cu_pad, num_layers=4, topk=8, topk_freq=2,
                                  skip_offset=1, measure_overlap=True)
    rp.attach_indexer_replay(p, replay)
    loss, grads = _fwd_bwd(model, tokens, pos, labels, p)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")
    ov = rp.indexer_topk_overlap(replay)
    assert ov["mean"] == 1.0 and ov["rows_below_0_8"] == 0 and sorted(ov["per_layer"]) == [1, 3]


def test_a_changed_row_changes_that_rows_output_only(megatron_single_process):
    card = cards.with_overrides(cards.load_card("tiny"), num_hidden_layers=1, first_k_dense_replace=1,
                                num_nextn_predict_layers=0)
    cfg = cards.card_to_transformer_config(card, moe_token_dispatcher_type="allgather")
    model = build(cfg, card, mtp=False).eval()
    g = torch.Generator().manual_seed(4)
    tokens, pos, _, psp, cu, cu_pad = _batch(card, g)
    records = _record(model, tokens, pos, psp, cu, cu_pad)

    def logits(recs):
        p = _psp_copy(psp)
        rp.attach_indexer_replay(p, rp.pack_indexer_topk(recs, cu, cu_seqlens_padded=cu_pad, num_layers=1, topk=8))
        with torch.no_grad():
            return model(tokens, pos, None, packed_seq_params=p)[0]

    base = logits(records)
    changed = [r.clone() for r in records]
    row = 17  # sample 2, position 17: sees 18 keys, keeps 8
    keep = set(changed[2][row, 0].tolist())
    other = [k for k in range(row + 1) if k not in keep][0]
    changed[2][row, 0, -1] = other
    out = logits(changed)
    diff = (out - base).abs().amax(-1)
    assert diff[24 + row] > 0
    diff[24 + row] = 0
    assert float(diff.max()) == 0.0


def test_replay_for_another_stage_or_rank_is_refused(megatron_single_process):
    card, cfg, model = _model()
    g = torch.Generator().manual_seed(5)
    tokens, pos, labels, psp, cu, cu_pad = _batch(card, g)
    records = _record(model, tokens, pos, psp, cu, cu_pad)
    p = _psp_copy(psp)
    rp.attach_indexer_replay(p, rp.pack_indexer_topk(records, cu, cu_seqlens_padded=cu_pad, num_layers=4, topk=8,
                                                     topk_freq=2, skip_offset=1, layers=[3, 4]))
    with pytest.raises(RuntimeError, match=r"no indices for DSA layer 1 \(the replay holds layers \[3\]\)"):
        model(tokens, pos, None, packed_seq_params=p)
    p = _psp_copy(psp)
    rp.attach_indexer_replay(p, rp.pack_indexer_topk(records, cu, cu_seqlens_padded=cu_pad, num_layers=4, topk=8,
                                                     topk_freq=2, skip_offset=1, rows=torch.arange(47, -1, -1)))
    with pytest.raises(RuntimeError, match="its rows are not the query rows of this rank"):
        model(tokens, pos, None, packed_seq_params=p)
