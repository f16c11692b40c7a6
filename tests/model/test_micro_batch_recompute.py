"""Recompute under 1F1B: a micro batch's recomputed forward must see that micro batch's shared top-k
(index sharing) and indexer replay, or refuse loudly.

megatron-core's full recompute (``--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1``) runs each layer's forward again in backward; with pipeline parallelism
1F1B runs other micro batches' forwards in between. The model is the tiny card with GLM-5.2 index
sharing (layers 2 and 4 reuse 1 and 3), fp32 on CPU, the reference backend. On CPU megatron-core's
``CheckpointFunction`` cannot run (it saves the CUDA RNG state), so its chunks go through
``torch.utils.checkpoint`` in its reentrant form: the same contract (forward under ``no_grad``,
inputs saved and detached, the forward run again inside backward), no RNG involved (no dropout).
"""

import pytest
import torch

from glm5_dsa_plugin.model import indexer_replay as rp
from glm5_dsa_plugin.model.shared_topk import StaleMicroBatchStateError
from tests.megatron_cpu import megatron_single_process  # noqa: F401  (fixture)
from tests.tiny_models import build, tiny_config

S = 16
SHARING = dict(dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1)


@pytest.fixture
def reentrant_checkpoint(monkeypatch):
    import torch.utils.checkpoint as tuc
    from megatron.core import recompute

    monkeypatch.setattr(recompute.tensor_parallel, "checkpoint",
                        lambda fn, _distribute, *args: tuc.checkpoint(fn, *args, use_reentrant=True,
                                                                      preserve_rng_state=False))


def _model(recompute_layers=None, **over):
    if recompute_layers:
        over.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=recompute_layers)
    card, cfg = tiny_config(mtp_num_layers=None, **over)
    return card, cfg, build(cfg, card, mtp=False).train()


def _tokens(card, n=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, card["vocab_size"], (1, S), generator=g) for _ in range(n)]


def _mask():
    return torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), 1)  # a fresh mask per micro batch


def _run(model, toks, order, masks=None, before_forward=None):
    """Forward (``f``) and backward (``b``) steps of micro batches in ``order``; the gradients
    each backward added, per micro batch."""
    pos = torch.arange(S)[None]
    model.zero_grad(set_to_none=True)
    losses, grads, last = {}, {}, {}
    for op, m in order:
        if op == "f":
            if before_forward is not None:
                before_forward(m)
            mask = masks[m] if masks is not None else None
            losses[m] = model(toks[m], pos, mask, labels=toks[m]).float().mean()
        else:
            losses[m].backward()
            now = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            grads[m] = {n: g - last.get(n, 0) for n, g in now.items()}
            last = now
    return grads


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")


ONE_F_ONE_B = [("f", 0), ("f", 1), ("b", 0), ("b", 1)]  # pipeline warm-up: two forwards ahead
IN_ORDER = [("f", 0), ("b", 0), ("f", 1), ("b", 1)]


def test_recompute_with_a_mask_per_micro_batch_is_exact_under_1f1b(megatron_single_process, reentrant_checkpoint):
    """The mask's storage carries the shared top-k, so a recomputed layer (which gets ``mask.detach()``)
    finds its micro batch's top-k; the gradients equal those without recompute, micro batch by micro batch."""
    card, _, plain = _model(**SHARING)
    toks = _tokens(card)
    want = _run(plain, toks, IN_ORDER, masks=[_mask(), _mask()])
    _, _, recomputed = _model(recompute_layers=1, **SHARING)
    got = _run(recomputed, toks, ONE_F_ONE_B, masks=[_mask(), _mask()])
    for m in (0, 1):
        _assert_same(got[m], want[m])


def test_recompute_on_the_shared_config_is_refused_when_a_forward_came_between(megatron_single_process,
                                                                               reentrant_checkpoint):
    """No mask, no packed sequences: the top-k rides on the config, one for both micro batches. Layer
    4's recompute for micro batch 0 would read micro batch 1's top-k of layer 3 (silently wrong
    gradients); it raises instead, naming the remedies."""
    card, _, model = _model(recompute_layers=1, **SHARING)
    with pytest.raises(StaleMicroBatchStateError, match=r"layer 4 reuses the top-k of layer 3 in a recomputed "
                                                        r"forward.*packed sequences.*recompute layers 3\.\.4"):
        _run(model, _tokens(card), ONE_F_ONE_B)


@pytest.mark.parametrize("recompute_layers, order", [(1, IN_ORDER), (2, ONE_F_ONE_B)],
                         ids=["one-layer-chunks-in-order", "source-and-reuser-in-one-chunk-1f1b"])
def test_recompute_on_the_shared_config_is_exact_where_it_can_be(megatron_single_process, reentrant_checkpoint,
                                                                  recompute_layers, order):
    """Exact and accepted: forward and backward of each micro batch in turn (pipeline size 1), or
    chunks that recompute the computing layer before the layer that reuses its top-k."""
    card, _, plain = _model(**SHARING)
    toks = _tokens(card)
    want = _run(plain, toks, IN_ORDER)
    _, _, recomputed = _model(recompute_layers=recompute_layers, **SHARING)
    got = _run(recomputed, toks, order)
    for m in (0, 1):
        _assert_same(got[m], want[m])


def _replays(model, cfg, toks, mode="eval"):
    """Each micro batch's top-k as a rollout would record it (a no-grad forward in ``mode``), packed
    for replay (every layer computes)."""
    out = []
    cu = torch.tensor([0, S])
    model.train(mode == "train")
    for t in toks:
        rec = rp.IndexerTopkRecorder()
        rp.attach_indexer_topk_recorder(cfg, rec)
        with torch.no_grad():
            model(t, torch.arange(S)[None], None)
        rp.attach_indexer_topk_recorder(cfg, None)
        out.append(rp.pack_indexer_topk(rec.records(cu), cu, num_layers=cfg.num_layers, topk=cfg.dsa_indexer_topk))
    model.train()
    return out


def test_replay_on_the_shared_config_is_refused_when_another_was_attached_between(megatron_single_process,
                                                                                   reentrant_checkpoint):
    card, cfg, model = _model(recompute_layers=1)
    toks = _tokens(card)
    replays = _replays(model, cfg, toks)
    with pytest.raises(StaleMicroBatchStateError, match=r"recomputed forward finds indexer replay \d+ on a carrier "
                                                        r"shared by micro batches.*this micro batch's forward used"):
        _run(model, toks, ONE_F_ONE_B, before_forward=lambda m: rp.attach_indexer_replay(cfg, replays[m]))


def test_replay_attached_to_each_micro_batchs_mask_is_exact_under_1f1b(megatron_single_process,
                                                                       reentrant_checkpoint):
    """A replay attached to the mask tensor is found again by the recompute (which sees the mask
    detached): the gradients equal those of the same replay without recompute. Each micro batch
    replays the other's record, so a recompute that lost its replay would attend elsewhere."""
    card, cfg, plain = _model()
    toks = _tokens(card)
    replays = _replays(plain, cfg, toks[::-1])
    masks = [_mask(), _mask()]
    for m in (0, 1):
        rp.attach_indexer_replay(masks[m], replays[m])
    want = _run(plain, toks, IN_ORDER, masks=masks)
    _, _, recomputed = _model(recompute_layers=1)
    got = _run(recomputed, toks, ONE_F_ONE_B, masks=masks)
    for m in (0, 1):
        _assert_same(got[m], want[m])


def test_replay_on_the_shared_config_recomputed_in_order_is_exact_after_an_eval_mode_record(
        megatron_single_process, reentrant_checkpoint):
    """A no-grad pass in eval mode between training steps (log-probs, a rollout record: what the PPO
    launcher's recorder runs) is no forward to be recomputed, so it leaves the pairing alone: a replay
    on the config, each micro batch's forward and backward in turn, gives the gradients of the same
    replay without recompute."""
    card, cfg, plain = _model()
    toks = _tokens(card)
    replays = _replays(plain, cfg, toks[::-1])
    want = _run(plain, toks, IN_ORDER, before_forward=lambda m: rp.attach_indexer_replay(cfg, replays[m]))
    _, cfg2, recomputed = _model(recompute_layers=1)
    _replays(recomputed, cfg2, toks)  # the record pass on the model that recomputes
    got = _run(recomputed, toks, IN_ORDER, before_forward=lambda m: rp.attach_indexer_replay(cfg2, replays[m]))
    for m in (0, 1):
        _assert_same(got[m], want[m])


def test_a_training_mode_no_grad_pass_is_named_when_it_breaks_the_pairing(megatron_single_process,
                                                                         reentrant_checkpoint):
    """The same no-grad pass in training mode looks like the first pass of a recompute (grad off,
    training) and leaves entries no recompute takes; the refusal that follows names that cause and
    model.eval() as its remedy."""
    card, cfg, model = _model(recompute_layers=1)
    toks = _tokens(card)
    replays = _replays(model, cfg, toks, mode="train")
    with pytest.raises(StaleMicroBatchStateError, match=r"torch\.no_grad\(\) in training mode.*model\.eval\(\)"):
        _run(model, toks, IN_ORDER, before_forward=lambda m: rp.attach_indexer_replay(cfg, replays[m]))


def test_replay_on_a_mask_reused_by_every_micro_batch_is_refused_when_another_was_attached_between(
        megatron_single_process, reentrant_checkpoint):
    """One mask tensor for every micro batch is a shared carrier like the config: micro batch 1's replay
    replaces micro batch 0's on it before micro batch 0's recompute, which would attend to the other
    record's keys (silently wrong gradients); it raises instead."""
    card, cfg, model = _model(recompute_layers=1)
    toks = _tokens(card)
    replays = _replays(model, cfg, toks[::-1])
    mask = _mask()
    with pytest.raises(StaleMicroBatchStateError, match=r"recomputed forward finds indexer replay \d+ on a carrier "
                                                        r"shared by micro batches"):
        _run(model, toks, ONE_F_ONE_B, masks=[mask, mask],
             before_forward=lambda m: rp.attach_indexer_replay(mask, replays[m]))
