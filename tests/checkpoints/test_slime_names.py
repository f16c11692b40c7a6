"""scripts/convert_slime_checkpoint.py on a tiny checkpoint in slime's names and layout (CPU).

The slime checkpoint is written from a transformers GLM-5 model the way slime's own HF -> Megatron
converter lays it out (slime/backends/megatron_utils/hf_to_megatron/deepseek.py: TE fused-norm
names, the indexer directly under self_attention with its channels rotated to [no-RoPE | RoPE],
grouped-GEMM expert names); the reference for the result is this project's HF -> Megatron
conversion of the same HF weights (whose logits match transformers', tests/model/test_spec.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glm5_dsa_plugin.checkpoints import hf_megatron as conversion
from glm5_dsa_plugin.checkpoints import slime_names as slime_conversion
from megatron_cpu import megatron_single_process  # noqa: F401
from tiny_models import tiny_hf

ROOT = Path(__file__).resolve().parents[2]


def slime_state_from_hf(hf: dict, card: dict) -> dict:
    """HF tensors -> slime's names and layout, written from slime's converter (not from ours)."""
    r, n, k = card["qk_rope_head_dim"], card["num_hidden_layers"], card["first_k_dense_replace"]

    def rot(t, per_head=False):  # slime: cat(hf[r:], hf[:r]) along the head's channels
        if per_head:
            h = t.view(-1, card["index_head_dim"], t.shape[-1])
            return torch.cat((h[:, r:], h[:, :r]), dim=1).flatten(0, 1)
        return torch.cat((t[r:], t[:r]), dim=0)

    out = {"module.module.embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "module.module.decoder.final_layernorm.weight": hf["model.norm.weight"],
           "module.module.output_layer.weight": hf["lm_head.weight"]}
    for i in range(n):
        h, m = f"model.layers.{i}.", f"module.module.decoder.layers.{i}."
        a = h + "self_attn."
        out |= {
            m + "input_layernorm.weight": hf[h + "input_layernorm.weight"],
            m + "self_attention.linear_q_down_proj.weight": hf[a + "q_a_proj.weight"],
            m + "self_attention.linear_q_up_proj.layer_norm_weight": hf[a + "q_a_layernorm.weight"],
            m + "self_attention.linear_q_up_proj.weight": hf[a + "q_b_proj.weight"],
            m + "self_attention.linear_kv_down_proj.weight": hf[a + "kv_a_proj_with_mqa.weight"],
            m + "self_attention.linear_kv_up_proj.layer_norm_weight": hf[a + "kv_a_layernorm.weight"],
            m + "self_attention.linear_kv_up_proj.weight": hf[a + "kv_b_proj.weight"],
            m + "self_attention.linear_proj.weight": hf[a + "o_proj.weight"],
            m + "self_attention.wq_b.weight": rot(hf[a + "indexer.wq_b.weight"], per_head=True),
            m + "self_attention.wk.weight": rot(hf[a + "indexer.wk.weight"]),
            m + "self_attention.k_norm.weight": rot(hf[a + "indexer.k_norm.weight"]),
            m + "self_attention.k_norm.bias": rot(hf[a + "indexer.k_norm.bias"]),
            m + "self_attention.weights_proj.weight": hf[a + "indexer.weights_proj.weight"],
        }
        if i < k:
            out |= {m + "mlp.linear_fc1.layer_norm_weight": hf[h + "post_attention_layernorm.weight"],
                    m + "mlp.linear_fc1.weight": torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]]),
                    m + "mlp.linear_fc2.weight": hf[h + "mlp.down_proj.weight"]}
            continue
        s = h + "mlp.shared_experts."
        out |= {m + "pre_mlp_layernorm.weight": hf[h + "post_attention_layernorm.weight"],
                m + "mlp.router.weight": hf[h + "mlp.gate.weight"],
                m + "mlp.router.expert_bias": hf[h + "mlp.gate.e_score_correction_bias"],
                m + "mlp.shared_experts.linear_fc1.weight": torch.cat([hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"]]),
                m + "mlp.shared_experts.linear_fc2.weight": hf[s + "down_proj.weight"]}
        for e in range(card["n_routed_experts"]):
            gate_up, down = hf[h + "mlp.experts.gate_up_proj"][e], hf[h + "mlp.experts.down_proj"][e]
            out[m + f"mlp.experts.linear_fc1.weight{e}"] = gate_up
            out[m + f"mlp.experts.linear_fc2.weight{e}"] = down
    return out


@pytest.fixture(scope="module")
def tiny():
    card, model = tiny_hf(seed=11)
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return card, hf


@pytest.mark.parametrize("fmt", ["pt", "torch_dist"])
def test_script_converts_a_slime_checkpoint(tmp_path, tiny, fmt, megatron_single_process):
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    from tiny_models import build, tiny_config

    card, hf = tiny
    if "model.layers.2.mlp.experts.gate_up_proj" not in hf:
        pytest.skip("this transformers version keeps per-expert HF tensors in memory")
    slime = slime_state_from_hf(hf, card)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({k: v for k, v in card.items() if k != "_card"}))
    torch.save(slime, tmp_path / "slime.pt")
    if fmt == "pt":
        src, dst = tmp_path / "slime.pt", tmp_path / "ours.pt"
    else:
        src, dst = tmp_path / "slime_dist", tmp_path / "ours_dist"
        torch_save_to_dcp(str(tmp_path / "slime.pt"), str(src))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_slime_checkpoint.py"), str(src), str(dst),
                          "--hf-config", str(tmp_path / "hf")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout)
    assert report["rotated"] == 4 * card["num_hidden_layers"] and report["dropped"] == []
    ours = slime_conversion.read_checkpoint(dst)
    expect = conversion.hf_to_megatron(hf, card, include_mtp=False)
    assert ours.keys() == expect.keys()
    for name in expect:
        assert torch.equal(ours[name], expect[name]), name
    _, cfg = tiny_config(mtp_num_layers=None)
    model = build(cfg, card, mtp=False)
    missing, unexpected = model.load_state_dict(ours, strict=False)
    assert unexpected == [] and all("_extra_state" in k or "expert_bias" in k or "local_tokens" in k for k in missing)


def test_index_sharing_drops_the_unused_indexer_of_reusing_layers():
    # GLM-5.2: freq 4, offset 3 -> layers 1, 2, 3, 7, 11, ... compute; 4, 5, 6, 8, ... reuse
    names = {f"decoder.layers.{i}.self_attention.wk.weight": torch.zeros(4, 2) for i in range(8)}
    names["mtp.layers.0.transformer_layer.self_attention.wk.weight"] = torch.zeros(4, 2)
    out, report = slime_conversion.convert_state(names, head_dim=4, rope_dim=2, topk_freq=4, skip_offset=3)
    kept = sorted(int(k.split(".")[2]) for k in out if k.startswith("decoder."))
    assert kept == [0, 1, 2, 6]  # 0-based layers 1, 2, 3, 7
    assert sorted(report["dropped"]) == sorted(f"decoder.layers.{i}.self_attention.wk.weight" for i in (3, 4, 5, 7))
    assert "mtp.layers.0.mtp_model_layer.self_attention.core_attention.indexer.linear_wk.weight" in out
    out, _ = slime_conversion.convert_state(names, head_dim=4, rope_dim=2, topk_freq=4, skip_offset=3,
                                            keys="torch_dist")
    # megatron-core 0.19.2's own sharded key for the MTP layer is transformer_layer too
    assert "mtp.layers.0.transformer_layer.self_attention.core_attention.indexer.linear_wk.weight" in out


def test_torch_dist_keys_and_optimizer_states_are_renamed():
    t = torch.arange(8.0).reshape(4, 2)
    state = {"decoder.layers.0.self_attention.wk.weight": t,
             "optimizer.state.exp_avg.decoder.layers.0.self_attention.wk.weight": t.clone(),
             "optimizer.state.step.decoder.layers.0.self_attention.wk.weight": torch.tensor(3.0),
             "decoder.layers.1.mlp.experts.experts.linear_fc1.weight": torch.ones(2, 3)}
    out, _ = slime_conversion.convert_state(state, head_dim=4, rope_dim=1)
    leaf = "decoder.layers.0.self_attention.core_attention.indexer.linear_wk.weight"
    # [no-RoPE (3) | RoPE (1)] -> [RoPE | no-RoPE]
    assert torch.equal(out[leaf], t[[3, 0, 1, 2]])
    assert torch.equal(out["optimizer.state.exp_avg." + leaf], t[[3, 0, 1, 2]])
    assert out["optimizer.state.step." + leaf].item() == 3.0
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in out


def test_torch_dist_round_trip_loads_in_megatron_core(tmp_path, megatron_single_process):
    """A torch_dist checkpoint written by megatron-core goes through read / convert / write and
    megatron-core's own dist_checkpointing loads the result into the model (names already ours:
    nothing renamed)."""
    from megatron.core import dist_checkpointing

    from tiny_models import build, tiny_config

    card, cfg = tiny_config()
    torch.cuda.synchronize = getattr(torch.cuda, "synchronize") if torch.cuda.is_available() else (lambda *a, **k: None)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    a = build(cfg, card, mtp=True, seed=1)
    dist_checkpointing.save(a.sharded_state_dict(), str(src), sharded_strategy="torch_dist")
    state, report = slime_conversion.convert_state(slime_conversion.read_checkpoint(src), head_dim=32, rope_dim=16,
                                                   keys="torch_dist")
    assert report["renamed"] == 0 and report["rotated"] == [] and report["dropped"] == []
    slime_conversion.write_checkpoint(state, dst, like=src)
    b = build(cfg, card, mtp=True, seed=2)
    b.load_state_dict(dist_checkpointing.load(b.sharded_state_dict(), str(dst)), strict=False)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
