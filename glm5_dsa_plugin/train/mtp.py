"""Training with one multi-token-prediction layer (``scripts/train_mtp.py``): the MTP block uses
the last decoder layer's spec (MoE + our DSA attention)."""

from __future__ import annotations

from . import core

__all__ = ["main"]


def main(argv=None) -> int:
    ap = core.base_parser("GLM-5 DSA training with one MTP layer (mtp_num_layers=1)", job="MTP")
    ap.add_argument("--mtp-loss-scale", type=float, default=0.3)
    args = ap.parse_args(argv)
    if args.dry_run:
        return core.run_dry(args)
    card, model = core.prepare(args, mtp=True, mtp_num_layers=1, mtp_loss_scaling_factor=args.mtp_loss_scale)
    core.train(args, model, card, core.lm_step(args, model, card))
    return 0
