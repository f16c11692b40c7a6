"""One launcher core for the LoRA, PPO and MTP jobs in ``scripts/``.

Every job builds its model the same way: ``--spec MODULE FUNCTION`` (default
``glm5_dsa_plugin.spec get_glm5_dsa_spec``) is imported and called with ``(args, config, vp_stage)``
exactly as slime / miles do, on a config from a model card (``--card``) or an HF checkpoint
(``--hf``). The core owns parallel state, data, optimizer, the tqdm progress line (loss,
grad-norm, tokens/s, guard counters), checkpoint save/resume and ``--dry-run`` planning.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..checkpoints import cards
from ..ops import guard_stats
from .cli import LauncherInputError, check_inputs
from .memory import CUDA_ALLOC_CONF

__all__ = ["SPEC_DEFAULT", "SPEC_HELP", "base_parser", "parse_overrides", "load_card_from_args", "resolve_spec",
           "cuda_alloc_conf", "init_parallel", "device_config", "model_config", "build_model", "prepare", "attention_classes",
           "StepResult", "flops_shape", "synthetic_batch", "save_checkpoint", "load_checkpoint", "train", "lm_step",
           "apply_recipe", "run_dry"]

SPEC_DEFAULT = ["glm5_dsa_plugin.spec", "get_glm5_dsa_spec"]
SPEC_HELP = ("--model gpt: the layer-spec provider, called with (args, config, vp_stage) as slime/miles do "
             "(default: --spec glm5_dsa_plugin.spec get_glm5_dsa_spec); --model hybrid: the stack ModuleSpec "
             "(default: glm5_dsa_plugin.spec glm5_dsa_hybrid_stack_spec)")


def base_parser(description: str, job: str | None = None) -> argparse.ArgumentParser:
    """The launchers' shared flags; ``job`` labels the progress bar (LoRA / PPO / MTP)."""
    built = ("\n\nModel built through: --model hybrid --spec glm5_dsa_plugin.spec glm5_dsa_hybrid_stack_spec "
             f"(default), or --model gpt --spec {' '.join(SPEC_DEFAULT)}")
    ap = argparse.ArgumentParser(description=description + built,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", nargs=2, default=SPEC_DEFAULT, metavar=("MODULE", "FUNCTION"), help=SPEC_HELP)
    ap.add_argument("--model", default="hybrid", choices=["gpt", "hybrid"],
                    help="megatron-core model class: hybrid (HybridModel, pattern from the card) or gpt (GPTModel, "
                         "deprecated by megatron-core)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--card", default="tiny", help="model card: glm5, glm5.1, glm5.2, tiny, or a card .json path "
                                                     f"(file stems work too: {', '.join(cards.available_cards())})")
    src.add_argument("--hf", default=None, help="HF checkpoint folder (config.json + safetensors), loaded lazily")
    ap.add_argument("--card-override", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a card field, e.g. --card-override num_hidden_layers=4 (JSON values)")
    ap.add_argument("--backend", default="auto", choices=["auto", "reference", "tilelang"], help="sparse-MLA backend")
    ap.add_argument("--dsa-indexer-precision", default=None, choices=["bf16", "fp8"],
                    help="indexer top-k scoring: fp8 = the rollout engines' FP8 indexer (default: bf16, or fp8 when "
                         "MEGATRON_USE_SGLANG_FP8_INDEXER=1)")
    ap.add_argument("--dsa-kv-fp8-qat", action="store_true", default=None,
                    help="sparse MLA reads the latent as FlashMLA's FP8 KV cache stores it (straight-through "
                         "gradient; default: off, or on when DSA_KV_FP8_QAT=1)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["fp32", "bf16"], help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--save", default=None, help="checkpoint folder (written after the last step)")
    ap.add_argument("--load", default=None, help="checkpoint folder to resume from")
    ap.add_argument("--log-json", default=None, help="write per-step metrics (JSON lines) here (replaces the file)")
    ap.add_argument("--log-json-append", action="store_true", help="append to --log-json instead of replacing it")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    ap.set_defaults(job=job)
    ap.add_argument("--dry-run", action="store_true",
                    help="build the card's full model on the meta device for --tp/--pp/--ep/--cp and print the plan")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--micro-batch-seq", dest="seq_len", type=int, default=argparse.SUPPRESS,
                    help="alias of --seq-len (the dry run plans micro batches of --batch-size x --seq-len tokens)")
    ap.add_argument("--allgather-cp", action="store_true",
                    help="slime's flag: DSA allgather CP over the contiguous layout (default: megatron-core's zigzag)")
    ap.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                    help="layers of the first pipeline stage (megatron-core's argument; dry run)")
    ap.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                    help="layers of the last pipeline stage (megatron-core's argument; dry run)")
    from .planner import add_plan_arguments

    add_plan_arguments(ap)
    ap.add_argument("--recipe", default=None,
                    help="a parallel layout named in the card's _recipes (e.g. glm5.2's slime-rl-64k); "
                         "flags given on the command line win")
    return ap


def parse_overrides(items: list[str]) -> dict:
    out = {}
    for it in items:
        k, _, v = it.partition("=")
        if not _:
            raise LauncherInputError(f"--card-override expects FIELD=VALUE, got {it!r}")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def load_card_from_args(args) -> dict:
    if args.hf:
        from transformers import AutoConfig

        card = cards.hf_config_to_card(AutoConfig.from_pretrained(args.hf), name=str(args.hf))
    else:
        card = cards.load_card(args.card)
    return cards.with_overrides(card, **parse_overrides(args.card_override))


def resolve_spec(args) -> Callable:
    module, name = args.spec
    return getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------------- runtime
def cuda_alloc_conf() -> str:
    """The CUDA caching allocator's settings of a launcher run, set before CUDA starts:
    ``PYTORCH_CUDA_ALLOC_CONF`` as the user set it, else expandable segments. Without them a large
    late allocation (the loss's fp32 logits at 64K) can fail with enough memory free in total but
    split across segments that still hold a live block; the dry run's verdict assumes them."""
    return os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)


def init_parallel(args) -> None:
    """Single-process megatron-core parallel state (gloo on CPU, nccl on CUDA; on CUDA the
    allocator settings of :func:`cuda_alloc_conf`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if args.device == "cuda":
        cuda_alloc_conf()
    if args.device == "cpu" and not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # megatron-core RotaryEmbedding asks CUDA for a device
    if not dist.is_initialized():
        backend = "nccl" if args.device == "cuda" else "gloo"
        world = int(os.environ.get("WORLD_SIZE", 1))
        if world > 1:  # torchrun
            dist.init_process_group(backend)
        else:  # one process: a file rendezvous needs no free port
            import tempfile

            store = tempfile.NamedTemporaryFile(prefix="glm5_dsa_pg_", delete=False).name
            dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
        model_parallel_cuda_manual_seed(args.seed)


def device_config(device: str) -> dict:
    """The config fields the launchers set by device: on a GPU megatron-core's fused SwiGLU
    (Megatron-LM's ``--bias-swiglu-fusion`` default: one compiled kernel each way, its input alone
    kept for the backward, docs/performance.md); on the CPU the unfused one (no torch.compile)."""
    return dict(bias_activation_fusion=device == "cuda")


def model_config(args, card: dict, **extra):
    """The job's megatron-core config from ``card``, ``extra`` overriding; with ``--model hybrid``
    the HybridModel fields and pattern too (:func:`glm5_dsa_plugin.train.hybrid_model.hybrid_config_fields`)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    te = False
    if args.device == "cuda":
        te = importlib.util.find_spec("transformer_engine") is not None
    kw = dict(moe_token_dispatcher_type="allgather", params_dtype=dtype, bf16=dtype == torch.bfloat16,
              transformer_impl="transformer_engine" if te else "local", use_cpu_initialization=True,
              **device_config(args.device))
    kw.update(extra)
    pattern = None
    if getattr(args, "model", "gpt") == "hybrid":
        from .hybrid_model import hybrid_config_fields

        pattern, fields = hybrid_config_fields(card, extra)
        kw.update(fields)
    config = cards.card_to_transformer_config(card, **kw)
    if pattern is not None:
        config.hybrid_layer_pattern = pattern
    # rollout-matched numerics (glm5_dsa_plugin.model.rollout_numerics): attributes, not dataclass fields
    config.dsa_indexer_precision = getattr(args, "dsa_indexer_precision", None)
    config.dsa_kv_fp8_qat = getattr(args, "dsa_kv_fp8_qat", None)
    # the sparse-MLA backend of every DSA attention call (glm5_dsa_plugin.model.switches)
    config.dsa_sparse_mla_backend = getattr(args, "backend", None)
    return config


def build_model(args, card: dict, config, mtp: bool = False):
    """The HybridModel of ``--model hybrid`` (the default; :mod:`glm5_dsa_plugin.train.hybrid_model`),
    or with ``--model gpt`` a GPTModel built through the ``--spec`` provider (and its MTP block when ``mtp``)."""
    from megatron.core.models.gpt import GPTModel

    from ..megatron.spec import get_glm5_dsa_mtp_spec

    if getattr(config, "dsa_sparse_mla_backend", None) is None:  # (a config not made by model_config)
        config.dsa_sparse_mla_backend = getattr(args, "backend", None)
    torch.manual_seed(args.seed)
    if getattr(args, "model", "gpt") == "hybrid":
        from .hybrid_model import build_hybrid_model

        model = build_hybrid_model(args, card, config, max(args.seq_len, 8) * 2)
    else:
        block = resolve_spec(args)(args, config, None)
        mtp_spec = get_glm5_dsa_mtp_spec(args, config, None) if mtp else None
        model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=card["vocab_size"],
                         max_sequence_length=max(args.seq_len, 8) * 2, position_embedding_type="none",
                         mtp_block_spec=mtp_spec)
    if args.hf:
        from ..checkpoints.hf_megatron import LazyHFCheckpoint, load_hf_checkpoint

        missing, unexpected = load_hf_checkpoint(model, LazyHFCheckpoint(args.hf), card, include_mtp=mtp)
        bad = [k for k in missing if not k.endswith("_extra_state")]
        if bad or unexpected:
            raise RuntimeError(f"HF checkpoint does not fit the model: missing {bad[:5]}, unexpected {unexpected[:5]}")
    model.to(args.device)
    if config.params_dtype == torch.bfloat16:
        model.to(torch.bfloat16)
    return model


def prepare(args, mtp: bool = False, **config_extra):
    """Parallel state, card, config and the model built through ``--spec``: -> (card, model)."""
    check_inputs(args)
    init_parallel(args)
    card = load_card_from_args(args)
    return card, build_model(args, card, model_config(args, card, **config_extra), mtp=mtp)


def attention_classes(model) -> set[type]:
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention

    return {type(m.core_attention) for m in model.modules() if isinstance(m, AbsorbedMLASelfAttention)}


# --------------------------------------------------------------------------- training loop
@dataclass
class StepResult:
    """What a job's step function reports; the core adds the grad-norm after clipping."""

    loss: float
    tokens: int
    metrics: dict = field(default_factory=dict)  # extra scalars for the progress line and --log-json
    seq_lens: list[int] | None = None  # packed sequence lengths trained on: model FLOPs and MFU when given


def synthetic_batch(args, card: dict, step: int):
    """Deterministic LM batch for step ``step`` (same on every run and after resume).

    Tokens follow a fixed random successor map (next = succ[token], with 10% of steps random), so
    the loss has somewhere to go from log(vocab) within a few dozen steps."""
    V = card["vocab_size"]
    succ = torch.randperm(V, generator=torch.Generator().manual_seed(args.seed))
    g = torch.Generator().manual_seed(args.seed * 1000 + step)
    B, S = args.batch_size, args.seq_len
    toks = [torch.randint(0, V, (B,), generator=g)]
    for _ in range(S):
        nxt = succ[toks[-1]]
        jump = torch.rand(B, generator=g) < 0.1
        toks.append(torch.where(jump, torch.randint(0, V, (B,), generator=g), nxt))
    seq = torch.stack(toks, dim=1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


MODEL_CLASSES = {"GPTModel": "gpt", "HybridModel": "hybrid"}  # model class -> its --model


def save_checkpoint(path, model, optimizer, step: int, extra: dict | None = None) -> None:
    """``PATH/checkpoint.pt``: model and optimizer state, step, RNG states and the model class."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}, "extra": extra or {},
                "model_class": type(model).__name__}, p / "checkpoint.pt")


def load_checkpoint(path, model, optimizer) -> int:
    """Resume from :func:`save_checkpoint`'s file -> its step. Every tensor of the model must be
    there (TransformerEngine's ``_extra_state`` aside) and nothing else: a checkpoint of the other
    model class (``--model``) or of another card is refused, naming what differs."""
    ck = torch.load(Path(path) / "checkpoint.pt", map_location="cpu", weights_only=False)
    # names as state_dict() writes them (LoRA wrappers save under the base names), so compared as saved
    want = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    have = {k for k in ck["model"] if not k.endswith("_extra_state")}
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing or unexpected:
        saved = ck.get("model_class")
        hint = (f"; it was saved from a {saved}: pass --model {MODEL_CLASSES.get(saved, '?')}"
                if saved and saved != type(model).__name__ else "")
        raise LauncherInputError(f"--load {path}: the checkpoint does not fit this {type(model).__name__} "
                                 f"({len(missing)} tensors missing, e.g. {missing[:2]}; {len(unexpected)} unexpected, "
                                 f"e.g. {unexpected[:2]}){hint}")
    model.load_state_dict(ck["model"], strict=False)  # strict would also ask for TE's _extra_state
    optimizer.load_state_dict(ck["optimizer"])
    torch.set_rng_state(ck["rng"]["torch"])
    random.setstate(ck["rng"]["python"])
    return int(ck["step"])


def train(args, model, card, step_fn: Callable[[int], StepResult], params=None) -> list[dict]:
    """Run ``args.steps`` optimizer steps with tqdm; resume from / save to checkpoints."""
    from tqdm import tqdm

    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    start = load_checkpoint(args.load, model, opt) if args.load else 0
    model.train()
    log = []
    model_class = type(model).__name__
    label = getattr(args, "job", None) or model_class
    # the first step pays one-time costs (torch.compile of megatron-core's fused functions, lazy imports)
    bar = tqdm(range(start, start + args.steps), desc=f"{label} (first step: warm-up)", dynamic_ncols=True)
    logf = open(args.log_json, "a" if getattr(args, "log_json_append", False) else "w") if args.log_json else None
    shape = flops_shape(model, card) if args.device == "cuda" else None
    for step in bar:
        if step == start + 1:
            bar.set_description(label, refresh=False)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        res = step_fn(step)
        gn = float(torch.nn.utils.clip_grad_norm_(params, args.clip_grad))
        opt.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        gs = guard_stats()
        rec = dict(step=step, loss=res.loss, grad_norm=gn, tokens_per_s=res.tokens / dt,
                   guard_events=gs["events"], guard_rows_repaired=gs["rows_repaired"], model=model_class,
                   **res.metrics)
        mfu = _step_mfu(args, model, shape, res, dt)
        if mfu is not None:
            rec["mfu"] = mfu
        log.append(rec)
        if logf:
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
        bar.set_postfix(loss=f"{res.loss:.4f}", gnorm=f"{gn:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                        guard=f"{gs['events']}/{gs['rows_repaired']}",
                        **({"mfu": f"{rec['mfu']:.1%}"} if "mfu" in rec else {}),
                        **{k: f"{v:.4g}" for k, v in res.metrics.items()})
        if not (math.isfinite(res.loss) and math.isfinite(gn)):
            raise FloatingPointError(f"step {step}: loss {res.loss}, grad-norm {gn}")
    if logf:
        logf.close()
    if args.save:
        save_checkpoint(args.save, model, opt, start + args.steps)
    return log


def flops_shape(model, card: dict):
    """The model's DSA widths for its model FLOPs (:mod:`glm5_dsa_plugin.model.flops`): the card the
    model was built from, with the model's own MTP depth (a job may build it without MTP). Not read
    from the config: a HybridModel's ``num_layers`` counts its MLP layers too."""
    from ..model.flops import DSAShape

    return DSAShape.from_card({**card, "num_nextn_predict_layers": model.config.mtp_num_layers or 0})


def _step_mfu(args, model, shape, res: StepResult, seconds: float) -> float | None:
    """Model FLOPs utilisation of one step on a known GPU, when the step reported its sequences."""
    if res.seq_lens is None or shape is None:
        return None
    from ..model.flops import mfu, model_flops

    return mfu(model_flops(shape, res.seq_lens, mtp=getattr(model, "mtp_process", False)), seconds,
               torch.cuda.get_device_name())


def lm_step(args, model, card) -> Callable[[int], StepResult]:
    def step(i: int) -> StepResult:
        tok, labels = synthetic_batch(args, card, i)
        tok, labels = tok.to(args.device), labels.to(args.device)
        B, S = tok.shape
        pos = torch.arange(S, device=args.device)[None].expand(B, S)
        per_token = model(tok, pos, None, labels=labels)  # [B, S]; MTP loss attached inside when enabled
        loss = per_token.float().mean()
        loss.backward()
        return StepResult(float(loss.detach()), B * S, seq_lens=[S] * B)

    return step


# --------------------------------------------------------------------------- entry
def apply_recipe(args, card: dict):
    """Fill ``args`` from the card's ``_recipes[args.recipe]`` (argparse names: tp, pp, cp, ep,
    seq_len, batch_size, allgather_cp, decoder_*_pipeline_num_layers) where the command line kept the
    parser's default."""
    if not args.recipe:
        return args
    recipes = card.get("_recipes", {})
    if args.recipe not in recipes:
        raise LauncherInputError(f"--recipe {args.recipe!r}: the card has {sorted(recipes) or 'no recipes'}")
    defaults = base_parser("defaults").parse_args([])
    for key, value in recipes[args.recipe].items():
        if key == "description":
            continue
        if not hasattr(defaults, key):
            raise LauncherInputError(f"recipe {args.recipe!r}: unknown field {key!r}")
        if getattr(args, key) == getattr(defaults, key):
            setattr(args, key, value)
    return args


def run_dry(args) -> int:
    from .planner import plan_and_print

    args.device = "cpu"  # meta-device build: single-process gloo state, no GPU
    init_parallel(args)
    card = load_card_from_args(args)
    args = apply_recipe(args, card)
    from .hybrid_model import describe_pattern

    print(describe_pattern(args, card))
    return plan_and_print(args, card)
