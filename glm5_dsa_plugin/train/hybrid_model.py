"""The launchers' ``--model hybrid``: megatron-core's HybridModel through ``glm5_dsa_hybrid_stack_spec``.

The card's GLM-5.x pattern (:func:`glm5_dsa_plugin.checkpoints.hybrid_pattern.glm5_hybrid_layer_pattern`:
``D-`` x dense, ``DE`` x MoE, ``/DE`` per MTP layer the job builds) fixes the config: ``num_layers`` =
two per GLM layer, ``moe_layer_freq=1`` (the ``E`` symbols place the MoE layers); same weights give
the same logits as ``--model gpt`` (tests/megatron/test_hybrid_spec.py).
"""

from __future__ import annotations

import importlib

from ..checkpoints import cards
from ..checkpoints.hybrid_pattern import check_index_sharing, glm5_hybrid_layer_pattern

__all__ = ["GPT_SPEC_DEFAULT", "HYBRID_SPEC_DEFAULT", "hybrid_config_fields", "build_hybrid_model",
           "pipeline_stage_layers", "describe_pattern"]

GPT_SPEC_DEFAULT = ["glm5_dsa_plugin.spec", "get_glm5_dsa_spec"]
HYBRID_SPEC_DEFAULT = ["glm5_dsa_plugin.spec", "glm5_dsa_hybrid_stack_spec"]


def hybrid_config_fields(card: dict, config_extra: dict) -> tuple[str, dict]:
    """-> (pattern, config fields) for a job whose config overrides are ``config_extra`` (its
    ``mtp_num_layers``, else the card's ``num_nextn_predict_layers``, sets the ``/`` depths)."""
    depths = config_extra.get("mtp_num_layers", card.get("num_nextn_predict_layers")) or 0
    pattern = glm5_hybrid_layer_pattern(cards.with_overrides(card, num_nextn_predict_layers=depths))
    return pattern, dict(num_layers=2 * card["num_hidden_layers"], moe_layer_freq=1, is_hybrid_model=True)


def build_hybrid_model(args, card: dict, config, max_sequence_length: int):
    """HybridModel of ``config.hybrid_layer_pattern``; ``--spec MODULE NAME`` names the stack spec
    object (the GPT default is read as ours: ``glm5_dsa_plugin.spec glm5_dsa_hybrid_stack_spec``)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.spec_utils import ModuleSpec

    module, name = HYBRID_SPEC_DEFAULT if list(args.spec) == GPT_SPEC_DEFAULT else args.spec
    stack_spec = getattr(importlib.import_module(module), name)
    if not isinstance(stack_spec, ModuleSpec):
        raise ValueError(f"--spec {module} {name} is a {type(stack_spec).__name__}, not a hybrid stack ModuleSpec: "
                         f"with --model hybrid (the default) --spec names the stack spec object (ours: "
                         f"{' '.join(HYBRID_SPEC_DEFAULT)}); pass --model gpt for a GPT layer-spec provider")
    return HybridModel(config=config, hybrid_stack_spec=stack_spec, vocab_size=card["vocab_size"],
                       max_sequence_length=max_sequence_length, hybrid_layer_pattern=config.hybrid_layer_pattern,
                       position_embedding_type="none")


def pipeline_stage_layers(card: dict, pp: int, first: int | None = None, last: int | None = None) -> list[int] | None:
    """GLM layers per pipeline stage as megatron-core splits them (``first`` / ``last`` stage sizes
    when given, the rest evenly); None for one stage or a split that does not divide evenly."""
    n = card["num_hidden_layers"]
    if pp <= 1:
        return None
    head, tail = [first] if first else [], [last] if last else []
    middle, rest = pp - len(head) - len(tail), n - sum(head) - sum(tail)
    if middle < 0 or (middle == 0 and rest) or (middle and (rest <= 0 or rest % middle)):
        return None
    return head + [rest // middle] * middle + tail if middle else head + tail


def describe_pattern(args, card: dict) -> str:
    """The dry run's line: the card's hybrid layer pattern with this layout's pipeline cuts, and
    whether those cuts keep index sharing on one stage."""
    stages = pipeline_stage_layers(card, getattr(args, "pp", 1), getattr(args, "decoder_first_pipeline_num_layers", None),
                                   getattr(args, "decoder_last_pipeline_num_layers", None))
    pattern = glm5_hybrid_layer_pattern(card, stage_layers=stages)
    try:
        check_index_sharing(pattern, *cards.index_sharing(card))
        verdict = "index sharing stays on each stage"
    except ValueError as exc:
        verdict = f"refused: {exc}"
    if stages is None and getattr(args, "pp", 1) > 1:
        verdict = (f"no '|' placed: {card['num_hidden_layers']} layers do not split evenly over {args.pp} stages; "
                   f"give --decoder-first/last-pipeline-num-layers")
    shown = pattern if len(pattern) <= 120 else f"{pattern[:56]}...{pattern[-56:]}"
    return f"hybrid layer pattern (--model hybrid): {shown} ({len(pattern)} chars; {verdict})"
