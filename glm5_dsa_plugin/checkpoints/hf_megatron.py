"""HF <-> Megatron weight conversion for GLM-5 DSA (pure functions; no Megatron-Bridge needed).

Megatron names are those of a GPTModel built with :mod:`glm5_dsa_plugin.spec` (local path;
the TE path fuses a dense layer's pre-MLP norm into ``linear_fc1`` and is mapped by Megatron-Bridge),
or with ``model="hybrid"`` those of a HybridModel built with ``glm5_dsa_hybrid_stack_spec``
(:mod:`glm5_dsa_plugin.checkpoints.hybrid_names`).
HF names are the on-disk checkpoint names (per-expert keys), as ``save_pretrained`` writes them
and as the published GLM-5 shards hold them. The MTP layer ``i`` is HF decoder layer
``num_hidden_layers + i``. Block-FP8 checkpoints (the published ``GLM-5.x-FP8``) are read as bf16:
:class:`LazyHFCheckpoint` dequantises each weight with its ``weight_scale_inv`` when it is read
(:mod:`glm5_dsa_plugin.checkpoints.block_fp8`), and :func:`iter_hf_to_megatron` / :func:`load_hf_checkpoint` hold one
converted tensor at a time.

Layout notes:
  * dense / expert / shared-expert ``linear_fc1`` = ``cat([gate_proj, up_proj], dim=0)``;
  * the indexer keeps HF's layout (RoPE on its first ``qk_rope_head_dim`` channels, rotated as
    the config's ``indexer_rope_interleave`` says), so its weights map 1:1 -- our indexer module uses that layout internally;
  * q_b_proj / kv_b_proj / kv_a_proj_with_mqa per-head layouts ([nope | rope], [nope | v],
    [latent | rope]) are identical on both sides; MLA RoPE interleaving is handled in the
    rotary code on both sides, not in the weights.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from . import block_fp8
from .cards import index_sharing
from .hybrid_names import gpt_to_hybrid_name
from ..model.index_sharing import computes_indices

__all__ = ["LazyHFCheckpoint", "name_plan", "iter_hf_to_megatron", "hf_to_megatron", "load_hf_checkpoint",
           "megatron_to_hf", "save_hf_safetensors"]

# (megatron suffix, hf suffix) inside one decoder layer, 1:1 copies
_LAYER_1TO1 = [
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
    ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
    ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
    ("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("self_attention.core_attention.indexer.linear_wq_b.weight", "self_attn.indexer.wq_b.weight"),
    ("self_attention.core_attention.indexer.linear_wk.weight", "self_attn.indexer.wk.weight"),
    ("self_attention.core_attention.indexer.k_norm.weight", "self_attn.indexer.k_norm.weight"),
    ("self_attention.core_attention.indexer.k_norm.bias", "self_attn.indexer.k_norm.bias"),
    ("self_attention.core_attention.indexer.linear_weights_proj.weight", "self_attn.indexer.weights_proj.weight"),
    ("mlp.router.weight", "mlp.gate.weight"),
    ("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
    ("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight"),
]
# megatron fc1 = cat(gate, up): (megatron suffix, hf prefix without gate_proj/up_proj)
_LAYER_GLU = [("mlp.linear_fc1.weight", "mlp."), ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.")]
_EXPERT_FC1 = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight$")
_EXPERT_FC2 = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight$")
_MTP_1TO1 = [("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"), ("eh_proj.weight", "eh_proj.weight"),
             ("final_layernorm.weight", "shared_head.norm.weight")]
_MTP_ALIASES = {"shared_head.head.weight": "lm_head.weight", "embed_tokens.weight": "model.embed_tokens.weight"}
_GLOBAL = [("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
           ("decoder.final_layernorm.weight", "model.norm.weight"),
           ("output_layer.weight", "lm_head.weight")]


class LazyHFCheckpoint(Mapping):
    """Read-only mapping over an HF checkpoint folder; tensors are read from their shard on access.

    A block-FP8 checkpoint (``quantization_config`` in ``config.json``, see :mod:`glm5_dsa_plugin.checkpoints.block_fp8`)
    is presented as bf16: the ``*.weight_scale_inv`` tensors are not keys of the mapping, and reading a
    quantised ``*.weight`` reads it and its scale and returns the dequantised bf16 tensor. Nothing is
    cached: memory is one tensor (and its scale) per access. ``quantization_config`` overrides the one
    in ``config.json`` (for a folder without one)."""

    _NO_OVERRIDE = object()

    def __init__(self, path: str | os.PathLike, quantization_config=_NO_OVERRIDE):
        from safetensors import safe_open

        self._safe_open = safe_open
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            self._where = json.loads(index.read_text())["weight_map"]
        else:
            single = self.path / "model.safetensors"
            if not single.exists():
                raise FileNotFoundError(f"{path}: neither model.safetensors.index.json nor model.safetensors")
            with safe_open(str(single), "pt") as f:
                self._where = {k: "model.safetensors" for k in f.keys()}
        config = self.path / "config.json"
        if quantization_config is self._NO_OVERRIDE:
            quantization_config = (json.loads(config.read_text()).get("quantization_config")
                                   if config.exists() else None)
        self.quantization = block_fp8.parse_quantization_config(quantization_config, where=str(config))
        scales = [k for k in self._where if k.endswith(block_fp8.SCALE_SUFFIX)]
        if scales and self.quantization is None:
            raise ValueError(f"{path}: {len(scales)} tensors like {scales[0]} carry block-FP8 scales, but "
                             f"{config} has no quantization_config: pass LazyHFCheckpoint(path, "
                             f"quantization_config=...) with the checkpoint's published one")
        self._scale_of = {k[:-len(block_fp8.SCALE_SUFFIX)]: k for k in scales}
        orphans = [k for w, k in self._scale_of.items() if w not in self._where]
        if orphans:
            raise ValueError(f"{path}: scale {orphans[0]} has no weight {orphans[0][:-len(block_fp8.SCALE_SUFFIX)]}")
        self._keys = [k for k in self._where if not k.endswith(block_fp8.SCALE_SUFFIX)]
        self.reads = 0

    def _read(self, key: str) -> torch.Tensor:
        with self._safe_open(str(self.path / self._where[key]), "pt") as f:
            self.reads += 1
            return f.get_tensor(key)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self:
            raise KeyError(key)
        t = self._read(key)
        if key in self._scale_of:
            return block_fp8.dequantize(t, self._read(self._scale_of[key]), self.quantization.block, name=key)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{self.path}: {key} is {t.dtype} but the checkpoint has no {key}{block_fp8.SCALE_SUFFIX} "
                             f"to dequantise it with")
        return t

    def __contains__(self, key) -> bool:
        return key in self._where and not key.endswith(block_fp8.SCALE_SUFFIX)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _layer_pairs(meg_prefix: str, hf_prefix: str, card: dict, is_moe: bool, has_indexer: bool = True):
    """Yield (kind, megatron_name, hf_names) for one decoder layer. A GLM-5.2 layer that reuses an
    earlier layer's top-k (index sharing) has no indexer, in HF's model and in ours."""
    for m, h in _LAYER_1TO1:
        if ("router" in m or "shared_experts" in m) and not is_moe:
            continue
        if ".indexer." in m and not has_indexer:
            continue
        if m == "mlp.linear_fc2.weight" and is_moe:
            continue
        yield "copy", meg_prefix + m, [hf_prefix + h]
    for m, h in _LAYER_GLU:
        if ("shared_experts" in m) != is_moe:
            continue
        yield "glu", meg_prefix + m, [hf_prefix + h + "gate_proj.weight", hf_prefix + h + "up_proj.weight"]
    if is_moe:
        for e in range(card["n_routed_experts"]):
            ep = f"{hf_prefix}mlp.experts.{e}."
            yield "glu", f"{meg_prefix}mlp.experts.local_experts.{e}.linear_fc1.weight", [ep + "gate_proj.weight",
                                                                                      ep + "up_proj.weight"]
            yield "copy", f"{meg_prefix}mlp.experts.local_experts.{e}.linear_fc2.weight", [ep + "down_proj.weight"]


def name_plan(card: dict, include_mtp: bool = True, model: str = "gpt") -> list[tuple[str, str, list[str]]]:
    """Every (kind, megatron name, hf names) of a card's model; ``model``: ``"gpt"`` or ``"hybrid"`` names."""
    if model not in ("gpt", "hybrid"):
        raise ValueError(f"model must be 'gpt' or 'hybrid', got {model!r}")
    n, k = card["num_hidden_layers"], card.get("first_k_dense_replace", 0)
    plan = [("copy", m, [h]) for m, h in _GLOBAL]
    freq, offset = index_sharing(card)
    for i in range(n):
        plan += list(_layer_pairs(f"decoder.layers.{i}.", f"model.layers.{i}.", card, is_moe=i >= k,
                                  has_indexer=computes_indices(i + 1, freq, offset)))
    if include_mtp:
        for j in range(card.get("num_nextn_predict_layers", 0) or 0):
            hp, mp = f"model.layers.{n + j}.", f"mtp.layers.{j}."
            plan += [("copy", mp + m, [hp + h]) for m, h in _MTP_1TO1]
            plan += list(_layer_pairs(mp + "mtp_model_layer.", hp, card, is_moe=True))
    if model == "hybrid":
        plan = [(kind, gpt_to_hybrid_name(m), hs) for kind, m, hs in plan]
    return plan


_PER_EXPERT = re.compile(r"^(.*mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _hf_get(hf: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """An HF tensor by its checkpoint name; also reads transformers' in-memory fused experts
    (``experts.gate_up_proj`` [E, 2I, H] gate first, ``experts.down_proj`` [E, H, I])."""
    if name in hf:
        return hf[name]
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
    if which == "down_proj":
        fused = prefix + "down_proj"
        return hf[fused][e] if fused in hf else None
    fused = prefix + "gate_up_proj"
    if fused not in hf:
        return None
    gate, up = hf[fused][e].chunk(2, dim=0)
    return gate if which == "gate_proj" else up


def iter_hf_to_megatron(hf: Mapping[str, torch.Tensor], card: dict, include_mtp: bool | None = None,
                        model: str = "gpt") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Megatron name, tensor) one at a time, keeping no reference to what it yielded: with a
    :class:`LazyHFCheckpoint` the memory in flight is one converted tensor (and its HF sources).
    The MTP aliases (``shared_head.head`` / ``embed_tokens``) are checked against their targets last."""
    n = card["num_hidden_layers"]
    if include_mtp is None:
        include_mtp = f"model.layers.{n}.eh_proj.weight" in hf
    for kind, m, hs in name_plan(card, include_mtp, model):
        ts = [_hf_get(hf, h) for h in hs]
        missing = [h for h, t in zip(hs, ts) if t is None]
        if missing:
            raise KeyError(f"HF checkpoint lacks {missing} (needed for {m})")
        out = ts[0] if kind == "copy" else torch.cat(ts, dim=0)
        del ts
        yield m, out
        del out
    if include_mtp:
        for j in range(card.get("num_nextn_predict_layers", 0) or 0):
            for alias, target in _MTP_ALIASES.items():
                key = f"model.layers.{n + j}.{alias}"
                if key in hf and not torch.equal(hf[key], hf[target]):
                    raise ValueError(f"{key} differs from {target}: Megatron's MTP shares the embedding and output "
                                     f"layer, so this checkpoint cannot be represented exactly")


def hf_to_megatron(hf: Mapping[str, torch.Tensor], card: dict, include_mtp: bool | None = None,
                   model: str = "gpt") -> dict:
    """HF state (a dict, an in-memory ``state_dict()`` or :class:`LazyHFCheckpoint`) -> Megatron state dict
    (the whole converted model in memory; :func:`load_hf_checkpoint` streams into a model instead)."""
    return dict(iter_hf_to_megatron(hf, card, include_mtp, model))


def load_hf_checkpoint(model: torch.nn.Module, hf: Mapping[str, torch.Tensor], card: dict,
                       include_mtp: bool | None = None) -> tuple[list[str], list[str]]:
    """Copy an HF checkpoint into ``model``'s parameters / buffers tensor by tensor (cast to each
    destination's dtype; shapes must match exactly). Returns (missing, unexpected) Megatron names, as
    ``load_state_dict(strict=False)`` does; peak extra memory is one converted tensor. A HybridModel
    gets the hybrid names."""
    dest = model.state_dict(keep_vars=True)
    seen, unexpected = set(), []
    with torch.no_grad():
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        names = "hybrid" if isinstance(model, HybridModel) else "gpt"
        for name, t in iter_hf_to_megatron(hf, card, include_mtp, names):
            if name not in dest:
                unexpected.append(name)
                continue
            d = dest[name]
            if tuple(d.shape) != tuple(t.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(d.shape)}")
            d.copy_(t)
            seen.add(name)
    return [k for k in dest if k not in seen], unexpected


def megatron_to_hf(meg: Mapping[str, torch.Tensor], card: dict, include_mtp: bool | None = None,
                   model: str = "gpt") -> dict:
    """Megatron state dict -> HF checkpoint names (per-expert keys; MTP shared_head/embed written as copies)."""
    n = card["num_hidden_layers"]
    if include_mtp is None:
        include_mtp = "mtp.layers.0.eh_proj.weight" in meg
    out = {}
    for kind, m, hs in name_plan(card, include_mtp, model):
        if m not in meg:
            raise KeyError(f"Megatron state lacks {m}")
        t = meg[m]
        if kind == "copy":
            out[hs[0]] = t
        else:
            gate, up = t.chunk(2, dim=0)
            out[hs[0]], out[hs[1]] = gate, up
    if include_mtp:
        for j in range(card.get("num_nextn_predict_layers", 0) or 0):
            for alias, target in _MTP_ALIASES.items():
                out[f"model.layers.{n + j}.{alias}"] = out[target]
    return out


def save_hf_safetensors(state: Mapping[str, torch.Tensor], folder: str | os.PathLike, max_shard_bytes: int = 1 << 30):
    """Write ``state`` as (sharded) safetensors + index, HF style."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards, cur, size = [], {}, 0
    for k in sorted(state):
        t = state[k].contiguous()
        if cur and size + t.numel() * t.element_size() > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = t.clone()
        size += t.numel() * t.element_size()
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
