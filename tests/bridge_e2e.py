"""Megatron-Bridge end to end through its own entry points, one process (run by
tests/model/test_bridge_e2e.py, on CPU and on the GPU): ``python tests/bridge_e2e.py HF_DIR WORK_DIR``.

1. ``AutoBridge.from_hf_pretrained(HF_DIR)`` (a checkpoint written by transformers'
   ``save_pretrained``) -> provider -> model with the HF weights (``load_hf_weights``);
2. training steps (AdamW) on fixed batches: run A takes 4 steps in one go; run B takes 2, saves the
   model with megatron-core's ``dist_checkpointing`` (``torch_dist``) and the optimizer state,
   builds a fresh model, loads both and takes steps 3-4: losses and final weights must equal run
   A's bit for bit (deterministic mode on the GPU);
3. Megatron-Bridge PEFT ``LoRA`` on the MLA projections of the loaded model: one step trains only
   the adapters (base weights bitwise unchanged, adapter B matrices moved).

Writes ``WORK_DIR/result.json``. On CPU: local modules, allgather dispatcher, reference backend.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda") if CUDA else torch.device("cpu")


def init():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not CUDA:
        torch.cuda.current_device = lambda: "cpu"  # megatron-core's RoPE asks for it (tests/megatron_cpu.py)
        torch.cuda.synchronize = lambda *a, **k: None  # the torch_dist writer syncs before reading tensors
    dist.init_process_group("nccl" if CUDA else "gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    if CUDA:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        torch.cuda.set_device(0)
        model_parallel_cuda_manual_seed(1234)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)  # a kernel without a deterministic variant warns


def provider(hf_dir):
    import glm5_dsa_plugin.bridge  # noqa: F401  registers our bridge after megatron.bridge's
    from megatron.bridge import AutoBridge
    from megatron.core.process_groups_config import ProcessGroupCollection

    bridge = AutoBridge.from_hf_pretrained(str(hf_dir))
    prov = bridge.to_megatron_provider(load_weights=False)
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        prov.transformer_impl, prov.moe_grouped_gemm = "local", False
        prov.moe_permute_fusion = prov.moe_shared_expert_overlap = False
        prov.gradient_accumulation_fusion = False
    prov.moe_token_dispatcher_type = "alltoall" if CUDA else "allgather"
    prov.make_vocab_size_divisible_by = 1
    prov.hidden_dropout = prov.attention_dropout = 0.0
    if CUDA:
        prov.params_dtype, prov.bf16, prov.deterministic_mode = torch.bfloat16, True, True
    else:
        prov.params_dtype, prov.bf16, prov.use_cpu_initialization = torch.float32, False, True
        prov.apply_rope_fusion = False
    prov.finalize()
    prov._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return bridge, prov


def build(bridge, prov):
    torch.manual_seed(0)
    model = prov.provide().to(DEV)
    bridge.load_hf_weights([model])
    return model


def batches(vocab, n=4, b=2, s=256 if CUDA else 64):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (b, s + 1), generator=g).to(DEV) for _ in range(n)]


def step(model, opt, tok):
    s = tok.shape[1] - 1
    pos = torch.arange(s, device=DEV)[None].expand(tok.shape[0], s)
    loss = model(tok[:, :-1], pos, None, labels=tok[:, 1:]).float().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def make_opt(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)


def main(hf_dir: str, work: str):
    from megatron.core import dist_checkpointing

    init()
    work = Path(work)
    bridge, prov = provider(hf_dir)
    data = batches(prov.vocab_size)
    from glm5_dsa_plugin.model.attention import GLM5DSAttention

    a = build(bridge, prov)
    n_cores = sum(isinstance(m, GLM5DSAttention) for m in a.modules())
    opt_a = make_opt(a)
    losses_a = [step(a, opt_a, t) for t in data]

    b = build(bridge, prov)
    opt_b = make_opt(b)
    losses_b = [step(b, opt_b, t) for t in data[:2]]
    ckpt = work / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(b.sharded_state_dict(), str(ckpt), sharded_strategy="torch_dist")
    torch.save(opt_b.state_dict(), work / "optimizer.pt")
    del b, opt_b

    c = build(bridge, prov)  # fresh: HF weights, then the checkpoint over them
    state = dist_checkpointing.load(c.sharded_state_dict(), str(ckpt))
    c.load_state_dict(state, strict=False)
    opt_c = make_opt(c)
    opt_c.load_state_dict(torch.load(work / "optimizer.pt", map_location=DEV))
    losses_c = [step(c, opt_c, t) for t in data[2:]]
    pa, pc = dict(a.named_parameters()), dict(c.named_parameters())
    mismatched = [n for n in pa if not torch.equal(pa[n], pc[n])]

    # LoRA through Megatron-Bridge PEFT
    from glm5_dsa_plugin.megatron import te_compat

    te_compat.install()
    from megatron.bridge.peft.lora import LoRA

    te_compat.correct_bridge_peft_flags()
    base = build(bridge, prov)
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    lora = LoRA(target_modules=["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
                                "linear_proj"], dim=4, alpha=8)
    peft = lora(base, training=True)
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    opt_l = make_opt(peft)
    lora_losses = [step(peft, opt_l, t) for t in data[:2]]
    after = dict(peft.named_parameters())
    base_changed = [n for n, v in before.items() if n in after and not torch.equal(after[n], v)]
    adapters_moved = [n for n in trainable if "linear_out" in n and after[n].abs().sum() > 0]
    # the classes LoRA wrapped (TransformerEngine's when prov.transformer_impl is "transformer_engine")
    wrapped = sorted({f"{type(m).__name__}({type(m.to_wrap).__name__})" for m in peft.modules() if hasattr(m, "to_wrap")})

    result = dict(n_cores=n_cores, losses_a=losses_a, losses_b=losses_b, losses_c=losses_c, mismatched=mismatched,
                  ckpt_files=sorted(p.name for p in ckpt.iterdir()), trainable=trainable, lora_losses=lora_losses,
                  base_changed=base_changed, adapters_moved=adapters_moved, transformer_impl=prov.transformer_impl,
                  lora_wrapped=wrapped)
    (work / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
