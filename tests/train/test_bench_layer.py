"""scripts/bench_layer.py's merging of a TransformerEngine run into an existing result, and its table."""

import importlib.util
import os

import pytest

from tests.megatron_cpu import megatron_single_process  # noqa: F401  (fixture)

pytest.importorskip("torch")
_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_layer.py")
_spec = importlib.util.spec_from_file_location("bench_layer", _PATH)
bench_layer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_layer)


def _row(layer, T, impl, ms, date="old"):
    return dict(layer=layer, T=T, impl=impl, fwd_ms=ms / 3, fwd_bwd_ms=ms, peak_gib=1.0, tflops=1.0, breakdown=None,
                error=None, date=date)


def test_merge_replaces_remeasured_rows_and_keeps_the_rest():
    old = [_row("dense", 4096, "ours", 30.0), _row("dense", 4096, "mcore_sparse", 100.0),
           _row("moe", 65536, "ours", 900.0), _row("dense", 16384, "ours", 150.0)]
    new = [_row("dense", 4096, "mcore_te", 90.0, "new"), _row("dense", 4096, "ours", 31.0, "new"),
           _row("dense", 4096, "ours_te", 28.0, "new")]
    rows = bench_layer.merge_rows(old, new)
    keys = [(r["layer"], r["T"], r["impl"], r["date"]) for r in rows]
    assert keys == [("dense", 4096, "ours", "new"), ("dense", 4096, "mcore_sparse", "old"),
                    ("dense", 4096, "ours_te", "new"), ("dense", 4096, "mcore_te", "new"),
                    ("dense", 16384, "ours", "old"), ("moe", 65536, "ours", "old")]


def test_table_quotes_te_rows_against_megatron_core_on_te():
    rows = [_row("dense", 4096, "ours", 30.0), _row("dense", 4096, "mcore_sparse", 90.0),
            _row("dense", 4096, "ours_te", 25.0), _row("dense", 4096, "mcore_te", 100.0),
            _row("dense", 16384, "ours", 150.0)]
    rows[-1]["peak_gib"] = None  # a CPU row has no peak
    table = bench_layer.markdown_table(dict(rows=rows)).splitlines()
    assert "ours on TE" in table[0] and "megatron-core on TE" in table[0]
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[6] == "3.00x" and cells[-1] == "4.00x"  # 90 / 30 (local), 100 / 25 (TE)
    assert [c.strip() for c in table[3].strip("|").split("|")][3] == "-"


def test_same_indices_check_matches_megatron_cores_layer_on_cpu(megatron_single_process):
    """The benchmark's check (tiny widths, fp32 math in bf16 storage on CPU): ours and megatron-core's
    DSA layer as index-reusing layers handed the same top-k agree in output and every gradient."""
    for layer in ("dense", "moe"):
        res = bench_layer.check_same_indices(bench_layer.TINY, layer, 64, "cpu")
        assert res["params_only_one_side"] == [] and res["params_compared"] >= 11, res
        assert res["out_rel"] < 5e-3 and res["dx_rel"] < 5e-3 and res["worst_param_grad_rel"] < 2e-2, res
