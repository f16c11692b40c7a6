"""LoRA fine-tuning through Megatron-Bridge PEFT (``scripts/train_lora.py``): adapters on the MLA
projections (and, when asked, the indexer's), saved alone or merged into the base weights."""

from __future__ import annotations

from pathlib import Path

import torch

from . import core

__all__ = ["INDEXER_LORA_TARGETS", "MLA_LORA_TARGETS", "adapter_state", "apply_lora", "main", "merge_lora"]

MLA_LORA_TARGETS = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
                    "linear_proj"]
INDEXER_LORA_TARGETS = ["linear_wq_b", "linear_wk", "linear_weights_proj"]



def apply_lora(model, dim: int = 8, alpha: int = 16, include_indexer: bool = False):
    """Megatron-Bridge PEFT LoRA on the MLA projections (indexer excluded unless asked)."""
    from ..megatron import te_compat

    te_compat.install()  # Megatron-Bridge's lora_layers imports TransformerEngine unconditionally
    from megatron.bridge.peft.lora import LoRA

    te_compat.correct_bridge_peft_flags()

    targets = MLA_LORA_TARGETS + (INDEXER_LORA_TARGETS if include_indexer else [])
    lora = LoRA(target_modules=targets, dim=dim, alpha=alpha)
    model = lora(model, training=True)
    return lora, model


def adapter_state(model) -> dict:
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if ".adapter." in k and v is not None}


def merge_lora(model) -> int:
    """Fold every LoRA adapter into its base weight and unwrap it; returns how many were merged."""
    from megatron.bridge.peft.lora_layers import LoRALinear

    merged = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                with torch.no_grad():
                    child.to_wrap.weight.copy_(child.weight)
                setattr(parent, name, child.to_wrap)
                merged += 1
    return merged


def main(argv=None) -> int:
    ap = core.base_parser("LoRA fine-tuning (Megatron-Bridge PEFT) of GLM-5 DSA", job="LoRA")
    ap.add_argument("--lora-dim", type=int, default=8)
    ap.add_argument("--lora-alpha", type=int, default=16)
    ap.add_argument("--lora-indexer", action="store_true", help="also adapt the indexer projections")
    ap.add_argument("--load-adapters", default=None, help="adapters.pt to start from")
    ap.add_argument("--merge-to", default=None, help="write the merged (base + LoRA) model state here")
    args = ap.parse_args(argv)
    if args.dry_run:
        return core.run_dry(args)
    card, model = core.prepare(args, mtp_num_layers=None)
    _, model = apply_lora(model, args.lora_dim, args.lora_alpha, args.lora_indexer)
    model.to(args.device)
    if args.load_adapters:
        missing, unexpected = model.load_state_dict(torch.load(args.load_adapters), strict=False)
        if unexpected:
            raise RuntimeError(f"adapters do not fit: {unexpected[:5]}")
    core.train(args, model, card, core.lm_step(args, model, card))
    if args.save:
        torch.save(adapter_state(model), Path(args.save) / "adapters.pt")
    if args.merge_to:
        n = merge_lora(model)
        Path(args.merge_to).mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), Path(args.merge_to) / "merged.pt")
        print(f"merged {n} LoRA adapters into {args.merge_to}/merged.pt")
    return 0
