"""megatron-training's own ``pretrain`` loop with HybridModel through glm5_dsa_hybrid_stack_spec (what
``pretrain_hybrid.py --spec glm5_dsa_plugin.spec glm5_dsa_hybrid_stack_spec --hybrid-layer-pattern ...``
runs): 20 iterations of a tiny GLM-5.2-shaped model on the GPU. ``pretrain`` asserts CUDA;
tests/megatron/test_hybrid_spec.py builds the same flags on CPU."""

import json
import math
import subprocess
import sys

import pytest
from single_rank_env import ROOT, single_rank_env

from client_flags import apex_grad_accum_fusion_available
from upstream_pretrain_hybrid import upstream_tiny_glm52_hybrid_args

DRIVER = ROOT / "tests" / "upstream_pretrain_hybrid.py"


@pytest.mark.gpu
@pytest.mark.parametrize("seq,mtp", [(4096, True), (16384, False)], ids=["4k_mtp", "16k"])
def test_upstream_hybrid_pretrain_loop_trains_through_our_spec(tmp_path, seq, mtp):
    flags = upstream_tiny_glm52_hybrid_args(seq_length=seq, mtp=mtp, train_iters=20) + ["--bf16"]
    if not apex_grad_accum_fusion_available():
        flags.append("--no-gradient-accumulation-fusion")
    losses = tmp_path / "losses.json"
    env = single_rank_env(CUDA_DEVICE_MAX_CONNECTIONS="1", GLM5_PRETRAIN_LOSSES=str(losses))
    out = subprocess.run([sys.executable, str(DRIVER), *flags], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
    losses = json.loads(losses.read_text())
    print(f"seq {seq} mtp {mtp}: losses {[round(x, 3) for x in losses]}")
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert first > 7.0  # ln(4096) = 8.3 at initialisation
    assert last < first - 1.0, losses
    log = out.stdout + out.stderr
    assert "hybrid stack spec: GLM5DSAHybridStack" in log
    if mtp:
        assert "mtp_1 loss" in log
