"""slime's contiguous allgather CP (``--allgather-cp``) through the whole self-attention module
the spec builds (megatron-core's absorbed MLA: projections, norms, RoPE, our DSA core attention,
output projection) on CPU with gloo: CP = 2 and CP = 4 against CP = 1, in one spawn of four
processes (CP = 2 runs as two CP groups of two).

The CP = 1 reference is ``GLM5AbsorbedMLA`` (what the spec builds without CP; it equals
megatron-core's own ``AbsorbedMLASelfAttention``, tests/model/test_absorbed_mla.py); each rank's
input is slime's slicing of the global tensors (``chunk(cp)[rank]`` of the packed stream, of each
bshd row). Gradient conventions as in tests/model/test_cp_cpu.py: the
upstream gradient is ``cp`` times the rank's rows of the CP = 1 one, parameter gradients are
averaged over CP. Checked: output, input gradient, every parameter gradient, the indexer loss and
the selected indices (GLM-5.2 index sharing: layer 3 computes, layer 4 reuses).

Also run under CP > 1: the same module with q / k rotated by megatron-core's zigzag positions
(megatron-core's own MLA class for THD; its zigzag positions through our rotary hook for bshd);
its output must miss the CP = 1 one by far more than the tolerance, so the parity above fails if
q / k were rotated that way.
"""

import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from megatron_cpu import megatron_single_process  # noqa: F401
from test_cp_cpu import LAYERS_SHARING, _card, _close, _packed, _to_cpu, run_cp_cases

WORLD = 4
# name: (format, real lengths (THD) or (S, B) (bshd), padded lengths or None). THD lengths: sequence 1
# crosses a rank boundary at CP = 2 and CP = 4 (and every (padded) length is a multiple of 2 * cp, so megatron-core's
# zigzag RoPE, the wrong one here, runs without error)
CASES = {
    "bshd": ("bshd", (16, 2), None),
    "thd_crossing": ("thd", [8, 24, 16], None),
    "thd_padded_crossing": ("thd", [13, 7, 20, 6], [16, 8, 24, 16]),
}


def _local_rows(fmt, sizes, padded, cp, rank):
    """slime's get_batch(allgather_cp=True): tokens.chunk(cp)[rank] (THD stream; every bshd row)."""
    n = sum(padded or sizes) if fmt == "thd" else sizes[0]
    return torch.arange(n).chunk(cp)[rank]


def _fill(module, seed):
    """Deterministic weights, the same at every CP size: norms near 1, linears ~ 1/sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * r if "norm" in name else r * p.shape[-1] ** -0.5)


def _build(cfg, layer, layout, pgc, mla_class=None):
    from megatron.core.transformer.spec_utils import build_module

    from glm5_dsa_plugin.megatron.spec import dsa_attention_spec

    spec = dsa_attention_spec(cfg, cp_layout=layout)
    if mla_class is not None:
        spec.module = mla_class
    att = build_module(spec, config=cfg, layer_number=layer, cp_comm_type="all_gather", pg_collection=pgc)
    _fill(att, layer)
    att.core_attention.backend = "reference"
    return att.train()


def _zigzag_rope_mla(fmt):
    """An MLA that rotates q / k by megatron-core's zigzag positions. THD: megatron-core's own class.
    bshd: its positions (chunks r and 2 * cp - 1 - r of each row, what ``get_pos_emb_on_this_cp_rank``
    keeps; that function itself needs CUDA) through ContiguousCPAbsorbedMLA's rotary hook."""
    from megatron.core.transformer.experimental_attention_variant import dsa_layout
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention
    from megatron.core.utils import get_pg_rank, get_pg_size

    from glm5_dsa_plugin.model.contiguous_cp_mla import ContiguousCPAbsorbedMLA

    if fmt == "thd":
        return AbsorbedMLASelfAttention

    class ZigzagPositions(ContiguousCPAbsorbedMLA):
        def _row_positions(self, hidden_states, packed_seq_params):
            cp, rank = get_pg_size(self.pg_collection.cp), get_pg_rank(self.pg_collection.cp)
            return dsa_layout.build_zigzag_cp_local_positions(hidden_states.shape[0] * cp, cp, rank,
                                                              torch.device("cpu"))

    return ZigzagPositions


def _run_case(name, cp, device="cpu", config=None):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from glm5_dsa_plugin.checkpoints import cards
    from glm5_dsa_plugin.model.shared_topk import HOLDER_ATTR

    fmt, sizes, padded = CASES[name]
    card = _card(sharing=True)
    cfg = cards.card_to_transformer_config(card, mtp_num_layers=None, context_parallel_size=cp,
                                           cp_comm_type="all_gather" if cp > 1 else None, **(config or {}))
    pgc = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    rank = torch.distributed.get_rank(pgc.cp) if cp > 1 else 0
    rows = _local_rows(fmt, sizes, padded, cp, rank)
    psp = _packed(sizes, padded, device) if fmt == "thd" else None
    S, B = (sum(padded or sizes), 1) if fmt == "thd" else sizes
    g = torch.Generator().manual_seed(7)
    res = {"rows": rows}
    for layer in LAYERS_SHARING:
        hidden = torch.randn(S, B, card["hidden_size"], generator=g).to(device)
        grad = torch.randn(S, B, card["hidden_size"], generator=g).to(device)
        zigzag_out = None
        if cp > 1 and layer == LAYERS_SHARING[0]:  # q / k rotated by zigzag positions
            zig = _build(cfg, layer, "contiguous", pgc, _zigzag_rope_mla(fmt)).to(device)
            with torch.no_grad():
                zigzag_out = zig(hidden[rows], None, packed_seq_params=psp)[0]
        att = _build(cfg, layer, "contiguous", pgc).to(device)
        h = hidden[rows].clone().requires_grad_(True)
        out, _ = att(h, None, packed_seq_params=psp)
        out.backward(grad[rows] * cp)
        holder = getattr(psp if psp is not None else cfg, HOLDER_ATTR, {})
        r = dict(module=type(att).__name__, out=out.detach(), dhidden=h.grad, indices=holder.get(layer),
                 loss=getattr(att.core_attention, "last_indexer_loss", None),
                 params={n: p.grad for n, p in att.named_parameters()}, zigzag_rope_out=zigzag_out)
        res[layer] = _to_cpu(r)
    return res


def _worker(rank, store, out_dir, world=WORLD, cps=(1, 2, 4), device="cpu", config=None):
    """Every CP size in ``cps``, every case; ``config``: overrides of the TransformerConfig fields."""
    run_cp_cases(rank, store, out_dir, world, cps, device, CASES, lambda name, cp: _run_case(name, cp, device, config))


@pytest.fixture(scope="module")
def mla_cp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_mla")
    store = tempfile.NamedTemporaryFile(prefix="glm5_dsa_cp_mla_", delete=False).name
    mp.spawn(_worker, args=(store, str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def check_parity(results, name, cp, world):
    """Every CP group of ``cp`` ranks against the CP = 1 run of rank 0 (module docstring)."""
    fmt, sizes = CASES[name][0], CASES[name][1]
    for group in [list(range(g, g + cp)) for g in range(0, world, cp)]:
        for layer in LAYERS_SHARING:
            ref = results[0][(name, 1)][layer]
            assert ref["module"] == "GLM5AbsorbedMLA"
            locs = [results[r][(name, cp)] for r in group]
            for r, loc in zip(group, locs):
                rows, got = loc["rows"], loc[layer]
                what = f"{name} CP={cp} rank {r} layer {layer}"
                assert got["module"] == "ContiguousCPAbsorbedMLA", what
                _close(got["out"], ref["out"][rows], f"{what} out")
                _close(got["dhidden"] / cp, ref["dhidden"][rows], f"{what} dhidden")
                if layer == LAYERS_SHARING[0]:  # the computing layer's indices (the next one reuses them)
                    packed_rows = rows if fmt == "thd" else torch.cat([b * sizes[0] + rows for b in range(sizes[1])])
                    assert got["indices"] is not None and ref["indices"] is not None, what
                    assert torch.equal(got["indices"], ref["indices"][packed_rows]), f"{what} indices"
            what = f"{name} CP={cp} ranks {group} layer {layer}"
            assert ref["params"].keys() == locs[0][layer]["params"].keys(), what
            for n, p in ref["params"].items():
                grads = [loc[layer]["params"][n] for loc in locs]
                if p is None:
                    assert all(x is None for x in grads), f"{what} {n}"
                    continue
                _close(sum(grads) / cp, p, f"{what} grad {n}")
            if ref["loss"] is not None:
                torch.testing.assert_close(sum(loc[layer]["loss"] for loc in locs) / cp, ref["loss"],
                                           rtol=1e-5, atol=1e-8, msg=lambda m: f"{what} indexer loss: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_contiguous_cp_mla_matches_cp1(mla_cp_results, name, cp):
    check_parity(mla_cp_results, name, cp, WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_zigzag_rope_would_fail_the_parity(mla_cp_results, name, cp):
    """megatron-core's MLA under the contiguous layout: every rank's output misses the CP = 1 one."""
    layer = LAYERS_SHARING[0]
    ref = mla_cp_results[0][(name, 1)][layer]["out"]
    for r in range(WORLD):
        loc = mla_cp_results[r][(name, cp)]
        wrong = loc[layer]["zigzag_rope_out"]
        with pytest.raises(AssertionError):
            _close(wrong, ref[loc["rows"]], "zigzag-rotated out")
        err = ((wrong - ref[loc["rows"]]).norm() / ref[loc["rows"]].norm()).item()
        assert err > 1e-2, f"{name} CP={cp} rank {r}: zigzag RoPE relative error only {err:.3g}"


def test_cp1_is_megatron_mla_and_rope_fusion_is_refused(megatron_single_process):
    """At CP = 1 ContiguousCPAbsorbedMLA is megatron-core's MLA (same output, bshd and THD); it
    refuses apply_rope_fusion, whose fused kernel computes zigzag positions itself."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention

    from glm5_dsa_plugin.checkpoints import cards
    from glm5_dsa_plugin.model.contiguous_cp_mla import ContiguousCPAbsorbedMLA

    card = _card(sharing=False)
    cfg = cards.card_to_transformer_config(card, mtp_num_layers=None)
    pgc = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    ours, ref = (_build(cfg, 1, "contiguous", pgc, c) for c in (ContiguousCPAbsorbedMLA, AbsorbedMLASelfAttention))
    assert type(ours) is ContiguousCPAbsorbedMLA and ours.state_dict().keys() == ref.state_dict().keys()
    g = torch.Generator().manual_seed(3)
    for fmt, sizes in (("bshd", (12, 2)), ("thd", [5, 11])):
        S, B = (sum(sizes), 1) if fmt == "thd" else sizes
        psp = _packed(sizes, None, "cpu") if fmt == "thd" else None
        h = torch.randn(S, B, card["hidden_size"], generator=g)
        torch.testing.assert_close(ours(h, None, packed_seq_params=psp)[0], ref(h, None, packed_seq_params=psp)[0],
                                   rtol=0, atol=0)
    cfg.apply_rope_fusion = True  # megatron-core allows it with yarn RoPE and TransformerEngine
    with pytest.raises(ValueError, match="apply_rope_fusion=True is not supported"):
        _build(cfg, 1, "contiguous", pgc, ContiguousCPAbsorbedMLA)
