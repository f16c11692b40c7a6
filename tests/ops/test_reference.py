"""The reference and the public op against an independent dense fp64 formula (CPU)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm5_dsa_plugin.ops import EMPTY_ROW_LSE, SparseMLAInputError, sparse_mla
from glm5_dsa_plugin.ops import reference as ref
from glm5_dsa_plugin.ops.contract import problem_of
from sparse_mla_cases import dense_sparse_mla, make_indices


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    T = draw(st.integers(1, 6))
    T_kv = draw(st.integers(1, 9))
    G = draw(st.sampled_from([1, 2]))
    H = G * draw(st.sampled_from([1, 2, 3]))
    topk = draw(st.integers(1, 7))
    d_v = draw(st.sampled_from([4, 8]))
    d_tail = draw(st.sampled_from([0, 2, 4]))
    pad_frac = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    empty = draw(st.lists(st.integers(0, T - 1), max_size=2))
    return B, T, T_kv, G, H, topk, d_v, d_tail, pad_frac, seed, empty


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_reference_matches_dense_fp64(p):
    B, T, T_kv, G, H, topk, d_v, d_tail, pad_frac, seed, empty = p
    gen = torch.Generator().manual_seed(seed)
    D = d_v + d_tail
    q = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(B, T_kv, G, D, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = make_indices(B, T, G, topk, T_kv, gen, pad_frac=pad_frac, empty_rows=empty)
    scale = 0.3
    out, lse = sparse_mla(q, kv, idx, scale, d_v=d_v, backend="reference")
    d_out, d_lse = dense_sparse_mla(q, kv, idx, scale, d_v)
    torch.testing.assert_close(out, d_out, rtol=1e-10, atol=1e-10)
    empty_mask = (idx < 0).all(-1)  # [B, T, G]
    empty_heads = empty_mask.repeat_interleave(H // G, dim=-1)
    assert torch.all(out[empty_heads] == 0)
    assert torch.all(lse[empty_heads] == EMPTY_ROW_LSE)
    torch.testing.assert_close(lse[~empty_heads], d_lse[~empty_heads].float(), rtol=1e-6, atol=1e-6)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    dq, dkv = torch.autograd.grad(out, (q, kv), g)
    rq, rkv = torch.autograd.grad(d_out, (q, kv), g)
    torch.testing.assert_close(dq, rq, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(dkv, rkv, rtol=1e-9, atol=1e-10)
    assert torch.all(dq[empty_heads] == 0)


@pytest.mark.slow
def test_gradcheck_fp64_packed():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(5, 2, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor(
        [[[0, 4, -1], [1, 1, 2]], [[-1, -1, -1], [3, -1, 0]], [[2, 2, 2], [4, 0, 1]], [[1, -1, 3], [-1, -1, -1]]],
        dtype=torch.int32,
    )
    fn = lambda a, b: sparse_mla(a, b, idx, 0.7, d_v=4, backend="reference")[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, kv), eps=1e-6, atol=1e-7)
    assert torch.autograd.gradgradcheck is not None


def test_bf16_accumulates_in_fp32():
    gen = torch.Generator().manual_seed(1)
    B, T, T_kv, G, H, K, dv, dt = 1, 8, 64, 1, 4, 48, 32, 8
    q = torch.randn(B, T, H, dv + dt, generator=gen)
    kv = torch.randn(B, T_kv, G, dv + dt, generator=gen)
    idx = make_indices(B, T, G, K, T_kv, gen)
    out16, _ = sparse_mla(q.bfloat16(), kv.bfloat16(), idx, 0.2, d_v=dv, backend="reference")
    out64, _ = dense_sparse_mla(q.bfloat16().double(), kv.bfloat16().double(), idx, 0.2, dv)
    assert out16.dtype == torch.bfloat16
    err = (out16.double() - out64).norm() / out64.norm()
    assert err < 4e-3


def test_chunking_does_not_change_results(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 9, 4, 12, generator=gen, dtype=torch.float64)
    kv = torch.randn(2, 7, 2, 12, generator=gen, dtype=torch.float64)
    idx = make_indices(2, 9, 2, 5, 7, gen, empty_rows=[3])
    g = torch.randn(2, 9, 4, 8, generator=gen, dtype=torch.float64)
    o1, l1 = ref.forward(q, kv, idx, 0.5, 8)
    dq1, dkv1 = ref.backward(q, kv, idx, g, 0.5, 8)
    monkeypatch.setattr(ref, "_CHUNK_BUDGET", 1)  # one row per chunk
    o2, l2 = ref.forward(q, kv, idx, 0.5, 8)
    dq2, dkv2 = ref.backward(q, kv, idx, g, 0.5, 8)
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-14)
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    torch.testing.assert_close(dq1, dq2, rtol=0, atol=1e-14)
    torch.testing.assert_close(dkv1, dkv2, rtol=0, atol=1e-13)


def test_top_k_wider_than_the_keys_drops_only_all_padding_columns():
    """2048-slot rows over 16 keys: columns padding in every row are skipped, and the result is the
    dense formula's. A live column is padding in most rows but not all, and a group's column can be
    live while the other group's is padding (a wrong drop changes out, lse and the gradients)."""
    gen = torch.Generator().manual_seed(6)
    B, T, T_kv, G, H, K, d_v = 1, 12, 16, 2, 4, 2048, 8
    q = torch.randn(B, T, H, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(B, T_kv, G, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.full((B, T, G, K), -1, dtype=torch.int32)
    cols = torch.randperm(K, generator=gen)[:21]
    idx[..., cols[:20]] = make_indices(B, T, G, 20, T_kv, gen, pad_frac=0.8, empty_rows=[5])
    idx[0, 7, 1, cols[20]] = 3  # the one live entry of its column: one row, the second group
    out, lse = sparse_mla(q, kv, idx, 0.4, d_v=d_v, backend="reference")
    d_out, d_lse = dense_sparse_mla(q, kv, idx, 0.4, d_v)
    torch.testing.assert_close(out, d_out, rtol=1e-10, atol=1e-10)
    live = lse != EMPTY_ROW_LSE
    torch.testing.assert_close(lse[live], d_lse[live].float(), rtol=1e-6, atol=1e-6)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, kv), g)
    want = torch.autograd.grad(d_out, (q, kv), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_row_subset_backward_equals_full_on_those_rows():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 10, 2, 12, generator=gen, dtype=torch.float64)
    kv = torch.randn(1, 6, 1, 12, generator=gen, dtype=torch.float64)
    idx = make_indices(1, 10, 1, 4, 6, gen)
    g = torch.randn(1, 10, 2, 8, generator=gen, dtype=torch.float64)
    rows = torch.tensor([[0, 2], [0, 7]])
    dq_s, _ = ref.backward(q, kv, idx, g, 0.5, 8, rows=rows)
    dq, _ = ref.backward(q, kv, idx, g, 0.5, 8)
    torch.testing.assert_close(dq_s[0, [2, 7]], dq[0, [2, 7]])
    assert torch.all(dq_s[0, [0, 1, 3, 4, 5, 6, 8, 9]] == 0)


def test_padding_slot_never_reads_its_clamped_row():
    # kv row 0 is NaN; only padding slots would clamp onto it: results must be finite and exact
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 2, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(5, 1, 10, generator=gen, dtype=torch.float64)
    kv[0] = float("nan")
    kv.requires_grad_(True)
    idx = torch.tensor([[[1, -1, 2]], [[-1, -1, -1]], [[4, 3, -1]]], dtype=torch.int32)
    out, lse = sparse_mla(q, kv, idx, 0.5, d_v=8, backend="reference")
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    dq, dkv = torch.autograd.grad(out.sum(), (q, kv))
    assert torch.isfinite(dq).all() and torch.all(dkv[0] == 0) and torch.isfinite(dkv[1:]).all()



def test_nonfinite_inputs_propagate_to_exactly_the_rows_that_read_them():
    """A NaN in a selected kv row makes out and lse NaN in every row (all heads of the group) that
    selects it; a NaN in q makes that row's head NaN; an inf in q that makes a score +inf makes
    that head nonfinite, its lse too (a +inf row max is not an empty row). Every other row equals
    the clean run, and an empty row stays out 0 / lse EMPTY_ROW_LSE. The guard relies on this:
    such inputs must not come out finite. (A score of -inf drops its slot like a masked one, as
    in torch.softmax; the kernels do the same.)"""
    gen = torch.Generator().manual_seed(7)
    T, T_kv, H, G, D, d_v = 6, 8, 4, 2, 12, 8
    q = torch.randn(1, T, H, D, generator=gen, dtype=torch.float64)
    kv = torch.randn(1, T_kv, G, D, generator=gen, dtype=torch.float64)
    kv[0, 1, 0, 0] = 1.0  # so that q[.., 0] = +inf gives key 1 a +inf score in group 0
    idx = torch.tensor([[0, 1, -1], [2, 3, 4], [5, -1, -1], [-1, -1, -1], [3, 6, 7], [1, 2, 7]], dtype=torch.int32)
    idx = idx[None, :, None, :].expand(1, T, G, 3).contiguous()
    out0, lse0 = ref.forward(q, kv, idx, 0.3, d_v)
    kv_bad = kv.clone()
    kv_bad[0, 3, 1, 5] = float("nan")  # group 1's key 3: rows 1 and 4 select it
    q_bad = q.clone()
    q_bad[0, 2, 0, 7] = float("nan")  # row 2, head 0 (group 0)
    q_bad[0, 5, 1, 0] = float("inf")  # row 5 (keys 1, 2, 7), head 1 (group 0)
    out, lse = ref.forward(q_bad, kv_bad, idx, 0.3, d_v)
    bad = torch.zeros(T, H, dtype=torch.bool)
    bad[[1, 4], 2:] = True  # group 1 = heads 2, 3
    bad[2, 0] = bad[5, 1] = True
    assert (~torch.isfinite(out[0])).any(-1).eq(bad).all(), "out: nonfinite rows"
    assert (~torch.isfinite(lse[0])).eq(bad).all(), "lse: nonfinite rows"
    assert torch.equal(out[0][~bad], out0[0][~bad]) and torch.equal(lse[0][~bad], lse0[0][~bad])
    assert (out[0, 3] == 0).all() and (lse[0, 3] == EMPTY_ROW_LSE).all()

# ---------------------------------------------------------------- bad input
def _ok(T=4, T_kv=6, H=4, G=2, K=3, D=12, dtype=torch.float32):
    q = torch.randn(T, H, D, dtype=dtype)
    kv = torch.randn(T_kv, G, D, dtype=dtype)
    idx = torch.zeros(T, G, K, dtype=torch.int32)
    return q, kv, idx


@pytest.mark.parametrize("bad_value,pos,needle", [(6, (2, 1, 0), "index 6 >= capacity T_kv=6"), (-2, (3, 0, 2), "index -2 < -1")])
def test_index_out_of_range_names_position_and_value(bad_value, pos, needle):
    q, kv, idx = _ok()
    idx[pos] = bad_value
    with pytest.raises(SparseMLAInputError) as e:
        sparse_mla(q, kv, idx, 0.5, d_v=8, backend="reference")
    msg = str(e.value)
    assert needle in msg and f"row={pos[0]}, group={pos[1]}, slot={pos[2]}" in msg and "batch=0" in msg


def test_capacity_4096_message():
    q, kv, idx = _ok(T_kv=4096)
    idx[1, 0, 1] = 4096
    with pytest.raises(ValueError, match="index 4096 >= capacity T_kv=4096"):
        sparse_mla(q, kv, idx, 0.5, d_v=8)


def test_validate_false_skips_the_check_but_stays_in_bounds():
    q, kv, idx = _ok()
    idx[0, 0, 0] = 100  # trusted caller lied: no crash, just no guarantee
    q2, kv2, idx2 = q.unsqueeze(0), kv.unsqueeze(0), idx.unsqueeze(0)
    with pytest.raises(IndexError):
        ref.forward(q2, kv2, idx2, 0.5, 8)  # the reference gathers by PyTorch indexing, which checks


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda q, kv, i: (q[0], kv, i), "q must be"),
        (lambda q, kv, i: (q, kv.unsqueeze(0), i), "kv must have 3 dims"),
        (lambda q, kv, i: (q, kv, i.long()), "indices must be int32"),
        (lambda q, kv, i: (q, kv.double(), i), "kv dtype"),
        (lambda q, kv, i: (q.int(), kv.int(), i), "q dtype"),
        (lambda q, kv, i: (q, kv[:, :, :10], i), "kv last dim 10 != q last dim 12"),
        (lambda q, kv, i: (q, kv, i[:3]), "indices has 3 rows, q has 4"),
        (lambda q, kv, i: (q[:, :3], kv, i), "must be a multiple of kv groups"),
        (lambda q, kv, i: (q, kv, i[:, :1]), "indices has 1 kv groups"),
    ],
)
def test_shape_and_dtype_errors(mutate, needle):
    q, kv, idx = mutate(*_ok())
    with pytest.raises(SparseMLAInputError, match=needle):
        sparse_mla(q, kv, idx, 0.5, d_v=8, backend="reference")


def test_sm_scale_is_required_and_checked():
    q, kv, idx = _ok()
    with pytest.raises(TypeError):
        sparse_mla(q, kv, idx)  # noqa: no default on purpose
    with pytest.raises(SparseMLAInputError, match="sm_scale is required"):
        sparse_mla(q, kv, idx, None, d_v=8)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(SparseMLAInputError, match="sm_scale must be finite"):
            sparse_mla(q, kv, idx, bad, d_v=8)


@pytest.mark.parametrize("d_v", [0, 13])
def test_d_v_range(d_v):
    q, kv, idx = _ok()
    with pytest.raises(SparseMLAInputError, match="d_v="):
        sparse_mla(q, kv, idx, 0.5, d_v=d_v)


def test_lse_is_fp32_natural_log_and_not_differentiable():
    q, kv, idx = _ok(dtype=torch.float64)
    q.requires_grad_(True)
    idx[:, :, 1] = 3
    out, lse = sparse_mla(q, kv, idx, 0.5, d_v=8, backend="reference")
    assert lse.dtype == torch.float32 and not lse.requires_grad
    s = torch.einsum("thd,tgkd->thgk", q.detach(), kv[idx.long().clamp(min=0), torch.arange(2)[None, :, None]])
    # head h reads group h // 2; all slots valid here
    g_of_h = torch.arange(4) // 2
    s = s[:, torch.arange(4), g_of_h] * 0.5
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).float())


def test_a_call_with_nothing_to_differentiate_records_no_autograd_node():
    """Without grad (or with inputs that need none) the op returns the same values as under
    autograd, with no graph node; a call autograd records gets one, and its gradients."""
    q, kv, idx = _ok(dtype=torch.float64)
    out_graph, lse_graph = sparse_mla(q.clone().requires_grad_(True), kv, idx, 0.5, d_v=8, backend="reference")
    node = out_graph.grad_fn.next_functions[0][0]  # under the unbatching squeeze
    assert "SparseMLA" in type(node).__name__
    with torch.no_grad():
        out_ng, lse_ng = sparse_mla(q.clone().requires_grad_(True), kv, idx, 0.5, d_v=8, backend="reference")
    out_plain, lse_plain = sparse_mla(q, kv, idx, 0.5, d_v=8, backend="reference")  # no input needs grad
    for out, lse in ((out_ng, lse_ng), (out_plain, lse_plain)):
        assert out.grad_fn is None and not out.requires_grad and not lse.requires_grad
        assert torch.equal(out, out_graph.detach()) and torch.equal(lse, lse_graph)


def test_deterministic_flag(no_deterministic_backend):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(9, 1, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(-1, 9, (6, 1, 4), generator=gen, dtype=torch.int32)
    sparse_mla(q, kv, idx, 0.3, d_v=8, deterministic=True)[0].sum().backward()  # CPU reference: deterministic
    with pytest.raises(ValueError, match="backend 'no_det' has no deterministic mode"):
        sparse_mla(q, kv, idx, 0.3, d_v=8, backend=no_deterministic_backend, deterministic=True)
    sparse_mla(q, kv, idx, 0.3, d_v=8, backend=no_deterministic_backend)


def test_backend_base_class_defaults_and_registry_type_check(no_deterministic_backend):
    """A backend that implements only available / forward / backward runs through the op and the
    guard on the base class's defaults (saved = (kv, indices), no flags of its own); a factory
    that returns something other than a ``Backend`` is refused with a message naming the backend."""
    from glm5_dsa_plugin.ops import get_backend, register_backend
    from glm5_dsa_plugin.ops.backends import unregister_backend

    be = get_backend(no_deterministic_backend)
    assert not be.memory_safe_on_any_index and not be.reports_nonfinite
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 5, 2, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(1, 7, 1, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(-1, 7, (1, 5, 1, 3), generator=gen, dtype=torch.int32)
    prob = problem_of(q, kv, idx, 0.3, 8)
    assert be.finite_out_lse_bound(prob) is None
    out, lse, saved = be.forward_saving(q, kv, idx, prob)
    assert saved[0] is kv and saved[1] is idx and be.originals(saved, prob) == (kv, idx)
    g = torch.randn(1, 5, 2, 8, generator=gen, dtype=torch.float64)
    out, _ = sparse_mla(q, kv, idx, 0.3, d_v=8, backend=no_deterministic_backend)
    dq, dkv = torch.autograd.grad(out, (q, kv), g)
    r_dq, r_dkv = ref.backward(q.detach(), kv.detach(), idx, g, 0.3, 8)
    torch.testing.assert_close(dq, r_dq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dkv, r_dkv, rtol=1e-12, atol=1e-12)

    class NotABackend:
        name = "not_a_backend"

    register_backend("not_a_backend", NotABackend, replace=True)
    try:
        with pytest.raises(TypeError, match="'not_a_backend' returned a NotABackend, not a .*Backend"):
            get_backend("not_a_backend")
    finally:
        unregister_backend("not_a_backend")


def test_reference_backend_reports_what_it_saves():
    """``Backend.saved_bytes``: the base class keeps the caller's kv and no index tensor of its own."""
    from glm5_dsa_plugin.ops.backends import ReferenceBackend

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 5, 4, 12, generator=gen, dtype=torch.float64)
    kv = torch.randn(2, 7, 2, 12, generator=gen, dtype=torch.float64)
    idx = torch.randint(-1, 7, (2, 5, 2, 3), generator=gen, dtype=torch.int32)
    be, prob = ReferenceBackend(), problem_of(q, kv, idx, 0.3, 8)
    _, _, saved = be.forward_saving(q, kv, idx, prob)
    assert be.saved_bytes(prob, kv.element_size()) == {"kv": saved[0].nbytes, "indices": 0}
    assert saved[1] is idx
