"""HF <-> Megatron weight conversion for GLM-5 DSA (pure functions; no Megatron-Bridge needed).

Megatron names are those of a GPTModel built with :mod:`glm5_dsa_plugin.spec` (local path;
TE fuses the input norms into the down projections and is mapped by Megatron-Bridge).
HF names are the on-disk checkpoint names (per-expert keys), as ``save_pretrained`` writes them
and as the published GLM-5 shards hold them. The MTP layer ``i`` is HF decoder layer
``num_hidden_layers + i``.

Layout notes:
  * dense / expert / shared-expert ``linear_fc1`` = ``cat([gate_proj, up_proj], dim=0)``;
  * the indexer keeps HF's layout (RoPE on its first ``qk_rope_head_dim`` channels, half
    split), so its weights map 1:1 -- our indexer module uses that layout internally;
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
    """Read-only mapping over an HF checkpoint folder; tensors are read from their shard on access."""

    def __init__(self, path: str | os.PathLike):
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
        self.reads = 0

    def __getitem__(self, key: str) -> torch.Tensor:
        shard = self._where[key]
        with self._safe_open(str(self.path / shard), "pt") as f:
            self.reads += 1
            return f.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _layer_pairs(meg_prefix: str, hf_prefix: str, card: dict, is_moe: bool):
    """Yield (kind, megatron_name, hf_names) for one decoder layer."""
    for m, h in _LAYER_1TO1:
        if ("router" in m or "shared_experts" in m) and not is_moe:
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


def name_plan(card: dict, include_mtp: bool = True) -> list[tuple[str, str, list[str]]]:
    """Every (kind, megatron name, hf names) of a card's model."""
    n, k = card["num_hidden_layers"], card.get("first_k_dense_replace", 0)
    plan = [("copy", m, [h]) for m, h in _GLOBAL]
    for i in range(n):
        plan += list(_layer_pairs(f"decoder.layers.{i}.", f"model.layers.{i}.", card, is_moe=i >= k))
    if include_mtp:
        for j in range(card.get("num_nextn_predict_layers", 0) or 0):
            hp, mp = f"model.layers.{n + j}.", f"mtp.layers.{j}."
            plan += [("copy", mp + m, [hp + h]) for m, h in _MTP_1TO1]
            plan += list(_layer_pairs(mp + "mtp_model_layer.", hp, card, is_moe=True))
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


def hf_to_megatron(hf: Mapping[str, torch.Tensor], card: dict, include_mtp: bool | None = None) -> dict:
    """HF state (a dict, an in-memory ``state_dict()`` or :class:`LazyHFCheckpoint`) -> Megatron state dict."""
    n = card["num_hidden_layers"]
    if include_mtp is None:
        include_mtp = f"model.layers.{n}.eh_proj.weight" in hf
    out = {}
    for kind, m, hs in name_plan(card, include_mtp):
        ts = [_hf_get(hf, h) for h in hs]
        missing = [h for h, t in zip(hs, ts) if t is None]
        if missing:
            raise KeyError(f"HF checkpoint lacks {missing} (needed for {m})")
        out[m] = ts[0] if kind == "copy" else torch.cat(ts, dim=0)
    if include_mtp:
        for j in range(card.get("num_nextn_predict_layers", 0) or 0):
            for alias, target in _MTP_ALIASES.items():
                key = f"model.layers.{n + j}.{alias}"
                if key in hf and not torch.equal(hf[key], hf[target]):
                    raise ValueError(f"{key} differs from {target}: Megatron's MTP shares the embedding and output "
                                     f"layer, so this checkpoint cannot be represented exactly")
    return out


def megatron_to_hf(meg: Mapping[str, torch.Tensor], card: dict, include_mtp: bool | None = None) -> dict:
    """Megatron state dict -> HF checkpoint names (per-expert keys; MTP shared_head/embed written as copies)."""
    n = card["num_hidden_layers"]
    if include_mtp is None:
        include_mtp = "mtp.layers.0.eh_proj.weight" in meg
    out = {}
    for kind, m, hs in name_plan(card, include_mtp):
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
