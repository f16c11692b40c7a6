"""Upstream Megatron-LM's training entry, run through the installed megatron-core's own loop.

Does what Megatron-LM's ``pretrain_gpt.py`` does in its ``__main__`` (core_v0.19.0):
``parse_and_validate_args`` -> ``gpt_config_from_args`` (which imports ``--spec``) ->
``pretrain_cfg_container_from_args`` -> ``megatron.training.pretrain``; with this project's small
forward step and mock data instead of pretrain_gpt's GPT dataset and tokenizer. Run it as
``python tests/upstream_pretrain.py ARGS`` (one process: RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT set by the caller or torchrun), or with MTP through our wrapper:
``python -m glm5_dsa_plugin.megatron_lm tests/upstream_pretrain.py ARGS``.

Mock data: each sample is a token sequence ``(start + stride * i) % 64`` with a random start and
one of four strides: 64 of the vocabulary's ids, each next token predictable, so the loss falls
from ln(vocab) within a few iterations. The loss of every
iteration (sum / tokens of the micro-batch) is written as JSON to ``$GLM5_PRETRAIN_LOSSES``.
"""

from __future__ import annotations

import json
import os
from functools import partial

import torch


class ArithmeticTokens(torch.utils.data.Dataset):
    """``n`` samples of ``seq_length + 1`` tokens; deterministic in ``seed``."""

    def __init__(self, n: int, seq_length: int, vocab: int, seed: int):
        self.n, self.s, self.v, self.seed = n, seq_length, vocab, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        used = min(self.v, 64)
        start = int(torch.randint(0, used, (1,), generator=g))
        stride = int(torch.randint(1, 5, (1,), generator=g))
        seq = (start + stride * torch.arange(self.s + 1)) % used
        return {"tokens": seq[:-1], "labels": seq[1:], "loss_mask": torch.ones(self.s),
                "position_ids": torch.arange(self.s)}


def datasets_provider(num_samples):
    from megatron.training import get_args

    args = get_args()
    vocab = args.vocab_size
    return tuple(ArithmeticTokens(max(int(n), 1), args.seq_length, vocab, seed) if n else None
                 for n, seed in zip(num_samples, (1, 2, 3)))


datasets_provider.is_distributed = True

LOSSES: list[float] = []


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    LOSSES.append(float(loss.detach() / num_tokens))
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = {k: v.cuda(non_blocking=True) for k, v in next(data_iterator).items()}
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"])
    return out, partial(loss_func, batch["loss_mask"])


def use_prebuilt_dataset_helpers():
    """megatron-training's initialisation runs ``make`` in ``megatron/core/datasets`` (a Megatron-LM
    checkout has its Makefile); the megatron-core wheel ships that extension prebuilt and no
    Makefile. Use the prebuilt one when it imports, else leave the build to fail as it would."""
    import megatron.core.datasets.utils as dataset_utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    dataset_utils.compile_helpers = lambda: None


def main():
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    use_prebuilt_dataset_helpers()
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    model_cfg = gpt_config_from_args(args)
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(full_config, datasets_provider, ModelType.encoder_or_decoder, forward_step)
    out = os.environ.get("GLM5_PRETRAIN_LOSSES")
    if out and torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(LOSSES, f)


if __name__ == "__main__":
    main()
