"""Replay a guard dump: rerun the recorded outputs / the kernel and the reference, compare row-wise."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import backends, reference
from .contract import problem_of

__all__ = ["Comparison", "compare", "replay"]


@dataclass
class Comparison:
    name: str
    nonfinite_rows: int
    total_rows: int
    max_abs: float
    max_rel: float
    ok: bool

    def line(self) -> str:
        return (f"{self.name:28s} nonfinite rows {self.nonfinite_rows:6d}/{self.total_rows:<6d} "
                f"max|diff| {self.max_abs:.3e}  max rel {self.max_rel:.3e}  {'OK' if self.ok else 'DISAGREE'}")


def compare(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> Comparison:
    """Rows are the first two dims ([B, T, ...]); diffs over the entries finite in both."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    bad_rows = ~torch.isfinite(got).flatten(2).all(-1)
    both = torch.isfinite(got) & torch.isfinite(want)
    diff = (got - want).abs()[both]
    scale = want.abs()[both].max().item() if both.any() else 0.0
    max_abs = diff.max().item() if diff.numel() else 0.0
    max_rel = max_abs / scale if scale > 0 else 0.0
    n_bad = int(bad_rows.sum())
    return Comparison(name, n_bad, bad_rows.numel(), max_abs, max_rel, n_bad == 0 and max_rel <= rtol)


def replay(dump: dict, device: str | None = None, rtol: float | None = None) -> list[Comparison]:
    """Compare the dump's recorded outputs, and a rerun of its backend where it is available here,
    with the fp32/fp64 reference on the same inputs."""
    inp = dump["inputs"]
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    q, kv, idx = inp["q"].to(dev), inp["kv"].to(dev), inp["indices"].to(dev)
    sm_scale, d_v = inp["sm_scale"], inp["d_v"]
    grad_out = inp.get("grad_out")
    if rtol is None:
        rtol = 1e-2 if q.dtype in (torch.bfloat16, torch.float16) else 1e-5
    up = (lambda t: t.double()) if q.dtype == torch.float64 else (lambda t: t.float())
    r_out, r_lse = reference.forward(up(q), up(kv), idx, sm_scale, d_v)
    want = {"out": r_out, "lse": r_lse}
    if grad_out is not None:
        want["dq"], want["dkv"] = reference.backward(up(q), up(kv), idx, up(grad_out.to(dev)), sm_scale, d_v)

    results = []
    for name, t in dump.get("bad_outputs", {}).items():
        if name in want:
            results.append(compare(f"recorded {name}", t, want[name], rtol))
    name = dump.get("backend")
    if name and name in backends.registered_backends() and name != "reference":
        be = backends.get_backend(name)
        ok, why = be.available()
        if ok and (dev.type == "cuda" or name != "tilelang"):
            prob = problem_of(q, kv, idx, sm_scale, d_v)
            out, lse = be.forward(q, kv, idx, prob)
            results += [compare(f"rerun {name} out", out, r_out, rtol), compare(f"rerun {name} lse", lse, r_lse, rtol)]
            if grad_out is not None:
                dq, dkv = be.backward(q, kv, idx, out, lse, grad_out.to(dev), prob)
                results += [compare(f"rerun {name} dq", dq, want["dq"], rtol),
                            compare(f"rerun {name} dkv", dkv, want["dkv"], rtol)]
        else:
            print(f"backend {name!r} not rerun here: {why if not ok else 'needs CUDA'}")
    return results
