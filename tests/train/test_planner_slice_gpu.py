"""The full-width GLM-5.2 LoRA slice of ``scripts/bench_lora_slice.py`` at a reduced length: it
trains (finite, falling loss) and its measured peak sits within 10% of the dry run's plan."""

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))


@pytest.mark.gpu
def test_full_width_slice_trains_within_its_plan():
    import bench_lora_slice as bench

    bench.init_state("cuda")
    (row,) = bench.run_slice(8, 16384, "none", [4096], 3)
    assert all(math.isfinite(x) for x in row["losses"]) and row["losses"][-1] < row["losses"][0]
    assert abs(row["planned_peak_gib"] / row["peak_gib"] - 1) < 0.10, row
