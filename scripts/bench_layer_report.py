"""Tables and charts of ``scripts/bench_layer.py``'s result JSON: the layer table (README), the
parts against their floors, the in-layer kernel split, the chart, and the merge of a run's rows into
an existing JSON."""

from __future__ import annotations

from kernel_events import KERNEL_GROUPS

IMPLS = ("ours", "ours_replay", "ours_rollout", "mcore_sparse", "mcore_dense", "ours_te", "mcore_te")


def _parts(row: dict) -> list[str]:
    """The breakdown's parts of a row with floors, in their recorded order (``total`` excluded)."""
    return [p for p in row["floor"] if p not in ("total", "floor_tflops")]


def breakdown_table(result: dict) -> str:
    """ours' parts: measured ms beside the floor ms (and their ratio), per (layer, T)."""
    lines = [f"{'layer':6} {'T':>6} {'part':16} {'ms':>9} {'floor ms':>9} {'x floor':>8} {'GFLOP':>10} {'GB':>8}"]
    for r in result["rows"]:
        if r["impl"] != "ours" or not r.get("breakdown") or not r.get("floor"):
            continue
        for part in _parts(r) + ["total"]:
            ms = r["fwd_bwd_ms"] if part == "total" else r["breakdown"].get(part)
            fl = r["floor"][part]
            ratio = "-" if ms is None or not fl["floor_ms"] else f"{ms / fl['floor_ms']:.2f}"
            lines.append(f"{r['layer']:6} {r['T']:>6} {part:16} {'-' if ms is None else f'{ms:.2f}':>9} "
                         f"{fl['floor_ms']:>9.2f} {ratio:>8} {fl['gflop']:>10.1f} {fl['gbyte']:>8.2f}")
    return "\n".join(lines)


def merge_rows(old: list[dict], new: list[dict], key=("layer", "T", "impl")) -> list[dict]:
    """``old`` rows whose key no ``new`` row has, then ``new``'s, in (layer, T, impl) order."""
    fresh = {tuple(r[k] for k in key) for r in new}
    order = {i: n for n, i in enumerate(IMPLS)}
    rows = [r for r in old if tuple(r[k] for k in key) not in fresh] + list(new)
    return sorted(rows, key=lambda r: (r.get("layer") != "dense", r.get("T", 0), order.get(r.get("impl"), len(order))))


def chart(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parted = [r for r in result["rows"] if r["impl"] == "ours" and r.get("breakdown") and r.get("floor")]
    fig, axes = plt.subplots(1, 3 if parted else 2, figsize=(17 if parted else 11, 4))
    if parted:
        breakdown_chart(axes[2], parted, result["gpu"])
    for ax, layer in zip(axes, ("dense", "moe")):
        rows = [r for r in result["rows"] if r["layer"] == layer]
        if not rows:  # a run of one layer kind
            ax.axis("off")
            continue
        Ts = sorted({r["T"] for r in rows})
        impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
        width = 0.8 / len(impls)
        failed = []  # (x, label, color) of rows without a time, marked at the axis' foot
        for i, impl in enumerate(impls):
            vals = [next((r["fwd_bwd_ms"] or 0.0 for r in rows if r["T"] == T and r["impl"] == impl), 0.0) for T in Ts]
            bars = ax.bar([j + i * width for j in range(len(Ts))], vals, width, label=impl)
            for b, T in zip(bars, Ts):
                r = next((r for r in rows if r["T"] == T and r["impl"] == impl), None)
                if r is not None and r["error"]:
                    failed.append((b.get_x() + width / 2, "OOM" if "OutOfMemory" in r["error"] else "not run"
                                   if r["error"].startswith("not run") else "err", b.get_facecolor()))
        ax.set_yscale("log")
        for x, label, color in failed:
            ax.text(x, ax.get_ylim()[0] * 1.15, label, ha="center", va="bottom", fontsize=7, rotation=90, color=color)
        ax.set_xticks([j + width * (len(impls) - 1) / 2 for j in range(len(Ts))], [f"T={T // 1024}K" for T in Ts])
        ax.set_ylabel("layer fwd+bwd ms (log)")
        ax.set_title(f"GLM-5 {layer} layer, {result['gpu']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def breakdown_chart(ax, rows: list[dict], gpu: str) -> None:
    """ours' parts as a share of each row's floor total: measured (left bar) beside the floor (right bar)."""
    parts = _parts(rows[0]) if rows else []
    colors = dict(zip(parts, ("tab:purple", "tab:red", "tab:blue", "tab:orange", "tab:gray")))
    labels = []
    for j, r in enumerate(rows):
        base = r["floor"]["total"]["floor_ms"]
        for off, key in ((-0.2, "ms"), (0.2, "floor")):
            bottom = 0.0
            for p in parts:
                v = (r["breakdown"].get(p) or 0.0) if key == "ms" else r["floor"][p]["floor_ms"]
                ax.bar(j + off, v / base, 0.38, bottom=bottom, color=colors[p], alpha=1.0 if key == "ms" else 0.45,
                       label=p if j == 0 and key == "ms" else None)
                bottom += v / base
        labels.append(f"{r['layer']} {r['T'] // 1024}K\n{r['fwd_bwd_ms'] / base:.2f}x floor")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("ms / floor ms (left: measured, right: floor)")
    ax.set_title(f"ours by part against its floor, {gpu}")
    ax.legend(fontsize=7)


def markdown_table(result: dict) -> str:
    """fwd+bwd ms and peak GiB per (layer, T) for each implementation, and ours' speed-up over
    megatron-core's layer on the same linears (local; TransformerEngine when TE rows exist)."""
    rows = result["rows"]
    te = any(r["impl"].endswith("_te") for r in rows)
    lines = ["| layer | T | ours fwd+bwd | peak | megatron-core, sparse loss | peak | ratio | megatron-core, dense loss | peak |"
             + (" ours on TE | peak | megatron-core on TE | peak | ratio |" if te else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|---|" if te else "")]
    keys = sorted({(r["layer"], r["T"]) for r in rows}, key=lambda k: (k[0] != "dense", k[1]))
    for layer, T in keys:
        by = {r["impl"]: r for r in rows if r["layer"] == layer and r["T"] == T}

        def cell(impl):
            r = by.get(impl)
            if r is None:
                return "-", "-"
            if r["error"]:
                kind = ("out of memory" if "OutOfMemory" in r["error"] else
                        "not run" if r["error"].startswith("not run") else "error")
                return kind, "-"
            return f"{r['fwd_bwd_ms']:.1f} ms", "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB"
        def ratio(ours, peer):
            if (by.get(ours) or {}).get("fwd_bwd_ms") and (by.get(peer) or {}).get("fwd_bwd_ms"):
                return f"{by[peer]['fwd_bwd_ms'] / by[ours]['fwd_bwd_ms']:.2f}x"
            return "-"
        o, s, d = cell("ours"), cell("mcore_sparse"), cell("mcore_dense")
        line = (f"| {layer} | {T // 1024}K | {o[0]} | {o[1]} | {s[0]} | {s[1]} | {ratio('ours', 'mcore_sparse')} "
                f"| {d[0]} | {d[1]} |")
        if te:
            ot, mt = cell("ours_te"), cell("mcore_te")
            line += f" {ot[0]} | {ot[1]} | {mt[0]} | {mt[1]} | {ratio('ours_te', 'mcore_te')} |"
        lines.append(line)
    return "\n".join(lines)


def kernels_table(result: dict) -> str:
    """ours' in-layer kernel time per group (ms per fwd + bwd step), one column per (layer, T)."""
    rows = [r for r in result["rows"] if r["impl"] == "ours" and r.get("kernels")]
    if not rows:
        return ""
    groups = [g for g, _, _ in KERNEL_GROUPS] + ["glue", "busy", "span"]
    lines = [f"{'kernels':20} " + " ".join(f"{r['layer'] + ' ' + str(r['T'] // 1024) + 'K':>11}" for r in rows)]
    for g in groups:
        lines.append(f"{g:20} " + " ".join(f"{r['kernels'].get(g, 0.0):>11.2f}" for r in rows))
    return "\n".join(lines)
