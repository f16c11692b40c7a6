"""Train / rollout numerics gap of one DSA attention layer, bf16 training vs rollout-matched training.

The "rollout" forward follows the published inference definitions in inference order: indexer
scores in FP8 (Hadamard, e4m3 with UE8M0 scales, ``fp8_index``), top-k, the latent kv read back from
FlashMLA's FP8 cache (656 bytes per token), sparse attention over the gathered keys in fp32 with a bf16
output, bf16 value up-projection. The training forward is ours: ``GLM5DSAIndexer``'s top-k (``bf16``: the bf16 / fp32
scores; ``rollout_matched``: ``dsa_indexer_precision="fp8"`` and ``dsa_kv_fp8_qat``) and
``sparse_mla`` (the TileLang kernel on a GPU). A fixed random readout turns each layer output into
log-probabilities of random tokens over a 4096-word vocabulary, the quantity an RL loss compares.

Layer: GLM-5.2's attention geometry (latent 512 + 64, indexer 32 heads x 128, top-k 2048) with 16
query heads (the ``tiny`` scale of the width, GLM-5.2's shapes). Rows: {mode, T,
topk_member_agreement, rows_below_0_8, logprob_max_abs_diff, logprob_mean_abs_diff}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from glm5_dsa_plugin.model import indexer as ix
from glm5_dsa_plugin.model.value_projection import value_up_projection
from glm5_dsa_plugin.ops import fp8_kv, sparse_mla
from glm5_dsa_plugin.ops.indexer import fp8_index

H, HI, DI, LAT, ROPE, DV, TOPK, VOCAB = 16, 32, 128, 512, 64, 256, 2048, 4096
SM_SCALE = (192 + 64) ** -0.5


def make_inputs(T: int, device, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    bf = dict(device=device, dtype=torch.bfloat16)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=device) * scale).to(torch.bfloat16)  # noqa: E731
    return dict(q=r(T, H, LAT + ROPE), kv=r(T, 1, LAT + ROPE), qi=r(T, HI, DI), ki=r(T, DI),
                wi=(torch.randn(T, HI, generator=g, device=device) * HI ** -0.5), up_v=r(H, DV, LAT, scale=LAT ** -0.5),
                readout=r(H * DV, VOCAB, scale=(H * DV) ** -0.5),
                tokens=torch.randint(0, VOCAB, (T,), generator=g, device=device), _bf=bf)


def logprobs(y: torch.Tensor, inp: dict) -> torch.Tensor:
    """y [T, H, DV] -> log p(token_t) [T] fp32 through the fixed readout."""
    logits = y.reshape(y.shape[0], -1).float() @ inp["readout"].float()
    return torch.log_softmax(logits, -1).gather(1, inp["tokens"][:, None])[:, 0]


def rollout_forward(inp: dict, vis: ix.Visibility, chunk: int = 256):
    """Inference order: FP8 index -> top-k -> FP8 cache read -> sparse attention (fp32, output rounded to
    bf16) -> bf16 value up-projection."""
    T = inp["q"].shape[0]
    idx = fp8_index.fp8_select_topk(inp["qi"], inp["ki"], inp["wi"], TOPK, vis.mask)
    cache = fp8_kv.pack(inp["kv"][:, 0])  # [T, 656] uint8, what the engine stores
    kv = fp8_kv.unpack(cache).float()  # [T, 576]
    out = torch.empty(T, H, LAT, device=kv.device)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        sel = idx[t0:t1]
        kvs = kv[sel.clamp(min=0).long()]  # [c, K, 576]
        s = torch.einsum("chd,ckd->chk", inp["q"][t0:t1].float(), kvs) * SM_SCALE
        s = s.masked_fill((sel < 0)[:, None, :], float("-inf"))
        out[t0:t1] = torch.einsum("chk,ckd->chd", torch.softmax(s, -1), kvs[..., :LAT])
    # the engine's attention kernel returns bf16; the value up-projection runs on bf16 operands
    y = torch.einsum("thc,hdc->thd", out.to(torch.bfloat16), inp["up_v"])
    return idx, logprobs(y, inp)


def train_forward(inp: dict, vis: ix.Visibility, mode: str):
    with torch.no_grad():
        if mode == "rollout_matched":
            idx = fp8_index.fp8_select_topk(inp["qi"], inp["ki"], inp["wi"], TOPK, vis.mask)
            kv = fp8_kv.fake_quant_kv(inp["kv"])
        else:
            idx = ix.select_topk(inp["qi"], inp["ki"], inp["wi"], TOPK, vis, check=False)
            kv = inp["kv"]
        o, _ = sparse_mla(inp["q"], kv, idx[:, None, :].contiguous(), SM_SCALE, d_v=LAT)
        y = value_up_projection(o, inp["up_v"].to(o.dtype))
    return idx, logprobs(y, inp)


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--out", default="benchmarks/results/rollout_alignment.json")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for T in args.seq:
        inp = make_inputs(T, dev)
        vis = ix.Visibility.causal(T, device=dev)
        t0 = time.perf_counter()
        ridx, rlp = rollout_forward(inp, vis)
        for mode in ("bf16", "rollout_matched"):
            tidx, tlp = train_forward(inp, vis, mode)
            ag = agreement(tidx, ridx)
            d = (tlp - rlp).abs()
            rows.append(dict(mode=mode, T=T, topk_member_agreement=round(float(ag.mean()), 6),
                             rows_below_0_8=int((ag < 0.8).sum()), logprob_max_abs_diff=float(d.max()),
                             logprob_mean_abs_diff=float(d.mean()),
                             card=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"))
            print(rows[-1], flush=True)
        print(f"T={T}: {time.perf_counter() - t0:.1f} s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{'mode':16} {'T':>6} {'agree':>9} {'rows<0.8':>8} {'lp max':>10} {'lp mean':>10}")
    for r in rows:
        print(f"{r['mode']:16} {r['T']:6d} {r['topk_member_agreement']:9.6f} {r['rows_below_0_8']:8d} "
              f"{r['logprob_max_abs_diff']:10.3e} {r['logprob_mean_abs_diff']:10.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
