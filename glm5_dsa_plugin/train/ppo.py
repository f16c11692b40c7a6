"""PPO update over packed-THD rollout batches (``scripts/train_ppo.py``): token log-probs through
our DSA attention, the clipped objective with a k3 KL penalty.

Indexer replay (:mod:`glm5_dsa_plugin.model.indexer_replay`): ``--record-indexer-topk PATH`` runs the
rollout batch forward once and saves it with the top-k each index-computing layer picked (the
rollout engine's capture, ``roll["indexer_topk"]``); ``--indexer-replay`` trains on a batch's
``indexer_topk`` instead of the trainer's own top-k; ``--indexer-topk-overlap`` also reports, per
step, how many replayed members the trainer's own indexer would have picked."""

from __future__ import annotations

from pathlib import Path

import torch

from . import core
from .cli import LauncherInputError

__all__ = ["main", "make_rollouts", "packed_params", "ppo_loss", "record_indexer_topk", "rollout_replay",
           "token_logprobs"]


def make_rollouts(card: dict, n_seqs: int = 6, seed: int = 0, pad_to: int = 8, max_len: int | None = None) -> dict:
    """A packed-THD rollout batch of ``n_seqs`` prompts + responses, each padded to a multiple of
    ``pad_to``. ``max_len`` None: short sequences (prompt 3-8, response 2-9 tokens); else each
    padded sequence is at most ``max_len`` tokens: prompt 1/8-1/4 of it, the response filling
    the sequence to between 1/2 and all of ``max_len`` (RL at the lengths GLM-5.x trains).

    Pad tokens belong to no sequence: their DSA top-k is all padding (the shape behind the
    reported NaN gradients in GLM-5.2 RL runs)."""
    if max_len is not None and max_len < pad_to:
        raise ValueError(f"make_rollouts: max_len={max_len} is below pad_to={pad_to}")
    g = torch.Generator().manual_seed(seed)
    V = card["vocab_size"]

    def draw(lo: int, hi: int) -> int:  # uniform in [lo, hi]
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    toks, lens, plens, padded = [], [], [], [0]
    for _ in range(n_seqs):
        if max_len is None:
            p, r = draw(3, 8), draw(2, 9)
        else:
            cap = max_len - max_len % pad_to  # the padded length may not pass max_len
            p = draw(max(1, max_len // 8), max(1, max_len // 4))
            r = draw(max(1, max_len // 2 - p), cap - p)
        seq = torch.randint(0, V, (p + r,), generator=g)
        pad = (-(p + r)) % pad_to
        toks.append(torch.cat([seq, torch.zeros(pad, dtype=torch.long)]))
        lens.append(p + r)
        plens.append(p)
        padded.append(padded[-1] + p + r + pad)
    tokens = torch.cat(toks)
    T = tokens.numel()
    labels = torch.zeros(T, dtype=torch.long)
    mask = torch.zeros(T)
    positions = torch.zeros(T, dtype=torch.long)
    for i in range(n_seqs):
        a, n, p = padded[i], lens[i], plens[i]
        labels[a : a + n - 1] = tokens[a + 1 : a + n]
        mask[a + p - 1 : a + n - 1] = 1.0  # predictions of response tokens
        positions[a : a + n] = torch.arange(n)
    cu_padded = torch.tensor(padded, dtype=torch.int32)
    return dict(tokens=tokens, labels=labels, positions=positions, loss_mask=mask, cu_seqlens_padded=cu_padded,
                seq_lens=torch.tensor(lens, dtype=torch.int32),
                old_logprobs=-torch.rand(T, generator=g) * 3 - 2.0, ref_logprobs=-torch.rand(T, generator=g) * 3 - 2.0,
                advantages=torch.randn(T, generator=g))


def packed_params(roll: dict, device):
    """megatron-core PackedSeqParams: real lengths in cu_seqlens_q, padded layout in cu_seqlens_q_padded."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = roll["seq_lens"].to(torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    cu_pad = roll["cu_seqlens_padded"]
    mx = int((cu_pad[1:] - cu_pad[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.to(device), cu_seqlens_kv=cu.to(device),
                           cu_seqlens_q_padded=cu_pad.to(device), cu_seqlens_kv_padded=cu_pad.to(device),
                           max_seqlen_q=mx, max_seqlen_kv=mx)


def token_logprobs(model, roll: dict, device, replay=None, recorder=None) -> torch.Tensor:
    """log p(label_t | tokens_<=t) for every packed position, through the model (our attention).
    ``replay``: an :class:`~glm5_dsa_plugin.model.indexer_replay.IndexerReplay` the DSA layers train
    on; ``recorder``: an :class:`~glm5_dsa_plugin.model.indexer_replay.IndexerTopkRecorder` to fill."""
    from ..model import indexer_replay as ir

    tok = roll["tokens"][None].to(device)
    params = packed_params(roll, device)
    if replay is not None:
        ir.attach_indexer_replay(params, replay)
    if recorder is not None:
        ir.attach_indexer_topk_recorder(params, recorder)
    logits = model(tok, roll["positions"][None].to(device), None, packed_seq_params=params)
    logp = torch.log_softmax(logits.float(), dim=-1)[0]
    return logp.gather(-1, roll["labels"].to(device)[:, None])[:, 0]


def ppo_loss(logp, roll: dict, clip: float = 0.2, kl_coef: float = 0.0) -> torch.Tensor:
    dev = logp.device
    mask, adv = roll["loss_mask"].to(dev), roll["advantages"].to(dev)
    ratio = torch.exp(logp - roll["old_logprobs"].to(dev))
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    if kl_coef:
        d = roll["ref_logprobs"].to(dev) - logp
        pg = pg + kl_coef * (torch.exp(d) - d - 1)  # k3 estimator of KL(pi || ref)
    return (pg * mask).sum() / mask.sum().clamp_min(1)


def _dsa_geometry(model) -> dict:
    """The replay's view of the model: its DSA decoder layers (GPTModel: every layer; HybridModel:
    the pattern's ``D`` layers, not ``config.num_layers``, which counts the MLP layers too), top-k
    and index-sharing schedule."""
    from ..model.attention import GLM5DSAttention
    from ..model.dsa_fields import dsa_geometry

    g = dsa_geometry(model.config)
    layers = sum(1 for m in model.modules() if isinstance(m, GLM5DSAttention) and not m.is_mtp)
    return dict(num_layers=layers, topk=g.topk, topk_freq=g.topk_freq, skip_offset=g.skip_offset)


def record_indexer_topk(model, roll: dict, device) -> dict:
    """``roll`` plus ``indexer_topk``: per sample the int32 ``[n_tokens - 1, n_computing_layers,
    topk]`` top-k of one no-grad forward in eval mode (the format SGLang returns in ``meta_info``);
    the model's training mode is restored."""
    from ..model import indexer_replay as ir

    rec = ir.IndexerTopkRecorder()
    training = model.training
    model.eval()  # the rollout's side: no dropout, and no forward taken for a recompute's first pass
    try:
        with torch.no_grad():
            token_logprobs(model, roll, device, recorder=rec)
    finally:
        model.train(training)
    lens = roll["seq_lens"].to(torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    return {**roll, "indexer_topk": rec.records(cu, roll["cu_seqlens_padded"])}


def rollout_replay(model, roll: dict, measure_overlap: bool = False):
    """The :class:`~glm5_dsa_plugin.model.indexer_replay.IndexerReplay` of ``roll["indexer_topk"]``
    in the packed rows :func:`packed_params` describes (validated against the model's geometry)."""
    from ..model import indexer_replay as ir

    if "indexer_topk" not in roll:
        raise LauncherInputError("--indexer-replay: the rollout batch has no 'indexer_topk' (record one with "
                                 "--record-indexer-topk PATH, or store the rollout engine's per-sample top-k there)")
    lens = roll["seq_lens"].to(torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    try:
        return ir.pack_indexer_topk(roll["indexer_topk"], cu, cu_seqlens_padded=roll["cu_seqlens_padded"],
                                    measure_overlap=measure_overlap, **_dsa_geometry(model))
    except ir.IndexerReplayError as e:
        raise LauncherInputError(f"--indexer-replay: {e}") from None


def main(argv=None) -> int:
    ap = core.base_parser("PPO update of GLM-5 DSA over packed rollout batches", job="PPO")
    ap.add_argument("--rollouts", default=None, help="rollout batch (.pt from make_rollouts); default: generated")
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--kl-coef", type=float, default=0.01)
    ap.add_argument("--record-indexer-topk", default=None, metavar="PATH",
                    help="forward the rollout batch once, save it with each sample's indexer top-k "
                         "('indexer_topk') to PATH and exit (stands in for the rollout engine's capture)")
    ap.add_argument("--indexer-replay", action="store_true",
                    help="train on the rollout batch's 'indexer_topk' instead of the trainer's own top-k")
    ap.add_argument("--indexer-topk-overlap", action="store_true",
                    help="with --indexer-replay: log the share of replayed top-k members the trainer's own "
                         "indexer also picks (indexer_topk_overlap, and the rows below 0.8)")
    args = ap.parse_args(argv)
    if args.dry_run:
        return core.run_dry(args)
    if args.indexer_topk_overlap and not args.indexer_replay:
        raise LauncherInputError("--indexer-topk-overlap measures a replay: add --indexer-replay")
    card, model = core.prepare(args, mtp_num_layers=None)
    roll = (torch.load(args.rollouts) if args.rollouts
            else make_rollouts(card, n_seqs=args.batch_size, seed=args.seed, max_len=args.seq_len))
    if args.record_indexer_topk:
        Path(args.record_indexer_topk).parent.mkdir(parents=True, exist_ok=True)
        torch.save(record_indexer_topk(model, roll, args.device), args.record_indexer_topk)
        print(f"rollout batch with indexer_topk ({len(roll['seq_lens'])} samples) -> {args.record_indexer_topk}")
        return 0
    replay = rollout_replay(model, roll, args.indexer_topk_overlap) if args.indexer_replay else None
    seq_lens = [int(n) for n in roll["seq_lens"]]

    def step(i: int) -> core.StepResult:
        from ..model import indexer_replay as ir

        if replay is not None:
            replay.overlap.clear()  # per-step figures
        logp = token_logprobs(model, roll, args.device, replay=replay)
        loss = ppo_loss(logp, roll, args.clip, args.kl_coef)
        loss.backward()
        metrics = {}
        if args.indexer_topk_overlap:
            ov = ir.indexer_topk_overlap(replay)
            metrics = {"indexer_topk_overlap": ov["mean"], "indexer_rows_below_0_8": ov["rows_below_0_8"]}
        return core.StepResult(float(loss.detach()), sum(seq_lens), metrics=metrics, seq_lens=seq_lens)

    core.train(args, model, card, step)
    return 0
