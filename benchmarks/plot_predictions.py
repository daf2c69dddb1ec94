"""The planner's predictions against their measurements, as a picture: one point per planned bench row.

    python3 benchmarks/plot_predictions.py OUT.png rows.jsonl [more.jsonl ...] [--title TEXT]

Reads the rows ``bench.py --json`` writes for ``fit@``/``fit_bf16@``/``plan@`` modes (``pred_step_s`` and
``pred_peak_GiB`` beside ``step_s`` and ``reserved_peak_GiB``). Left: measured step against predicted; right:
measured reserved peak against predicted. The diagonal is a perfect prediction, the band the issue's tolerance
(15% on the step, 10% on the peak). Prints the table the picture shows, and how many points lie in each band.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

STEP_TOL, PEAK_TOL = 0.15, 0.10


def planned_rows(paths: list[str]) -> list[dict]:
    """The rows with a prediction, in file order."""
    rows = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if "pred_step_s" in row and "pred_peak_GiB" in row and "step_s" in row:  # not one that failed
                    rows.append(row)
    return rows


def within(measured: float, predicted: float, tol: float) -> bool:
    return abs(measured / predicted - 1.0) <= tol


def plot(rows: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    panels = (("step_s", "pred_step_s", "step (s)", STEP_TOL), ("reserved_peak_GiB", "pred_peak_GiB",
                                                                  "reserved peak (GiB)", PEAK_TOL))
    workloads = sorted({r["workload"] for r in rows})
    markers = dict(zip(workloads, "osD^vP*X"))
    for ax, (got, want, label, tol) in zip(axes, panels):
        lo = min(min(r[got], r[want]) for r in rows) / 1.3
        top = max(max(r[got], r[want]) for r in rows) * 1.3
        ax.set_xscale("log")  # steps of 0.2-2 s and peaks of 8-80 GiB side by side
        ax.set_yscale("log")
        ax.plot([lo, top], [lo, top], color="black", lw=1)
        ax.fill_between([lo, top], [lo * (1 - tol), top * (1 - tol)], [lo * (1 + tol), top * (1 + tol)],
                        color="0.85", label=f"within {tol:.0%}")
        for w in workloads:
            pts = [r for r in rows if r["workload"] == w]
            ax.scatter([r[want] for r in pts], [r[got] for r in pts], marker=markers[w], label=w, zorder=3)
        ax.set_xlim(lo, top)
        ax.set_ylim(lo, top)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            axis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel(f"predicted {label}")
        ax.set_ylabel(f"measured {label}")
        inside = sum(within(r[got], r[want], tol) for r in rows)
        ax.set_title(f"{label}: {inside} of {len(rows)} within {tol:.0%}")
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the picture to write (PNG)")
    ap.add_argument("rows", nargs="+", help="bench.py --json files")
    ap.add_argument("--title", default="elbowroom's plans: predicted against measured")
    args = ap.parse_args()
    rows = planned_rows(args.rows)
    if not rows:
        raise SystemExit("no planned rows (pred_step_s, pred_peak_GiB) in " + ", ".join(args.rows))
    print("| workload | mode | step s / predicted | reserved GiB / predicted |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['mode']} | {r['step_s']:.3f} / {r['pred_step_s']:.3f} "
              f"({r['step_s'] / r['pred_step_s']:.2f}) | {r['reserved_peak_GiB']:.2f} / {r['pred_peak_GiB']:.2f} "
              f"({r['reserved_peak_GiB'] / r['pred_peak_GiB']:.2f}) |")
    plot(rows, Path(args.out), args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
