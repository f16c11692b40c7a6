"""Nonfinite guard: fault injection through a test-only backend, repair, dumps, replay, doctor (CPU)."""

import subprocess
import sys
import warnings

import pytest
import torch

from glm5_dsa_plugin.ops import configure, guard_stats, register_backend, reset_guard_stats, sparse_mla
from glm5_dsa_plugin.ops import guard
from glm5_dsa_plugin.ops.guard import events as guard_events
from glm5_dsa_plugin.ops.guard import pending as guard_pending
from glm5_dsa_plugin.ops.guard import run as guard_run
from glm5_dsa_plugin.ops.guard import slots as guard_slots
from glm5_dsa_plugin.ops.guard.slots import Flag
from glm5_dsa_plugin.ops import reference as ref
from glm5_dsa_plugin.ops.backends import ReferenceBackend, unregister_backend
from glm5_dsa_plugin.ops.contract import index_violation_flag, problem_of
from sparse_mla_cases import make_indices

NAN = float("nan")


class FaultyBackend(ReferenceBackend):
    """The reference, then NaN written into chosen rows (test-only)."""

    name = "faulty"
    fwd_rows: list = []
    dq_rows: list = []
    dkv_rows: list = []

    def forward(self, q, kv, indices, prob):
        out, lse = super().forward(q, kv, indices, prob)
        for b, t in self.fwd_rows:
            out[b, t, 0, 0] = NAN
        return out, lse

    def backward(self, q, kv, indices, out, lse, grad_out, prob):
        dq, dkv = super().backward(q, kv, indices, out, lse, grad_out, prob)
        for b, t in self.dq_rows:
            dq[b, t, -1, 3] = NAN
        for b, s in self.dkv_rows:
            dkv[b, s, 0, :2] = float("inf")
        return dq, dkv


@pytest.fixture
def faulty(tmp_path):
    be = FaultyBackend()
    register_backend("faulty", lambda: be, replace=True)
    configure(policy="fallback", dump_dir=str(tmp_path), dump_every=1)
    reset_guard_stats()
    yield be
    unregister_backend("faulty")
    configure(policy="fallback", dump_dir="glm5_dsa_dumps", dump_every=100)
    reset_guard_stats()


def _inputs(seed=0, B=2, T=12, T_kv=10, H=4, G=2, K=5, D=12):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(B, T_kv, G, D, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = make_indices(B, T, G, K, T_kv, gen, empty_rows=[4])
    g = torch.randn(B, T, H, 8, generator=gen, dtype=torch.float64)
    return q, kv, idx, g


def test_forward_repair_rows_only(faulty):
    faulty.fwd_rows = [(0, 3), (1, 7)]
    q, kv, idx, _ = _inputs()
    with pytest.warns(RuntimeWarning, match="repaired"):
        out, lse = sparse_mla(q, kv, idx, 0.4, d_v=8, backend="faulty")
    r_out, r_lse = ref.forward(q.detach(), kv.detach(), idx, 0.4, 8)
    torch.testing.assert_close(out, r_out, rtol=1e-12, atol=1e-12)
    good = torch.ones(2, 12, dtype=torch.bool)
    good[0, 3] = good[1, 7] = False
    assert torch.equal(out[good], r_out[good])  # untouched bit for bit
    st = guard_stats()
    assert st["events"] == 1 and st["rows_repaired"] == 2 and st["calls_checked"] == 1


def test_backward_repair_dq_rows_and_dkv_rows(faulty):
    faulty.dq_rows = [(1, 2)]
    faulty.dkv_rows = [(0, 3)]
    q, kv, idx, g = _inputs(1)
    with pytest.warns(RuntimeWarning):
        out, _ = sparse_mla(q, kv, idx, 0.4, d_v=8, backend="faulty")
        dq, dkv = torch.autograd.grad(out, (q, kv), g)
    r_dq, r_dkv = ref.backward(q.detach(), kv.detach(), idx, g, 0.4, 8)
    torch.testing.assert_close(dq, r_dq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dkv, r_dkv, rtol=1e-12, atol=1e-12)
    good_q = torch.ones(2, 12, dtype=torch.bool)
    good_q[1, 2] = False
    assert torch.equal(dq[good_q], r_dq[good_q])
    good_kv = torch.ones(2, 10, dtype=torch.bool)
    good_kv[0, 3] = False
    assert torch.equal(dkv[good_kv], r_dkv[good_kv])
    st = guard_stats()
    assert st["rows_repaired"] == 1 and st["kv_rows_repaired"] == 1 and st["events"] == 1


def test_warns_once_and_counts(faulty):
    faulty.fwd_rows = [(0, 1)]
    q, kv, idx, _ = _inputs()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            sparse_mla(q, kv, idx, 0.4, d_v=8, backend="faulty")
    assert sum("repaired" in str(x.message) for x in w) == 1
    assert guard_stats()["events"] == 3 and guard_stats()["calls_checked"] == 3


def test_raise_policy_names_the_dump(faulty, tmp_path):
    faulty.fwd_rows = [(1, 0)]
    configure(policy="raise")
    q, kv, idx, _ = _inputs()
    with pytest.raises(FloatingPointError, match=str(tmp_path)) as e:
        sparse_mla(q, kv, idx, 0.4, d_v=8, backend="faulty")
    path = guard_stats()["dumps"][0]
    assert path in str(e.value)
    dump = torch.load(path, weights_only=False)
    assert set(dump["inputs"]) >= {"q", "kv", "indices", "sm_scale", "d_v"}
    assert torch.isnan(dump["bad_outputs"]["out"][1, 0]).any()
    assert "torch" in dump["env"] and "pass_configs" in dump["env"]


def test_off_policy_passes_nan_through(faulty):
    faulty.fwd_rows = [(0, 0)]
    configure(policy="off")
    q, kv, idx, _ = _inputs()
    out, _ = sparse_mla(q, kv, idx, 0.4, d_v=8, backend="faulty")
    assert torch.isnan(out).any() and guard_stats()["calls_checked"] == 0


def test_bad_inputs_are_not_hidden(faulty):
    """A nonfinite input cannot be repaired: the call raises (loud, not silent) and does not warn
    first that it repaired the rows."""
    q, kv, idx, _ = _inputs()
    with torch.no_grad():
        q[0, 2, 1, 0] = NAN
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with pytest.raises(FloatingPointError, match="inputs are bad"):
            sparse_mla(q, kv, idx, 0.4, d_v=8, backend="faulty")
    assert not [x for x in w if "repaired" in str(x.message)]
    assert guard_stats()["events"] == 1 and guard_stats()["rows_repaired"] == 0


def test_dump_every_n(faulty, tmp_path):
    faulty.fwd_rows = [(0, 1)]
    configure(dump_every=2)
    q, kv, idx, _ = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            sparse_mla(q, kv, idx, 0.4, d_v=8, backend="faulty")
    assert len(guard_stats()["dumps"]) == 3  # events 1, 3, 5


@pytest.mark.slow
def test_env_policy_is_validated():
    code = "import glm5_dsa_plugin.ops"
    r = subprocess.run([sys.executable, "-c", code], env={"GLM5_DSA_NONFINITE": "maybe", "PATH": ""},
                       capture_output=True, text=True)
    assert r.returncode != 0 and "GLM5_DSA_NONFINITE" in r.stderr
    with pytest.raises(ValueError):
        configure(policy="sometimes")
    # the integer settings name the variable and the value
    for name, value, says in (("GLM5_DSA_PENDING_BYTES", "2GiB", "expected an integer"),
                              ("GLM5_DSA_PENDING_BYTES", "-1", "expected bytes >= 0"),
                              ("GLM5_DSA_DUMP_EVERY", "0", "expected >= 1")):
        r = subprocess.run([sys.executable, "-c", code], env={name: value, "PATH": ""}, capture_output=True, text=True)
        assert r.returncode != 0 and f"{name}=" in r.stderr and says in r.stderr, r.stderr[-300:]


@pytest.mark.slow
def test_replay_script_exit_codes(faulty, tmp_path):
    faulty.dq_rows = [(0, 5)]
    q, kv, idx, g = _inputs(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _ = sparse_mla(q, kv, idx, 0.4, d_v=8, backend="faulty")
        torch.autograd.grad(out, (q, kv), g)
    path = guard_stats()["dumps"][0]
    script = "scripts/replay_sparse_mla.py"
    r = subprocess.run([sys.executable, script, path, "--device", "cpu"], capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "nonfinite rows      1/24" in r.stdout and "DISAGREE" in r.stdout
    # the same dump with good outputs agrees
    dump = torch.load(path, weights_only=False)
    dq, dkv = ref.backward(q.detach(), kv.detach(), idx, g, 0.4, 8)
    dump["bad_outputs"] = {"dq": dq, "dkv": dkv}
    dump["backend"] = "reference"
    good = tmp_path / "good.pt"
    torch.save(dump, good)
    r = subprocess.run([sys.executable, script, str(good), "--device", "cpu"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "AGREE" in r.stdout


@pytest.mark.slow
def test_doctor_reports_versions_and_backend_choice():
    r = subprocess.run([sys.executable, "-m", "glm5_dsa_plugin", "doctor"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for needle in ("torch", "tilelang", "megatron-core", "transformers", "megatron-bridge", "backend='auto' picks"):
        assert needle in r.stdout
    if not torch.cuda.is_available():
        assert "picks   reference" in r.stdout


def test_doctor_warns_on_known_bad_tilelang(monkeypatch):
    from glm5_dsa_plugin.ops import doctor

    monkeypatch.setattr(doctor, "versions", lambda: {"tilelang": "0.1.10"})
    lines = []
    assert doctor.run(lines.append) == 1
    assert any("known to miscompile" in x for x in lines)


class IndexSafeReference(ReferenceBackend):
    """The reference made memory-safe for any index (invalid slots treated as padding), and so
    allowed to have its index validation read after the kernel, like TileLang's safe mode."""

    name = "index_safe_ref"
    memory_safe_on_any_index = True
    forward_calls = 0

    def forward(self, q, kv, indices, prob, index_flag):
        type(self).forward_calls += 1
        index_flag += index_violation_flag(indices, kv.shape[1])
        clean = indices.masked_fill((indices < -1) | (indices >= kv.shape[1]), -1)
        return super().forward(q, kv, clean, prob)


@pytest.mark.parametrize("policy", ["fallback", "off"])
def test_deferred_validation_still_raises_with_position_and_value(policy):
    register_backend("index_safe_ref", IndexSafeReference, replace=True)
    configure(policy=policy)
    try:
        q, kv, idx, g = _inputs()
        out, _ = sparse_mla(q, kv, idx, 0.3, d_v=8, backend="index_safe_ref")
        want, _ = sparse_mla(q, kv, idx, 0.3, d_v=8, backend="reference")
        assert torch.equal(out, want)
        bad = idx.clone()
        bad[1, 3, 0, 2] = 10  # == T_kv
        calls = IndexSafeReference.forward_calls
        with pytest.raises(ValueError, match=r"indices\[batch=1, row=3, group=0, slot=2\] = 10"):
            sparse_mla(q, kv, bad, 0.3, d_v=8, backend="index_safe_ref")
        assert IndexSafeReference.forward_calls == calls + 1  # the kernel ran, the result was not returned
        # a backend without the property validates before running anything
        with pytest.raises(ValueError, match=r"row=3"):
            sparse_mla(q, kv, bad, 0.3, d_v=8, backend="reference")
    finally:
        unregister_backend("index_safe_ref")
        configure(policy="fallback")


def test_flag_read_under_cuda_graph_capture_is_a_clear_error(faulty, monkeypatch):
    """Inside stream capture no host read is allowed: the guard says what to switch off instead of
    torch's generic capture error; with the guard off and validate=False nothing is read."""
    monkeypatch.setattr(guard_slots, "capturing", lambda device: True)
    q, kv, idx, g = _inputs()
    with pytest.raises(RuntimeError, match="GLM5_DSA_NONFINITE=off.*validate=False"):
        sparse_mla(q, kv, idx, 0.3, d_v=8, backend="faulty")
    configure(policy="off")
    out, _ = sparse_mla(q, kv, idx, 0.3, d_v=8, backend="faulty", validate=False)
    out.backward(g)  # no flag read in either direction


class SavingFaultyBackend(FaultyBackend):
    """The prepared-inputs protocol (``forward_saving`` / ``backward_saved`` / ``originals``,
    ``reports_nonfinite``) over the faulty reference: saves a copy of kv and indices with -1
    rewritten to T_kv (as the TileLang backend does), sets the backward's flag itself."""

    name = "faulty_saving"
    reports_nonfinite = True
    flag_calls = 0

    def forward_saving(self, q, kv, indices, prob):
        out, lse = self.forward(q, kv, indices, prob)
        n_kv = kv.shape[1]
        return out, lse, (kv.detach().clone(), torch.where(indices < 0, n_kv, indices))

    def originals(self, saved, prob):
        kv, idx = saved
        return kv, torch.where(idx == prob.seq_len_kv, -1, idx)[..., :prob.topk]

    def backward_saved(self, q, saved, out, lse, grad_out, prob, nonfinite_flag=None):
        dq, dkv = self.backward(q, *self.originals(saved, prob), out, lse, grad_out, prob)
        if nonfinite_flag is not None:
            type(self).flag_calls += 1
            nonfinite_flag += int(not (torch.isfinite(dq).all() and torch.isfinite(dkv).all()))
        return dq, dkv


def test_backward_repair_through_saved_inputs(tmp_path):
    """A backend that keeps prepared inputs instead of (kv, indices) and flags its own backward:
    the guard reads that flag, rebuilds the originals for the reference, repairs the same rows."""
    be = SavingFaultyBackend()
    be.dq_rows, be.dkv_rows = [(1, 2)], [(0, 3)]
    register_backend(be.name, lambda: be, replace=True)
    configure(policy="fallback", dump_dir=str(tmp_path), dump_every=1)
    reset_guard_stats()
    try:
        q, kv, idx, g = _inputs()
        out, _ = sparse_mla(q, kv, idx, 0.4, d_v=8, backend=be.name)
        with pytest.warns(RuntimeWarning, match="repaired"):
            out.backward(g)
        r_dq, r_dkv = ref.backward(q.detach(), kv.detach(), idx, g, 0.4, 8)
        torch.testing.assert_close(q.grad, r_dq, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(kv.grad, r_dkv, rtol=1e-10, atol=1e-10)
        assert SavingFaultyBackend.flag_calls == 1
        st = guard_stats()
        assert st["events"] == 1 and st["rows_repaired"] == 1 and st["kv_rows_repaired"] == 1
        dump = torch.load(st["dumps"][0], weights_only=False)
        assert torch.equal(dump["inputs"]["indices"], idx)  # the caller's indices, -1 padding restored
    finally:
        unregister_backend(be.name)
        configure(policy="fallback", dump_dir="glm5_dsa_dumps", dump_every=100)
        reset_guard_stats()


class BoundedFaultyBackend(SavingFaultyBackend):
    """``finite_out_lse_bound`` / ``row_extent`` over the faulty reference: its forward sets
    ``kv_flag`` when kv holds NaN / inf (as TileLang's index preparation does) and may return
    chosen rows with an lse beyond the bound, or empty (out 0, lse EMPTY_ROW_LSE) although they
    have valid slots (what TileLang's kernels do when every score of a row underflows)."""

    name = "faulty_bounded"
    unusual_lse_rows: list = []
    emptied_rows: list = []
    kv_flag_passed: list = []

    def finite_out_lse_bound(self, prob):
        return 50.0

    def row_extent(self, saved):
        kv, idx = saved
        return ((idx >= 0) & (idx < kv.shape[1])).any(-1).to(torch.int32)

    def forward_saving(self, q, kv, indices, prob, kv_flag=None):
        type(self).kv_flag_passed.append(kv_flag is not None)
        if kv_flag is not None:
            kv_flag += int(not torch.isfinite(kv).all())
        out, lse, saved = super().forward_saving(q, kv, indices, prob)
        for b, t in self.unusual_lse_rows:
            lse[b, t] = 1e6
        for b, t in self.emptied_rows:
            out[b, t], lse[b, t] = 0.0, ref.EMPTY_ROW_LSE
        return out, lse, saved


@pytest.mark.parametrize("case", ["kv_clean", "kv_suspect", "unusual_lse", "emptied_rows", "policy_off"])
def test_bounded_backend_has_out_read_only_where_left_open(tmp_path, case):
    """A backend with ``finite_out_lse_bound`` gets a kv flag slot and its out is read only when
    kv is suspect: with kv clean and lse usual, NaN planted in out after the kernels (what the
    bound says the kernels never return) passes unseen, which shows the guard skips the read;
    kv flagged has the NaN rows found and repaired from the reference; rows the backend does not
    vouch for (an lse beyond its bound; empty although they have a valid slot) are recomputed
    too, out and lse. Under ``off`` no flag slot is passed."""
    be = BoundedFaultyBackend()
    be.fwd_rows = [(0, 3), (1, 7)] if case in ("kv_clean", "kv_suspect", "policy_off") else []
    be.unusual_lse_rows = [(0, 3), (1, 7)] if case == "unusual_lse" else []
    be.emptied_rows = [(0, 3), (1, 7)] if case == "emptied_rows" else []
    BoundedFaultyBackend.kv_flag_passed = []
    register_backend(be.name, lambda: be, replace=True)
    configure(policy="off" if case == "policy_off" else "fallback", dump_dir=str(tmp_path), dump_every=1)
    reset_guard_stats()
    try:
        q, kv, idx, _ = _inputs()
        kv = kv.detach().clone()
        assert (idx[0, 3] >= 0).any() and (idx[1, 7] >= 0).any()  # rows with valid slots
        if case == "kv_suspect":
            unused = sorted(set(range(kv.shape[1])) - set(idx[1].flatten().tolist()))[0]
            kv[1, unused, 0, 0] = float("inf")  # a row nothing selects: the reference stays finite
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out, lse = sparse_mla(q.detach(), kv, idx, 0.4, d_v=8, backend=be.name)
        repaired = case in ("kv_suspect", "unusual_lse", "emptied_rows")
        assert BoundedFaultyBackend.kv_flag_passed == [case != "policy_off"]
        assert torch.isfinite(out).all() == (case != "kv_clean" and case != "policy_off")
        assert guard_stats()["rows_repaired"] == (2 if repaired else 0)
        if repaired:
            r_out, r_lse = ref.forward(q.detach(), kv, idx, 0.4, 8)
            torch.testing.assert_close(out, r_out, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(lse, r_lse, rtol=1e-12, atol=1e-12)
    finally:
        unregister_backend(be.name)
        configure(policy="fallback", dump_dir="glm5_dsa_dumps", dump_every=100)
        reset_guard_stats()


class _FakeEvent:
    """Stands in for a CUDA event: the test says when the copy behind it has arrived."""

    def __init__(self):
        self.done = False
        self.waited = 0

    def record(self, stream):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited += 1
        self.done = True


class _CpuPending(guard_pending.PendingRepairs):
    _new_event = staticmethod(_FakeEvent)
    _stream = staticmethod(lambda device: None)

    @staticmethod
    def _host_buffer():
        return torch.zeros(guard.FLAG_SLOTS, dtype=torch.int32)


def test_deferred_backward_flags_are_settled_in_order(faulty, monkeypatch):
    """The device-side repair's flags (CPU stand-ins for the pinned copy and its event): nothing
    is counted before the copy arrives; then events, repaired rows, one warning and the dump
    (bad outputs recomputed) follow; a happy call counts nothing; more than MAX_PENDING calls
    wait for the oldest only; a repair that stayed nonfinite raises when settled."""
    pending = _CpuPending()
    monkeypatch.setattr(guard_pending, "queue", pending)
    faulty.dq_rows = [(0, 1)]
    q, kv, idx, g = _inputs()
    args = (faulty, q.detach(), (kv.detach(), idx), problem_of(q, kv, idx, 0.4, 8), g)
    call = lambda values: guard_run._settle_backward_event(values, args)  # noqa: E731

    def flags(nonfinite, still=0, rows=0, kv_rows=0):
        f = torch.zeros(guard.FLAG_SLOTS, dtype=torch.int32)
        f[Flag.NONFINITE], f[Flag.STILL_NONFINITE], f[Flag.ROWS_REPAIRED], f[Flag.KV_ROWS_REPAIRED] = \
            nonfinite, still, rows, kv_rows
        return f

    pending.push(flags(1, rows=1, kv_rows=2), call)
    assert guard_events.counters.events == 0  # the copy has not arrived
    pending.push(flags(0), call)
    pending._queue[0][2].done = pending._queue[1][2].done = True
    with pytest.warns(RuntimeWarning, match="repaired"):
        pending.settle()
    counters = guard_events.counters
    assert (counters.events, counters.rows_repaired, counters.kv_rows_repaired) == (1, 1, 2)
    dump = torch.load(guard_events.counters.dumps[0], weights_only=False)
    assert dump["bad_outputs_recomputed"] and torch.isnan(dump["bad_outputs"]["dq"][0, 1]).any()
    assert not pending._queue and len(pending._spare[torch.device("cpu")]) == 2  # buffers reused
    # MAX_PENDING + 1 unsettled calls: only the oldest is waited for
    for _ in range(pending.MAX_PENDING + 1):
        pending.push(flags(0), call)
    waited = [e.waited for _, _, e, _, _ in pending._queue]
    assert len(pending._queue) == pending.MAX_PENDING and waited == [0] * pending.MAX_PENDING
    pending.settle(wait_all=True)
    assert guard_events.counters.events == 1 and not pending._queue
    pending.push(flags(1, still=1, rows=1), call)
    with pytest.raises(FloatingPointError, match="even in the reference repair"):
        pending.settle(wait_all=True)


def test_pending_calls_keep_at_most_pending_bytes_alive(monkeypatch):
    """Unsettled calls keep their tensors alive for a possible dump; past ``pending_bytes`` of
    them the oldest are waited for and released, the newest never (one call bigger than the
    budget does not stall its own push); the setting is validated."""
    pending = _CpuPending()
    monkeypatch.setattr(guard_pending, "queue", pending)
    settled = []
    flags = torch.zeros(guard.FLAG_SLOTS, dtype=torch.int32)
    try:
        configure(pending_bytes=1000)
        for i in range(3):
            pending.push(flags, lambda values, i=i: settled.append(i), held_bytes=400)
        # 1200 > 1000 after the third push: the first was waited for, two stay (800 bytes)
        assert settled == [0] and pending.held_bytes == 800 and len(pending._queue) == 2
        assert [e.waited for _, _, e, _, _ in pending._queue] == [0, 0]
        pending.push(flags, lambda values: settled.append(3), held_bytes=5000)
        assert settled == [0, 1, 2] and len(pending._queue) == 1 and pending.held_bytes == 5000
        pending.settle(wait_all=True)
        assert settled == [0, 1, 2, 3] and pending.held_bytes == 0
        # what a call holds: distinct storages, a view counting its whole storage once
        a = torch.zeros(10, 4)
        assert guard_pending.storage_bytes(a, a[2:5], a.t(), torch.zeros(3, dtype=torch.int32)) == 160 + 12
        with pytest.raises(ValueError, match="pending_bytes"):
            configure(pending_bytes=-1)
    finally:
        configure(pending_bytes=2 << 30)


def test_index_error_of_a_recorded_forward_is_raised_in_its_backward(monkeypatch):
    """A call autograd records, on a device whose flags are read late (CPU stand-ins for CUDA's
    pinned copy and event): the forward returns without reading the index flag; the backward
    raises the usual error (position and value, and that it was found late) before returning
    gradients; without a backward, a later call raises it once the flags have arrived; a call
    that no backward follows (no grad) raises before returning, as before."""
    pending = _CpuPending()
    monkeypatch.setattr(guard_pending, "queue", pending)
    monkeypatch.setattr(guard_slots, "reads_late", lambda device: True)
    register_backend("index_safe_ref", IndexSafeReference, replace=True)
    configure(policy="off")  # the index flag alone (the forward's device repair needs CUDA)
    try:
        q, kv, idx, g = _inputs()
        bad = idx.clone()
        bad[0, 5, 1, 4] = -7
        want = r"indices\[batch=0, row=5, group=1, slot=4\] = -7: index -7 < -1.*after the call returned"
        out, _ = sparse_mla(q, kv, bad, 0.3, d_v=8, backend="index_safe_ref")  # no raise, no read
        assert len(pending._queue) == 1
        with pytest.raises(ValueError, match=want):
            out.backward(g)
        assert q.grad is None and not pending._queue
        # no backward: the next call settles the arrived flags and raises for the bad call
        sparse_mla(q, kv, bad, 0.3, d_v=8, backend="index_safe_ref")
        pending._queue[0][2].done = True
        with pytest.raises(ValueError, match=want):
            sparse_mla(q, kv, idx, 0.3, d_v=8, backend="index_safe_ref")
        # good indices: the backward settles them and returns the reference's gradients
        out, _ = sparse_mla(q, kv, idx, 0.3, d_v=8, backend="index_safe_ref")
        out.backward(g)
        r_dq, _ = ref.backward(q.detach(), kv.detach(), idx, g, 0.3, 8)
        torch.testing.assert_close(q.grad, r_dq, rtol=1e-12, atol=1e-12)
        assert not pending._queue
        with torch.no_grad(), pytest.raises(ValueError, match=r"row=5, group=1, slot=4\] = -7"):
            sparse_mla(q, kv, bad, 0.3, d_v=8, backend="index_safe_ref")
    finally:
        unregister_backend("index_safe_ref")
        configure(policy="fallback")


@pytest.mark.slow
def test_deferred_forward_flags_without_grad_settle_later_and_at_exit(monkeypatch, capsys):
    """``forward_flags="deferred"``: a call without grad does not read its index flag either; a
    later call raises it once the flags have arrived, and what is still queued at exit is settled
    by the exit hook, which prints the error instead of raising. The default stays eager, and the
    setting is validated (``configure`` and the environment variable)."""
    pending = _CpuPending()
    monkeypatch.setattr(guard_pending, "queue", pending)
    monkeypatch.setattr(guard_slots, "reads_late", lambda device: True)
    register_backend("index_safe_ref", IndexSafeReference, replace=True)
    configure(policy="off")
    try:
        q, kv, idx, g = _inputs()
        bad = idx.clone()
        bad[1, 2, 0, 1] = 11
        with torch.no_grad(), pytest.raises(ValueError, match=r"row=2, group=0, slot=1\] = 11"):
            sparse_mla(q, kv, bad, 0.3, d_v=8, backend="index_safe_ref")  # eager by default
        configure(forward_flags="deferred")
        with torch.no_grad():
            sparse_mla(q, kv, bad, 0.3, d_v=8, backend="index_safe_ref")  # returns; the flag is queued
            assert len(pending._queue) == 1
            pending._queue[0][2].done = True
            with pytest.raises(ValueError, match=r"row=2, group=0, slot=1\] = 11.*after the call returned"):
                sparse_mla(q, kv, idx, 0.3, d_v=8, backend="index_safe_ref")
            pending.settle(wait_all=True)  # the good call's flags
            sparse_mla(q, kv, bad, 0.3, d_v=8, backend="index_safe_ref")
        guard_pending.settle_at_exit()
        err = capsys.readouterr().err
        assert "at exit" in err and "row=2, group=0, slot=1] = 11" in err and not pending._queue
        with pytest.raises(ValueError, match="forward_flags"):
            configure(forward_flags="later")
        r = subprocess.run([sys.executable, "-c", "import glm5_dsa_plugin.ops"], capture_output=True, text=True,
                           env={**__import__("os").environ, "GLM5_DSA_FORWARD_FLAGS": "sometimes"})
        assert r.returncode != 0 and "GLM5_DSA_FORWARD_FLAGS='sometimes'" in r.stderr
    finally:
        unregister_backend("index_safe_ref")
        configure(policy="fallback", forward_flags="eager")


def test_a_backward_too_large_to_keep_is_counted_and_warned_without_a_dump(faulty, monkeypatch):
    """A device-repaired backward whose tensors exceed ``pending_bytes`` keeps none of them (they
    would outlive the backward): its settled event is counted and warned, naming the reason and
    the setting, with no dump; a repair that stayed nonfinite still raises."""
    pending = _CpuPending()
    monkeypatch.setattr(guard_pending, "queue", pending)
    monkeypatch.setattr(guard_events, "_warned", False)
    big = 3 << 30
    flags = torch.zeros(guard.FLAG_SLOTS, dtype=torch.int32)
    flags[Flag.NONFINITE], flags[Flag.ROWS_REPAIRED] = 1, 2
    before = (guard_events.counters.events, guard_events.counters.rows_repaired, list(guard_events.counters.dumps))
    pending.push(flags, lambda values: guard_run._settle_backward_event(values, (faulty,), unkept_bytes=big))
    with pytest.warns(RuntimeWarning, match=r"repaired.*Dump: none \(its tensors \(3.00 GiB\) exceed pending_bytes "
                                            r"\(2.00 GiB, GLM5_DSA_PENDING_BYTES\)\)"):
        pending.settle(wait_all=True)
    c = guard_events.counters
    assert (c.events, c.rows_repaired, c.dumps) == (before[0] + 1, before[1] + 2, before[2])
    flags[Flag.STILL_NONFINITE] = 1
    pending.push(flags, lambda values: guard_run._settle_backward_event(values, (faulty,), unkept_bytes=big))
    with pytest.raises(FloatingPointError, match=r"even in the reference repair.*dump: none \(its tensors"):
        pending.settle(wait_all=True)
