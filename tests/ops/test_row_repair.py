"""The guard's device-side backward repair (``ops.guard.row_repair``) in the Triton interpreter on CPU:
poisoned dq rows and dkv rows come back equal to the PyTorch reference, every other entry bit
for bit as it was, the counters and the still-nonfinite flag are right, and with the nonfinite
flag clear the kernels change nothing (not even poisoned rows)."""

import pytest

from triton_interpreter import run_interpreted

SCRIPT = r"""
import torch
from glm5_dsa_plugin.ops import reference
from glm5_dsa_plugin.ops.guard import FLAG_SLOTS, Flag
from glm5_dsa_plugin.ops.guard.row_repair import repair_backward_rows
COUNTED = (Flag.NONFINITE, Flag.STILL_NONFINITE, Flag.ROWS_REPAIRED, Flag.KV_ROWS_REPAIRED)

g = torch.Generator().manual_seed(0)

def case(B, T, T_kv, H, G, K, d_v, d_t, dtype, sentinel):
    D = d_v + d_t
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    kv = torch.randn(B, T_kv, G, D, generator=g).to(dtype)
    do = torch.randn(B, T, H, d_v, generator=g).to(dtype)
    idx = torch.randint(0, T_kv, (B, T, G, K), generator=g, dtype=torch.int32)
    idx[torch.rand(B, T, G, K, generator=g) < 0.3] = -1
    idx[0, 1] = -1  # a row with no valid slot
    scale = D ** -0.5
    want_dq, want_dkv = reference.backward(q, kv, idx, do, scale, d_v)
    # what a backend returns, with a few rows poisoned: random, so that any entry of a bad row
    # left unrepaired (e.g. other heads of a poisoned row) is far from the reference
    dq = torch.randn(B, T, H, D, generator=g).to(dtype)
    dkv = torch.randn(B, T_kv, G, D, generator=g).to(dtype)
    bad_q = [(0, 1), (B - 1, T - 2), (0, 3)]
    bad_kv = [(0, int(idx[0, 0, 0][idx[0, 0, 0] >= 0][0])), (B - 1, 5)]
    for b, t in bad_q:
        dq[b, t, 0, 0] = float("nan")  # head 0: every other head block must still repair its heads
    for b, s in bad_kv:
        dkv[b, s, G - 1, D - 1] = float("inf")
    before_dq, before_dkv = dq.clone(), dkv.clone()
    # the saved-input form: padding rewritten to the sentinel T_kv
    idx_in = torch.where(idx < 0, T_kv, idx) if sentinel else idx
    # clear flag: nothing changes
    flags = torch.zeros(FLAG_SLOTS, dtype=torch.int32)
    repair_backward_rows(q, kv, idx_in, do, scale, d_v, dq, dkv, flags)
    assert torch.equal(dq.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       before_dq.view(torch.int16 if dtype != torch.float32 else torch.int32)), "flag clear: dq changed"
    assert flags.tolist() == [0] * FLAG_SLOTS
    flags[Flag.NONFINITE] = 1
    repair_backward_rows(q, kv, idx_in, do, scale, d_v, dq, dkv, flags)
    rq = torch.zeros(B, T, dtype=torch.bool)
    for b, t in bad_q: rq[b, t] = True
    rk = torch.zeros(B, T_kv, dtype=torch.bool)
    for b, s in bad_kv: rk[b, s] = True
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(dq[rq].float(), want_dq[rq].float(), **tol)
    torch.testing.assert_close(dkv[rk].float(), want_dkv[rk].float(), **tol)
    assert torch.equal(dq[~rq], before_dq[~rq]) and torch.equal(dkv[~rk], before_dkv[~rk]), "good rows touched"
    assert (dq[0, 1] == 0).all(), "a row with no valid slot has exact-zero dq"
    assert [int(flags[f]) for f in COUNTED] == [1, 0, len(set(bad_q)), len(set(bad_kv))], flags
    # bad inputs: a NaN in q makes the repaired row nonfinite -> Flag.STILL_NONFINITE
    q2 = q.clone(); q2[0, 3, 0, 0] = float("nan")
    dq2, dkv2 = before_dq.clone(), before_dkv.clone()
    flags = torch.zeros(FLAG_SLOTS, dtype=torch.int32); flags[Flag.NONFINITE] = 1
    repair_backward_rows(q2, kv, idx_in, do, scale, d_v, dq2, dkv2, flags)
    assert flags[Flag.STILL_NONFINITE] == 1, flags

case(2, 9, 13, 4, 2, 40, 32, 16, torch.float32, sentinel=False)   # G=2, topk not a multiple of 16
case(1, 7, 11, 20, 1, 24, 64, 8, torch.bfloat16, sentinel=True)  # 20 heads: two head blocks, one partial
case(1, 5, 9, 40, 2, 16, 32, 16, torch.float32, sentinel=True)  # 20 heads per group, two groups
print("OK")
"""


@pytest.mark.slow
def test_device_backward_repair_matches_reference_in_interpreter():
    run_interpreted(SCRIPT)


FORWARD_SCRIPT = r"""
import torch
from glm5_dsa_plugin.ops import reference
from glm5_dsa_plugin.ops.contract import EMPTY_ROW_LSE
from glm5_dsa_plugin.ops.guard import FLAG_SLOTS, Flag
from glm5_dsa_plugin.ops.guard.row_repair import repair_forward_rows
COUNTED = (Flag.NONFINITE, Flag.STILL_NONFINITE, Flag.ROWS_REPAIRED, Flag.KV_ROWS_REPAIRED)

g = torch.Generator().manual_seed(1)

def case(B, T, T_kv, H, G, K, d_v, d_t, dtype):
    D = d_v + d_t
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    kv = torch.randn(B, T_kv, G, D, generator=g).to(dtype)
    idx = torch.randint(0, T_kv, (B, T, G, K), generator=g, dtype=torch.int32)
    idx[torch.rand(B, T, G, K, generator=g) < 0.3] = -1
    idx[0, 1] = -1  # a row with no valid slot
    idx[B - 1, 2, 0, 0] = T_kv + 3  # out of range: padding for the kernels (validation is elsewhere)
    scale = D ** -0.5
    want_out, want_lse = reference.forward(q, kv, idx.masked_fill(idx >= T_kv, -1), scale, d_v)
    # what a backend returns, a few rows poisoned with random values and one NaN / inf (out or lse)
    out = torch.randn(B, T, H, d_v, generator=g).to(dtype)
    lse = torch.randn(B, T, H, generator=g)
    bad = [(0, 1), (B - 1, 2), (0, 3)]
    out[0, 1, H - 1, 0] = float("nan")
    lse[B - 1, 2, 0] = float("inf")
    out[0, 3, 0, d_v - 1] = float("-inf")
    before_out, before_lse = out.clone(), lse.clone()
    flags = torch.zeros(FLAG_SLOTS, dtype=torch.int32)
    repair_forward_rows(q, kv, idx, scale, d_v, out, lse, flags)  # flag clear: nothing changes
    assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       before_out.view(torch.int16 if dtype != torch.float32 else torch.int32)), "flag clear: out changed"
    assert torch.equal(lse, before_lse) and flags.tolist() == [0] * FLAG_SLOTS
    flags[Flag.NONFINITE] = 1
    repair_forward_rows(q, kv, idx, scale, d_v, out, lse, flags)
    rows = torch.zeros(B, T, dtype=torch.bool)
    for b, t in bad: rows[b, t] = True
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(out[rows].float(), want_out[rows].float(), **tol)
    torch.testing.assert_close(lse[rows], want_lse[rows], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[~rows], before_out[~rows]) and torch.equal(lse[~rows], before_lse[~rows]), "good rows touched"
    assert (out[0, 1] == 0).all() and (lse[0, 1] == EMPTY_ROW_LSE).all(), "empty row: out 0, lse EMPTY_ROW_LSE"
    assert [int(flags[f]) for f in COUNTED] == [1, 0, len(bad), 0], flags
    # bad inputs: a NaN in q keeps the recomputed row nonfinite -> Flag.STILL_NONFINITE
    q2 = q.clone(); q2[0, 3, 0, 0] = float("nan")
    out2, lse2 = before_out.clone(), before_lse.clone()
    flags = torch.zeros(FLAG_SLOTS, dtype=torch.int32); flags[Flag.NONFINITE] = 1
    repair_forward_rows(q2, kv, idx, scale, d_v, out2, lse2, flags)
    assert flags[Flag.STILL_NONFINITE] == 1, flags
    assert torch.isnan(out2[0, 3, 0]).all() and torch.isnan(lse2[0, 3, 0]), "the NaN head: out and lse NaN"
    assert torch.isfinite(lse2[0, 3, 1:]).all(), "the row's other heads are finite"

case(2, 9, 13, 4, 2, 40, 32, 16, torch.float32)   # G=2, topk not a multiple of the slot step
case(1, 7, 11, 20, 1, 24, 64, 8, torch.bfloat16)  # 20 heads: two head blocks, one partial
# scores near -2^30 (lse about -1.3e8, whose fp32 rounding is several units): p normalised by
# the row sum, not exp(score - lse), so out is still the reference's (here a mean of kv rows)
q = torch.zeros(1, 3, 2, 48); q[0, 1, :, :32] = -(2.0**25)
kv = torch.ones(1, 20, 1, 48); kv[0, :, 0, 0] = 1 + 0.5 * (torch.arange(20) % 3 - 1); kv[0, :, 0, 1] = 2 - kv[0, :, 0, 0]
idx = torch.randint(0, 20, (1, 3, 1, 16), generator=g, dtype=torch.int32)
want_out, want_lse = reference.forward(q.double(), kv.double(), idx, 0.125, 32)
out, lse = torch.zeros(1, 3, 2, 32), torch.zeros(1, 3, 2)
lse[0, 1] = float("nan")
flags = torch.zeros(FLAG_SLOTS, dtype=torch.int32); flags[Flag.NONFINITE] = 1
repair_forward_rows(q, kv, idx, 0.125, 32, out, lse, flags)
assert abs(float(want_lse[0, 1, 0])) > 1e8
torch.testing.assert_close(out[0, 1].double(), want_out[0, 1], rtol=1e-5, atol=1e-6)
torch.testing.assert_close(lse[0, 1], want_lse[0, 1], rtol=1e-7, atol=0)
print("OK")
"""


@pytest.mark.slow
def test_device_forward_repair_matches_reference_in_interpreter():
    """The forward's device-side repair: poisoned rows (every head) come back equal to the
    reference, other rows bit for bit, the empty row as the contract says; counters and the
    still-nonfinite flag as for the backward; a row of huge scores (|lse| > 1e8) exact too."""
    run_interpreted(FORWARD_SCRIPT)
