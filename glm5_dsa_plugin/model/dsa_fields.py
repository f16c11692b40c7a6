"""Every DSA field of megatron-core 0.19.2's ``TransformerConfig``: honoured, or refused at build time.

``check_dsa_config(config)`` runs when :class:`glm5_dsa_plugin.model.attention.GLM5DSAttention` is
built. A field set to a value our modules do not implement raises ``ValueError`` naming the
field, its value and what to set instead; nothing is silently ignored.

| field | here |
|---|---|
| ``dsa_indexer_n_heads`` / ``_head_dim`` / ``_topk`` | used |
| ``dsa_indexer_topk_freq`` / ``_skip_topk_offset`` | used (index sharing) |
| ``dsa_indexer_loss_coeff`` | used (None = 0: no indexer loss) |
| ``dsa_indexer_use_sparse_loss`` | True only, when the loss is on (coeff > 0): our KL loss is the sparse one, over the selected slots; megatron-core's default False is its dense loss over every visible key |
| ``dsa_indexer_rope_interleaved`` | used (both conventions) |
| ``dsa_indexer_rotate_activation`` | either value: see below |
| ``dsa_indexer_scoring_relu`` | True only |
| ``dsa_indexer_k_norm_epsilon`` | used; None = ``layernorm_epsilon``, as in megatron-core |
| ``dsa_indexer_k_norm_fp32`` | used |
| ``dsa_kernel_backend`` | "none" only: it picks megatron-core's own fused kernels, which never run here; ``dsa_sparse_mla_backend`` picks ours |
| ``dsa_indexer_precision`` (ours, megatron-core's pending name) | "bf16" (default) or "fp8": :mod:`.rollout_numerics` |
| ``dsa_kv_fp8_qat`` (ours) | False (default) or True: :mod:`.rollout_numerics` |
| ``dsa_sparse_mla_backend`` / ``dsa_nonfinite_policy`` (ours) | the call's backend and guard policy: :mod:`.switches` |

Any other ``dsa_*`` attribute on the config (a misspelt switch) is refused.

``dsa_indexer_rotate_activation`` multiplies the indexer q and k by the same orthonormal
Hadamard matrix ``Had / sqrt(Di)``; every score is a dot product q . k, which that rotation
leaves unchanged, so the indexer is the same with and without it. That holds when ``Di`` is a
power of two (GLM-5: 128); otherwise megatron-core's transform zero-pads to the next power of
two and truncates, which is not orthonormal, and a True is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import rollout_numerics, switches

__all__ = ["KNOWN_DSA_FIELDS", "PLUGIN_DSA_FIELDS", "DSAGeometry", "dsa_geometry", "check_dsa_config"]

# megatron-core 0.19.2 TransformerConfig DSA fields (tests compare this list with the dataclass)
KNOWN_DSA_FIELDS = (
    "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_topk_freq",
    "dsa_indexer_skip_topk_offset", "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss", "dsa_kernel_backend",
    "dsa_indexer_rope_interleaved", "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu",
    "dsa_indexer_k_norm_epsilon", "dsa_indexer_k_norm_fp32",
)

# fields this plugin adds (set as config attributes by the launchers)
PLUGIN_DSA_FIELDS = rollout_numerics.FIELDS + switches.FIELDS


@dataclass(frozen=True)
class DSAGeometry:
    """A model's DSA geometry, resolved once from its ``TransformerConfig`` (:func:`dsa_geometry`)
    and passed to what needs it instead of re-reading (and re-defaulting) the config fields.

    ``topk``: keys per query row (``dsa_indexer_topk``). ``topk_freq`` >= 1 and ``skip_offset`` >= 0:
    the index-sharing schedule (``dsa_indexer_topk_freq`` / ``dsa_indexer_skip_topk_offset``, None
    read as megatron-core's defaults 1 / 0): 1-indexed layer L computes its own indices iff
    ``max(L - max(skip_offset, 1), 0) % topk_freq == 0``, else it reuses the last computing layer's.
    ``indexer_heads`` / ``indexer_head_dim``: the indexer's heads and their width;
    ``rope_interleaved``: the indexer's RoPE convention (``dsa_indexer_rope_interleaved``).
    """

    topk: int | None
    topk_freq: int = 1
    skip_offset: int = 0
    indexer_heads: int | None = None
    indexer_head_dim: int | None = None
    rope_interleaved: bool = False

    def __post_init__(self):
        if not isinstance(self.topk_freq, int) or self.topk_freq < 1:
            _refuse("dsa_indexer_topk_freq", self.topk_freq, "index sharing needs a period of 1 or more",
                    "set 1 (every layer computes its indices) or more")
        if not isinstance(self.skip_offset, int) or self.skip_offset < 0:
            _refuse("dsa_indexer_skip_topk_offset", self.skip_offset, "a negative offset", "set 0 or more")

    def computes_indices(self, layer_number: int) -> bool:
        """Whether 1-indexed ``layer_number`` runs its indexer (else it reuses :meth:`source_layer`'s)."""
        from .index_sharing import computes_indices

        return computes_indices(layer_number, self.topk_freq, self.skip_offset)

    def source_layer(self, layer_number: int) -> int:
        """The computing layer whose indices 1-indexed ``layer_number`` uses (itself if it computes)."""
        from .index_sharing import index_source_layer

        return index_source_layer(layer_number, self.topk_freq, self.skip_offset)

    def check_stage_layers(self, first_layer: int, last_layer: int) -> None:
        """ValueError when a pipeline stage owning 1-indexed layers [first, last] starts on a reusing layer."""
        from .index_sharing import check_stage_layers

        check_stage_layers(first_layer, last_layer, self.topk_freq, self.skip_offset)


def dsa_geometry(config) -> DSAGeometry:
    """The :class:`DSAGeometry` of a ``TransformerConfig`` (or any object with its ``dsa_*`` fields;
    a missing field reads as megatron-core's default)."""
    freq = getattr(config, "dsa_indexer_topk_freq", None)
    offset = getattr(config, "dsa_indexer_skip_topk_offset", None)
    return DSAGeometry(topk=getattr(config, "dsa_indexer_topk", None),
                       topk_freq=1 if freq is None else freq, skip_offset=0 if offset is None else offset,
                       indexer_heads=getattr(config, "dsa_indexer_n_heads", None),
                       indexer_head_dim=getattr(config, "dsa_indexer_head_dim", None),
                       rope_interleaved=bool(getattr(config, "dsa_indexer_rope_interleaved", False)))


def _refuse(field: str, value, why: str, fix: str) -> None:
    raise ValueError(f"glm5_dsa_plugin: config.{field}={value!r} is not supported: {why}; {fix}")


def check_dsa_config(config) -> None:
    """Raise ``ValueError`` for a DSA field value the GLM-5 DSA modules do not implement."""
    known = set(KNOWN_DSA_FIELDS) | set(PLUGIN_DSA_FIELDS)
    unknown = sorted(k for k in getattr(config, "__dict__", {}) if k.startswith("dsa_") and k not in known)
    if unknown:
        _refuse(unknown[0], getattr(config, unknown[0]), "no DSA field has that name",
                f"use one of {sorted(known)}")
    rollout_numerics.check(config)
    switches.check(config)
    coeff = getattr(config, "dsa_indexer_loss_coeff", None) or 0.0
    if coeff < 0:
        _refuse("dsa_indexer_loss_coeff", coeff, "a negative loss coefficient", "set it to 0 (off) or above")
    if coeff > 0 and not getattr(config, "dsa_indexer_use_sparse_loss", True):
        _refuse("dsa_indexer_use_sparse_loss", False,
                "megatron-core's dense indexer loss (KL over every visible key, needing the full attention "
                "distribution of each row) is not implemented; the indexer loss here is the sparse one, over the "
                "top-k selected slots (megatron-core's dsa_indexer_use_sparse_loss=True)",
                "set dsa_indexer_use_sparse_loss=True (--dsa-indexer-use-sparse-loss), or dsa_indexer_loss_coeff=0")
    if not getattr(config, "dsa_indexer_scoring_relu", True):
        _refuse("dsa_indexer_scoring_relu", False, "the indexer scores are relu(q . k) (GLM-5.x, DeepSeek-V3.2)",
                "set dsa_indexer_scoring_relu=True")
    backend = getattr(config, "dsa_kernel_backend", "none")
    if backend not in (None, "none"):
        _refuse("dsa_kernel_backend", backend,
                "it selects megatron-core's fused DSA kernels, which GLM5DSAttention never runs (its attention is "
                "glm5_dsa_plugin.ops.sparse_mla)",
                "set dsa_kernel_backend='none' and choose the sparse-MLA kernels with config.dsa_sparse_mla_backend "
                "('auto', 'reference' or 'tilelang'; the launchers' --backend, or GLM5_DSA_BACKEND)")
    head_dim = getattr(config, "dsa_indexer_head_dim", None)
    rope_dim = getattr(config, "qk_pos_emb_head_dim", None)
    if head_dim and rope_dim and head_dim < rope_dim:
        _refuse("dsa_indexer_head_dim", head_dim,
                f"the indexer rotates the first qk_pos_emb_head_dim={rope_dim} channels of its q and k heads",
                f"use an indexer head dim of at least {rope_dim} (GLM-5.x: 128 with 64 RoPE channels)")
    if getattr(config, "dsa_indexer_rotate_activation", False) and head_dim and head_dim & (head_dim - 1):
        _refuse("dsa_indexer_rotate_activation", True,
                f"with dsa_indexer_head_dim={head_dim} (not a power of two) megatron-core's Hadamard transform "
                f"pads and truncates, which changes the indexer scores, and is not implemented",
                "set dsa_indexer_rotate_activation=False or use a power-of-two head dim")
    rope_type = getattr(config, "rope_type", "rope")
    scaling = getattr(config, "rotary_scaling_factor", 1.0)
    # YaRN at scaling factor 1 has the plain RoPE frequencies and no attention scaling
    if rope_type not in (None, "rope") and not (rope_type == "yarn" and scaling == 1.0):
        _refuse("rope_type", rope_type, f"the DSA indexer implements plain RoPE only (GLM-5.x); "
                f"rotary_scaling_factor={scaling}", "set rope_type='rope'")
    percent = getattr(config, "rotary_percent", 1.0)
    if percent not in (None, 1.0):
        _refuse("rotary_percent", percent, "the DSA indexer rotates all qk_pos_emb_head_dim channels",
                "set rotary_percent=1.0")
