"""The dry-run planner under context parallelism: slime's GLM-5.2 recipe (TP4 PP8 CP8 EP32, stages
of 14 + 6 x 8 + 16 layers, --allgather-cp) plans every stage, and the per-rank memory of one DSA
layer counts the gathered (global-length) kv and indexer keys."""

import subprocess
import sys

import pytest

from glm5_dsa_plugin.checkpoints import cards
from glm5_dsa_plugin.train import attention_memory, planner


def test_stage_split_with_megatron_first_last_matches_slime():
    # slime's docs (examples/glm5.2-744B-A40B.md): stage starts 1, 15, 23, 31, 39, 47, 55, 63
    stages = planner.split_with_ends(78, 8, 14, 16, 4, 3)
    assert [a for a, _ in stages] == [1, 15, 23, 31, 39, 47, 55, 63] and stages[-1] == (63, 78)
    with pytest.raises(ValueError, match="would reuse the DSA indices of layer"):
        planner.split_with_ends(78, 8, 12, 18, 4, 3)  # stage 2 would start on layer 13
    with pytest.raises(ValueError, match="do not split into pp=8"):
        planner.split_with_ends(78, 8, 13, 16, 4, 3)


def test_gathered_tensors_are_global_length_and_the_rest_local():
    card = cards.load_card("glm5.2")
    dq, Di = card["kv_lora_rank"] + card["qk_rope_head_dim"], card["index_head_dim"]
    for cp in (1, 8):
        kept = attention_memory.attention_activation_parts(card, 4, cp, 65536, True)
        assert kept["kv"] == (65536 + 1) * dq * 2  # the gathered latent kv (+ the zero sentinel row)
        assert kept["q"] == 65536 // cp * 16 * dq * 2
    zig = attention_memory.attention_transient_parts(card, 4, 8, 65536, True, "zigzag")
    cont = attention_memory.attention_transient_parts(card, 4, 8, 65536, True, "contiguous")
    assert zig["gather"] == dict(kv=65536 * dq * 2, indexer_k=65536 * Di * 2)  # rank-major buffer before reorder
    assert cont["gather"] == dict(kv=0, indexer_k=0)  # slime's layout gathers in global order
    peak, phase = attention_memory.layer_peak_bytes(card, 4, 8, 65536, False, "contiguous")
    assert phase == "backward" and peak < attention_memory.layer_peak_bytes(card, 4, 1, 65536, False, "contiguous")[0]


def test_dry_run_glm52_slime_recipe_with_cp8():
    out = subprocess.run([sys.executable, "scripts/train_lora.py", "--card", "glm5.2", "--dry-run", "--recipe",
                          "slime-rl-64k"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "TP4 PP8 EP32 CP8 (contiguous allgather CP) DP1  micro batch 1 x 65536 tokens" in out.stdout
    assert "verdict on 80 GiB cards" in out.stdout and "verdict on 141 GiB cards" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit() and "compute [" in line]
    assert [int(r[1].split("-")[0]) for r in rows] == [1, 15, 23, 31, 39, 47, 55, 63]
    assert "8192 local of 65536 tokens: peak" in out.stdout
