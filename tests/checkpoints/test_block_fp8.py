"""Block-FP8 checkpoints in the published GLM-5.x-FP8 layout, read through glm5_dsa_plugin.checkpoints.hf_megatron.

The fixture quantises a GLM-5-shaped HF state the way the published checkpoints are stored
(float8_e4m3fn weights, float32 ``weight_scale_inv`` [ceil(out/128), ceil(in/128)] beside each quantised
linear, bf16 embeddings / lm_head / norms / router / indexer weights_proj, fp32 router bias; sharded
safetensors + index json + ``quantization_config`` in config.json). The reference is the bf16 checkpoint
whose values are the exact dequantised ones: scales are powers of two, so ``q * scale`` is exact in bf16
and the reference is computed here block by block, independently of the loader."""

import gc
import json
import math
import re
import weakref

import pytest
import torch

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.checkpoints import hf_megatron as conversion
from glm5_dsa_plugin.checkpoints import block_fp8 as fp8
from megatron_cpu import megatron_single_process  # noqa: F401
from tiny_models import tiny_hf, with_mtp

PUBLISHED_QC = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128]}
# the linear weights the published FP8 checkpoints quantise (everything else stays in its own dtype)
QUANTISED = re.compile(r"self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b|indexer\.wk)"
                       r"\.weight$|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj)\.weight$")
# dims above, at and off the 128 block: hidden 160 = 128 + 32, q_lora 136, q_b_proj rows 4 * 32 = 128,
# kv_a_proj_with_mqa rows 32 + 16 = 48, dense MLP 272, experts 48
SHAPES = dict(hidden_size=160, q_lora_rank=136, kv_lora_rank=32, intermediate_size=272, moe_intermediate_size=48,
              index_head_dim=64)


def quantise_block_fp8(w: torch.Tensor, block=(128, 128), seed=0):
    """-> (q float8_e4m3fn, scale_inv float32 power-of-two per block, exact bf16 value of q * scale)."""
    R, C = w.shape
    b0, b1 = block
    g = torch.Generator().manual_seed(seed)
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(R / b0), math.ceil(C / b1), dtype=torch.float32)
    ref = torch.empty(R, C, dtype=torch.bfloat16)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            blk = w[bi * b0:(bi + 1) * b0, bj * b1:(bj + 1) * b1].float()
            # a power of two near amax / 448, varied per block so a scale applied to the wrong block shows
            exp = math.ceil(math.log2(max(blk.abs().max().item(), 1e-12) / 448.0)) + int(
                torch.randint(0, 3, (), generator=g))
            s[bi, bj] = 2.0 ** exp
            qb = (blk / s[bi, bj]).to(torch.float8_e4m3fn)
            q[bi * b0:(bi + 1) * b0, bj * b1:(bj + 1) * b1] = qb
            ref[bi * b0:(bi + 1) * b0, bj * b1:(bj + 1) * b1] = (qb.float() * s[bi, bj]).to(torch.bfloat16)
            assert torch.equal(ref[bi * b0:(bi + 1) * b0, bj * b1:(bj + 1) * b1].float(), qb.float() * s[bi, bj])
    return q, s, ref


def write_checkpoint(folder, state, quantization_config=None, max_shard_bytes=48 * 1024, hf_config=None):
    conversion.save_hf_safetensors(state, folder, max_shard_bytes=max_shard_bytes)
    cfg = dict(hf_config or {"model_type": "glm_moe_dsa"})
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(card, fp8 folder, bf16 reference folder, quantised names)."""
    card, model = tiny_hf(**SHAPES)
    root = tmp_path_factory.mktemp("fp8")
    model.save_pretrained(root / "hf")  # the on-disk names (per-expert keys)
    saved = conversion.LazyHFCheckpoint(root / "hf")
    state = with_mtp(card, {k: saved[k] for k in saved})
    fp8_state, ref_state, quantised = {}, {}, []
    for i, (k, v) in enumerate(sorted(state.items())):
        if QUANTISED.search(k):
            q, s, ref = quantise_block_fp8(v, seed=i)
            fp8_state[k], fp8_state[k + "_scale_inv"], ref_state[k] = q, s, ref
            quantised.append(k)
        else:
            keep = torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16
            fp8_state[k] = ref_state[k] = v.to(keep)
    qc = dict(PUBLISHED_QC, modules_to_not_convert=["model.embed_tokens", "lm_head"] + [
        f"model.layers.{i}.self_attn.indexers_proj" for i in range(card["num_hidden_layers"])])
    hf_config = json.loads((root / "hf" / "config.json").read_text())
    write_checkpoint(root / "fp8", fp8_state, qc, hf_config=hf_config)
    write_checkpoint(root / "bf16", ref_state, hf_config=hf_config)
    return card, root / "fp8", root / "bf16", quantised


def test_fixture_is_the_published_layout(checkpoints):
    card, fp8_dir, _, quantised = checkpoints
    index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 3  # sharded
    from safetensors import safe_open

    def meta(key):
        with safe_open(str(fp8_dir / index[key]), "pt") as f:
            return f.get_slice(key).get_dtype(), f.get_slice(key).get_shape()

    assert meta("model.layers.0.self_attn.kv_a_proj_with_mqa.weight") == ("F8_E4M3", [48, 160])
    assert meta("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv") == ("F32", [1, 2])
    assert meta("model.layers.2.mlp.experts.3.down_proj.weight_scale_inv") == ("F32", [2, 1])
    assert meta("model.layers.2.mlp.gate.weight")[0] == "BF16"
    assert meta("model.layers.2.self_attn.indexer.weights_proj.weight")[0] == "BF16"
    assert meta("model.layers.2.mlp.gate.e_score_correction_bias")[0] == "F32"
    n = card["num_hidden_layers"]
    assert f"model.layers.{n}.self_attn.q_b_proj.weight_scale_inv" in index  # the MTP layer is quantised too
    assert sum(k.endswith("_scale_inv") for k in index) == len(quantised) > 40


def test_fp8_checkpoint_reads_as_its_dequantised_bf16(checkpoints):
    _, fp8_dir, bf16_dir, quantised = checkpoints
    lazy, ref = conversion.LazyHFCheckpoint(fp8_dir), conversion.LazyHFCheckpoint(bf16_dir)
    assert set(lazy) == set(ref) and not any(k.endswith("_scale_inv") for k in lazy)
    for k in ref:
        a, b = lazy[k], ref[k]
        assert a.dtype == b.dtype and torch.equal(a, b), k
    before = lazy.reads
    lazy[quantised[0]]
    assert lazy.reads - before == 2  # the weight and its scale, nothing else


def test_fp8_checkpoint_converts_like_its_bf16_reference(checkpoints):
    card, fp8_dir, bf16_dir, _ = checkpoints
    got = conversion.hf_to_megatron(conversion.LazyHFCheckpoint(fp8_dir), card)
    want = conversion.hf_to_megatron(conversion.LazyHFCheckpoint(bf16_dir), card)
    assert got.keys() == want.keys()
    assert "mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.3.linear_fc1.weight" in got
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_conversion_streams_one_tensor_at_a_time(checkpoints):
    """Nothing the converter yielded stays alive once the caller dropped it and asked for the next one
    (memory is bounded by one converted tensor, not the checkpoint)."""
    card, fp8_dir, _, _ = checkpoints
    refs = []
    for _, t in conversion.iter_hf_to_megatron(conversion.LazyHFCheckpoint(fp8_dir), card):
        assert all(r() is None for r in refs), [i for i, r in enumerate(refs) if r() is not None]
        refs.append(weakref.ref(t))
        del t
    gc.collect()
    assert len(refs) > 100 and all(r() is None for r in refs)


@pytest.mark.parametrize("model_class", ["hybrid", "gpt"])
def test_launcher_loads_the_fp8_checkpoint(model_class, checkpoints, megatron_single_process):
    """The launchers' ``--hf`` path (load_hf_checkpoint into the spec model) gives the model the bf16
    reference's weights, under either model class's names."""
    from glm5_dsa_plugin.train import core

    _, fp8_dir, bf16_dir, _ = checkpoints
    args = core.base_parser("t").parse_args(["--hf", str(fp8_dir), "--backend", "reference", "--device", "cpu",
                                             "--model", model_class])
    card = core.load_card_from_args(args)
    model = core.build_model(args, card, core.model_config(args, card), mtp=True)
    want = conversion.hf_to_megatron(conversion.LazyHFCheckpoint(bf16_dir), card, model=model_class)
    state = model.state_dict()
    assert "mtp.layers.0.eh_proj.weight" in want
    for k, v in want.items():
        assert torch.equal(state[k], v.to(state[k].dtype)), k


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((48, 160), (128, 128)), ((300, 130), (128, 128)),
                                         ((37, 53), (16, 8))])
def test_dequantize_matches_a_blockwise_reference(shape, block):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=g) * 0.05
    q, s, ref = quantise_block_fp8(w, block=block)
    got = fp8.dequantize(q, s, block, name="w")
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)


def test_dequantize_matches_transformers_with_arbitrary_scales():
    """Non-power-of-two scales (rounding to bf16 matters): transformers' own FP8 dequantiser is the
    reference (it handles block-multiple shapes only)."""
    pytest.importorskip("triton")  # transformers' finegrained_fp8 module imports it
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(7)
    q = (torch.randn(256, 384, generator=g) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=g) * 1e-3 + 1e-5
    want = Fp8Dequantize(None)._dequantize_one(q, s, torch.bfloat16)
    assert torch.equal(fp8.dequantize(q, s, (128, 128)), want)


@pytest.mark.parametrize("field,value", [
    ("quant_method", "compressed-tensors"), ("quant_method", "modelopt"), ("fmt", "e5m2"),
    ("activation_scheme", "static"), ("weight_block_size", None), ("weight_block_size", [128]),
    ("weight_block_size", [0, 128]), ("scale_fmt", "ue8m0"), ("kv_cache_scheme", {"num_bits": 8}),
])
def test_unsupported_quantization_configs_are_refused(tmp_path, field, value):
    qc = dict(PUBLISHED_QC)
    qc[field] = value
    write_checkpoint(tmp_path, {"model.norm.weight": torch.ones(4, dtype=torch.bfloat16)}, qc)
    with pytest.raises(ValueError, match=re.escape(f"quantization_config.{field} = {value!r}")):
        conversion.LazyHFCheckpoint(tmp_path)


def test_bad_fp8_tensors_are_refused(tmp_path):
    q = torch.randn(48, 160).to(torch.float8_e4m3fn)
    # scales without a quantization_config
    write_checkpoint(tmp_path / "a", {"w.weight": q, "w.weight_scale_inv": torch.ones(1, 2)})
    with pytest.raises(ValueError, match="w.weight_scale_inv carry block-FP8 scales.*no quantization_config"):
        conversion.LazyHFCheckpoint(tmp_path / "a")
    # an fp8 weight without its scale
    write_checkpoint(tmp_path / "b", {"w.weight": q}, PUBLISHED_QC)
    with pytest.raises(ValueError, match="w.weight is torch.float8_e4m3fn but the checkpoint has no "
                                         "w.weight_scale_inv"):
        conversion.LazyHFCheckpoint(tmp_path / "b")["w.weight"]
    # a scale grid that does not fit the weight in 128x128 blocks
    write_checkpoint(tmp_path / "c", {"w.weight": q, "w.weight_scale_inv": torch.ones(1, 1)}, PUBLISHED_QC)
    with pytest.raises(ValueError, match=re.escape("w.weight_scale_inv: shape (1, 1), but weight (48, 160) in 128x128 "
                                                   "blocks needs (1, 2)")):
        conversion.LazyHFCheckpoint(tmp_path / "c")["w.weight"]
    # a non-finite scale
    write_checkpoint(tmp_path / "d", {"w.weight": q, "w.weight_scale_inv": torch.tensor([[1.0, float("inf")]])},
                     PUBLISHED_QC)
    with pytest.raises(ValueError, match=re.escape("w.weight_scale_inv: non-finite scale inf at block (0, 1)")):
        conversion.LazyHFCheckpoint(tmp_path / "d")["w.weight"]


def test_megatron_bridge_dequantises_fp8_checkpoints(checkpoints, megatron_single_process):
    """AutoBridge with our bridge loads the FP8 checkpoint into the same weights as its bf16 reference."""
    from glm5_dsa_plugin.megatron import te_compat

    te_compat.install()
    pytest.importorskip("glm5_dsa_plugin.bridge", reason="megatron-bridge not installed", exc_type=ImportError)
    from tiny_models import bridge_cpu_provider as _cpu_provider

    _, fp8_dir, bf16_dir, quantised = checkpoints
    models = []
    for folder in (fp8_dir, bf16_dir):
        b, prov = _cpu_provider(folder)
        torch.manual_seed(0)
        models.append(prov.provide())
        b.load_hf_weights([models[-1]])
    got, want = (dict(m.named_parameters()) for m in models)
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n
    # the reference's values are the dequantised ones, not the FP8 codes: a bare cast would differ
    q_a = "model.layers.0.self_attn.q_a_proj.weight"
    assert not torch.equal(conversion.LazyHFCheckpoint(bf16_dir)[q_a].float(),
                           conversion.LazyHFCheckpoint(fp8_dir)._read(q_a).float())
