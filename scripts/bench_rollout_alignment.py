"""Train / rollout numerics gap of one DSA attention layer, bf16 training vs rollout-matched training.

The "rollout" forward follows the published inference definitions in inference order: indexer
scores in FP8 (Hadamard, e4m3 with UE8M0 scales, ``fp8_index``), top-k, the latent kv read back from
FlashMLA's FP8 cache (656 bytes per token), sparse attention over the gathered keys with a bf16
output, bf16 value up-projection. ``--rollout`` picks the attention's arithmetic: ``fp32`` (the
definition in fp32) and ``flashmla`` (FlashMLA's sparse-kernel order: fp32 scores of the bf16
operands, an online softmax over blocks of 64 selected keys in index order whose row sums add the
fp32 probabilities, the probabilities rounded to bf16 for the product with the values). Both are
faithful; the ``two_rollouts`` row measures how far they are from each other, the gap any bf16
attention kernel leaves against an engine that is not bit-identical to it. The training forward is ours: ``indexer.select_topk`` as
``GLM5DSAIndexer`` calls it (``bf16``: the bf16 / fp32 scores; ``rollout_matched``:
``precision="fp8"``, the fused FP8 score kernel on a GPU, with ``dsa_kv_fp8_qat``'s fake-quantised
latent) and ``sparse_mla`` (``--backend``: "auto", the TileLang kernel on a GPU; "reference", the
fp32 PyTorch reference, which separates the attention kernel's bf16 arithmetic from the numerics
matched here). A fixed random readout turns each layer output into log-probabilities of random
tokens over a 4096-word vocabulary, the quantity an RL loss compares.

Layer: the attention core of one GLM-5.x DSA layer (absorbed MLA: latent 512 + 64, qk head 192 + 64,
value head 256, indexer 32 heads x 128, top-k 2048), fed random bf16 activations in place of the
projections. ``--width tiny`` (default): 16 query heads, the tiny GLM-5.2-shaped model's layer;
``--width full``: GLM-5.x's 64 query heads, one full-width layer. ``--rows N`` evaluates N query
rows evenly strided over [0, T) (the last row included) against all T keys, where every row of a
long sequence is more than a CPU can score; the rows' figures are then a sample of the full
sequence's (``query_rows`` in each row; the max is the max over the sample).

Rows: {mode, T, topk_member_agreement, rows_below_0_8, logprob_max_abs_diff, logprob_mean_abs_diff,
width, query_heads, query_rows, card, backend, rollout, seconds}; ``mode`` is ``bf16``,
``rollout_matched`` or ``two_rollouts`` (the ``flashmla`` rollout against the ``fp32`` one). ``--merge`` keeps the rows of other (width, T,
card, backend) already in ``--out`` and replaces those this run measures, so each row of the file is its
latest result.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from glm5_dsa_plugin.model import indexer, visibility
from glm5_dsa_plugin.model.value_projection import value_up_projection
from glm5_dsa_plugin.ops import fp8_kv, sparse_mla
from glm5_dsa_plugin.ops.backends import explain_auto
from glm5_dsa_plugin.ops.indexer import fp8_index

HI, DI, LAT, ROPE, DV, TOPK, VOCAB = 32, 128, 512, 64, 256, 2048, 4096
WIDTHS = {"tiny": 16, "full": 64}  # query heads: the tiny GLM-5.2-shaped model, GLM-5.x
SM_SCALE = (192 + 64) ** -0.5


def make_inputs(T: int, device, H: int = WIDTHS["tiny"], seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    bf = dict(device=device, dtype=torch.bfloat16)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=device) * scale).to(torch.bfloat16)  # noqa: E731
    return dict(q=r(T, H, LAT + ROPE), kv=r(T, 1, LAT + ROPE), qi=r(T, HI, DI), ki=r(T, DI),
                wi=(torch.randn(T, HI, generator=g, device=device) * HI ** -0.5), up_v=r(H, DV, LAT, scale=LAT ** -0.5),
                readout=r(H * DV, VOCAB, scale=(H * DV) ** -0.5),
                tokens=torch.randint(0, VOCAB, (T,), generator=g, device=device), _bf=bf)


def query_rows(T: int, n: int | None, device) -> torch.Tensor:
    """n query rows evenly strided over [0, T), the last row included (all T rows when n is None or >= T)."""
    if n is None or n >= T:
        return torch.arange(T, device=device)
    if n < 1:
        raise ValueError(f"--rows must be >= 1, got {n}")
    return torch.arange(T - 1 - (n - 1) * (T // n), T, T // n, device=device)


def logprobs(y: torch.Tensor, inp: dict, rows: torch.Tensor) -> torch.Tensor:
    """y [R, H, DV] of query rows ``rows`` -> log p(token_t) [R] fp32 through the fixed readout."""
    logits = y.reshape(y.shape[0], -1).float() @ inp["readout"].float()
    return torch.log_softmax(logits, -1).gather(1, inp["tokens"][rows, None])[:, 0]


ROLLOUTS = ("fp32", "flashmla")
FLASHMLA_BLOCK = 64  # selected keys per step of FlashMLA's sparse kernels


def flashmla_order_attention(q: torch.Tensor, kvs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """q [c, H, 576] bf16, kvs [c, K, 576] (bf16 values), valid [c, K] -> out [c, H, 512] fp32 as
    FlashMLA's sparse kernels compute it: per block of 64 selected keys in index order, fp32 scores,
    running max m, p = exp2((s - m) * scale * log2 e) in fp32, row sum l += sum(p) (fp32), o += bf16(p)
    @ v with fp32 accumulation, both rescaled when m grows; out = o / l (0 for a row without keys)."""
    c, H, _ = q.shape
    scale2 = SM_SCALE * 1.4426950408889634
    m = torch.full((c, H), float("-inf"), device=q.device)
    l = torch.zeros(c, H, device=q.device)
    o = torch.zeros(c, H, LAT, device=q.device)
    for b0 in range(0, kvs.shape[1], FLASHMLA_BLOCK):
        blk = kvs[:, b0:b0 + FLASHMLA_BLOCK].float()
        s = (q.float() @ blk.transpose(1, 2)).masked_fill(~valid[:, None, b0:b0 + FLASHMLA_BLOCK], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # no key yet: nothing to rescale
        alpha = torch.exp2((m - base) * scale2)
        p = torch.exp2(s * scale2 - (base * scale2)[..., None])
        l = l * alpha + p.sum(-1)
        o = o * alpha[..., None] + p.to(torch.bfloat16).float() @ blk[..., :LAT]
        m = m_new
    return torch.where(l[..., None] > 0, o / l.clamp(min=torch.finfo(torch.float32).tiny)[..., None], 0.0)


def rollout_forward(inp: dict, vis: visibility.Visibility, rows: torch.Tensor, chunk: int = 256,
                    attention: str = "fp32"):
    """Inference order: FP8 index -> top-k -> FP8 cache read -> sparse attention (``attention``: ``fp32``
    or ``flashmla``, see the module docstring; output rounded to bf16) -> bf16 value up-projection.
    Query rows ``rows`` against all keys."""
    if attention not in ROLLOUTS:
        raise ValueError(f"rollout attention must be one of {ROLLOUTS}, got {attention!r}")
    H = inp["q"].shape[1]
    q, qi, wi = inp["q"][rows], inp["qi"][rows], inp["wi"][rows]
    idx = fp8_index.fp8_select_topk(qi, inp["ki"], wi, TOPK, vis.rows(rows).mask)
    cache = fp8_kv.pack(inp["kv"][:, 0])  # [T, 656] uint8, what the engine stores
    kv = fp8_kv.unpack(cache)  # [T, 576] bf16
    R = rows.shape[0]
    out = torch.empty(R, H, LAT, device=kv.device)
    for t0 in range(0, R, chunk):
        t1 = min(R, t0 + chunk)
        sel = idx[t0:t1]
        kvs = kv[sel.clamp(min=0).long()]  # [c, K, 576]
        if attention == "flashmla":
            out[t0:t1] = flashmla_order_attention(q[t0:t1], kvs, sel >= 0)
            continue
        s = torch.einsum("chd,ckd->chk", q[t0:t1].float(), kvs.float()) * SM_SCALE
        s = s.masked_fill((sel < 0)[:, None, :], float("-inf"))
        out[t0:t1] = torch.einsum("chk,ckd->chd", torch.softmax(s, -1), kvs[..., :LAT].float())
    # the engine's attention kernel returns bf16; the value up-projection runs on bf16 operands
    y = torch.einsum("thc,hdc->thd", out.to(torch.bfloat16), inp["up_v"])
    return idx, logprobs(y, inp, rows)


def train_forward(inp: dict, vis: visibility.Visibility, mode: str, rows: torch.Tensor, backend: str = "auto"):
    """Our training forward for query rows ``rows`` against all keys (the attention module's calls)."""
    q, qi, wi, rv = inp["q"][rows], inp["qi"][rows], inp["wi"][rows], vis.rows(rows)
    with torch.no_grad():
        matched = mode == "rollout_matched"
        idx = indexer.select_topk(qi, inp["ki"], wi, TOPK, rv, check=False, precision="fp8" if matched else "bf16")
        kv = fp8_kv.fake_quant_kv(inp["kv"]) if matched else inp["kv"]
        o, _ = sparse_mla(q, kv, idx[:, None, :].contiguous(), SM_SCALE, d_v=LAT, backend=backend)
        y = value_up_projection(o, inp["up_v"].to(o.dtype))
    return idx, logprobs(y, inp, rows)


def agreement(a: torch.Tensor, b: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Per row |set(a) & set(b)| / |set(b)| over valid (>= 0) entries; rows without any: 1."""
    out = []
    for t0 in range(0, a.shape[0], chunk):
        x, y = a[t0:t0 + chunk].long(), b[t0:t0 + chunk].long()
        n = int(max(x.max(), y.max())) + 2
        mx = torch.zeros(x.shape[0], n, dtype=torch.bool, device=x.device).scatter_(1, x + 1, True)
        my = torch.zeros_like(mx).scatter_(1, y + 1, True)
        mx[:, 0] = my[:, 0] = False
        inter, total = (mx & my).sum(1).float(), my.sum(1).float()
        out.append(torch.where(total > 0, inter / total.clamp(min=1), torch.ones_like(total)))
    return torch.cat(out)


def _key(r: dict) -> tuple:
    return r["width"], r["T"], r["card"], r["backend"]


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` without the (width, T, card, backend) that ``new`` measures, plus ``new``; sorted by card,
    backend, tiny before full, then T, bf16 first."""
    mine = {_key(r) for r in new}
    rows = [r for r in old if _key(r) not in mine] + new
    order = {"bf16": 0, "rollout_matched": 1, "two_rollouts": 2}
    return sorted(rows, key=lambda r: (r["card"], r["backend"], r["width"] != "tiny", r["T"], r.get("rollout", "fp32"),
                                       order.get(r["mode"], 3)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--width", choices=sorted(WIDTHS), default="tiny",
                    help="tiny: 16 query heads (the tiny GLM-5.2-shaped model); full: GLM-5.x's 64")
    ap.add_argument("--rows", type=int, default=None,
                    help="query rows evaluated, evenly strided over [0, T) (default: all T)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of --out this run does not measure (other width / T / row count)")
    ap.add_argument("--backend", default="auto", help="sparse_mla backend of the training forward")
    ap.add_argument("--rollout", nargs="+", choices=ROLLOUTS, default=list(ROLLOUTS),
                    help="the rollout attention's arithmetic (module docstring); both also give a two_rollouts row")
    ap.add_argument("--out", default="benchmarks/results/rollout_alignment.json")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    card = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    H = WIDTHS[args.width]
    backend = explain_auto(dev)[0] if args.backend == "auto" else args.backend
    rows = []

    def row(mode, T, rollout, idx, ref_idx, lp, ref_lp, seconds):
        ag, d = agreement(idx, ref_idx), (lp - ref_lp).abs()
        rows.append(dict(mode=mode, T=T, topk_member_agreement=round(float(ag.mean()), 6),
                         rows_below_0_8=int((ag < 0.8).sum()), logprob_max_abs_diff=float(d.max()),
                         logprob_mean_abs_diff=float(d.mean()), width=args.width, query_heads=H,
                         query_rows=int(sel.shape[0]), card=card, backend=backend, rollout=rollout,
                         seconds=round(seconds, 1)))
        print(rows[-1], flush=True)

    for T in args.seq:
        inp = make_inputs(T, dev, H)
        vis = visibility.Visibility.causal(T, device=dev)
        sel = query_rows(T, args.rows, dev)
        t0 = time.perf_counter()
        rolled = {}
        for name in args.rollout:
            t1 = time.perf_counter()
            rolled[name] = (*rollout_forward(inp, vis, sel, attention=name), time.perf_counter() - t1)
        for mode in ("bf16", "rollout_matched"):
            t1 = time.perf_counter()
            tidx, tlp = train_forward(inp, vis, mode, sel, backend)
            t_train = time.perf_counter() - t1
            for name, (ridx, rlp, t_roll) in rolled.items():
                row(mode, T, name, tidx, ridx, tlp, rlp, t_roll + t_train)
        if set(ROLLOUTS) <= set(rolled):
            (fidx, flp, tf), (midx, mlp, tm) = rolled["fp32"], rolled["flashmla"]
            row("two_rollouts", T, "flashmla vs fp32", midx, fidx, mlp, flp, tf + tm)
        print(f"T={T}: {time.perf_counter() - t0:.1f} s", flush=True)
    out = Path(args.out)
    if args.merge and out.exists():
        rows = merge_rows(json.loads(out.read_text()), rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{'card':12} {'backend':9} {'rollout':16} {'mode':16} {'width':5} {'T':>6} {'rows':>6} {'agree':>9} "
          f"{'rows<0.8':>8} {'lp max':>10} {'lp mean':>10}")
    for r in rows:
        print(f"{r['card'][-12:]:12} {r['backend']:9} {r.get('rollout', 'fp32'):16} {r['mode']:16} {r['width']:5} "
              f"{r['T']:6d} {r['query_rows']:6d} "
              f"{r['topk_member_agreement']:9.6f} {r['rows_below_0_8']:8d} "
              f"{r['logprob_max_abs_diff']:10.3e} {r['logprob_mean_abs_diff']:10.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
