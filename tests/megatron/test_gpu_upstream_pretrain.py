"""megatron-training's own ``pretrain`` loop (installed megatron-core 0.19.2) with our spec: 20
iterations of a tiny GLM-5.2-shaped model at seq 4096 on the GPU, without and with MTP (MTP
through ``python -m glm5_dsa_plugin.megatron_lm``). ``pretrain`` asserts CUDA, so there is no CPU
variant of the loop; tests/model/test_spec_clients.py builds the same flags on CPU."""

import json
import math
import subprocess
import sys

import pytest
from single_rank_env import ROOT, single_rank_env

from client_flags import apex_grad_accum_fusion_available, upstream_tiny_glm52_args

DRIVER = ROOT / "tests" / "upstream_pretrain.py"


def _run(tmp_path, mtp: bool):
    flags = upstream_tiny_glm52_args(seq_length=4096, mtp=mtp, train_iters=20) + ["--bf16"]
    if not apex_grad_accum_fusion_available():
        flags.append("--no-gradient-accumulation-fusion")  # the spec names this flag when Apex is absent
    losses = tmp_path / "losses.json"
    env = single_rank_env(CUDA_DEVICE_MAX_CONNECTIONS="1", GLM5_PRETRAIN_LOSSES=str(losses))
    entry = ["-m", "glm5_dsa_plugin.megatron_lm", str(DRIVER)] if mtp else [str(DRIVER)]
    out = subprocess.run([sys.executable, *entry, *flags], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
    return json.loads(losses.read_text()), out.stdout + out.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("mtp", [False, True], ids=["no_mtp", "mtp"])
def test_upstream_pretrain_loop_trains_through_our_spec(tmp_path, mtp):
    losses, log = _run(tmp_path, mtp)
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert first > 7.0  # ln(4096) = 8.3 at initialisation
    assert last < first - 1.0, losses
    if mtp:
        assert "mtp_1 loss" in log  # megatron-training logs the MTP layer's loss
