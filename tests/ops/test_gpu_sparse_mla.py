"""TileLang kernels vs the reference on the H200 (pytest -m gpu; skipped without sm_90)."""

import pytest
import torch

from glm5_dsa_plugin.ops import EMPTY_ROW_LSE, sparse_mla
from glm5_dsa_plugin.ops import reference as ref
from glm5_dsa_plugin.ops.contract import problem_of
from glm5_dsa_plugin.ops.workloads import w2_indices

pytestmark = pytest.mark.gpu
SCALE = 256**-0.5


def _prob(q, kv, idx):
    """The ``contract.Problem`` a backend receives for these batched inputs (d_v 512)."""
    return problem_of(q, kv, idx, SCALE, 512)


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run_both(q, kv, idx, d_v=512, scale=SCALE, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    grad = torch.randn(q.shape[:-1] + (d_v,), generator=gen, device="cuda", dtype=q.dtype)
    res = {}
    for backend in ("tilelang", "reference"):
        # the reference runs in fp32 on the same (bf16-representable) values
        cast = (lambda x: x) if backend == "tilelang" else (lambda x: x.float())
        qq, kk = cast(q.detach()).clone().requires_grad_(True), cast(kv.detach()).clone().requires_grad_(True)
        out, lse = sparse_mla(qq, kk, idx, scale, d_v=d_v, backend=backend)
        out.backward(cast(grad))
        res[backend] = (out.detach(), lse, qq.grad, kk.grad)
    return res["tilelang"], res["reference"]


def _check(ours, theirs, idx, tol=3e-3):
    out, lse, dq, dkv = ours
    r_out, r_lse, r_dq, r_dkv = theirs
    for name, a in (("out", out), ("lse", lse), ("dq", dq), ("dkv", dkv)):
        assert torch.isfinite(a).all(), f"{name} has nonfinite values"
    assert rel_l2(out, r_out) <= tol, rel_l2(out, r_out)
    assert rel_l2(dq, r_dq) <= tol, rel_l2(dq, r_dq)
    assert rel_l2(dkv, r_dkv) <= tol, rel_l2(dkv, r_dkv)
    torch.testing.assert_close(lse, r_lse, rtol=1e-4, atol=1e-3)
    empty = (idx < 0).all(-1)  # [.., T, G]
    H, G = out.shape[-2], idx.shape[-2]
    empty_h = empty.repeat_interleave(H // G, dim=-1)
    assert torch.all(out[empty_h] == 0) and torch.all(dq[empty_h] == 0)
    assert torch.all(lse[empty_h] == EMPTY_ROW_LSE)


@pytest.mark.parametrize("H", [64, 8])
def test_production_shape_ragged_rows(H):
    T, topk = 4096, 2048
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)  # fresh inputs every run
    q = torch.randn(T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(T, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = w2_indices(T, topk, gen)
    _check(*run_both(q, kv, idx), idx)


@pytest.mark.parametrize(
    "B,T,T_kv,H,G,topk,d_v",
    [
        (2, 257, 300, 16, 1, 128, 512),  # batched
        (1, 200, 512, 32, 2, 192, 512),  # kv groups, 16 heads per group
        (1, 200, 512, 16, 1, 192, 512),  # 16 heads, odd number of topk blocks
        (1, 160, 300, 8, 2, 128, 256),  # 4 heads per group, d_v 256
        (1, 150, 400, 128, 1, 256, 512),  # H=128: two head blocks
        (1, 100, 333, 64, 1, 100, 512),  # topk not a multiple of 64
        (1, 180, 250, 24, 1, 64, 512),  # heads per group padded to 32
        (1, 160, 300, 16, 1, 128, 256),  # d_v 256 + 64
        (1, 130, 300, 64, 1, 128, 256),  # d_v 256 + 64, one row per block (tiles split by vector_rows)
        (1, 64, 64, 8, 1, 4096, 512),  # topk 4096, mostly padding
    ],
)
def test_shapes(B, T, T_kv, H, G, topk, d_v):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    q = torch.randn(B, T, H, d_v + 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(B, T_kv, G, d_v + 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, T_kv, (B, T, G, topk), generator=gen, device="cuda", dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=gen, device="cuda") < 0.3] = -1
    idx[..., 0] = T_kv - 1
    idx[:, 3] = -1
    if topk > 2:
        idx[..., 1] = idx[..., 2]  # repeated index
    _check(*run_both(q, kv, idx, d_v=d_v), idx)


def test_large_magnitude_inputs_stay_finite_and_exact():
    """Regression for the shared-memory-merge miscompile: q, kv ~ N(0, 4).

    Scores have std ~4 here, so the softmax is sharp and the bf16 rounding of P and dP inside
    the kernel weighs more: the bound is 6e-3 (the miscompile gave NaN, i.e. no bound at all)."""
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    T, H = 512, 64
    q = (2 * torch.randn(T, H, 576, generator=gen, device="cuda")).bfloat16()
    kv = (2 * torch.randn(T, 1, 576, generator=gen, device="cuda")).bfloat16()
    idx = w2_indices(T, 2048, gen)
    _check(*run_both(q, kv, idx, scale=576**-0.5), idx, tol=6e-3)


def test_unsupported_split_is_a_clear_error():
    q = torch.randn(4, 16, 448, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(4, 1, 448, device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros(4, 1, 64, device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match=r"supports \(d_v, d_tail\)"):
        sparse_mla(q, kv, idx, SCALE, d_v=384, backend="tilelang")


def test_fixes_leave_fully_valid_rows_bitwise_unchanged():
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    T, T_kv, H = 256, 1024, 64
    q = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, T_kv, (1, T, 1, 512), generator=gen, device="cuda", dtype=torch.int32)
    g = torch.randn(1, T, H, 512, generator=gen, device="cuda", dtype=torch.bfloat16)
    # the same (single-warpgroup) kernels with the fixes compiled in and out
    safe = TileLangBackend()._with_choices(safe=True, fwd_warp_specialized=False, bwd_warp_specialized=False)
    raw = TileLangBackend()._with_choices(safe=False)
    o1, l1 = safe.forward(q, kv, idx, _prob(q, kv, idx))
    o2, l2 = raw.forward(q, kv, idx, _prob(q, kv, idx))
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    dq1, _ = safe.backward(q, kv, idx, o1, l1, g, _prob(q, kv, idx))
    dq2, _ = raw.backward(q, kv, idx, o2, l2, g, _prob(q, kv, idx))
    assert torch.equal(dq1, dq2)  # dkv uses atomics: order-dependent, compared in the other tests


@pytest.mark.parametrize("H,K,buckets_64,R,ws", [(64, 128, 1, 1, False), (16, 512, 1, 1, False), (64, 512, 8, 1, False),
                                                 (16, 512, 1, 4, False), (8, 256, 1, 8, False),
                                                 (64, 192, 1, 1, True), (16, 512, 1, 4, True), (8, 256, 1, 8, True)])
def test_nan_guard_regions_untouched(H, K, buckets_64, R, ws):
    """Every buffer the kernels touch sits inside NaN-filled guard regions (safe-memory pass off):
    results finite and exact, every guard element unchanged after forward and backward. The
    forward runs the backend's own launch plan (H=16, topk 512: four row buckets; H=64 with
    ``fwd_buckets_64=8``: eight single-stage buckets), or R > 1: the row-group kernels over
    ``group_keys`` lists, with a last group that runs past the sequence (T = 301). ``ws``: the
    warp-specialised forward and backward instead (H64 with topk 192: an odd count of the
    forward's 64-slot blocks, so the last pair's second block re-reads the last one; the
    backward's 32-slot blocks then number 6)."""
    from glm5_dsa_plugin.ops.row_groups import group_keys
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend
    from glm5_dsa_plugin.ops.tilelang.bwd import sparse_mla_bwd_kernel
    from glm5_dsa_plugin.ops.tilelang.bwd_ws import sparse_mla_bwd_ws_kernel
    from glm5_dsa_plugin.ops.tilelang.fwd import sparse_mla_fwd_kernel
    from glm5_dsa_plugin.ops.tilelang.fwd_ws import sparse_mla_fwd_ws_kernel
    from glm5_dsa_plugin.ops.tilelang.plan import forward_launches
    from glm5_dsa_plugin.ops.tilelang.passes import prepare_indices

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    T, T_kv, D, GUARD = 300 if R == 1 else 301, 257, 576, 1 << 16
    be = TileLangBackend()._with_choices(fwd_buckets_64=buckets_64)
    c = be._choices
    plan = forward_launches(H, K // 64, c.fwd_buckets, c.fwd_buckets_64) if R == 1 else [(0, R * K // 64, 1)]
    assert len(plan) == (buckets_64 if H == 64 else 4 if R == 1 else 1)

    def guarded(shape, dtype, fill=None):
        n = torch.Size(shape).numel()
        # an int32 read outside faults; a uint8 one (member bits) sets every row's bit
        poison = float("nan") if dtype.is_floating_point else -(2**31) if dtype == torch.int32 else 255
        buf = torch.full((GUARD + n + GUARD,), poison, device="cuda", dtype=dtype)
        inner = buf[GUARD : GUARD + n].view(shape)
        if fill is not None:
            inner.copy_(fill)
        return buf, inner

    kv_real = torch.randn(1, T_kv, 1, D, generator=gen, device="cuda").bfloat16()
    kv_ext = torch.cat([kv_real, torch.zeros_like(kv_real[:, :1])], dim=1)  # + zero sentinel row
    kv_buf, kv = guarded((1, T_kv + 1, 1, D), torch.bfloat16, kv_ext)
    q = torch.randn(1, T, H, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, T_kv, (1, T, 1, K), generator=gen, device="cuda", dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=gen, device="cuda") < 0.4] = -1
    idx[..., :3] = torch.tensor([0, T_kv - 1, -1], device="cuda", dtype=torch.int32)
    # indices that validation rejects must still be memory-safe (validation is read after the
    # kernel on this backend): they act as padding here
    idx[..., 3:6] = torch.tensor([T_kv, -7, 2**31 - 1], device="cuda", dtype=torch.int32)
    # ragged rows: every row keeps a random-length prefix (extents in every bucket)
    cut = torch.randint(0, K + 1, (T, 1), generator=gen, device="cuda")
    idx[0, :, 0] = torch.where(torch.arange(K, device="cuda") < cut, idx[0, :, 0], -1)
    idx[:, 5] = -1
    out_buf, out = guarded((1, T, H, 512), torch.bfloat16)
    lse_buf, lse = guarded((1, T, H), torch.float32)
    kidx, extent = prepare_indices(idx, T_kv, K)  # the backend's rewrite: values in [0, T_kv]
    members = kidx  # not read with R = 1
    if R > 1:  # the row groups' lists, each inside its own guard region
        lists = group_keys(kidx, T_kv, R)
        (_, kidx), (_, members), (_, extent) = (guarded(x.shape, x.dtype, x) for x in lists)
    # the forward as the backend runs it: direct gathers of the rewritten indices, its launch plan
    for lo, hi, stages in [] if ws else plan:
        sparse_mla_fwd_kernel(H, 512, 64, K, 1, SCALE, select_in_kernel=False, num_stages=stages,
                              blocks=None if (lo, hi) == (0, R * K // 64) else (lo, hi),
                              rows_per_block=R)(q, kv, kidx, extent, members, out, lse)
    if ws:  # as the backend runs it: one row per block reads the caller's indices (its own select)
        keys = kidx if R > 1 else guarded(idx.shape, torch.int32, idx)[1]
        sparse_mla_fwd_ws_kernel(H, 512, 64, K, 1, SCALE, rows_per_block=R)(q, kv, keys, extent,
                                                                            members if R > 1 else keys, out, lse)
    dq_buf, dq = guarded((1, T, H, D), torch.bfloat16)
    dkv_buf, dkv = guarded((1, T_kv + 1, 1, D), torch.float32, torch.zeros(1, T_kv + 1, 1, D, device="cuda"))
    do = torch.randn(1, T, H, 512, generator=gen, device="cuda", dtype=torch.bfloat16)
    # the backward reads out (for Delta) inside its guard region too; as the backend runs it, with
    # one row per block it reads the caller's indices as they are (the invalid values included,
    # 2**31 - 1 too: its kernels select and mask them), row groups read their lists
    bwd = (sparse_mla_bwd_ws_kernel(H, 512, 64, K, 1, SCALE, rows_per_block=R) if ws
           else sparse_mla_bwd_kernel(H, 512, 64, K, 1, SCALE, rows_per_block=R))
    flags = torch.zeros(1, dtype=torch.int32, device="cuda")  # the warp-specialised backward's nonfinite flag
    # (and its HeadProbs argument, unused without head_probs: a one-element placeholder)
    ws_flag = (flags, torch.zeros(1, device="cuda")) if ws else ()
    if R == 1:
        _, raw = guarded(idx.shape, torch.int32, idx)
        bwd(q, kv, do, raw, lse, out, extent, raw, dq, dkv, *ws_flag)
    else:
        bwd(q, kv, do, kidx, lse, out, extent, members, dq, dkv, *ws_flag)
    torch.cuda.synchronize()
    assert flags.item() == 0, "the warp-specialised backward flagged a nonfinite dq (a NaN guard region read?)"
    for name, buf, inner in (("kv", kv_buf, kv), ("out", out_buf, out), ("lse", lse_buf, lse),
                             ("dq", dq_buf, dq), ("dkv", dkv_buf, dkv)):
        assert torch.isfinite(inner).all(), f"{name}: nonfinite inside"
        n = inner.numel()
        assert torch.isnan(buf[:GUARD]).all() and torch.isnan(buf[GUARD + n :]).all(), f"{name}: guard written"
    assert torch.all(dkv[:, T_kv] == 0), "sentinel row received a dKV contribution"
    assert torch.all(out[0, 5] == 0) and torch.all(dq[0, 5] == 0)
    clean = idx.masked_fill((idx < -1) | (idx >= T_kv), -1)
    r_out, r_lse = ref.forward(q.float(), kv_real.float(), clean, SCALE, 512)
    r_dq, r_dkv = ref.backward(q.float(), kv_real.float(), clean, do.float(), SCALE, 512)
    assert rel_l2(out, r_out) < 3e-3 and rel_l2(dq, r_dq) < 3e-3 and rel_l2(dkv[:, :T_kv], r_dkv) < 3e-3


def _tilelang(**options):
    """A TileLangBackend with the user settings among ``options`` and the rest as kernel choices."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    user = {k: options.pop(k) for k in ("deterministic", "row_groups", "slot_buffer_bytes") if k in options}
    return TileLangBackend(**user)._with_choices(**options)


@pytest.mark.parametrize("H,topk,options,caller", [
    (64, 256, {}, True),  # one row per block, topk a multiple of 64
    (64, 200, {}, False),  # one row per block, topk padded: the backward reads the padded copy
    (8, 200, {}, True),  # row groups read their lists; the indices are only the guard's
    (64, 256, dict(deterministic=True), False),  # per-key sums need the sentinel rewrite
])
def test_backward_keeps_the_callers_indices(H, topk, options, caller):
    """What autograd keeps for the backward: the caller's indices where the backward can read them
    as they are, so no second index-sized tensor per call; the rewritten copy elsewhere. Either
    way the gradients equal the reference, with indices the rule rejects acting as padding."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    T, T_kv = 160, 300
    q = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1, T, H, 512, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(-1, T_kv, (1, T, 1, topk), generator=gen, device="cuda", dtype=torch.int32)
    idx[0, :, 0, :3] = torch.tensor([T_kv, -5, 2**31 - 1], device="cuda", dtype=torch.int32)  # rejected
    idx[0, 7] = -1
    be = _tilelang(**options)
    out, lse, saved = be.forward_saving(q, kv, idx, _prob(q, kv, idx))
    assert (saved[1].data_ptr() == idx.data_ptr()) == caller
    reported = be.saved_bytes(_prob(q, kv, idx), 2)  # what the planner reads: an upper bound per tensor
    assert reported["kv"] == saved[0].nbytes and reported["extent"] == saved[2].nbytes
    assert reported["indices"] >= (0 if caller else saved[1].nbytes)
    dq, dkv = be.backward_saved(q, saved, out, lse, g, _prob(q, kv, idx))
    clean = idx.masked_fill(idx >= T_kv, -1).clamp(min=-1)
    r_out, r_lse = ref.forward(q.float(), kv.float(), clean, SCALE, 512)
    r_dq, r_dkv = ref.backward(q.float(), kv.float(), clean, g.float(), SCALE, 512)
    _check((out, lse, dq, dkv), (r_out, r_lse, r_dq, r_dkv), clean)
    kv_o, idx_o = be.originals(saved, _prob(q, kv, idx))  # what the guard's reference repair reads
    assert torch.equal(kv_o, kv) and torch.equal(idx_o.masked_fill(idx_o >= T_kv, -1).clamp(min=-1), clean)


NONFINITE_PATHS = [
    (64, {}),  # warp-specialised, one row per block
    (128, {}),  # two 64-row head blocks
    (64, dict(fwd_warp_specialized=False, bwd_warp_specialized=False)),  # single-warpgroup kernels
    (16, dict(row_groups=False)),  # one row per block, 16-row head tiles
    (8, {}),  # row groups, R = 8
    (32, {}),  # row groups, R = 2
    (16, dict(fwd_warp_specialized=False)),  # row groups, R = 4, single-warpgroup forward
]


def _nonfinite_case(H, T=256, T_kv=2048, K=128):
    """(gen, q, kv, idx, grad) for the nonfinite tests: fresh random bf16 q [1, T, H, 576], kv, dO,
    indices in [-1, T_kv) (topk K), row 9 empty; the tests then plant their bad values."""
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    q = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(-1, T_kv, (1, T, 1, K), generator=gen, device="cuda", dtype=torch.int32)
    idx[0, 9] = -1  # an empty row
    grad = torch.randn(1, T, H, 512, generator=gen, device="cuda", dtype=torch.bfloat16)
    return gen, q, kv, idx, grad


@pytest.mark.parametrize("H,options", NONFINITE_PATHS)
def test_nonfinite_inputs_come_out_nonfinite(H, options):
    """A NaN in a selected kv row, a NaN in q and an inf in q that makes a score +inf come out
    nonfinite (out, lse, dq) in every (row, head) where the fp32 reference's do, and dkv of the
    NaN key nonfinite. An epilogue that tested ``row_sum > 0`` to find empty rows would fail a
    NaN row sum and return such rows as empty rows (out 0, lse -1e30): finite, and invisible to
    the guard. A row group may spread a NaN key to the group's other
    rows (a masked entry is -inf + NaN); nothing else may differ: every other entry is finite
    and matches the reference."""
    from glm5_dsa_plugin.ops.tilelang.backend import _kernel_lists, TileLangBackend

    T, T_kv = 256, 2048
    gen, q, kv, idx, grad = _nonfinite_case(H, T, T_kv)
    idx[0, [40, 150], 0, 0] = torch.randperm(T_kv, generator=gen, device="cuda")[:2].to(torch.int32)
    key = int(idx[0, 40, 0, 0])  # selected by row 40 and, at random, by about 6% of the rows
    kv[0, key, 0, 10] = float("nan")
    q[0, 77, H // 2, 100] = float("nan")
    kv[0, int(idx[0, 150, 0, 0]), 0, 5] = 1.0  # so that q[150, 1, 5] = +inf gives a +inf score
    q[0, 150, 1, 5] = float("inf")
    be = _tilelang(**options)
    out, lse, saved = be.forward_saving(q, kv, idx, _prob(q, kv, idx))  # as the op runs it: both directions
    dq, dkv = be.backward_saved(q, saved, out, lse, grad, _prob(q, kv, idx))  # on the same row groups
    r_out, r_lse = ref.forward(q.float(), kv.float(), idx, SCALE, 512)
    r_dq, _ = ref.backward(q.float(), kv.float(), idx, grad.float(), SCALE, 512)
    want = ~torch.isfinite(r_out[0]).all(-1) | ~torch.isfinite(r_lse[0])  # [T, H]
    assert want[40].all() and want[77, H // 2] and want[150, 1] and not want[9].any()
    got = {"out": ~torch.isfinite(out[0]).all(-1), "lse": ~torch.isfinite(lse[0]), "dq": ~torch.isfinite(dq[0]).all(-1)}
    R = _kernel_lists(saved, _prob(q, kv, idx))[0]  # consecutive rows per block (R > 1: this call ran row groups)
    spread = want.any(-1).view(T // R, R).any(-1).repeat_interleave(R)[:, None] if R > 1 else want
    for name, bad in got.items():
        assert (bad | ~want).all(), f"{name}: finite where the reference is not: {(want & ~bad).nonzero().tolist()[:5]}"
        assert not (bad & ~spread).any(), f"{name}: nonfinite outside the rows that read the bad inputs"
    assert not torch.isfinite(dkv[0, key]).all()
    ok = ~got["out"]
    assert rel_l2(out[0][ok], r_out[0][ok]) <= 3e-3
    torch.testing.assert_close(lse[0][ok], r_lse[0][ok], rtol=1e-4, atol=1e-3)
    ok = ~got["dq"]
    assert rel_l2(dq[0][ok], r_dq[0][ok]) <= 3e-3


@pytest.mark.parametrize("H,options", NONFINITE_PATHS + [(64, dict(deterministic=True))])
@pytest.mark.parametrize("case", ["clean", "inf_value", "nan_grad"])
def test_backward_flags_exactly_its_nonfinite_outputs(H, options, case):
    """The backward's ``nonfinite_flag`` is set exactly when the dq or dkv it returns holds a NaN /
    inf: the warp-specialised kernel tests dq in its registers before storing it (the dq scan
    goes), the others' dq is scanned in the dKV conversion pass, dkv is tested there in every
    case. ``inf_value``: +inf in a kv row's value columns, which (for heads whose q is negative
    there) scores -inf, a zero weight, and 0 * inf = NaN while lse stays finite; ``nan_grad``:
    one row of dO is NaN (the forward stays finite)."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    _, q, kv, idx, grad = _nonfinite_case(H)
    if case == "inf_value":
        key = int(idx[0, 60].max())
        kv[0, key, 0, 7] = float("inf")
        q[0, 60, 0, 7], q[0, 60, 1, 7] = -1.0, 1.0  # head 0: score -inf (lse finite); head 1: +inf
    elif case == "nan_grad":
        grad[0, 200, H - 1, 3] = float("nan")
    be = _tilelang(**options)
    flags = torch.zeros(1, dtype=torch.int32, device="cuda")
    out, lse, saved = be.forward_saving(q, kv, idx, _prob(q, kv, idx))
    dq, dkv = be.backward_saved(q, saved, out, lse, grad, _prob(q, kv, idx), nonfinite_flag=flags)
    fwd_bad = not (torch.isfinite(out).all() and torch.isfinite(lse).all())
    bwd_bad = not (torch.isfinite(dq).all() and torch.isfinite(dkv).all())
    assert (fwd_bad, bwd_bad) == {"clean": (False, False), "inf_value": (True, True),
                                  "nan_grad": (False, True)}[case]
    assert bool(flags.item()) == bwd_bad, (flags.item(), bwd_bad)
    if case == "inf_value":  # the case a scan of lse alone would miss: some head's lse stays finite
        assert torch.isfinite(lse[0, 60, 0]) and not torch.isfinite(out[0, 60, 0]).all()


GATED_CASES = {  # case: (kv flagged suspect, a full scan must flag)
    "clean": (False, False), "q_nan": (False, True), "q_pos_inf": (False, True), "q_neg_inf": (False, True),
    "kv_nan": (True, True), "kv_inf": (True, True), "kv_neg_inf": (True, True), "kv_huge": (True, None),
    "kv_below_bound": (False, None), "scores_below_mask_init": (False, None), "scores_huge": (False, None),
    "scores_overflow": (False, None),
}


@pytest.mark.parametrize("H,options", NONFINITE_PATHS)
@pytest.mark.parametrize("case", list(GATED_CASES))
def test_forward_check_flags_what_a_full_scan_does_and_the_rows_it_cannot_vouch_for(H, options, case):
    """The guard's forward check for this backend (kv flagged in index preparation, lse read, out
    read only when kv is suspect) flags whenever a full scan of out and lse does, on every kernel
    path, over poisoned q and kv and the regimes ``finite_out_lse_bound`` argues about: every
    score of a row below -2^30 (where a finite running-max start would sit), scores with
    |m * c| >= 2^27, scores that overflow fp32, kv entries of 2^99 (not suspect) and 2^101. It
    flags more only for doubtful rows (lse beyond the bound, or empty with a valid slot), whose
    lse it sets to NaN, every other lse untouched; in the clean case nothing."""
    from glm5_dsa_plugin.ops.guard import FLAG_SLOTS, Flag
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend
    from glm5_dsa_plugin.ops.guard.device_checks import check_forward, flag_nonfinite

    _, q, kv, idx, _ = _nonfinite_case(H)
    row, h = 60, H - 1
    key = int(idx[0, row].max())
    planted = {
        "q_nan": lambda: q[0, row, h].__setitem__(11, float("nan")),
        "q_pos_inf": lambda: q[0, row, h].__setitem__(11, float("inf")),
        "q_neg_inf": lambda: q[0, row, h].__setitem__(11, -float("inf")),
        "kv_nan": lambda: kv[0, key, 0].__setitem__(11, float("nan")),
        "kv_inf": lambda: kv[0, key, 0].__setitem__(11, float("inf")),
        "kv_neg_inf": lambda: kv[0, key, 0].__setitem__(11, -float("inf")),
        "kv_huge": lambda: kv[0, key, 0].__setitem__(11, 2.0**101),
        "kv_below_bound": lambda: kv[0, key, 0].__setitem__(11, 2.0**99),
        "scores_huge": lambda: q[0, row, h].fill_(2.0**26),
        "scores_overflow": lambda: q[0, row, h].fill_(3e38),
    }
    if case == "scores_below_mask_init":
        # kv all ones; the row's scores all exactly -(2^30 + 2048) (multiples of 128 below 2^31:
        # exact in fp32 in any order): with a running max starting at -2^30 every p would
        # underflow (out 0, lse EMPTY_ROW_LSE); the row is exact, its lse (about -6.7e7) beyond
        # the bound
        kv.fill_(1.0)
        q[0, row, h].zero_()
        q[0, row, h, :512] = -(2.0**21)
        q[0, row, h, 512:528] = -128.0
    elif case != "clean":
        planted[case]()
    be = _tilelang(**options)
    flags = torch.zeros(FLAG_SLOTS, dtype=torch.int32, device="cuda")
    out, lse, saved = be.forward_saving(q, kv, idx, _prob(q, kv, idx),
                                        kv_flag=flags[Flag.KV_SUSPECT:Flag.KV_SUSPECT + 1])
    full = torch.zeros(FLAG_SLOTS, dtype=torch.int32, device="cuda")
    flag_nonfinite(out, full, Flag.NONFINITE, lse)
    bound, extent = be.finite_out_lse_bound(_prob(q, kv, idx)), be.row_extent(saved)
    has_slot = extent.repeat_interleave(H, -1) > 0
    doubtful = ((lse.abs() > bound) & (lse != EMPTY_ROW_LSE)) | ((lse == EMPTY_ROW_LSE) & has_slot)
    before = lse.clone()
    check_forward(out, lse, flags, Flag.NONFINITE, Flag.KV_SUSPECT, bound, EMPTY_ROW_LSE, extent, H)
    suspect, must_flag = GATED_CASES[case]
    assert int(flags[Flag.KV_SUSPECT]) == suspect
    assert int(flags[Flag.NONFINITE]) == int(bool(full[Flag.NONFINITE]) or bool(doubtful.any())), \
        (case, flags.tolist(), full.tolist())
    assert torch.isnan(lse[doubtful]).all()
    assert torch.equal(lse[~doubtful].nan_to_num(7.0), before[~doubtful].nan_to_num(7.0))
    if must_flag is not None:
        assert int(full[1]) == must_flag
    if case == "clean":
        assert not doubtful.any() and int(flags[Flag.NONFINITE]) == 0
    if case == "scores_below_mask_init":
        assert doubtful[0, row, h]  # lse beyond the bound: recomputed by the guard


@pytest.mark.parametrize("H", [64, 16])
def test_rows_whose_scores_all_underflow_are_recomputed(H):
    """Through the op (``fallback``, without grad and under autograd): a row whose scores are all
    far below -2^30 (right in the kernels, with an lse beyond the check's bound) is recomputed by
    the guard, so out and lse equal the fp64 reference there and every other row is the kernels' own."""
    from glm5_dsa_plugin.ops import configure, guard_stats, reset_guard_stats

    gen = torch.Generator(device="cuda").manual_seed(3)
    T, T_kv, K, row = 256, 512, 128, 77
    q = torch.randn(T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    # kv rows of ones but for entries 0 / 1 = 1 + a / 1 - a (a in {-0.5, 0, 0.5}): the row's scores stay
    # exactly -(2^30 + 2048) while its out (the mean of the selected rows) is not constant
    kv = torch.ones(T_kv, 1, 576, device="cuda", dtype=torch.bfloat16)
    a = (torch.randint(0, 3, (T_kv,), generator=gen, device="cuda") - 1).to(torch.bfloat16) * 0.5
    kv[:, 0, 0], kv[:, 0, 1] = 1 + a, 1 - a
    idx = torch.randint(0, T_kv, (T, 1, K), generator=gen, device="cuda", dtype=torch.int32)
    q[row].zero_()
    q[row, :, :512] = -(2.0**21)
    q[row, :, 512:528] = -128.0
    configure(policy="fallback")
    reset_guard_stats()
    try:
        r_out, r_lse = ref.forward(q.double()[None], kv.double()[None], idx[None], SCALE, 512)
        with pytest.warns(RuntimeWarning, match="repaired"):
            with torch.no_grad():
                out, lse = sparse_mla(q, kv, idx, SCALE, backend="tilelang")
        assert guard_stats()["rows_repaired"] >= 1
        assert torch.isfinite(out).all() and (out[row] != 0).any()
        assert rel_l2(out[row], r_out[0, row]) <= 3e-3
        torch.testing.assert_close(lse[row], r_lse[0, row], rtol=1e-6, atol=0)  # (both fp32)
        qq = q.clone().requires_grad_(True)
        out2, _ = sparse_mla(qq, kv, idx, SCALE, backend="tilelang")  # device-side repair
        assert rel_l2(out2[row].detach(), r_out[0, row]) <= 3e-3
        out2.float().sum().backward()  # settles the call's flags (the warning was given once already)
        assert guard_stats()["rows_repaired"] >= 2
        others = torch.ones(T, dtype=torch.bool, device="cuda")
        others[row] = False
        assert rel_l2(out[others], r_out[0][others]) <= 3e-3
    finally:
        configure(policy="fallback")
        reset_guard_stats()


@pytest.mark.parametrize("H,options", NONFINITE_PATHS)
def test_rows_far_below_any_finite_max_start_are_exact_in_the_kernels(H, options):
    """The kernels alone (no guard) on every forward path: rows whose scores all lie far below
    -2^30 (exactly -(2^30 + 2048) and -(2^30 + 2^27)) equal the fp64 reference, and so do rows whose
    first slot blocks are all padding (the running max -inf through them) and every other row; the
    empty row is an empty row. The running max starts at -inf; a start at -2^30 would return such
    a row empty (out 0, lse EMPTY_ROW_LSE), which only the guard would catch."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    T, T_kv, K = 256, 512, 192
    q = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    # kv rows of ones but for entries 0 / 1 = 1 + a / 1 - a (a in {-0.5, 0, 0.5}): the far rows' scores
    # stay constant while their out (the mean of the selected rows) is not
    kv = torch.ones(1, T_kv, 1, 576, device="cuda", dtype=torch.bfloat16)
    a = (torch.randint(0, 3, (T_kv,), generator=gen, device="cuda") - 1).to(torch.bfloat16) * 0.5
    kv[0, :, 0, 0], kv[0, :, 0, 1] = 1 + a, 1 - a
    idx = torch.randint(0, T_kv, (1, T, 1, K), generator=gen, device="cuda", dtype=torch.int32)
    far = (77, 150)
    for row in far:
        q[0, row].zero_()
        q[0, row, :, :512] = -(2.0**21)
    q[0, 77, :, 512:528] = -128.0  # -(2^30 + 2048)
    q[0, 150, :, 512:576] = -(2.0**21)  # -(2^30 + 2^27)
    idx[0, (77, 100), :, :64] = -1
    idx[0, 101, :, :128] = -1
    idx[0, 9] = -1
    out, lse, _ = _tilelang(**options).forward_saving(q, kv, idx, _prob(q, kv, idx))
    r_out, r_lse = ref.forward(q.double(), kv.double(), idx, SCALE, 512)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    for row in far:
        assert (out[0, row] != 0).any()
        # at |m * c| ~ 1e8 every p of the row is 2^e, |e| <= 4 (m * c rounded), not 1: P enters the
        # PV GEMM in bf16 and the row sum in fp32, so the whole row is off by bf16's rounding of
        # that one factor (<= 2^-9) besides out's own
        assert rel_l2(out[0, row], r_out[0, row]) <= 5e-3, row
        torch.testing.assert_close(lse[0, row], r_lse[0, row], rtol=1e-6, atol=0)  # (both fp32)
    assert rel_l2(out[0], r_out[0]) <= 3e-3
    near = torch.ones(T, dtype=torch.bool, device="cuda")
    near[list(far)] = False
    torch.testing.assert_close(lse[0, near], r_lse[0, near], rtol=1e-4, atol=1e-3)
    assert (out[0, 9] == 0).all() and (lse[0, 9] == EMPTY_ROW_LSE).all()


def test_nonfinite_inputs_raise_under_the_guard(tmp_path):
    """Through the op, ``fallback``: a NaN kv row that rows select is not repairable (the reference
    is NaN there too), so the call raises FloatingPointError naming its dump, without grad (the
    eager flag read) and, under autograd, in the backward (the device repair's flags)."""
    from glm5_dsa_plugin.ops import configure

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    q = torch.randn(128, 64, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(200, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, 200, (128, 1, 128), generator=gen, device="cuda", dtype=torch.int32)
    kv[int(idx[5, 0, 0]), 0, 0] = float("nan")
    configure(policy="fallback", dump_dir=str(tmp_path), dump_every=1)
    try:
        with torch.no_grad(), pytest.raises(FloatingPointError, match="inputs are bad"):
            sparse_mla(q, kv, idx, SCALE, backend="tilelang")
        qq = q.clone().requires_grad_(True)
        with pytest.raises(FloatingPointError, match="inputs are bad"):
            sparse_mla(qq, kv, idx, SCALE, backend="tilelang")[0].float().sum().backward()
    finally:
        configure(policy="fallback", dump_dir="glm5_dsa_dumps", dump_every=100)

def test_guard_counts_calls_and_stays_quiet_on_good_output():
    from glm5_dsa_plugin.ops import guard_stats, reset_guard_stats

    reset_guard_stats()
    q = torch.randn(64, 16, 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(80, 1, 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx = torch.randint(-1, 80, (64, 1, 64), device="cuda", dtype=torch.int32)
    sparse_mla(q, kv, idx, SCALE, backend="tilelang")[0].sum().backward()
    st = guard_stats()
    assert st["calls_checked"] == 2 and st["events"] == 0


@pytest.mark.parametrize("H", [16, 64])
def test_device_side_backward_repair(tmp_path, H):
    """Fallback on CUDA: a TileLang backend whose dq rows / dkv rows come back NaN is repaired on
    the device (``row_repair``, no flag read in the backward): repaired rows equal the fp32
    reference, every other row is bitwise what the backend returned, the counters and the dump
    arrive when the flags are settled (``guard_stats``)."""
    from glm5_dsa_plugin.ops import configure, guard_stats, reset_guard_stats
    from glm5_dsa_plugin.ops.backends import register_backend
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    T, K = 512, 256
    bad_q, bad_kv = [3, 100, 400], [5, 200]
    returned = {}

    class NaNRows(TileLangBackend):
        name = "tilelang_nan_rows"
        reports_nonfinite = False  # poisoned after the kernels: the guard scans

        def backward_saved(self, q, saved, out, lse, grad_out, prob, nonfinite_flag=None):
            dq, dkv = super().backward_saved(q, saved, out, lse, grad_out, prob)
            # bad rows: random values (far from the reference) with one NaN in head / channel 0,
            # so an entry the repair misses cannot pass for a repaired one
            dq[:, bad_q] = torch.randn_like(dq[:, bad_q])
            dq[:, bad_q, 0, 0] = float("nan")
            dkv[:, bad_kv] = torch.randn_like(dkv[:, bad_kv])
            dkv[:, bad_kv, 0, 0] = float("nan")
            returned.setdefault("dq", dq.clone())  # the first call (the dump recomputes)
            returned.setdefault("dkv", dkv.clone())
            return dq, dkv

    register_backend(NaNRows.name, NaNRows, replace=True)
    configure(policy="fallback", dump_dir=str(tmp_path), dump_every=1)
    reset_guard_stats()
    gen = torch.Generator(device="cuda").manual_seed(7)
    idx = w2_indices(T, K, gen)
    q = torch.randn(T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(T, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, H, 512, generator=gen, device="cuda", dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="repaired"):
        sparse_mla(q, kv, idx, SCALE, backend=NaNRows.name)[0].backward(g)
        st = guard_stats()  # settles the deferred flags
    assert st["events"] == 1 and st["rows_repaired"] == len(bad_q) and st["kv_rows_repaired"] == len(bad_kv), st
    r_dq, r_dkv = ref.backward(q.detach().float()[None], kv.detach().float()[None], idx[None], g.float()[None],
                               SCALE, 512)
    rq = torch.zeros(T, dtype=torch.bool, device="cuda")
    rq[bad_q] = True
    rk = torch.zeros(T, dtype=torch.bool, device="cuda")
    rk[bad_kv] = True
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
    assert rel_l2(q.grad[rq], r_dq[0][rq]) <= 3e-3 and rel_l2(kv.grad[rk], r_dkv[0][rk]) <= 3e-3
    assert torch.equal(q.grad[~rq], returned["dq"][0][~rq]) and torch.equal(kv.grad[~rk], returned["dkv"][0][~rk])
    dump = torch.load(st["dumps"][0], weights_only=False)
    assert dump["bad_outputs_recomputed"] and torch.isnan(dump["bad_outputs"]["dq"]).any()


def _queued_backward_inputs():
    """(q_leaf, q, kv, idx, grad_out) of a 512-row, 64-head call with the guard's queue settled; q is
    no leaf (q_leaf * 1), so once the graph is gone only the guard's queue can hold it."""
    from glm5_dsa_plugin.ops import guard_stats

    gen = torch.Generator(device="cuda").manual_seed(3)
    T, H = 512, 64
    idx = w2_indices(T, 256, gen)
    q_leaf = torch.randn(T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(T, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    guard_stats()
    g = torch.randn(T, H, 512, generator=gen, device="cuda", dtype=torch.bfloat16)
    return q_leaf, q_leaf * 1.0, kv, idx, g


def test_a_queued_backward_keeps_its_inputs_not_its_outputs():
    """Fallback on CUDA: until its flags are settled, a recorded call's backward keeps what a dump
    would need (q, grad_out, the saved index tensors) and nothing else: out is released with the
    graph, so settling frees q + grad_out + the saved tensors and no more."""
    from glm5_dsa_plugin.ops import configure, guard, guard_stats

    configure(policy="fallback")
    q_leaf, q, kv, idx, g = _queued_backward_inputs()
    out, lse = sparse_mla(q, kv, idx, SCALE, backend="tilelang")
    out_bytes = out.untyped_storage().nbytes()
    out.backward(g)
    held = guard.pending.queue.held_bytes
    q_bytes, g_bytes = q.untyped_storage().nbytes(), g.untyped_storage().nbytes()
    del q, g, out, lse
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    guard_stats()
    freed = before - torch.cuda.memory_allocated()
    assert held >= q_bytes + g_bytes and freed >= q_bytes + g_bytes and freed < q_bytes + g_bytes + out_bytes
    assert abs(freed - held) <= 2**20 + idx.nbytes  # the caller's indices may be among the saved


def test_bad_index_raises_on_the_tilelang_path():
    """Validation is read after the (memory-safe) kernel here; the error is the same as elsewhere."""
    q = torch.randn(64, 16, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(80, 1, 576, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(-1, 80, (64, 1, 64), device="cuda", dtype=torch.int32)
    idx[10, 0, 7] = 80
    with pytest.raises(ValueError, match=r"row=10, group=0, slot=7\] = 80: index 80 >= capacity T_kv=80"):
        sparse_mla(q, kv, idx, SCALE, backend="tilelang")


def test_bad_index_of_a_recorded_forward_raises_in_its_backward():
    """Under autograd the forward does not read the index flag (no stall); its backward raises the
    same error, naming the entry, before any gradient is returned."""
    q = torch.randn(64, 16, 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(80, 1, 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    idx = torch.randint(-1, 80, (64, 1, 64), device="cuda", dtype=torch.int32)
    idx[10, 0, 7] = 80
    out, _ = sparse_mla(q, kv, idx, SCALE, backend="tilelang")
    with pytest.raises(ValueError, match=r"row=10, group=0, slot=7\] = 80: index 80 >= capacity T_kv=80.*after the call"):
        out.float().sum().backward()
    assert q.grad is None and kv.grad is None


def test_deferred_forward_flags_without_grad():
    """configure(forward_flags="deferred"): a forward without grad returns the same output as the
    eager one without reading its flags; a bad index then raises from guard_stats(), naming it."""
    from glm5_dsa_plugin.ops import configure, guard_stats

    q = torch.randn(64, 16, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(80, 1, 576, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(-1, 80, (64, 1, 64), device="cuda", dtype=torch.int32)
    want, _ = sparse_mla(q, kv, idx, SCALE, backend="tilelang")
    configure(forward_flags="deferred")
    try:
        got, _ = sparse_mla(q, kv, idx, SCALE, backend="tilelang")
        guard_stats()
        assert torch.equal(got, want)
        idx[3, 0, 9] = 95
        sparse_mla(q, kv, idx, SCALE, backend="tilelang")  # returns
        with pytest.raises(ValueError, match=r"row=3, group=0, slot=9\] = 95: index 95 >= capacity T_kv=80"):
            guard_stats()
    finally:
        configure(forward_flags="eager")


@pytest.mark.parametrize("H", [16, 64])
def test_device_side_forward_repair(tmp_path, H):
    """Fallback on CUDA under autograd: out rows / lse rows a TileLang forward returns nonfinite
    are repaired on the device before the call returns (no flag read): they equal the fp32
    reference, every other row is bitwise what the backend returned; the event is counted and
    dumped when the flags are settled (the backward)."""
    from glm5_dsa_plugin.ops import configure, guard_stats, reset_guard_stats
    from glm5_dsa_plugin.ops.backends import register_backend
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    T, K = 512, 256
    bad_out, bad_lse = [3, 300], [100]
    returned = {}

    class NaNRows(TileLangBackend):
        name = "tilelang_nan_fwd_rows"
        def finite_out_lse_bound(self, prob):
            return None  # NaN written into out after the kernels, lse left usual: the guard scans out

        def forward_saving(self, q, kv, indices, prob, index_flag=None):
            out, lse, saved = super().forward_saving(q, kv, indices, prob, index_flag)
            out[:, bad_out] = torch.randn_like(out[:, bad_out])
            out[:, bad_out, 0, 0] = float("nan")
            lse[:, bad_lse, -1] = float("inf")
            returned.setdefault("out", out.clone())  # the first call (the dump recomputes)
            returned.setdefault("lse", lse.clone())
            return out, lse, saved

    register_backend(NaNRows.name, NaNRows, replace=True)
    configure(policy="fallback", dump_dir=str(tmp_path), dump_every=1)
    reset_guard_stats()
    gen = torch.Generator(device="cuda").manual_seed(8)
    idx = w2_indices(T, K, gen, empty_rows=(300,))
    q = torch.randn(T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(T, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, lse = sparse_mla(q, kv, idx, SCALE, backend=NaNRows.name)
    r_out, r_lse = ref.forward(q.detach().float()[None], kv.detach().float()[None], idx[None], SCALE, 512)
    rows = torch.zeros(T, dtype=torch.bool, device="cuda")
    rows[bad_out + bad_lse] = True
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_l2(out[rows], r_out[0][rows]) <= 3e-3
    torch.testing.assert_close(lse[rows], r_lse[0][rows], rtol=1e-4, atol=1e-3)
    assert torch.all(out[300] == 0) and torch.all(lse[300] == EMPTY_ROW_LSE)  # the empty row
    assert torch.equal(out[~rows], returned["out"][0][~rows]) and torch.equal(lse[~rows], returned["lse"][0][~rows])
    with pytest.warns(RuntimeWarning, match="repaired"):
        out.float().sum().backward()
        st = guard_stats()
    assert st["events"] == 1 and st["rows_repaired"] == len(bad_out + bad_lse), st
    dump = torch.load(st["dumps"][0], weights_only=False)
    assert dump["bad_outputs_recomputed"] and torch.isnan(dump["bad_outputs"]["out"]).any()
    configure(policy="fallback", dump_dir="glm5_dsa_dumps", dump_every=100)
    reset_guard_stats()


@pytest.mark.parametrize("H,G,R", [(64, 1, 1), (128, 1, 1), (16, 2, 8), (16, 1, 4), (8, 1, 8), (16, 2, 1)])
def test_deterministic_backward_is_bitwise_reproducible_and_exact(H, G, R):
    """deterministic=True: 20 backward runs give bitwise identical dq/dkv, equal to the reference;
    a small slot buffer forces several row chunks. R > 1: row groups (one contribution per entry of
    a group's key list), R = 1 below 64 heads: one-row blocks (row_groups=False)."""
    from glm5_dsa_plugin.ops import backends
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    seen = []

    class Recording(TileLangBackend):
        def _backward_deterministic(self, qp, kv_k, dop, lists, *args, **kwargs):
            seen.append(lists[0])
            return super()._backward_deterministic(qp, kv_k, dop, lists, *args, **kwargs)

    groups = "auto" if H // G >= 64 else R > 1
    backends.register_backend("tilelang_small_chunks",
                              lambda: Recording(slot_buffer_bytes=64 << 20, row_groups=groups), replace=True)
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    T, K = 1024, 512
    idx = w2_indices(T, K, gen).expand(T, G, K).contiguous()  # [T, 1, K] -> every group
    q = torch.randn(T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(T, G, 576, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, H, 512, generator=gen, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(20):
        q.grad = kv.grad = None
        sparse_mla(q, kv, idx, SCALE, backend="tilelang_small_chunks", deterministic=True)[0].backward(g)
        runs.append((q.grad.clone(), kv.grad.clone()))
    for dq, dkv in runs[1:]:
        assert torch.equal(dq, runs[0][0]) and torch.equal(dkv, runs[0][1])
    r_dq, r_dkv = ref.backward(q.detach().float()[None], kv.detach().float()[None], idx[None], g.float()[None],
                               SCALE, 512)
    assert rel_l2(runs[0][0], r_dq[0]) < 3e-3 and rel_l2(runs[0][1], r_dkv[0]) < 3e-3
    assert seen == [R] * 20
    backends.unregister_backend("tilelang_small_chunks")



def test_forward_plan_auto_for_64_row_tiles():
    """``fwd_buckets_64="auto"``: the first call runs one two-stage launch and counts its rows'
    blocks; once those counts are in (read without a sync) a call of the same shape on ragged
    causal rows runs the single-stage buckets. Both outputs are bitwise equal (the plan never
    changes a result) and equal to the reference."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend
    from glm5_dsa_plugin.ops.tilelang.plan import AUTO_BUCKETS_64

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    T, topk, H = 1024, 1024, 64
    q = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, T, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    idx = w2_indices(T, topk, gen)[None]
    # (the plan of the classic forward)
    be = TileLangBackend()._with_choices(fwd_buckets_64="auto", fwd_warp_specialized=False)
    o1, l1 = be.forward(q, kv, idx, _prob(q, kv, idx))
    torch.cuda.synchronize()
    (last,) = be._block_counts.values()
    assert last.choose(topk // 64) == AUTO_BUCKETS_64
    o2, l2 = be.forward(q, kv, idx, _prob(q, kv, idx))
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    r_out, r_lse = ref.forward(q.float(), kv.float(), idx, SCALE, 512)
    assert rel_l2(o2, r_out) <= 3e-3


def test_row_groups_auto_follows_key_sharing():
    """``row_groups="auto"`` (default), 16 heads: causal ragged rows (neighbours share most keys)
    and random keys over a wide range (little sharing) stay on row groups; rows whose groups share
    no key at all switch to one-row blocks once the first call's counts are in (ENTRY_COST = 1).
    Every call equals the reference (the choice never changes a result beyond rounding)."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    T, H, K = 512, 16, 256
    q = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1, T, H, 512, generator=gen, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(T, device="cuda")[:, None]
    # row t reads keys [(t % 32) * K, (t % 32 + 1) * K): the 4 rows of a group share no key
    disjoint = ((rows % 32) * K + torch.arange(K, device="cuda")[None, :]).int()
    for T_kv, idx, want_groups in ((T, w2_indices(T, K, gen)[None], True),
                                   (8192, torch.rand(T, 8192, generator=gen, device="cuda").topk(K).indices
                                    .int()[None, :, None], True),
                                   (8192, disjoint[None, :, None], False)):
        kv = torch.randn(1, T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
        be = TileLangBackend()
        r_out, _ = ref.forward(q.float(), kv.float(), idx, SCALE, 512)
        r_dq, r_dkv = ref.backward(q.float(), kv.float(), idx, g.float(), SCALE, 512)
        for call in range(2):
            out, lse, saved = be.forward_saving(q, kv, idx, _prob(q, kv, idx))
            assert (len(saved) > 3) == (want_groups or call == 0), (T_kv, call)  # the first call: groups
            dq, dkv = be.backward_saved(q, saved, out, lse, g, _prob(q, kv, idx))
            assert rel_l2(out, r_out) <= 3e-3 and rel_l2(dq, r_dq) <= 3e-3 and rel_l2(dkv, r_dkv) <= 3e-3
            torch.cuda.synchronize()  # the counts arrive


@pytest.mark.parametrize("R", [2, 4, 8])
def test_group_keys_on_the_gpu_equal_the_row_by_row_build(R):
    """The key lists built on the GPU (threads running concurrently, which the interpreter's CPU
    test cannot show) equal the row-by-row build entry for entry: random distinct keys over a long
    context (a group's bit table is hundreds of words), several calls, and one group per batch.
    (It guards a race in which R = 2's table pass overlapped its own clearing of the table and
    some groups lost entries or member bits.)"""
    from glm5_dsa_plugin.ops.row_groups import group_keys, group_keys_reference

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    T, T_kv = 256, 8192
    for K in (128, 512):
        idx = torch.rand(T, T_kv, generator=gen, device="cuda").topk(K).indices.int()[None, :, None]
        want = group_keys_reference(idx.cpu(), T_kv, R)
        for table_words in (1 << 26, 1 << 26, 1 << 26, 1):
            got = group_keys(idx, T_kv, R, table_words=table_words)
            for name, a, b in zip(("keys", "members", "extent"), got, want):
                bad = (a.cpu() != b).flatten(2).any(-1).nonzero().tolist()
                assert not bad, f"R={R} K={K} table_words={table_words}: {name} differs in groups {bad[:8]}"


@pytest.mark.parametrize("H", [8, 32])
def test_row_groups_count_repeated_keys_per_slot(H):
    """Row groups forced on: rows that repeat one key in every slot (an indexer padding with 0),
    rows that repeat a key in half their slots, an all -1 row and a last group past the sequence
    (T = 203) equal the reference, which counts every slot; the key lists and the forward are
    bitwise the same in every call."""
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    T, T_kv, K = 203, 100, 128
    idx = torch.randint(0, T_kv, (1, T, 1, K), generator=gen, device="cuda", dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=gen, device="cuda") < 0.3] = -1
    idx[0, 5:10] = 0
    idx[0, 11, 0, ::2] = 3
    idx[0, 12] = -1
    q = torch.randn(1, T, H, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, T_kv, 1, 576, generator=gen, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1, T, H, 512, generator=gen, device="cuda", dtype=torch.bfloat16)
    be = TileLangBackend(row_groups=True)
    out, lse, saved = be.forward_saving(q, kv, idx, _prob(q, kv, idx))
    assert len(saved) == 6  # ran row groups
    dq, dkv = be.backward_saved(q, saved, out, lse, g, _prob(q, kv, idx))
    r_out, r_lse = ref.forward(q.float(), kv.float(), idx, SCALE, 512)
    r_dq, r_dkv = ref.backward(q.float(), kv.float(), idx, g.float(), SCALE, 512)
    _check((out, lse, dq, dkv), (r_out, r_lse, r_dq, r_dkv), idx)
    # the repeats' entries are appended by atomics in any order and then sorted: the forward (and
    # so dq, which sums the entries in list order) is bitwise the same from call to call
    for _ in range(3):
        out2, lse2, saved2 = be.forward_saving(q, kv, idx, _prob(q, kv, idx))
        assert torch.equal(saved2[3], saved[3]) and torch.equal(saved2[4], saved[4])
        assert torch.equal(out2, out) and torch.equal(lse2, lse)


def test_a_backward_larger_than_pending_bytes_keeps_nothing_after_it():
    """Fallback on CUDA with a call whose q + grad_out + saved tensors exceed ``pending_bytes``:
    nothing is kept past the backward (the queue holds 0 bytes, and q is freed with the graph)."""
    from glm5_dsa_plugin.ops import configure, guard, guard_stats

    configure(policy="fallback", pending_bytes=1 << 20)
    try:
        q_leaf, q, kv, idx, g = _queued_backward_inputs()
        out, lse = sparse_mla(q, kv, idx, SCALE, backend="tilelang")
        out.backward(g)
        assert guard.pending.queue.held_bytes == 0 and len(guard.pending.queue._queue) == 1
        q_bytes = q.untyped_storage().nbytes()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        del q, out, lse
        assert before - torch.cuda.memory_allocated() >= q_bytes  # freed with the graph, not held
        assert guard_stats()["events"] == 0
    finally:
        configure(pending_bytes=2 << 30)
