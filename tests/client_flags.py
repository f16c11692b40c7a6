"""Client command lines as the clients write them, and megatron-training's own argument parsing.

``SLIME_GLM52_MODEL_ARGS`` is the ``MODEL_ARGS`` array of slime's ``scripts/models/glm5.2-744B-A40B.sh``
(miles' ``scripts/models/glm5.2-744B-A40B.py`` passes the same flags without ``--allgather-cp``,
which miles' run script adds), with only the ``--spec`` line changed to ours. ``tiny`` shrinks the
sizes (layers, widths, heads, experts, vocab) and keeps every flag.
"""

from __future__ import annotations

import importlib.util
import os


def slime_glm52_model_args(n_dense: int = 3, n_moe: int = 75, hidden: int = 6144, ffn: int = 12288,
                           moe_ffn: int = 2048, experts: int = 256, router_topk: int = 8, heads: int = 64,
                           q_lora: int = 2048, kv_lora: int = 512, qk_head: int = 192, v_head: int = 256,
                           rope_head: int = 64, vocab: int = 154880) -> list[str]:
    return [
        "--spec", "glm5_dsa_plugin.spec", "get_glm5_dsa_spec",
        "--moe-layer-freq", f"[0]*{n_dense}+[1]*{n_moe}",
        "--num-experts", str(experts),
        "--moe-shared-expert-intermediate-size", str(moe_ffn),
        "--moe-router-topk", str(router_topk),
        "--moe-grouped-gemm",
        "--moe-permute-fusion",
        "--moe-ffn-hidden-size", str(moe_ffn),
        "--moe-router-score-function", "sigmoid",
        "--moe-router-pre-softmax",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0",
        "--moe-router-load-balancing-type", "seq_aux_loss",
        "--moe-router-topk-scaling-factor", "2.5",
        "--moe-aux-loss-coeff", "0",
        "--moe-router-dtype", "fp32",
        "--make-vocab-size-divisible-by", "16",
        "--num-layers", str(n_dense + n_moe),
        "--hidden-size", str(hidden),
        "--ffn-hidden-size", str(ffn),
        "--num-attention-heads", str(heads),
        "--disable-bias-linear",
        "--swiglu",
        "--untie-embeddings-and-output-weights",
        "--position-embedding-type", "rope",
        "--no-position-embedding",
        "--normalization", "RMSNorm",
        "--qk-layernorm",
        "--multi-latent-attention",
        "--q-lora-rank", str(q_lora),
        "--kv-lora-rank", str(kv_lora),
        "--qk-head-dim", str(qk_head),
        "--v-head-dim", str(v_head),
        "--kv-channels", str(qk_head),
        "--qk-pos-emb-head-dim", str(rope_head),
        "--vocab-size", str(vocab),
        "--rotary-base", "8000000",
        "--enable-experimental",
        "--allgather-cp",
    ]


def slime_extra_args(parser):
    """The two slime arguments the GLM-5.2 model flags rely on (slime/utils/arguments.py)."""
    group = parser.add_argument_group("slime")
    group.add_argument("--allgather-cp", action="store_true", default=False)
    group.add_argument("--hf-checkpoint", type=str, default=None)
    return parser


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def without_te_only_flags(flags: list[str]) -> list[str]:
    """Without TransformerEngine: ``--moe-permute-fusion`` (a TE kernel; megatron-core refuses it
    without TE) is dropped and ``--transformer-impl local`` added. With TE: unchanged."""
    if te_available():
        return list(flags)
    return [f for f in flags if f != "--moe-permute-fusion"] + ["--transformer-impl", "local"]


def parse_megatron_args(argv: list[str], extra_args_provider=None):
    """megatron-training's ``parse_args`` + ``validate_args`` on ``argv`` (world size 1)."""
    import sys

    import torch
    from megatron.training.arguments import parse_args, validate_args

    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    saved = sys.argv
    sys.argv = ["train.py"] + list(argv)
    try:
        args = parse_args(extra_args_provider=extra_args_provider, ignore_unknown_args=True)
        if not torch.cuda.is_available():
            # validate_args asks the GPU's compute capability for --moe-grouped-gemm; answer sm_90 on CPU
            real = torch.cuda.get_device_capability
            torch.cuda.get_device_capability = lambda *a: (9, 0)
            try:
                validate_args(args)
            finally:
                torch.cuda.get_device_capability = real
        else:
            validate_args(args)
    finally:
        sys.argv = saved
    return args


def upstream_tiny_glm52_args(seq_length: int = 4096, mtp: bool = False, train_iters: int = 20) -> list[str]:
    """Upstream Megatron-LM flags for a tiny GLM-5.2-shaped model (first layer dense, then MoE;
    index sharing freq 4 / offset 3; the kernels' MLA head shape 256 + 64) through our spec. The
    DSA geometry is given with upstream's own ``--dsa-indexer-*`` flags (upstream has no HF
    checkpoint argument)."""
    flags = [
        "--spec", "glm5_dsa_plugin.spec", "get_glm5_dsa_spec",
        "--num-layers", "4", "--moe-layer-freq", "[0]*1+[1]*3", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "256", "--moe-shared-expert-intermediate-size", "256",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0",
        "--moe-token-dispatcher-type", "alltoall",
        "--hidden-size", "512", "--ffn-hidden-size", "1024", "--num-attention-heads", "16",
        "--disable-bias-linear", "--swiglu", "--untie-embeddings-and-output-weights",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--qk-layernorm",
        "--multi-latent-attention", "--q-lora-rank", "256", "--kv-lora-rank", "256", "--qk-head-dim", "64",
        "--v-head-dim", "64", "--kv-channels", "64", "--qk-pos-emb-head-dim", "64", "--rotary-base", "8000000",
        "--dsa-indexer-n-heads", "8", "--dsa-indexer-head-dim", "128", "--dsa-indexer-topk", "2048",
        "--dsa-indexer-topk-freq", "4", "--dsa-indexer-skip-topk-offset", "3", "--dsa-indexer-loss-coeff", "0.001",
        "--dsa-indexer-use-sparse-loss",
        "--vocab-size", "4096", "--tokenizer-type", "NullTokenizer", "--make-vocab-size-divisible-by", "16",
        "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", str(train_iters),
        "--lr", "3e-3", "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--clip-grad", "1.0",
        "--eval-iters", "0", "--eval-interval", "100000", "--log-interval", "1", "--seed", "1234",
    ]
    if mtp:
        flags += ["--mtp-num-layers", "1"]
    if not te_available():
        flags += ["--transformer-impl", "local"]
    return flags


def apex_grad_accum_fusion_available() -> bool:
    from megatron.core.tensor_parallel import layers

    return bool(getattr(layers, "_grad_accum_fusion_available", False))
