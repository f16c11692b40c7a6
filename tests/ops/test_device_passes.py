"""The small Triton kernels on CPU (through the interpreter, in a subprocess): the guard's
finiteness flag, the deterministic segment sum, the backward's dKV conversion + flag, and the
TileLang backend's index preparation (rewrite, extent, index-rule flag, sentinel kv) against a
torch oracle built from the contract's index rule."""

import pytest
import torch
from triton_interpreter import run_interpreted


SCRIPT = r"""
import torch
from glm5_dsa_plugin.ops.guard.device_checks import flag_nonfinite
g = torch.Generator().manual_seed(0)
x = torch.randn(20000, generator=g).bfloat16()
f = torch.zeros(3, dtype=torch.int32); flag_nonfinite(x, f, 1); assert f.tolist() == [0, 0, 0]
for bad in (float("nan"), float("inf"), -float("inf")):
    for pos in (0, 8191, 8192, 19999):
        y = x.clone(); y[pos] = bad; f = torch.zeros(3, dtype=torch.int32)
        flag_nonfinite(y, f, 2); assert f.tolist() == [0, 0, 1], (bad, pos, f)
z = torch.full((5, 7), 3e38, dtype=torch.float32); f = torch.zeros(1, dtype=torch.int32)
flag_nonfinite(z, f, 0); assert f.item() == 0, "huge but finite must not be flagged"
# two tensors of different dtypes in one launch: a bad value in either is seen
for which in (0, 1):
    a, b = x.clone(), torch.randn(3000, generator=g)
    (a if which == 0 else b)[-1] = float("nan"); f = torch.zeros(2, dtype=torch.int32)
    flag_nonfinite(a, f, 1, b); assert f.tolist() == [0, 1], which
f = torch.zeros(2, dtype=torch.int32); flag_nonfinite(x, f, 1, torch.randn(3000, generator=g))
assert f.tolist() == [0, 0]
from glm5_dsa_plugin.ops.segment_sum import segment_sum_rows
for N, R, D in [(1000, 37, 576), (5, 3, 70), (40, 1, 64)]:
    c = torch.randn(N, D, generator=g); k = torch.randint(0, R, (N,), generator=g)
    out = torch.randn(R, D, generator=g); want = out.double().index_add(0, k, c.double())
    segment_sum_rows(c, k, out)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
# n_keys (no host sync): key n_keys drops an entry (its contrib row, NaN here, is never read);
# bitwise the same sums as the synchronising path over the kept entries, in the same order
for N, R, D in [(1000, 37, 576), (5, 3, 70), (64, 1, 64)]:
    c = torch.randn(N, D, generator=g); k = torch.randint(0, R + 1, (N,), generator=g)
    c[k == R] = float("nan")
    keep = k < R
    out = torch.randn(R, D, generator=g)
    got, ref = out.clone(), out.clone()
    segment_sum_rows(c, k, got, n_keys=R)
    segment_sum_rows(c, k[keep], ref, src=keep.nonzero().squeeze(1))
    assert torch.equal(got, ref), (N, R, D)
    torch.testing.assert_close(got.double(), out.double().index_add(0, k[keep], c[keep].double()), rtol=1e-5, atol=1e-4)
# int32 keys sort to the same order as int64 ones; 64-column programs sum the same values (their
# reduction tree may differ); rows no entry names are left alone (-0.0 would become +0.0 on a
# read-add-write)
c = torch.randn(700, 576, generator=g); k = torch.randint(0, 41, (700,), generator=g)
k[k == 5] = 40  # row 5: no entry
out = torch.randn(40, 576, generator=g); out[5] = -0.0
a, b, d = out.clone(), out.clone(), out.clone()
segment_sum_rows(c, k, a, n_keys=40)
segment_sum_rows(c, k.to(torch.int32), b, n_keys=40)
segment_sum_rows(c, k, d, n_keys=40, block_d=64, block_p=16)
assert torch.equal(a, b)
assert torch.signbit(a[5]).all() and torch.signbit(d[5]).all()
torch.testing.assert_close(d, a, rtol=1e-5, atol=1e-4)
torch.testing.assert_close(a.double(), out.double().index_add(0, k[k < 40], c[k < 40].double()), rtol=1e-5, atol=1e-4)
try:
    segment_sum_rows(c, k, torch.zeros(R + 1, D), n_keys=R)
    raise SystemExit("n_keys != out rows accepted")
except ValueError as e:
    assert "n_keys" in str(e)
print("OK")
"""


@pytest.mark.slow
def test_nonfinite_flag_and_segment_sum_in_interpreter():
    run_interpreted(SCRIPT)


PREPARE = r"""
import torch
from glm5_dsa_plugin.ops.contract import _bad_index_mask
from glm5_dsa_plugin.ops.tilelang.passes import prepare_indices

def oracle(idx, n_kv, k_pad):
    valid = (idx >= 0) & (idx < n_kv)
    out = torch.full((*idx.shape[:-1], k_pad), n_kv, dtype=torch.int32)
    out[..., : idx.shape[-1]] = torch.where(valid, idx, n_kv)
    pos = torch.arange(1, idx.shape[-1] + 1, dtype=torch.int32)
    return out, (valid * pos).amax(-1).to(torch.int32), int(_bad_index_mask(idx, n_kv).any())

g = torch.Generator().manual_seed(0)
pool = torch.tensor([-2**31, -7, -1, -1, 2**31 - 1], dtype=torch.int32)
cases = [((2, 9, 2, 256), 256, 50, 0.5), ((1, 3, 1, 7), 64, 5, 0.4), ((1, 4, 3, 2048), 2048, 4096, 0.3),
         ((2, 2, 1, 100), 1088, 30, 0.0), ((1, 5, 1, 1), 64, 1, 0.9)]
for shape, k_pad, n_kv, wild_frac in cases:
    for check in (True, False):
        idx = torch.randint(0, n_kv, shape, generator=g, dtype=torch.int32)
        idx[torch.rand(shape, generator=g) < 0.4] = -1  # padding anywhere, not only at the tail
        wild = torch.rand(shape, generator=g) < wild_frac * 0.1
        p = pool.clone(); p[-1] = n_kv  # == T_kv: the classic off-by-one
        idx[wild] = p[torch.randint(0, len(p), (int(wild.sum()),), generator=g)]
        idx[0, 0, 0] = -1  # an empty row
        flags = torch.zeros(2, dtype=torch.int32)
        out, ext = prepare_indices(idx, n_kv, k_pad, flags if check else None)
        w_out, w_ext, w_bad = oracle(idx, n_kv, k_pad)
        assert torch.equal(out, w_out) and torch.equal(ext, w_ext), (shape, k_pad, n_kv)
        assert ext[0, 0, 0].item() == 0
        assert flags.tolist() == ([w_bad, 0] if check else [0, 0]), (flags, w_bad, check)
        assert int(out.min()) >= 0 and int(out.max()) <= n_kv
        if k_pad == shape[-1]:  # without the rewrite: the caller's tensor back, the same extent / flag
            flags2 = torch.zeros(2, dtype=torch.int32)
            same, ext2 = prepare_indices(idx, n_kv, k_pad, flags2 if check else None, rewrite=False)
            assert same is idx and torch.equal(ext2, w_ext) and torch.equal(flags2, flags)
# rewrite=False with topk short of k_pad: refused (the kernels would read past the caller's rows)
try:
    prepare_indices(torch.zeros(1, 2, 1, 100, dtype=torch.int32), 5, 128, rewrite=False)
    raise AssertionError("expected ValueError")
except ValueError as e:
    assert "rewrite=False" in str(e)
# with kv: the same indices, plus kv with one zero row appended per batch (bit-exact copy)
for B, n_kv, G, D in [(2, 50, 1, 576), (3, 7, 2, 40), (1, 3000, 1, 64)]:
    kv = torch.randn(B, n_kv, G, D, generator=g).bfloat16()
    idx = torch.randint(-1, n_kv, (B, 5, G, 64), generator=g, dtype=torch.int32)
    out, ext, kv_k = prepare_indices(idx, n_kv, 64, None, kv=kv)
    w_out, w_ext, _ = oracle(idx, n_kv, 64)
    assert torch.equal(out, w_out) and torch.equal(ext, w_ext)
    assert kv_k.shape == (B, n_kv + 1, G, D) and torch.equal(kv_k[:, :n_kv], kv)
    assert torch.equal(kv_k[:, n_kv], torch.zeros_like(kv_k[:, n_kv])), (B, n_kv)
# rows counted by the slot block their valid slots end in
for block in (32, 64):
    idx = torch.randint(-1, 30, (2, 9, 1, 256), generator=g, dtype=torch.int32)
    idx[0, 0] = -1  # no valid slot: count 0
    idx[1, 3, 0, 100:] = -1
    counts = torch.zeros(256 // block + 1, dtype=torch.int32)
    _, ext = prepare_indices(idx, 30, 256, block_counts=counts, block=block)
    want = torch.bincount(((ext + block - 1) // block).flatten().long(), minlength=256 // block + 1)
    assert torch.equal(counts, want.to(torch.int32)) and counts[0] >= 1, (counts, want)
# the TileLang backend's saved inputs give the caller's (kv, indices) back for the guard's repair
from glm5_dsa_plugin.ops.contract import Problem
from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend
be = TileLangBackend()
kv = torch.randn(2, 30, 1, 576, generator=g).bfloat16()
idx = torch.randint(-1, 30, (2, 7, 1, 100), generator=g, dtype=torch.int32)
prob = Problem(batch=2, seq_len=7, seq_len_kv=30, heads=16, kv_groups=1, topk=100, d_qk=576, d_v=512,
               sm_scale=256**-0.5)
saved = be.save(kv, idx, prob)
assert saved[1].shape[-1] == 128  # topk padded to a multiple of 64
kv2, idx2 = be.originals(saved, prob)
assert torch.equal(kv2, kv) and torch.equal(idx2, idx)
# the memory the backend reports for a call is what it keeps (topk 100: its own padded copy)
want = be.saved_bytes(prob, kv.element_size())
assert (want["kv"], want["indices"], want["extent"]) == tuple(t.nbytes for t in saved[:3]), (want, saved)
from glm5_dsa_plugin.ops.row_groups import group_keys
lists = group_keys(saved[1], 30, be.rows_per_block(prob.heads_per_group)[1])  # 16 heads: rows of 4 per block
assert (want["key_lists"], want["key_list_extent"]) == (lists[0].nbytes + lists[1].nbytes, lists[2].nbytes)
print("OK")
"""


@pytest.mark.slow
def test_prepare_indices_matches_the_index_rule_in_interpreter():
    """Every slot outside [0, T_kv) (padding, negatives, T_kv, 2^31-1) becomes the sentinel T_kv,
    valid slots are kept, topk is padded, extent = 1 + last valid position, the flag is set
    exactly when the contract's rule is broken (and only when asked); the same launch copies kv
    and appends each batch's zero sentinel row."""
    run_interpreted(PREPARE)


FINISH = r"""
import torch
from glm5_dsa_plugin.ops.tilelang.passes import finish_backward

g = torch.Generator().manual_seed(0)
for B, R, n_rows, G, D, block in [(2, 11, 10, 2, 576, 8192), (1, 5, 4, 1, 64, 128), (3, 3, 3, 1, 40, 64)]:
    dkv32 = torch.randn(B, R, G, D, generator=g) * 100
    dq = torch.randn(B, 7, 4, D, generator=g).bfloat16()
    want = dkv32[:, :n_rows].to(torch.bfloat16)
    for check in (True, False):
        f = torch.zeros(1, dtype=torch.int32)
        out = finish_backward(dkv32, n_rows, torch.bfloat16, dq, f if check else None, block=block)
        assert out.shape == (B, n_rows, G, D) and out.dtype == torch.bfloat16
        # (the interpreter's fp32 -> bf16 cast truncates; on the GPU it rounds to nearest even)
        torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=0)
        assert f.item() == 0, (B, R, n_rows)
    # a nonfinite value in a kept dkv row or in dq: flagged; one in the dropped sentinel rows:
    # not flagged (the caller never sees it)
    for where, bad in [("dkv", float("nan")), ("dkv", -float("inf")), ("dq", float("inf")), ("sentinel", float("nan"))]:
        d, q = dkv32.clone(), dq.clone()
        if where == "dq":
            q[-1, -1, -1, -1] = bad
        elif where == "sentinel":
            if R == n_rows:
                continue
            d[-1, -1, 0, 0] = bad
        else:
            d[B - 1, n_rows - 1, G - 1, D - 1] = bad
        f = torch.zeros(1, dtype=torch.int32)
        finish_backward(d, n_rows, torch.bfloat16, q, f, block=block)
        assert f.item() == (where != "sentinel"), (where, B, R, n_rows)
        f = torch.zeros(1, dtype=torch.int32)
        finish_backward(d, n_rows, torch.bfloat16, q, None, block=block)
        assert f.item() == 0
print("OK")
"""


@pytest.mark.slow
def test_finish_backward_converts_drops_sentinel_and_flags_in_interpreter():
    """dKV fp32 -> bf16 without each batch's sentinel rows (to one bf16 ulp: the interpreter truncates), and
    the flag set exactly when the returned dkv or dq holds NaN/inf."""
    run_interpreted(FINISH)


GATED = r"""
import torch
from glm5_dsa_plugin.ops.contract import EMPTY_ROW_LSE
from glm5_dsa_plugin.ops.guard import FLAG_SLOTS, Flag
from glm5_dsa_plugin.ops.tilelang.passes import KV_SUSPECT_BOUND, prepare_indices
from glm5_dsa_plugin.ops.guard.device_checks import check_forward

g = torch.Generator().manual_seed(0)
n_flagged = {0: 0, 1: 0}
for B, T, G, hg, d_v, rows, block in [(1, 7, 2, 2, 16, 4, 8), (2, 5, 1, 3, 24, 8, 32), (1, 33, 1, 2, 512, 16, 4096)]:
    H = G * hg
    for trial in range(24):
        out = torch.randn(B, T, H, d_v, generator=g).bfloat16()
        lse = torch.randn(B, T, H, generator=g) * 5
        extent = torch.randint(0, 3, (B, T, G), generator=g, dtype=torch.int32)  # 0: the row has no valid slot
        for k in torch.randint(0, 13, (2,), generator=g).tolist():  # up to two plantings (6..12: nothing)
            r = int(torch.randint(0, B * T * H, (1,), generator=g))
            o, l = out.view(-1, d_v), lse.view(-1)
            if k == 0:
                o[r, int(torch.randint(0, d_v, (1,), generator=g))] = float("nan")  # bad out, usual lse
            elif k == 1:
                l[r] = float("nan")
            elif k == 2:
                l[r] = -float("inf")
            elif k == 3:
                l[r] = 1e9  # beyond the bound
            elif k == 4:
                l[r] = EMPTY_ROW_LSE  # doubtful exactly when its query row has a valid slot
            elif k == 5:
                l[r] = -3e8
        ext_rows = extent.view(-1).repeat_interleave(hg)
        doubtful = ((lse.view(-1).abs() > 50.0) & (lse.view(-1) != EMPTY_ROW_LSE)) | (
            (lse.view(-1) == EMPTY_ROW_LSE) & (ext_rows > 0))
        for gate_set in (False, True):
            flags = torch.zeros(FLAG_SLOTS, dtype=torch.int32)
            flags[Flag.KV_SUSPECT] = int(gate_set)
            l2 = lse.clone()
            check_forward(out, l2, flags, Flag.NONFINITE, Flag.KV_SUSPECT, 50.0, EMPTY_ROW_LSE, extent, hg, rows=rows,
                          block=block)
            want = int(bool((~torch.isfinite(lse)).any() or doubtful.any() or (gate_set and (~torch.isfinite(out)).any())))
            assert flags.tolist() == [want if i == Flag.NONFINITE else int(gate_set) if i == Flag.KV_SUSPECT else 0
                                      for i in range(FLAG_SLOTS)], (flags, want, gate_set)
            assert torch.isnan(l2.view(-1)[doubtful]).all()
            assert torch.equal(l2.view(-1)[~doubtful].nan_to_num(7.0), lse.view(-1)[~doubtful].nan_to_num(7.0))
            n_flagged[want] += 1
            if not gate_set:  # without extent: empty rows are never doubtful
                l3, f3 = lse.clone(), torch.zeros(FLAG_SLOTS, dtype=torch.int32)
                check_forward(out, l3, f3, Flag.NONFINITE, Flag.KV_SUSPECT, 50.0, EMPTY_ROW_LSE, rows=rows, block=block)
                assert torch.equal((l3 == EMPTY_ROW_LSE), (lse == EMPTY_ROW_LSE))
assert min(n_flagged.values()) >= 30, n_flagged  # both outcomes exercised
for bad_args in [dict(lse=torch.zeros(2, 4)), dict(lse=torch.zeros(3, 2).t()),
                 dict(extent=torch.zeros(5, dtype=torch.int32))]:
    kw = dict(out=torch.zeros(2, 3, 8), lse=torch.zeros(2, 3), flags=torch.zeros(8, dtype=torch.int32), slot=Flag.NONFINITE,
              gate=Flag.KV_SUSPECT, lse_bound=1.0, empty_lse=-1e30) | bad_args
    if "out" in bad_args or kw["lse"].shape != (2, 3):
        kw["out"] = torch.zeros(*kw["lse"].shape, 8) if kw["lse"].shape == (2, 3) else kw["out"]
    try:
        check_forward(**kw)
        raise AssertionError(f"expected ValueError for {list(bad_args)}")
    except ValueError as e:
        assert "check_forward" in str(e)
# kv_flag: set by the copy exactly when some kv entry is NaN, +-inf or >= 2^100 in magnitude
idx = torch.randint(-1, 40, (2, 5, 1, 64), generator=g, dtype=torch.int32)
for value, suspect in [(None, 0), (float("nan"), 1), (float("inf"), 1), (-float("inf"), 1), (KV_SUSPECT_BOUND, 1),
                       (-2.0**101, 1), (2.0**99, 0), (-2.0**99, 0), (3e38, 1)]:
    for b, row, col in [(0, 0, 0), (1, 39, 575), (1, 17, 300)]:
        kv = torch.randn(2, 40, 1, 576, generator=g).bfloat16()
        if value is not None:
            kv[b, row, 0, col] = value
        kv_flag, index_flag = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        _, _, kv_k = prepare_indices(idx, 40, 64, index_flag, kv=kv, kv_flag=kv_flag)
        assert kv_flag.item() == suspect and index_flag.item() == 0, (value, b, row, col, kv_flag)
        assert torch.equal(kv_k[:, :40].nan_to_num(0.0), kv.nan_to_num(0.0))
try:
    prepare_indices(idx, 40, 64, kv_flag=torch.zeros(1, dtype=torch.int32))
    raise AssertionError("expected ValueError")
except ValueError as e:
    assert "kv_flag" in str(e)
print("OK")
"""


@pytest.mark.slow
def test_forward_check_and_kv_flag_in_interpreter():
    """``check_forward`` marks exactly the doubtful rows (|lse| beyond the bound but not
    EMPTY_ROW_LSE, or EMPTY_ROW_LSE on a query row whose extent says it has a valid slot; never
    without an extent) with lse NaN, leaves every other lse as it was, and sets its flag exactly
    when a row is doubtful, an lse is nonfinite, or the gate is set and out is nonfinite (a NaN
    in out under a usual lse with the gate clear is not read), over random plantings, head
    groups and program / block splits; ``prepare_indices``' kv_flag is set exactly when a kv
    entry is NaN, +-inf or >= 2^100 in magnitude, at any position."""
    run_interpreted(GATED)


def test_forward_buckets_cover_every_row_once():
    from glm5_dsa_plugin.ops.tilelang.plan import forward_buckets

    for n_blocks in (1, 2, 3, 7, 32, 64):
        for buckets in (1, 2, 4, 8):
            parts = forward_buckets(n_blocks, buckets)
            assert parts[0][0] == 0 and parts[-1][1] == n_blocks and len(parts) <= buckets
            assert all(lo < hi for lo, hi in parts)
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous: every count in one bucket
    assert forward_buckets(32, 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]


def test_cheaper_buckets_64_follows_the_rows():
    """Ragged causal rows (W2: half the rows short) pick the single-stage buckets, full rows (W1)
    keep one two-stage launch, mostly empty rows pick the buckets."""
    import pytest

    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend
    from glm5_dsa_plugin.ops.tilelang.plan import cheaper_buckets_64

    n = 32
    w2 = [0] * (n + 1)
    for t in range(4096):
        w2[-(-min(t + 1, 2048) // 64)] += 1
    assert cheaper_buckets_64(w2, n, 8) == 8
    assert cheaper_buckets_64([0] * n + [4096], n, 8) == 1
    assert cheaper_buckets_64([4000] + [0] * (n - 1) + [96], n, 8) == 8
    assert cheaper_buckets_64([0] * (n + 1), n, 8) == 1  # no rows: nothing to gain
    with pytest.raises(ValueError, match="fwd_buckets_64"):
        TileLangBackend()._with_choices(fwd_buckets_64="sometimes")


def test_forward_launch_plans():
    """16/32-row tiles: two-stage buckets; 64-row tiles: one two-stage launch unless single-stage
    buckets are asked for; short topk: one launch."""
    from glm5_dsa_plugin.ops.tilelang.plan import forward_launches

    assert forward_launches(16, 32, 4) == [(0, 8, 2), (8, 16, 2), (16, 24, 2), (24, 32, 2)]
    assert forward_launches(64, 32, 4) == [(0, 32, 2)]
    assert forward_launches(128, 32, 4, buckets_64=2) == [(0, 16, 1), (16, 32, 1)]
    assert forward_launches(32, 4, 4, buckets_64=8) == [(0, 4, 2)]




def test_row_group_geometry_and_choice():
    """Row groups: R = 64 / hg_pad rows per block for hg < 64 (hg padded to 8, 16, 32), in
    deterministic mode too; one row per block otherwise, when off, without the fixes, or in
    deterministic mode without the warp-specialised backward (its per-entry stores). "auto" keeps row
    groups while ENTRY_COST x entries < slots (also where rows share few keys: W1-like counts),
    switches to one-row blocks otherwise (rows sharing no key), and counts a one-row shape again
    every REPROBE_CALLS calls."""
    import pytest

    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend
    from glm5_dsa_plugin.ops.tilelang.plan import REPROBE_CALLS, RowGroupChoice

    be = TileLangBackend()
    assert [be.rows_per_block(hg) for hg in (4, 8, 12, 16, 32, 64, 128)] == \
        [(8, 8), (8, 8), (16, 4), (16, 4), (32, 2), (64, 1), (128, 1)]
    assert be.deterministic_variant().rows_per_block(8) == (8, 8)
    for off in (TileLangBackend(row_groups=False),
                TileLangBackend()._with_choices(bwd_warp_specialized=False).deterministic_variant(),
                TileLangBackend()._with_choices(safe=False)):
        assert off.rows_per_block(8) == (16, 1)
    with pytest.raises(ValueError, match="row_groups"):
        TileLangBackend(row_groups="sometimes")
    with pytest.raises(ValueError, match="slot_buffer_bytes"):
        TileLangBackend(slot_buffer_bytes=0)
    with pytest.raises(TypeError):
        TileLangBackend(safe=False)  # a kernel choice, not a constructor setting

    choice = RowGroupChoice()
    arrivals = iter([None, [100, 1000], None])  # counts of W2-like sharing arrive on the 2nd call
    choice.arrived = lambda: next(arrivals, None)
    assert [choice.choose() for _ in range(3)] == [(True, True)] * 3
    arrivals = iter([[700, 1000]])  # W1-like: groups (an entry costs less than a slot)
    assert choice.choose() == (True, True)
    arrivals = iter([[1000, 1000]])  # no key shared: one entry per slot
    assert choice.choose() == (False, False)  # the first of REPROBE_CALLS one-row calls
    calls = [choice.choose() for _ in range(REPROBE_CALLS - 1)]
    assert calls[-1] == (False, True) and all(c == (False, False) for c in calls[:-1])
    arrivals = iter([[100, 1000]])  # the recount says the rows share keys again
    assert choice.choose() == (True, True)


def test_deterministic_variant_keeps_every_setting():
    from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

    be = TileLangBackend(slot_buffer_bytes=1 << 20)._with_choices(fwd_min_heads=32, fwd_buckets=2, fwd_buckets_64=8,
                                                                   fwd_block_16=32, fwd_select_in_kernel=True)
    det = be.deterministic_variant()
    assert det.deterministic and not be.deterministic
    assert {k: v for k, v in vars(det).items() if k != "deterministic"} == \
        {k: v for k, v in vars(be).items() if k != "deterministic"}


def test_deterministic_chunks_are_whole_waves():
    """Rows per deterministic chunk round down to whole waves of one CTA per SM (132 SMs: 455 rows
    -> 396, three waves; two CTAs per row -> 396 rows, six waves); fewer rows than one wave stay."""
    from glm5_dsa_plugin.ops.tilelang.plan import whole_waves

    assert whole_waves(455, 1, 132) == 396
    assert whole_waves(455, 2, 132) == 396 and 396 * 2 % 132 == 0
    assert whole_waves(455, 3, 132) == 440 and 440 * 3 % 132 == 0
    assert whole_waves(131, 1, 132) == 131 and whole_waves(132, 1, 132) == 132
    assert whole_waves(1, 4, 132) == 1


DETERMINISTIC_CHUNKS = r"""
import types
import torch
from glm5_dsa_plugin.ops.contract import Problem
from glm5_dsa_plugin.ops.tilelang import bwd_ws
from glm5_dsa_plugin.ops.tilelang.backend import TileLangBackend

# The deterministic backward's chunk loop with the kernels replaced by a stand-in that writes a
# known contribution for every slot (NaN for padding slots: the sum must never read them), dq as
# its row numbers, and records the rows of each chunk; the per-kv-row sums must equal a float64
# index_add over the valid slots for every chunk size, dq must land on its rows (in place at
# B = 1, through a copy at B = 2), and the chunks must be whole waves (3 SMs here).
T, G, HG, K, n_kv, D = 11, 2, 128, 64, 20, 64  # (D: the stand-in ignores the real widths)
nh = HG // 64
Hp = G * HG
torch.cuda.get_device_properties = lambda dev: types.SimpleNamespace(multi_processor_count=3)

def check(B):
    g = torch.Generator().manual_seed(B)
    idx = torch.randint(0, n_kv + 1, (B, T, G, K), generator=g, dtype=torch.int32)  # n_kv: the sentinel
    idx[0, 3] = n_kv  # a row without a valid slot
    value = torch.randn(B, T, G * nh, K, D, generator=g, dtype=torch.float64)
    chunks = []

    def fake_builder(*args, **kwargs):
        assert kwargs.get("dkv_per_slot")
        def kernel(q, kv_k, dO, ind, lse, out, extent, members, dq, slots, *flag):
            t0 = int(q[0, 0, 0, 0].item())  # the chunk's first row, written into q below
            rows = slots.shape[1]
            chunks.append(rows)
            v = value[:, t0:t0 + rows].clone()
            v[(ind >= n_kv).unsqueeze(3).expand(B, rows, G, nh, K).reshape(B, rows, G * nh, K)] = float("nan")
            slots.copy_(v.float())
            dq.copy_((torch.arange(rows) + t0 + 1).view(1, rows, 1, 1).expand_as(dq))
        return kernel

    bwd_ws.sparse_mla_bwd_ws_kernel = fake_builder
    qp = torch.zeros(B, T, Hp, D, dtype=torch.bfloat16)
    qp[:, :, 0, 0] = torch.arange(T, dtype=torch.bfloat16)  # row numbers (exact in bf16 below 256)
    kv_k = torch.zeros(B, n_kv + 1, G, D, dtype=torch.bfloat16)
    dop, outp = torch.zeros(B, T, Hp, 512, dtype=torch.bfloat16), torch.zeros(B, T, Hp, 512, dtype=torch.bfloat16)
    lsep, extent = torch.zeros(B, T, Hp), torch.full((B, T, G), K, dtype=torch.int32)
    want = torch.zeros(B * (n_kv + 1) * G, D, dtype=torch.float64)
    for b, t, gg, j in (idx < n_kv).nonzero().tolist():
        for hb in range(nh):
            want[(b * (n_kv + 1) + idx[b, t, gg, j]) * G + gg] += value[b, t, gg * nh + hb, j]
    per_row = B * G * nh * K * D * 4
    # 4 (B = 1) or 8 (B = 2) CTAs per row: a whole wave of 3 SMs is 3 rows either way
    for rows_fit, expect in ((2, [2, 2, 2, 2, 2, 1]), (4, [3, 3, 3, 2]), (7, [6, 5]), (40, [11])):
        chunks.clear()
        be = TileLangBackend(deterministic=True, slot_buffer_bytes=rows_fit * per_row)
        prob = Problem(B, T, n_kv, Hp, G, K, D, 512, 0.1)
        dq, dkv, tested = be._backward_deterministic(qp, kv_k, dop, (1, idx, idx, extent), lsep, outp, G, HG, prob)
        assert chunks == expect, (B, rows_fit, chunks)
        assert tested and bool(torch.isfinite(dkv).all()), (B, rows_fit)
        torch.testing.assert_close(dkv.double().view(-1, D), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(dq, (torch.arange(T) + 1).view(1, T, 1, 1).expand_as(dq).to(dq.dtype)), (B, rows_fit)

check(1)
check(2)

# row groups (R = 4 rows of 16 heads per block): one contribution per entry of each group's key list,
# chunks of whole groups, the kernel handed the chunk's lists and rows
def check_groups(B, R=4):
    hg, NG = 64 // R, -(-T // R)
    g = torch.Generator().manual_seed(10 + B)
    keys = torch.randint(0, n_kv + 1, (B, NG, G, R * K), generator=g, dtype=torch.int32)
    members = torch.randint(1, 16, (B, NG, G, R * K), generator=g, dtype=torch.uint8)
    ext = torch.randint(0, R * K // 2 + 1, (B, NG, G), generator=g, dtype=torch.int32)
    keys[torch.arange(R * K).view(1, 1, 1, -1) >= ext.unsqueeze(-1)] = n_kv  # (lists end at their extent)
    KS = int(ext.max())  # the slot buffer's entries per group: the longest list, not R * K
    value = torch.randn(B, NG, G, R * K, D, generator=g, dtype=torch.float64)
    chunks = []

    def fake_builder(*args, **kwargs):
        assert kwargs.get("dkv_per_slot") and kwargs.get("rows_per_block") == R and args[3] == K
        def kernel(q, kv_k, dO, ind, lse, out, extent, mem, dq, slots, *flag):
            t0 = int(q[0, 0, 0, 0].item())
            n0, n = t0 // R, slots.shape[1]
            assert t0 % R == 0 and q.shape[1] == dq.shape[1] == lse.shape[1] == min(T, (n0 + n) * R) - t0
            assert torch.equal(ind, keys[:, n0:n0 + n]) and torch.equal(mem, members[:, n0:n0 + n])
            assert torch.equal(extent, ext[:, n0:n0 + n]) and slots.shape == (B, n, G, KS, D) and KS < R * K
            chunks.append(n)
            v = value[:, n0:n0 + n].clone()
            v[ind >= n_kv] = float("nan")
            slots.copy_(v[..., :KS, :].float())
            dq.copy_((torch.arange(dq.shape[1]) + t0 + 1).view(1, -1, 1, 1).expand_as(dq))
        return kernel

    bwd_ws.sparse_mla_bwd_ws_kernel = fake_builder
    qp = torch.zeros(B, T, G * hg, D, dtype=torch.bfloat16)
    qp[:, :, 0, 0] = torch.arange(T, dtype=torch.bfloat16)
    kv_k = torch.zeros(B, n_kv + 1, G, D, dtype=torch.bfloat16)
    dop = outp = torch.zeros(B, T, G * hg, 512, dtype=torch.bfloat16)
    lsep = torch.zeros(B, T, G * hg)
    want = torch.zeros(B * (n_kv + 1) * G, D, dtype=torch.float64)
    for b, n, gg, j in (keys < n_kv).nonzero().tolist():
        want[(b * (n_kv + 1) + keys[b, n, gg, j]) * G + gg] += value[b, n, gg, j]
    per_group = B * G * KS * D * 4
    for fit, expect in ((1, [1, 1, 1]), (2, [2, 1]), (40, [3])):
        chunks.clear()
        be = TileLangBackend(deterministic=True, slot_buffer_bytes=fit * per_group)
        prob = Problem(B, T, n_kv, G * hg, G, K, D, 512, 0.1)
        dq, dkv, tested = be._backward_deterministic(qp, kv_k, dop, (R, keys, members, ext), lsep, outp, G, hg,
                                                     prob)
        assert chunks == expect, (B, fit, chunks)
        assert tested and bool(torch.isfinite(dkv).all()), (B, fit)
        torch.testing.assert_close(dkv.double().view(-1, D), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(dq, (torch.arange(T) + 1).view(1, T, 1, 1).expand_as(dq).to(dq.dtype)), (B, fit)

check_groups(1)
check_groups(2)
print("OK")
"""


@pytest.mark.slow
def test_deterministic_backward_sums_each_valid_slot_once_per_chunking():
    """The deterministic chunk loop on CPU (Triton interpreter for the segment sum, a stand-in for
    the TileLang kernel): B = 1 and 2, G = 2, two head tiles per group, and row groups (R = 4);
    the kv rows' sums equal a float64 index_add over the valid slots (group entries) whatever the
    chunk size, padding slots (NaN) are never read, dq lands on its rows, and chunks are whole
    waves of the (here 3) SMs."""
    run_interpreted(DETERMINISTIC_CHUNKS)
