"""Parameter names: GPTModel (``glm5_dsa_plugin.spec``) <-> HybridModel (``glm5_dsa_hybrid_stack_spec``).

For GLM-5.x patterns (:func:`glm5_dsa_plugin.checkpoints.hybrid_pattern.glm5_hybrid_layer_pattern`,
``D-`` / ``DE`` pairs, ``/DE`` MTP) one GPT decoder layer ``i`` is hybrid layers ``2i`` (its
``input_layernorm`` and ``self_attention``) and ``2i + 1`` (``pre_mlp_layernorm`` and ``mlp``; on
TE a dense layer's pre-MLP norm is ``mlp.linear_fc1.layer_norm_weight`` on both sides);
``decoder.final_layernorm`` is ``decoder.final_norm``; an MTP layer's inner transformer layer
``mtp.layers.j.mtp_model_layer.X`` is ``mtp.layers.j.mtp_model_layer.layers.{0, 1}.X`` by the same
attention / MLP split. Embedding, output layer and the MTP norms / projection keep their names.
Tensors are never changed, only renamed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["gpt_to_hybrid_name", "hybrid_to_gpt_name", "gpt_to_hybrid_state", "hybrid_to_gpt_state"]

_ATTENTION = ("input_layernorm.", "self_attention.", "self_attn_bda.")
_GPT_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_GPT_MTP = re.compile(r"^mtp\.layers\.(\d+)\.mtp_model_layer\.(.+)$")
_HYB_MTP = re.compile(r"^mtp\.layers\.(\d+)\.mtp_model_layer\.layers\.(\d+)\.(.+)$")
_GPT_FINAL, _HYB_FINAL = "decoder.final_layernorm.", "decoder.final_norm."


def _half(rest: str) -> int:
    """0: the attention half of a GPT layer (hybrid ``D``), 1: its MLP half (``-`` / ``E``)."""
    return 0 if rest.startswith(_ATTENTION) else 1


def gpt_to_hybrid_name(name: str) -> str:
    if name.startswith(_GPT_FINAL):
        return _HYB_FINAL + name[len(_GPT_FINAL):]
    m = _GPT_LAYER.match(name)
    if m:
        i, rest = int(m.group(1)), m.group(2)
        return f"decoder.layers.{2 * i + _half(rest)}.{rest}"
    m = _GPT_MTP.match(name)
    if m:
        return f"mtp.layers.{m.group(1)}.mtp_model_layer.layers.{_half(m.group(2))}.{m.group(2)}"
    return name


def hybrid_to_gpt_name(name: str) -> str:
    """Inverse of :func:`gpt_to_hybrid_name`; refuses a name on the wrong half of its pair (e.g. an
    attention weight on an odd hybrid layer), which no GLM-5.x pattern produces."""
    if name.startswith(_HYB_FINAL):
        return _GPT_FINAL + name[len(_HYB_FINAL):]
    m = _HYB_MTP.match(name)
    if m:
        j, pos, rest = m.group(1), int(m.group(2)), m.group(3)
        if pos > 1 or _half(rest) != pos:
            raise ValueError(f"{name}: MTP layer position {pos} does not hold {rest!r} in a GLM-5.x 'DE' MTP depth")
        return f"mtp.layers.{j}.mtp_model_layer.{rest}"
    m = _GPT_LAYER.match(name)
    if m:
        j, rest = int(m.group(1)), m.group(2)
        if _half(rest) != j % 2:
            raise ValueError(f"{name}: hybrid layer {j} holds {rest!r}, but a GLM-5.x pattern puts attention on even "
                             f"layers (D) and MLPs on odd ones (- / E)")
        return f"decoder.layers.{j // 2}.{rest}"
    return name


def _renamed(state: Mapping, rename) -> dict:
    out = {}
    for k, v in state.items():
        new = rename(k)
        if new in out:
            raise ValueError(f"{k} and another key both map to {new}")
        out[new] = v
    return out


def gpt_to_hybrid_state(state: Mapping) -> dict:
    """A GPTModel state dict under HybridModel names (same tensors)."""
    return _renamed(state, gpt_to_hybrid_name)


def hybrid_to_gpt_state(state: Mapping) -> dict:
    """A HybridModel state dict under GPTModel names (same tensors)."""
    return _renamed(state, hybrid_to_gpt_name)
