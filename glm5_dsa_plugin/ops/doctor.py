"""``python -m glm5_dsa_plugin doctor``: versions, GPU, backend choice, known-bad TileLang, self-check."""

from __future__ import annotations

import importlib
import importlib.metadata as md

import torch

__all__ = ["KNOWN_BAD_TILELANG", "PACKAGES", "versions", "self_check", "run"]

# TileLang releases whose aggressive shared-memory merge miscompiled the sparse-MLA backward
KNOWN_BAD_TILELANG = {"0.1.9": "aliases acc_dkv_shared with a live Q_shared: NaN dq/dkv from finite inputs",
                      "0.1.10": "aliases acc_dkv_shared with a live Q_shared: NaN dq/dkv from finite inputs"}
PACKAGES = ["torch", "tilelang", "megatron-core", "transformers", "megatron-bridge", "transformer-engine",
            "transformer_engine", "triton"]


def versions() -> dict[str, str | None]:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    out["cuda (torch build)"] = torch.version.cuda
    return out


def self_check(device: str = "cuda") -> tuple[bool, str]:
    """Short kernel-vs-reference check at a GLM-5 shape (H=16, topk 256, ragged padding)."""
    from . import sparse_mla

    gen = torch.Generator(device=device).manual_seed(0)
    T, T_kv, H = 128, 300, 16
    q = torch.randn(T, H, 576, generator=gen, device=device, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(T_kv, 1, 576, generator=gen, device=device, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.randint(-1, T_kv, (T, 1, 256), generator=gen, device=device, dtype=torch.int32)
    idx[5] = -1
    g = torch.randn(T, H, 512, generator=gen, device=device, dtype=torch.bfloat16)
    res = {}
    for be in ("tilelang", "reference"):
        qq = (q if be == "tilelang" else q.float()).detach().requires_grad_(True)
        kk = (kv if be == "tilelang" else kv.float()).detach().requires_grad_(True)
        out, _ = sparse_mla(qq, kk, idx, 256**-0.5, backend=be)
        out.backward(g.float() if be == "reference" else g)
        res[be] = (out.float(), qq.grad.float(), kk.grad.float())
    errs = [((a - b).norm() / b.norm()).item() for a, b in zip(res["tilelang"], res["reference"])]
    ok = all(e <= 3e-3 for e in errs) and all(torch.isfinite(a).all() for a in res["tilelang"])
    return ok, "rel L2 out/dq/dkv = " + ", ".join(f"{e:.1e}" for e in errs)


def run(print_fn=print) -> int:
    from . import explain_auto

    status = 0
    print_fn("glm5-dsa-plugin doctor")
    for k, v in versions().items():
        print_fn(f"  {k:22s} {v or 'not installed'}")
    tl = versions().get("tilelang")
    if tl in KNOWN_BAD_TILELANG:
        print_fn(f"  WARNING: tilelang {tl} is known to miscompile this kernel: {KNOWN_BAD_TILELANG[tl]}")
        status = 1
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        print_fn(f"  GPU                    {torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]})")
        device = torch.device("cuda")
    else:
        print_fn("  GPU                    none")
        device = torch.device("cpu")
    chosen, why = explain_auto(device)
    print_fn(f"  backend='auto' picks   {chosen} ({why})")
    try:
        importlib.import_module("transformer_engine")
        print_fn("  TransformerEngine      importable")
    except Exception as exc:  # noqa: BLE001
        print_fn(f"  TransformerEngine      not importable ({type(exc).__name__})")
    if chosen == "tilelang":
        ok, detail = self_check()
        print_fn(f"  self-check             {'PASS' if ok else 'FAIL'}: {detail}")
        status = status or (0 if ok else 1)
    else:
        print_fn("  self-check             skipped (no TileLang-capable GPU)")
    return status
