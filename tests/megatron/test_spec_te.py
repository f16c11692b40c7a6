"""The TransformerEngine form of glm5_dsa_plugin.spec against megatron-core 0.19.2's own DSA spec.

megatron-core builds a DSA model with ``get_transformer_block_with_experimental_attention_variant_spec``
(and ``get_gpt_mtp_block_spec`` for MTP). Ours must choose the same TE submodules for every layer
kind: the only intended difference is the core attention (our ``GLM5DSAttention`` / ``GLM5DSAIndexer``
in place of ``DSAttention`` / ``DSAIndexer``, with the same submodule fields).

TransformerEngine is not needed: spec construction only names classes. Without TE, ``fake_te`` makes
``import transformer_engine`` succeed and sets the TE version megatron-core reads (TE >= 1.9 picks
``TENorm`` for q/k norms) while both specs are built; megatron-core's TE wrapper classes are then its
own placeholders, the same objects on both sides, and are named here by their attribute name in
``megatron.core.extensions.transformer_engine``. Where TE is installed the real classes are compared."""

import dataclasses
import enum
import functools
import sys
import types

import pytest

from glm5_dsa_plugin.model import attention as ours_attention
from glm5_dsa_plugin.model.absorbed_mla import GLM5AbsorbedMLA
from glm5_dsa_plugin.megatron import spec
from megatron_cpu import megatron_single_process  # noqa: F401
from tiny_models import tiny_config

# our core attention classes -> the megatron-core classes they stand in for
_OURS_FOR_MC = {
    ours_attention.GLM5DSAttention: "megatron.core.transformer.experimental_attention_variant.dsa.DSAttention",
    ours_attention.GLM5DSAttentionSubmodules:
        "megatron.core.transformer.experimental_attention_variant.dsa.DSAttentionSubmodules",
    ours_attention.GLM5DSAIndexer: "megatron.core.transformer.experimental_attention_variant.dsa.DSAIndexer",
    ours_attention.GLM5DSAIndexerSubmodules:
        "megatron.core.transformer.experimental_attention_variant.dsa.DSAIndexerSubmodules",
    # megatron-core's absorbed MLA with its query absorbed in place (same parameters and interface)
    GLM5AbsorbedMLA: "megatron.core.transformer.experimental_attention_variant.absorbed_mla.AbsorbedMLASelfAttention",
}


def mc_te_available() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return HAVE_TE


@pytest.fixture
def fake_te(monkeypatch, megatron_single_process):
    """TE importable (as an empty module) and reported as version 2.8 while specs are built."""
    from packaging.version import Version

    import megatron.core.utils as mc_utils
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as mc_exp
    from megatron.core.models.gpt import gpt_layer_specs as mc_gpt

    if not mc_te_available():
        monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
        monkeypatch.setattr(mc_utils, "_te_version", Version("2.8.0"))
    # without TE these modules leave TESpecProvider unset / None at import
    monkeypatch.setattr(mc_exp, "TESpecProvider", TESpecProvider, raising=False)
    monkeypatch.setattr(mc_gpt, "TESpecProvider", TESpecProvider)
    return mc_exp, mc_gpt


def _te_names():
    """id -> name of megatron-core's TE wrapper classes (placeholders without TE, classes with it)."""
    from unittest.mock import NonCallableMock

    import megatron.core.extensions.transformer_engine as mc_te

    return {id(v): f"{mc_te.__name__}.{k}" for k, v in vars(mc_te).items()
            if isinstance(v, NonCallableMock) or (isinstance(v, type) and v.__module__ == mc_te.__name__)}


def _name(obj, te_names):
    if id(obj) in te_names:  # first: a placeholder mocks ``str`` and would pass the checks below
        return te_names[id(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, types.MethodType):  # e.g. MLP.as_mlp_submodule
        return f"{_name(obj.__self__, te_names)}.{obj.__func__.__name__}"
    if obj in _OURS_FOR_MC:
        return _OURS_FOR_MC[obj]
    return f"{obj.__module__}.{obj.__qualname__}"


def tree(obj, te_names):
    """A comparable, readable form of a spec: classes by qualified name, specs / partials /
    submodule dataclasses recursively by field."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if id(obj) in te_names:
        return te_names[id(obj)]
    if isinstance(obj, ModuleSpec):
        params = obj.params
        if obj.module is ours_attention.GLM5DSAttention:  # our constructor arguments megatron-core's DSAttention lacks
            params = {k: v for k, v in params.items() if k not in ("cp_layout", "is_mtp")}
        return {"module": _name(obj.module, te_names), "params": tree(params, te_names),
                "submodules": tree(obj.submodules, te_names), "metainfo": tree(obj.metainfo, te_names)}
    if isinstance(obj, functools.partial):
        return {"partial": _name(obj.func, te_names), "args": [tree(a, te_names) for a in obj.args],
                "keywords": tree(obj.keywords, te_names)}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"dataclass": _name(type(obj), te_names),
                **{f.name: tree(getattr(obj, f.name), te_names) for f in dataclasses.fields(obj)}}
    if isinstance(obj, dict):
        return {k: tree(v, te_names) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [tree(v, te_names) for v in obj]
    if isinstance(obj, enum.Enum):
        return f"{_name(type(obj), te_names)}.{obj.name}"
    return _name(obj, te_names)


def _diff(a, b, path=""):
    """First differing leaves (for a readable failure)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _diff(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: ours {a!r} != megatron-core {b!r}"]


def _te_config(**over):
    over.setdefault("transformer_impl", "transformer_engine")
    return tiny_config(**over)[1]


@pytest.mark.parametrize("sharing", [False, True], ids=["every-layer-indexer", "index-sharing"])
def test_te_decoder_block_matches_megatron_core(fake_te, sharing):
    """Every decoder layer (dense layers 0-1, MoE layers 2-3; with index sharing, layers 2 and 4
    reuse indices) and the final norm: the same submodules as megatron-core's own DSA block."""
    mc_exp, _ = fake_te
    over = dict(dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1) if sharing else {}
    cfg = _te_config(**over)
    ours = spec.get_glm5_dsa_spec(None, cfg)
    ref = mc_exp.get_transformer_block_with_experimental_attention_variant_spec(cfg)
    te_names = _te_names()
    assert len(ours.layer_specs) == len(ref.layer_specs) == 4
    problems = _diff(tree(ours.layer_norm, te_names), tree(ref.layer_norm, te_names), "final_layernorm")
    for i, (a, b) in enumerate(zip(ours.layer_specs, ref.layer_specs)):
        problems += _diff(tree(a, te_names), tree(b, te_names), f"layer{i}")
    assert not problems, "\n".join(problems)


def test_te_dense_layer_has_one_pre_mlp_norm(fake_te):
    """The dense MLP's linear_fc1 is TELayerNormColumnParallelLinear (it normalises), so the layer's
    pre_mlp_layernorm is IdentityOp; a MoE layer keeps its own norm (its experts do not normalise)."""
    from megatron.core.transformer.identity_op import IdentityOp

    cfg = _te_config()
    te_names = _te_names()
    dense = spec.layer_submodules(cfg, is_moe=False)
    assert _name(dense.mlp.keywords["submodules"].linear_fc1, te_names).endswith("TELayerNormColumnParallelLinear")
    assert dense.pre_mlp_layernorm is IdentityOp
    moe = spec.layer_submodules(cfg, is_moe=True)
    assert _name(moe.pre_mlp_layernorm, te_names).endswith("TENorm")


def test_te_mtp_block_matches_megatron_core(fake_te):
    """The MTP block (enorm / hnorm / eh_proj / final norm and its MoE transformer layer) equals what
    megatron-core builds from its own DSA block spec."""
    mc_exp, mc_gpt = fake_te
    cfg = _te_config()
    ours = spec.get_glm5_dsa_mtp_spec(None, cfg)
    ref_block = mc_exp.get_transformer_block_with_experimental_attention_variant_spec(cfg)
    ref = mc_gpt.get_gpt_mtp_block_spec(cfg, ref_block, use_transformer_engine=True)
    te_names = _te_names()
    assert len(ours.layer_specs) == len(ref.layer_specs) == 1
    problems = _diff(tree(ours, te_names), tree(ref, te_names), "mtp")
    assert not problems, "\n".join(problems)
    # the MTP layer computes its own top-k (indexer replay and recording skip it)
    att = ours.layer_specs[0].submodules.mtp_model_layer.submodules.self_attention
    assert att.submodules.core_attention.params["is_mtp"] is True


def test_te_slime_allgather_cp_differs_only_in_the_mla_class(fake_te):
    """slime's --allgather-cp at CP = 2: every layer's self-attention is ContiguousCPAbsorbedMLA
    (megatron-core's MLA with RoPE at the contiguous layout's positions); with that class named as
    megatron-core's, the block equals megatron-core's own DSA block."""
    import argparse

    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention

    from glm5_dsa_plugin.model.contiguous_cp_mla import ContiguousCPAbsorbedMLA

    mc_exp, _ = fake_te
    cfg = _te_config(context_parallel_size=2, cp_comm_type="allgather")
    ours = spec.get_glm5_dsa_spec(argparse.Namespace(allgather_cp=True), cfg)
    ref = mc_exp.get_transformer_block_with_experimental_attention_variant_spec(cfg)
    te_names = _te_names()
    attention = [a.submodules.self_attention for a in ours.layer_specs]
    for i, att in enumerate(attention):
        assert att.module is ContiguousCPAbsorbedMLA, f"layer{i}"
        assert att.submodules.core_attention.params["cp_layout"] == "contiguous", f"layer{i}"
    for att in attention:  # our spec objects (shared by layers of one kind), built for this test
        att.module = AbsorbedMLASelfAttention
    problems = []
    for i, (a, b) in enumerate(zip(ours.layer_specs, ref.layer_specs)):
        problems += _diff(tree(a, te_names), tree(b, te_names), f"layer{i}")
    assert len(ours.layer_specs) == len(ref.layer_specs) == 4
    assert not problems, "\n".join(problems)
