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


@pytest.mark.parametrize("name, group", [
    ("bwd_kernel", "sparse_mla_backward"),  # TileLang's names for the prim_funcs fwd / bwd
    ("fwd_kernel", "sparse_mla_forward"),
    ("_prepare_indices_kernel", "sparse_mla_passes"),
    ("_repair_query_rows", "sparse_mla_passes"),
    ("_index_scores_kernel", "indexer_scores"),
    ("_radix_select_kernel", "topk_select"),
    ("void at::native::mbtopk::gatherTopK<long, unsigned int, 2>(at::cuda::detail::TensorInfo<long const, unsigned int>)",
     "topk_select"),
    ("void at::native::radixSortKVInPlace<2, -1, 64, 32, int, long, unsigned int>(...)", "topk_select"),
    ("_slot_scores_bwd_kernel", "indexer_loss"),
    ("_kl_rows_kernel", "indexer_loss"),
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)", "gemm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(...)", "norms"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>>",
     "glue"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<float>>", "glue"),
    ("_fwd_kernel_other", "glue"),  # exact names only: a Triton kernel that merely contains one is not ours
])
def test_kernel_groups_of_the_layers_kernel_names(name, group):
    assert bench_layer.kernel_group(name) == group


def test_kernels_table_has_one_column_per_row_and_every_group():
    split = {g: float(i) for i, (g, _, _) in enumerate(bench_layer.KERNEL_GROUPS)} | {"glue": 9.0, "busy": 45.0,
                                                                                     "span": 46.5}
    rows = [dict(_row("dense", 4096, "ours", 30.0), kernels=split), _row("dense", 4096, "mcore_sparse", 90.0),
            dict(_row("dense", 16384, "ours", 130.0), kernels=dict(split, glue=12.25))]
    lines = bench_layer.kernels_table(dict(rows=rows)).splitlines()
    assert lines[0].split()[1:] == ["dense", "4K", "dense", "16K"]
    body = {ln.split()[0]: ln.split()[1:] for ln in lines[1:]}
    assert list(body) == [g for g, _, _ in bench_layer.KERNEL_GROUPS] + ["glue", "busy", "span"]
    assert body["glue"] == ["9.00", "12.25"] and body["gemm"] == ["6.00", "6.00"]
    assert bench_layer.kernels_table(dict(rows=rows[1:2])) == ""


@pytest.mark.gpu
def test_kernel_split_times_a_steps_kernels_by_group():
    import torch

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def step():
        torch.cat([a @ a, a], dim=0).sum()

    split = bench_layer.kernel_split(step, steps=3)
    assert split["gemm"] > 0 and split["glue"] > 0
    assert split["busy"] == pytest.approx(sum(v for k, v in split.items() if k not in ("busy", "span")))
    assert split["span"] >= split["busy"] * 0.99
