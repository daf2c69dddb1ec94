"""The report's pictures (matplotlib, imported here only, inside the functions: importing the report never does).

Each function draws one PNG and returns its path, or None when there is nothing to draw (no empty panels).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elbowroom.report.categories import CATEGORIES, CATEGORY_LABELS
from elbowroom.report.rundir import RunData, block_measurements, step_samples
from elbowroom.report.trace import LinkTimeline

__all__ = ["draw_memory", "draw_plan", "draw_link", "draw_metrics", "byte_unit"]

COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer_state": "#55a868",
    "master_weights": "#8172b3",
    "activations_kept": "#c44e52",
    "activations_in_flight": "#f2a3a5",
    "offload_pool": "#937860",
    "other": "#c8c8c8",
}
PHASE_COLORS = {"forward": "#e8f0fb", "backward": "#fbeee6", "optimizer": "#eaf5ea"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def byte_unit(max_bytes: float) -> tuple[float, str]:
    """A divisor and name that show ``max_bytes`` as a number between 1 and 1024."""
    for div, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= div:
            return float(div), name
    return 1.0, "B"


def _phase_spans(samples: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """Contiguous runs of forward / backward (recompute included) / optimizer, as (phase, t0, t1) in ms."""
    spans: list[tuple[str, float, float]] = []
    for a, b in zip(samples, samples[1:]):
        # the interval between two samples belongs to the phase of the sample that ends it, except that an
        # interval ending at a step's "end" sample belongs to the phase that was running
        phase = b["phase"] if b["phase"] != "step" else a["phase"]
        phase = "backward" if phase == "recompute" else phase
        if phase not in PHASE_COLORS:
            continue
        t0, t1 = a["t"] * 1e3, b["t"] * 1e3
        if spans and spans[-1][0] == phase and abs(spans[-1][2] - t0) < 1e-9:
            spans[-1] = (phase, spans[-1][1], t1)
        else:
            spans.append((phase, t0, t1))
    return spans


def _mark_phases(ax: Any, spans: list[tuple[str, float, float]], label: bool) -> None:
    for phase, t0, t1 in spans:
        ax.axvspan(t0, t1, color=PHASE_COLORS[phase], zorder=0, lw=0)
        if label:
            ax.text(
                (t0 + t1) / 2,
                0.985,
                phase,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="top",
                fontsize=9,
                color="#444444",
                zorder=7,
            )


def _hline(ax: Any, y: float, div: float, unit: str, text: str, style: str, color: str, below: bool = False) -> None:
    ax.axhline(y / div, ls=style, color=color, lw=1.2, zorder=5)
    ax.annotate(
        f"{text} {y / div:.3g} {unit}",
        xy=(1.0, y / div),
        xycoords=("axes fraction", "data"),
        xytext=(-4, -2 if below else 2),
        textcoords="offset points",
        ha="right",
        va="top" if below else "bottom",
        fontsize=8,
        color=color,
        zorder=6,
    )


def draw_memory(data: RunData, path: Path) -> Path | None:
    """A stacked timeline of one recorded step by category, phases shaded, peaks and budget as lines.

    On CUDA: one panel of device bytes (``memory_allocated``), and a second of host bytes (pinned offload pool,
    host optimizer) when there are any. On a CPU: tensor bytes by category, then the process RSS beside the
    tensor total (the RSS is mostly interpreter and libraries, which would flatten a stacked picture).

    Args:
        data: the parsed run.
        path: the PNG to write.

    Returns:
        ``path``, or None without recorded samples.
    """
    samples = step_samples(data)
    if len(samples) < 2:
        return None
    plt = _pyplot()
    cuda = data.device == "cuda"
    step_row = next(r for r in data.steps if r["step"] == data.shown_step)
    t = [s["t"] * 1e3 for s in samples]
    shown = [c for c in CATEGORIES if (cuda or c != "other") and any(s["bytes"].get(c, 0) for s in samples)]
    host_keys = sorted({k for s in samples for k in (s.get("host_bytes") or {})})
    plan = data.plan or {}
    panels = 1 + (1 if (not cuda or host_keys) else 0)
    fig, axes = plt.subplots(panels, 1, figsize=(13, 4.2 * panels), sharex=True, squeeze=False)
    ax = axes[0][0]
    top = max(
        max(s["total_bytes"] if cuda else sum(s["bytes"].get(c, 0) for c in shown) for s in samples),
        step_row.get("peak_bytes", 0) if cuda else 0,
        plan.get("predicted_peak_bytes") or 0,
        plan.get("budget_bytes") or 0,
    )
    div, unit = byte_unit(top)
    spans = _phase_spans(samples)
    _mark_phases(ax, spans, label=True)
    ys = [[s["bytes"].get(c, 0) / div for s in samples] for c in shown]
    ax.stackplot(
        t, ys, labels=[CATEGORY_LABELS[c] for c in shown], colors=[COLORS[c] for c in shown], alpha=0.9, zorder=2
    )
    if cuda:
        peak = step_row.get("peak_bytes")
        if peak:
            _hline(ax, peak, div, unit, "measured peak (allocator, run so far)", ":", "black")
    else:
        i = max(range(len(samples)), key=lambda k: sum(samples[k]["bytes"].get(c, 0) for c in shown))
        ax.plot([t[i]], [sum(samples[i]["bytes"].get(c, 0) for c in shown) / div], "kv", zorder=6)
        peak_y = sum(ys[k][i] for k in range(len(shown)))
        ax.annotate(
            f"measured peak {peak_y:.3g} {unit}",
            xy=(t[i], peak_y),
            xytext=(6, -2),
            textcoords="offset points",
            ha="left",
            va="top",
            fontsize=8,
            zorder=6,
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8},
        )
    if plan.get("predicted_peak_bytes"):
        # a prediction just under the budget writes its label below its line, not over the budget's
        close = plan.get("budget_bytes") and plan["budget_bytes"] - plan["predicted_peak_bytes"] < 0.05 * plan[
            "budget_bytes"]
        _hline(ax, plan["predicted_peak_bytes"], div, unit, "predicted peak", "--", "#1f5fbf", below=bool(close))
    if plan.get("budget_bytes"):
        _hline(ax, plan["budget_bytes"], div, unit, "budget", "-", "#b00020")
    # where each block's forward and backward begin: ticks on the top edge, labelled with the block index
    starts = [(s["t"] * 1e3, s["block"]) for s in samples if s.get("block") is not None and s["event"] == "begin"]
    if starts:
        gap = 0.02 * (t[-1] - t[0] or 1.0)  # a label closer than this to the previous one would overlap it
        labels, last = [], None
        for x, b in starts:
            keep = last is None or x - last > gap
            labels.append(str(b) if keep else "")
            last = x if keep else last
        top_ax = ax.secondary_xaxis("top")
        top_ax.set_xticks([x for x, _ in starts], labels=labels)
        top_ax.tick_params(labelsize=6, length=3, pad=1, colors="#666666")
        top_ax.set_xlabel("block (each forward and backward begin)", fontsize=7, color="#666666", labelpad=2)
    where = "device memory (torch.cuda.memory_allocated)" if cuda else "tensor memory of the process"
    ax.set_title(f"Step {data.shown_step}: {where} by category", pad=16)
    ax.set_ylabel(unit)
    ax.set_ylim(0, top / div * 1.12)
    # legends beside the panels: inside they would hide the forward ramp
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    if panels > 1:
        ax2 = axes[1][0]
        _mark_phases(ax2, spans, label=False)
        if cuda:
            hy = [[(s.get("host_bytes") or {}).get(k, 0) for s in samples] for k in host_keys]
            hdiv, hunit = byte_unit(max(sum(col) for col in zip(*hy)))
            names = {"offload_pool": "activation offload pool (pinned)", "optimizer": "optimizer on the host"}
            ax2.stackplot(
                t,
                [[v / hdiv for v in row] for row in hy],
                labels=[names.get(k, k) for k in host_keys],
                colors=["#937860", "#55a868", "#aaaaaa"][: len(host_keys)],
                alpha=0.9,
                zorder=2,
            )
            ax2.set_title("Host memory outside the device total")
            ax2.set_ylabel(hunit)
        else:
            rss = [s["total_bytes"] for s in samples]
            tensors = [sum(s["bytes"].get(c, 0) for c in shown) for s in samples]
            rdiv, runit = byte_unit(max(rss))
            ax2.plot(t, [v / rdiv for v in rss], color="black", lw=1.5, label="process RSS (total)", zorder=3)
            ax2.fill_between(
                t,
                0,
                [v / rdiv for v in tensors],
                color=COLORS["activations_kept"],
                alpha=0.5,
                label="tensors (top panel)",
                zorder=2,
            )
            ax2.fill_between(
                t,
                [v / rdiv for v in tensors],
                [v / rdiv for v in rss],
                color=COLORS["other"],
                alpha=0.6,
                label="other (interpreter, libraries, allocator)",
                zorder=2,
            )
            ax2.set_title("Process resident memory (RSS) over the same step")
            ax2.set_ylabel(runit)
            ax2.set_ylim(0, max(rss) / rdiv * 1.1)
        ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        ax2.grid(axis="y", alpha=0.3)
    axes[-1][0].set_xlabel("milliseconds since the step began (host clock)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plan_rows(plan: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for i, b in enumerate(plan.get("blocks") or []):
        rows.append({**b, "index": b.get("index", i)})
    return rows


def draw_plan(data: RunData, path: Path) -> Path | None:
    """Per block: bytes kept / offloaded / recomputed, and seconds, predicted beside measured.

    Args:
        data: the parsed run (needs a plan with ``blocks``).
        path: the PNG to write.

    Returns:
        ``path``, or None without a plan or without block rows.
    """
    if not data.plan:
        return None
    rows = _plan_rows(data.plan)
    if not rows:
        return None
    plt = _pyplot()
    measured = block_measurements(step_samples(data)) if data.samples else {}
    idx = [r["index"] for r in rows]
    fig, (axb, axt) = plt.subplots(1, 2, figsize=(13, 5.4))
    width = 0.38 if measured else 0.7
    left = [i - width / 2 if measured else i for i in idx]
    kinds = [
        ("kept_bytes", "kept (predicted)", "#c44e52"),
        ("offloaded_bytes", "offloaded (predicted)", "#937860"),
        ("recomputed_bytes", "recomputed (predicted)", "#dddddd"),
    ]
    top = max(
        [sum(float(r.get(k, 0) or 0) for k, _, _ in kinds) for r in rows]
        + [m.get("kept_bytes", 0) for m in measured.values()]
        + [1]
    )
    div, unit = byte_unit(top)
    bottom = [0.0] * len(rows)
    for key, label, color in kinds:
        vals = [float(r.get(key, 0) or 0) / div for r in rows]
        if any(vals):
            axb.bar(
                left,
                vals,
                width,
                bottom=bottom,
                label=label,
                color=color,
                edgecolor="#999999" if key == "recomputed_bytes" else None,
                hatch="//" if key == "recomputed_bytes" else None,
            )
            bottom = [a + b for a, b in zip(bottom, vals)]
    if measured:
        mk = [max(0.0, measured.get(i, {}).get("kept_bytes", 0)) / div for i in idx]
        axb.bar(
            [i + width / 2 for i in idx],
            mk,
            width,
            label="on the device after its forward (measured: kept + in flight)",
            color="#7a1f22",
        )
    axb.set_title("Activation bytes per block: kept, offloaded, recomputed")
    axb.set_xlabel("block")
    axb.set_ylabel(unit)
    axb.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    axb.grid(axis="y", alpha=0.3)

    pred = [float(r.get("forward_s", 0) or 0) + float(r.get("backward_s", 0) or 0) for r in rows]
    extra = [float(r.get("extra_s", 0) or 0) for r in rows]
    have_pred = any(pred) or any(extra)
    if have_pred:
        axt.bar(left, [p * 1e3 for p in pred], width, color="#4c72b0", label="forward + backward (predicted)")
        axt.bar(
            left,
            [e * 1e3 for e in extra],
            width,
            bottom=[p * 1e3 if e >= 0 else p * 1e3 for p, e in zip(pred, extra)],
            color="#dd8452",
            label="recompute / transfer time spent (+) or saved (-), predicted",
        )
    if measured:
        mt = [(measured.get(i, {}).get("forward_s", 0) + measured.get(i, {}).get("backward_s", 0)) * 1e3 for i in idx]
        axt.bar(
            [i + width / 2 if have_pred else i for i in idx],
            mt,
            width,
            color="#23395d",
            label="forward + backward, recompute included (measured)",
        )
    axt.axhline(0, color="black", lw=0.8)
    axt.set_title("Time per block, predicted beside measured (host clock)")
    axt.set_xlabel("block")
    axt.set_ylabel("milliseconds")
    axt.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1, frameon=False)
    axt.grid(axis="y", alpha=0.3)
    for ax in (axb, axt):
        ax.set_xticks(idx)
        policies = [str(r.get("policy", "")) for r in rows]
        if any(policies) and len(idx) <= 32:
            ax.set_xticklabels([f"{i}\n{p}" for i, p in zip(idx, policies)], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_link(tl: LinkTimeline, plan: dict[str, Any] | None, path: Path) -> Path:
    """Host-device traffic each way against the link's limit, and the compute stream busy or waiting.

    Args:
        tl: the binned step (:func:`elbowroom.report.trace.link_timeline`).
        plan: the plan (its ``h2d_bandwidth``/``d2h_bandwidth`` are the limits), or None: the fastest copy seen.
        path: the PNG to write.

    Returns:
        ``path``.
    """
    plt = _pyplot()
    fig, (ax, axc) = plt.subplots(2, 1, figsize=(13, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ms = [e * 1e3 for e in tl.edges_s]
    ax.stairs(
        [v / 1e9 for v in tl.h2d_bytes_per_s],
        ms,
        color="#1f77b4",
        lw=1.4,
        label=f"host to device ({tl.h2d_bytes / 2**30:.2f} GiB in the step)",
    )
    ax.stairs(
        [v / 1e9 for v in tl.d2h_bytes_per_s],
        ms,
        color="#d62728",
        lw=1.4,
        label=f"device to host ({tl.d2h_bytes / 2**30:.2f} GiB in the step)",
    )
    plan = plan or {}
    h2d, d2h, duplex = (plan.get(k) for k in ("h2d_bandwidth", "d2h_bandwidth", "duplex_bandwidth"))

    def rate(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0

    if rate(h2d) and rate(d2h) and h2d == d2h:
        ax.axhline(
            h2d / 1e9, ls="--", color="black", lw=1, label=f"link limit each way alone (plan): {h2d / 1e9:.0f} GB/s"
        )
    else:
        for value, color, way in ((h2d, "#1f77b4", "host to device"), (d2h, "#d62728", "device to host")):
            if rate(value):
                ax.axhline(value / 1e9, ls="--", color=color, lw=1,
                           label=f"link limit, {way} (plan): {value / 1e9:.0f} GB/s")
    if rate(duplex):
        ax.axhline(
            duplex / 1e9, ls=":", color="black", lw=1, label=f"each way, both at once (plan): {duplex / 1e9:.0f} GB/s"
        )
    if not (rate(h2d) or rate(d2h)) and tl.best_copy_bytes_per_s:
        ax.axhline(
            tl.best_copy_bytes_per_s / 1e9,
            ls="--",
            color="black",
            lw=1,
            label=f"fastest single copy seen: {tl.best_copy_bytes_per_s / 1e9:.0f} GB/s (the plan gives no limit)",
        )
    ax.set_ylabel("GB/s")
    title = f"Step {tl.step}: " if tl.step is not None else ""
    ax.set_title(title + "host-device copies (profiler memcpy events), each way")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    busy = [b * 100 for b in tl.compute_busy]
    axc.stairs(busy, ms, fill=True, color="#55a868", alpha=0.8, label="busy (kernels running)")
    axc.stairs([100.0] * len(busy), ms, baseline=busy, fill=True, color="#f2c4c4", label="waiting (no kernel)")
    axc.set_ylim(0, 100)
    axc.set_ylabel("% of time")
    axc.set_title("Compute stream: busy or waiting")
    axc.set_xlabel("milliseconds since the step began")
    axc.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_metrics(data: RunData, path: Path) -> Path | None:
    """Loss (and validation loss), tokens/s and peak memory over the run's steps, one panel each that has data.

    Args:
        data: the parsed run.
        path: the PNG to write.

    Returns:
        ``path``, or None when no row has any of them.
    """

    def series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
        pts = [
            (r["step"], r[key])
            for r in rows
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
        ]
        return [p[0] for p in pts], [p[1] for p in pts]

    panels = []
    if series(data.metrics, "loss")[0]:
        panels.append("loss")
    if series(data.metrics, "tokens_per_s")[0]:
        panels.append("tokens_per_s")
    if series(data.metrics, "peak_memory_bytes")[0]:
        panels.append("peak_memory_bytes")
    if not panels:
        return None
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
    for ax, key in zip(axes[0], panels):
        x, y = series(data.metrics, key)
        if key == "loss":
            ax.plot(x, y, marker="." if len(x) < 50 else None, label="train loss")
            vx, vy = series(data.val, "val_loss")
            if vx:
                ax.plot(vx, vy, "o-", label="validation loss")
            ax.set_title("Loss")
            ax.legend(fontsize=8)
        elif key == "tokens_per_s":
            ax.plot(x, y, marker="." if len(x) < 50 else None, color="#55a868")
            ax.set_title("Throughput (tokens/s)")
        else:
            div, unit = byte_unit(max(y))
            ax.plot(
                x, [v / div for v in y], marker="." if len(x) < 50 else None, color="#8172b3", label="peak_memory_bytes"
            )
            if data.plan and data.plan.get("budget_bytes"):
                ax.axhline(data.plan["budget_bytes"] / div, color="#b00020", ls="--", lw=1, label="budget (plan)")
            if data.plan and data.plan.get("predicted_peak_bytes"):
                ax.axhline(
                    data.plan["predicted_peak_bytes"] / div,
                    color="#1f5fbf",
                    ls=":",
                    lw=1,
                    label="predicted peak (plan)",
                )
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=8)
            ax.set_title(f"Peak memory per logged step ({unit})")
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
