"""slime / miles GLM-5 checkpoint names and layouts -> ours (pure functions on name -> tensor dicts).

slime's and miles' GLM-5 model (``slime_plugins.models.glm5``, ``miles_plugins.models.glm5``) is a
TransformerEngine model whose attention module holds the indexer directly and fuses the MLA norms
into the up projections. Per decoder layer (and per MTP layer, under ``transformer_layer.``):

=================================================  ================================================
slime / miles                                      ours
=================================================  ================================================
``self_attention.linear_q_up_proj.layer_norm_weight``   ``self_attention.q_layernorm.weight``
``self_attention.linear_kv_up_proj.layer_norm_weight``  ``self_attention.kv_layernorm.weight``
``mlp.linear_fc1.layer_norm_weight`` (dense layers)     ``pre_mlp_layernorm.weight``
``self_attention.wq_b.weight``                     ``self_attention.core_attention.indexer.linear_wq_b.weight``
``self_attention.wk.weight``                       ``self_attention.core_attention.indexer.linear_wk.weight``
``self_attention.k_norm.{weight,bias}``            ``self_attention.core_attention.indexer.k_norm.{weight,bias}``
``self_attention.weights_proj.weight``             ``self_attention.core_attention.indexer.linear_weights_proj.weight``
``mlp.experts.linear_fc{1,2}.weight{E}`` (module)  ``mlp.experts.local_experts.{E}.linear_fc{1,2}.weight``
``mtp.layers.{j}.transformer_layer.*`` (module)    ``mtp.layers.{j}.mtp_model_layer.*``
=================================================  ================================================

Every other name is the same (embedding, output layer, norms, MLA projections, router, shared
experts, MTP ``enorm`` / ``hnorm`` / ``eh_proj`` / ``final_layernorm``); ``module.`` wrapper
prefixes are dropped. Keys inside a torch_dist checkpoint (megatron-core's sharded keys:
``...mlp.experts.experts.linear_fc1.weight`` for the experts on both sides, ``mtp.layers.{j}.
transformer_layer.*`` for the MTP layer on both sides, optimizer states keyed by the parameter's
name) are renamed by the same rules except those two (``keys="torch_dist"``).

Layout: slime stores the indexer's query / key channels of each head as [no-RoPE | RoPE] (it
rotates HF's [RoPE | no-RoPE] order when it converts an HF checkpoint; ``hf_to_megatron/deepseek.py``
hard-codes GLM-5's 128 / 64); ours keep HF's order, so ``wq_b`` (per head), ``wk`` and ``k_norm``
are rotated back by ``rope_dim`` channels. Layers that reuse another layer's indices (GLM-5.2
index sharing) have no indexer in our model: slime builds one there that is never used, and its
weights are dropped (listed in the report).
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping

import torch

from ..model.index_sharing import computes_indices

__all__ = ["convert_name", "rotate_indexer", "convert_state", "geometry", "read_checkpoint", "write_checkpoint"]

_INDEXER = {
    "wq_b.weight": "linear_wq_b.weight",
    "wk.weight": "linear_wk.weight",
    "k_norm.weight": "k_norm.weight",
    "k_norm.bias": "k_norm.bias",
    "weights_proj.weight": "linear_weights_proj.weight",
}
_FUSED_NORMS = {
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LAYER = re.compile(r"^(?P<pre>.*?)(?P<where>decoder\.layers\.(?P<i>\d+)\.|mtp\.layers\.(?P<j>\d+)\.(?:transformer_layer|mtp_model_layer)\.)(?P<rest>.+)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")


def _rename_rest(rest: str) -> tuple[str, str | None]:
    """(our in-layer name, indexer leaf or None)."""
    if rest in _FUSED_NORMS:
        return _FUSED_NORMS[rest], None
    if rest.startswith("self_attention."):
        leaf = rest[len("self_attention."):]
        if leaf in _INDEXER:
            return "self_attention.core_attention.indexer." + _INDEXER[leaf], leaf
    m = _GROUPED_EXPERT.match(rest)
    if m:
        return f"mlp.experts.local_experts.{m.group(2)}.linear_fc{m.group(1)}.weight", None
    return rest, None


def convert_name(name: str, topk_freq: int = 1, skip_offset: int = 0, keys: str = "module"
                 ) -> tuple[str | None, str | None]:
    """slime name -> (our name or None when the tensor has no place in our model, indexer leaf).

    ``keys``: ``"module"`` for ``state_dict()`` names, ``"torch_dist"`` for megatron-core's sharded
    keys (whose MTP layer is ``transformer_layer`` in megatron-core 0.19.2 as well).

    ``topk_freq`` / ``skip_offset``: the index-sharing schedule (HF ``index_topk_freq`` /
    ``index_skip_topk_offset``); decoder layer i (0-based) computes indices iff
    ``index_sharing.computes_indices(i + 1, freq, offset)``."""
    while name.startswith("module."):
        name = name[len("module."):]
    name = re.sub(r"(^|\.)module\.", r"\1", name)
    m = _LAYER.match(name)
    if m is None:
        return name, None
    rest, leaf = _rename_rest(m.group("rest"))
    if m.group("i") is not None:
        where = m.group("where")
        if leaf is not None and not computes_indices(int(m.group("i")) + 1, topk_freq, skip_offset):
            return None, leaf
    else:
        inner = "transformer_layer" if keys == "torch_dist" else "mtp_model_layer"
        where = f"mtp.layers.{m.group('j')}.{inner}."
    return m.group("pre") + where + rest, leaf


def rotate_indexer(leaf: str, t: torch.Tensor, head_dim: int, rope_dim: int) -> torch.Tensor:
    """slime's [no-RoPE | RoPE] channel order of one indexer tensor -> HF's / ours [RoPE | no-RoPE].

    ``wq_b`` [n_heads * head_dim, q_lora_rank]: per head; ``wk`` [head_dim, hidden]; ``k_norm``
    weight / bias [head_dim]; ``weights_proj`` unchanged."""
    if leaf == "weights_proj.weight":
        return t
    keep = head_dim - rope_dim
    if leaf == "wq_b.weight":
        if t.shape[0] % head_dim:
            raise ValueError(f"wq_b.weight rows {t.shape[0]} are not a multiple of the indexer head dim {head_dim}")
        h = t.reshape(-1, head_dim, *t.shape[1:])
        return torch.cat((h[:, keep:], h[:, :keep]), dim=1).reshape(t.shape)
    if t.shape[0] != head_dim:
        raise ValueError(f"{leaf}: first dim {t.shape[0]} != indexer head dim {head_dim}")
    return torch.cat((t[keep:], t[:keep]), dim=0)


def convert_state(state: Mapping[str, torch.Tensor], head_dim: int, rope_dim: int, topk_freq: int = 1,
                  skip_offset: int = 0, keys: str = "module") -> tuple[dict, dict]:
    """slime / miles state (module names or torch_dist keys) -> ours. Returns (state, report) with
    report = {"renamed": n, "rotated": [names], "dropped": [names]}. Non-tensor values (torch_dist
    bookkeeping) pass through renamed. Raises ``ValueError`` if two names map to one."""
    out, rotated, dropped, renamed = {}, [], [], 0
    for name, value in state.items():
        new, leaf = convert_name(name, topk_freq, skip_offset, keys)
        if new is None:
            dropped.append(name)
            continue
        if new in out:
            raise ValueError(f"{name!r} and another tensor both convert to {new!r}")
        # parameters and their optimizer moments (same shape) are rotated; scalars (Adam's step) are not
        if leaf not in (None, "weights_proj.weight") and isinstance(value, torch.Tensor) and value.dim() > 0:
            value = rotate_indexer(leaf, value, head_dim, rope_dim)
            rotated.append(new)
        renamed += new != name
        out[new] = value
    return out, {"renamed": renamed, "rotated": rotated, "dropped": dropped}


def geometry(hf_config: Mapping) -> dict:
    """What :func:`convert_state` needs, from an HF config dict (or a model card)."""
    from .cards import dsa_geometry

    g = dsa_geometry(hf_config)
    return {"head_dim": g["dsa_indexer_head_dim"], "rope_dim": hf_config["qk_rope_head_dim"],
            "topk_freq": g["dsa_indexer_topk_freq"], "skip_offset": g["dsa_indexer_skip_topk_offset"]}


def read_checkpoint(path) -> dict:
    """A torch_dist / torch.distributed.checkpoint folder (every tensor as its global tensor) or a
    ``torch.save`` file (a state dict, or a dict with the state dict under ``"model"``)."""
    import tempfile
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(p), f"{tmp}/state.pt")
            return torch.load(f"{tmp}/state.pt", map_location="cpu", weights_only=False)
    state = torch.load(p, map_location="cpu", weights_only=False)
    return state["model"] if isinstance(state, dict) and isinstance(state.get("model"), dict) else state


def write_checkpoint(state: dict, path, like=None) -> None:
    """``state`` as a torch.distributed.checkpoint folder (a folder path) or a ``torch.save`` file
    (a path ending in ``.pt``). ``like``: the source folder, whose ``metadata.json`` / ``common.pt``
    (megatron-core's torch_dist bookkeeping) are copied alongside."""
    import shutil
    from pathlib import Path

    p = Path(path)
    if p.suffix == ".pt":
        p.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, p)
        return
    import torch.distributed.checkpoint as dcp

    p.mkdir(parents=True, exist_ok=True)
    # megatron-core stores a non-tensor value (its common state, TE extra state) as one torch.save'd
    # byte stream of a list; reading gives that list back, so write it the same way (plain DCP
    # would traverse a list holding an empty dict and store nothing)
    out = {}
    for k, v in state.items():
        if isinstance(v, (torch.Tensor, io.BytesIO)):
            out[k] = v
        else:
            out[k] = io.BytesIO()
            torch.save(v, out[k])
            out[k].seek(0)
    # megatron-core's save planner writes a BytesIO as its bytes (the default one would pickle it)
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    dcp.save(out, storage_writer=dcp.FileSystemWriter(str(p)), planner=MCoreSavePlanner(flatten_state_dict=False),
             no_dist=True)
    if like is not None and Path(like).is_dir():
        for extra in ("metadata.json", "common.pt"):
            if (Path(like) / extra).exists():
                shutil.copy(Path(like) / extra, p / extra)
