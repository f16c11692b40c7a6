"""Upstream Megatron-LM's hybrid training entry, run through the installed megatron-core's own loop.

Does what Megatron-LM's ``pretrain_hybrid.py`` does in its ``__main__`` (core_v0.19.0):
``parse_and_validate_args`` -> ``hybrid_config_from_args`` (which imports ``--spec`` as an object)
-> ``pretrain_cfg_container_from_args`` -> ``megatron.training.pretrain``, with the mock data,
forward step and loss log of :mod:`upstream_pretrain`. Run it as
``python tests/upstream_pretrain_hybrid.py ARGS`` (one process, rank variables set by the caller).
"""

from __future__ import annotations

import json
import os

import torch

import upstream_pretrain as gpt_driver


def upstream_tiny_glm52_hybrid_args(seq_length: int = 4096, mtp: bool = False, train_iters: int = 20) -> list[str]:
    """:func:`client_flags.upstream_tiny_glm52_args` for ``pretrain_hybrid.py``: ``--spec`` names
    ``glm5_dsa_hybrid_stack_spec`` and ``--hybrid-layer-pattern 'D-DEDEDE'`` (+ ``/DE`` with MTP)
    replaces ``--num-layers`` / ``--moe-layer-freq`` / ``--mtp-num-layers``; ``--no-rope-fusion``."""
    from client_flags import upstream_tiny_glm52_args

    flags = upstream_tiny_glm52_args(seq_length=seq_length, mtp=False, train_iters=train_iters)
    flags[flags.index("get_glm5_dsa_spec")] = "glm5_dsa_hybrid_stack_spec"
    for name in ("--num-layers", "--moe-layer-freq"):
        i = flags.index(name)
        del flags[i:i + 2]
    # a pattern with D makes megatron-training set experimental_attention_variant='dsa', whose config
    # refuses RoPE fusion (on by default)
    return flags + ["--hybrid-layer-pattern", "D-DEDEDE" + ("/DE" if mtp else ""), "--no-rope-fusion"]


def main():
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import hybrid_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    gpt_driver.use_prebuilt_dataset_helpers()
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    model_cfg = hybrid_config_from_args(args)
    # upstream logs an unimportable --spec and falls back to its own stack spec: name what is used
    if args.spec is not None and model_cfg.hybrid_stack_spec is None:
        raise ImportError(f"--spec {' '.join(args.spec)} did not import")
    print(f"hybrid stack spec: {model_cfg.hybrid_stack_spec.module.__name__}", flush=True)
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(full_config, gpt_driver.datasets_provider, ModelType.encoder_or_decoder, gpt_driver.forward_step)
    out = os.environ.get("GLM5_PRETRAIN_LOSSES")
    if out and torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gpt_driver.LOSSES, f)


if __name__ == "__main__":
    main()
