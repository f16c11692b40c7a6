"""Rollout-matched DSA numerics: which of the two switches a config turns on, and whether it may.

* ``dsa_indexer_precision``: ``"bf16"`` (default) scores the indexer top-k with the bf16 / fp32
  definition of :mod:`glm5_dsa_plugin.model.indexer`; ``"fp8"`` scores it as the rollout engines do
  (:mod:`glm5_dsa_plugin.ops.indexer.fp8_index`: Hadamard rotation, e4m3 with UE8M0 scales per 128
  channels, ``fp8_index``), same tie order. Only the selection changes: the indexer loss's logits and
  their backward stay in bf16 / fp32. Needs ``dsa_indexer_head_dim == 128``.
* ``dsa_kv_fp8_qat``: the sparse attention reads the latent kv as FlashMLA's FP8 KV cache stores it
  (:mod:`glm5_dsa_plugin.ops.fp8_kv`, 656 bytes per token), gradient straight through. Needs
  ``kv_lora_rank == 512`` and ``qk_pos_emb_head_dim == 64``.

Both are read from the config (attributes a launcher sets; megatron-core 0.19.2's dataclass has
neither). A config that does not set one (None or absent) falls back to slime's environment
switches, so the same job script turns them on with either: ``MEGATRON_USE_SGLANG_FP8_INDEXER=1``
-> ``"fp8"``, ``DSA_KV_FP8_QAT=1`` -> True (``DSA_KV_FP8_QAT_BLOCK_SIZE``, if set, must be 128).
"""

from __future__ import annotations

import os

__all__ = ["INDEXER_PRECISIONS", "FIELDS", "ENV_FP8_INDEXER", "ENV_KV_FP8_QAT", "ENV_KV_FP8_QAT_BLOCK",
           "indexer_precision", "kv_fp8_qat", "check"]

INDEXER_PRECISIONS = ("bf16", "fp8")
FIELDS = ("dsa_indexer_precision", "dsa_kv_fp8_qat")
ENV_FP8_INDEXER = "MEGATRON_USE_SGLANG_FP8_INDEXER"
ENV_KV_FP8_QAT = "DSA_KV_FP8_QAT"
ENV_KV_FP8_QAT_BLOCK = "DSA_KV_FP8_QAT_BLOCK_SIZE"


def _env_on(name: str) -> bool:
    v = os.environ.get(name, "0").strip()
    if v not in ("0", "1", ""):
        raise ValueError(f"glm5_dsa_plugin: environment {name}={v!r}: expected 0 or 1")
    return v == "1"


def indexer_precision(config) -> str:
    """``"bf16"`` or ``"fp8"``: the config's ``dsa_indexer_precision``, else slime's environment switch."""
    v = getattr(config, "dsa_indexer_precision", None)
    if v is None:
        return "fp8" if _env_on(ENV_FP8_INDEXER) else "bf16"
    if v not in INDEXER_PRECISIONS:
        raise ValueError(f"glm5_dsa_plugin: config.dsa_indexer_precision={v!r} is not supported; "
                         f"set one of {INDEXER_PRECISIONS}")
    return v


def kv_fp8_qat(config) -> bool:
    """The config's ``dsa_kv_fp8_qat``, else slime's ``DSA_KV_FP8_QAT`` environment switch."""
    v = getattr(config, "dsa_kv_fp8_qat", None)
    if v is None:
        on = _env_on(ENV_KV_FP8_QAT)
        block = os.environ.get(ENV_KV_FP8_QAT_BLOCK, "128").strip() or "128"
        if on and block != "128":
            raise ValueError(f"glm5_dsa_plugin: {ENV_KV_FP8_QAT_BLOCK}={block!r}: FlashMLA's FP8 KV cache has "
                             f"one scale per 128 channels; set it to 128")
        return on
    if not isinstance(v, bool):
        raise ValueError(f"glm5_dsa_plugin: config.dsa_kv_fp8_qat={v!r} is not supported; set True or False")
    return v


def check(config) -> None:
    """Raise ``ValueError`` when a switch is on for a geometry it does not cover."""
    if indexer_precision(config) == "fp8":
        d = getattr(config, "dsa_indexer_head_dim", None)
        if d != 128:
            raise ValueError(f"glm5_dsa_plugin: dsa_indexer_precision='fp8' needs dsa_indexer_head_dim=128 (one "
                             f"e4m3 scale per 128 channels and head), got {d}; set dsa_indexer_precision='bf16'")
    if kv_fp8_qat(config):
        r, p = getattr(config, "kv_lora_rank", None), getattr(config, "qk_pos_emb_head_dim", None)
        if (r, p) != (512, 64):
            raise ValueError(f"glm5_dsa_plugin: dsa_kv_fp8_qat=True needs the FP8 cache's latent of 512 NoPE + 64 "
                             f"RoPE channels, got kv_lora_rank={r}, qk_pos_emb_head_dim={p}; "
                             f"set dsa_kv_fp8_qat=False")
