"""HF <-> Megatron conversion, model cards, and numerical parity with HF transformers' GLM-5."""

import pytest
import torch

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.checkpoints import hf_megatron as conversion
from megatron_cpu import megatron_single_process  # noqa: F401
from tiny_models import tiny_hf, with_mtp


@pytest.mark.slow
def test_roundtrip_is_bitwise_and_reads_shards_lazily(tmp_path):
    card, model = tiny_hf()
    model.save_pretrained(tmp_path / "hf")
    single = conversion.LazyHFCheckpoint(tmp_path / "hf")
    state = with_mtp(card, {k: single[k] for k in single})
    conversion.save_hf_safetensors(state, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    lazy = conversion.LazyHFCheckpoint(tmp_path / "sharded")
    assert lazy.reads == 0 and len(lazy) == len(state)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 3
    meg = conversion.hf_to_megatron(lazy, card)
    back = conversion.megatron_to_hf(meg, card)
    assert back.keys() == state.keys()
    for k in state:
        assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]), k


def test_megatron_names_are_the_spec_model(megatron_single_process, tmp_path):
    from tiny_models import build, tiny_config

    card, cfg = tiny_config()
    model = build(cfg, card)
    names = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    planned = {m for _, m, _ in conversion.name_plan(card)}
    assert names == planned


def test_mtp_aliases_must_match():
    card, model = tiny_hf()
    state = with_mtp(card, dict(model.state_dict()))
    state[f"model.layers.{card['num_hidden_layers']}.shared_head.head.weight"] = torch.zeros(256, 64)
    with pytest.raises(ValueError, match="shared_head.head.weight differs"):
        conversion.hf_to_megatron(state, card)


@pytest.mark.parametrize("name", ["glm5", "glm5.1", "glm5.2", "tiny"])
def test_card_hf_config_roundtrip(name, tmp_path):
    card = cards.load_card(name)
    hf = cards.card_to_hf_config(card)
    hf.save_pretrained(tmp_path)
    from transformers import AutoConfig

    again = cards.hf_config_to_card(AutoConfig.from_pretrained(tmp_path), name=name)
    for f in cards.ARCH_FIELDS + ("index_topk_freq", "index_skip_topk_offset", "num_nextn_predict_layers"):
        assert again[f] == card[f], f
    assert cards.rope_theta(again) == cards.rope_theta(card)


def test_published_cards_hold_the_architecture():
    c = cards.load_card("glm5")
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]) == (6144, 78, 64)
    assert (c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]) == (
        2048, 512, 192, 64, 256)
    assert (c["index_n_heads"], c["index_head_dim"], c["index_topk"]) == (32, 128, 2048)
    assert (c["n_routed_experts"], c["num_experts_per_tok"], c["n_shared_experts"]) == (256, 8, 1)
    assert (c["first_k_dense_replace"], c["moe_intermediate_size"], c["intermediate_size"]) == (3, 2048, 12288)
    assert (c["vocab_size"], c["rms_norm_eps"], c["num_nextn_predict_layers"]) == (154880, 1e-5, 1)
    assert (c["scoring_func"], c["topk_method"], c["routed_scaling_factor"]) == ("sigmoid", "noaux_tc", 2.5)
    c52 = cards.load_card("glm5.2")
    assert cards.rope_theta(c52) == 8e6 and (c52["index_topk_freq"], c52["index_skip_topk_offset"]) == (4, 3)
    with pytest.raises(FileNotFoundError, match="available"):
        cards.load_card("glm6")


def _hf_run(model, tok):
    """HF logits and each indexer's top-k [B, S, k] (None if a row's k-th and (k+1)-th visible scores tie:
    torch.topk breaks such ties arbitrarily, so the sets could not be compared)."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    caught, selected = [], {}
    real = torch.Tensor.topk

    def spy(self, k, *a, **kw):
        if self.dim() == 3 and self.shape[-1] == tok.shape[1]:
            caught.append((self.detach().clone(), k))
        return real(self, k, *a, **kw)

    hooks = [m.register_forward_hook(lambda mod, args, out: selected.__setitem__(mod.layer_idx, out.clone()))
             for m in model.modules() if isinstance(m, GlmMoeDsaIndexer)]
    torch.Tensor.topk = spy
    try:
        with torch.no_grad():
            logits = model(tok).logits
    finally:
        torch.Tensor.topk = real
        for h in hooks:
            h.remove()
    for scores, k in caught:
        vals = scores.sort(dim=-1, descending=True).values
        if vals.shape[-1] <= k:
            continue
        visible = vals[..., k] > -1e30  # HF masks with -inf or finfo.min
        if bool((visible & (vals[..., k - 1] == vals[..., k])).any()):
            return None, None
    return logits, selected


def _our_run(model, tok):
    """Our logits and each computing layer's top-k, per 1-indexed layer number: [B*S, k] packed."""
    from glm5_dsa_plugin.model import indexer
    from glm5_dsa_plugin.model.attention import GLM5DSAttention

    selected, real = {}, indexer.select_topk
    layer = {}

    def pre(mod, args):
        layer["n"] = mod.layer_number

    def spy(*a, **kw):
        out = real(*a, **kw)
        selected[layer["n"]] = out.clone()
        return out

    hooks = [m.register_forward_pre_hook(pre) for m in model.modules() if isinstance(m, GLM5DSAttention)]
    indexer.select_topk = spy
    try:
        model.eval()
        with torch.no_grad():
            B, S = tok.shape
            logits = model(tok, torch.arange(S)[None].expand(B, S), None)
    finally:
        indexer.select_topk = real
        for h in hooks:
            h.remove()
    return logits, selected


def _index_sets_equal(ours, theirs, B, S):
    """ours [B*S, k] packed (-1 padding), theirs [B, S, k] per sequence: same key set on every row."""
    for b in range(B):
        for t in range(S):
            mine = ours[b * S + t]
            mine = sorted((mine[mine >= 0] - b * S).tolist())
            hf = theirs[b, t]
            hf = sorted(hf[hf <= t].tolist())  # HF fills short rows with masked (future) keys
            if mine != hf:
                return False
    return True


def _our_model(card, hf, **over):
    from tiny_models import build

    cfg = cards.card_to_transformer_config(card, moe_token_dispatcher_type="allgather", mtp_num_layers=None, **over)
    model = build(cfg, card, mtp=False)
    state = dict(hf.state_dict())
    shared = [i for i, t in enumerate(hf.config.indexer_types) if t == "shared"]
    assert not any(".indexer." in k for k in state if any(k.startswith(f"model.layers.{i}.") for i in shared))
    meg = conversion.hf_to_megatron(state, card, include_mtp=False)  # a sharing layer: no indexer either side
    missing, unexpected = model.load_state_dict(meg, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    return model


def test_logits_and_selected_indices_match_hf_transformers(megatron_single_process):
    """GLM-5.2-shaped tiny model (layers 1-3 run their indexer, layer 4 shares layer 3's indices), top-k 8
    of up to 24 visible keys: same weights, same tokens -> the same selected key sets on every row of
    every indexer, and logits within 1e-4 (fp32, reference backend)."""
    S, B = 24, 2
    for seed in range(20):
        # 8 indexer heads: all-zero relu scores are rare
        card, hf = tiny_hf(seed=seed, index_n_heads=8, index_topk_freq=4, index_skip_topk_offset=3)
        tok = torch.randint(0, card["vocab_size"], (B, S), generator=torch.Generator().manual_seed(seed))
        ref_logits, hf_sel = _hf_run(hf, tok)
        if ref_logits is not None:
            break
    assert ref_logits is not None, "no tie-free seed found"
    assert hf.config.indexer_types == ["full", "full", "full", "shared"]
    k = card["index_topk"]
    assert sum(t + 1 > k for t in range(S)) > S // 2  # most rows see more keys than they keep
    model = _our_model(card, hf)
    ours, our_sel = _our_run(model, tok)
    assert sorted(our_sel) == [1, 2, 3]  # layer 4 reuses layer 3's indices, as HF's "shared" layer does
    for n in (1, 2, 3):
        assert _index_sets_equal(our_sel[n], hf_sel[n - 1], B, S), f"layer {n}: selected keys differ from HF"
    rel = ((ours - ref_logits).norm() / ref_logits.norm()).item()
    print(f"relative L2 error vs HF: {rel:.2e}")
    assert rel <= 1e-4, rel
    # the comparison sees the indexer's RoPE convention: half split selects other keys
    half = _our_model(card, hf, dsa_indexer_rope_interleaved=False)
    _, half_sel = _our_run(half, tok)
    assert not all(_index_sets_equal(half_sel[n], hf_sel[n - 1], B, S) for n in (1, 2, 3))


def test_index_sharing_reads_the_cards_schedule_and_defaults_unset_fields():
    from glm5_dsa_plugin.checkpoints.cards import index_sharing, load_card

    assert index_sharing(load_card("glm5.2")) == (4, 3)
    assert index_sharing(load_card("glm5")) == (1, 0)
    assert index_sharing({"index_topk_freq": None, "index_skip_topk_offset": None}) == (1, 0)
    assert index_sharing({}) == (1, 0)
