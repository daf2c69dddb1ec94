"""Summarise the runs of ``benchmarks/multi_gpu.sh``: median tokens/s after warm-up, peak GiB per GPU, last loss,
bytes on the wire per step, one Markdown row per run (the single-GPU rows first, for the N x ratios)."""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from elbowroom.report.trace import comm_overlap, read_trace


def main(out: str, n: int) -> None:
    rows = []
    for run in sorted(p for p in Path(out).iterdir() if (p / "metrics.jsonl").is_file()):
        ms = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [m for m in ms if "tokens_per_s" in m]
        tail = steps[len(steps) // 3:] or steps  # after warm-up
        rows.append((run.name, statistics.median(m["tokens_per_s"] for m in tail) if tail else 0.0,
                     max((m.get("peak_memory_bytes") or 0) for m in steps) / 2**30 if steps else 0.0,
                     max((m.get("peak_reserved_bytes") or 0) for m in steps) / 2**30 if steps else 0.0,
                     steps[-1]["loss"] if steps else float("nan"),
                     steps[-1].get("comm_bytes_per_step") if steps else None))
    single = {name: tps for name, tps, *_ in rows if "single" in name}

    def of_ideal(name: str, tps: float) -> str:  # against N x the same shape on one GPU (of the same round)
        rnd = re.search(r"-r\d+$", name)  # multi_gpu.sh's SUFFIX=-rK: a round of the same runs
        suffix = rnd.group(0) if rnd else ""
        core = name[: len(name) - len(suffix)]
        key = ("7b-single" if core.startswith("7b") else
               "single-plain-1024" if core.startswith("ddp-hook") else
               "single-log10" if core.endswith("-log10") else
               "single-plain-acc4" if "-acc" in core and any(k.startswith("single-plain-acc4") for k in single) else
               "single-bf16" if core.endswith("-bf16") else
               # compiled on N GPUs against one GPU compiled; one GPU's compiled plan against eager plain (issue 13's
               # reference)
               ("single-bf16-compile" if "-bf16" in core else "single-compile")
               if core.endswith("-compile") and not core.startswith("single") else "single-plain")
        base = single.get(key + suffix) or single.get(key) or statistics.median(
            [v for k, v in single.items() if re.fullmatch(re.escape(key) + r"-r\d+", k)] or [0.0])
        return f"{tps / (base * (1 if 'single' in name else n)):.1%}" if base else ""

    print(f"| run | tokens/s | of {n} x one GPU | peak GiB/GPU (alloc / reserved) | last loss | "
          "bytes on the wire/step |")
    print("|---|---|---|---|---|---|")
    for name, tps, peak, reserved, loss, comm in rows:
        print(f"| {name} | {tps:,.0f} | {of_ideal(name, tps)} | {peak:.2f} / {reserved:.2f} | {loss:.4f} | "
              f"{f'{comm / 2**20:,.1f} MiB' if comm else ''} |")
    host_table(Path(out))
    plan_table(Path(out))
    traces = sorted(Path(out).glob("*/profile/trace.json"))
    if traces:
        print("\n| run | step | window ms | compute ms (busy) | NCCL ms | NCCL under compute |")
        print("|---|---|---|---|---|---|")
    for path in traces:
        ov = comm_overlap(read_trace(path))
        if ov is not None:
            busy = ov.compute_s / ov.window_s if ov.window_s > 0 else 0.0  # low: the GPU waits (for the host)
            print(f"| {path.parent.parent.name} | {ov.step} | {ov.window_s * 1e3:.1f} | "
                  f"{ov.compute_s * 1e3:.1f} ({busy:.0%}) | "
                  f"{ov.comm_s * 1e3:.1f} | {ov.hidden:.0%} |")


def _median(rows: list[dict], field: Callable[[dict], float | None]) -> str:
    """The median of ``field`` over ``rows`` where it is given, to the millisecond, or empty."""
    vals = [v for v in map(field, rows) if v is not None]
    return f"{statistics.median(vals):.3f}" if vals else ""


def host_table(out: Path) -> None:
    """The runs with a host optimizer: medians over the last two thirds of their steps of the host step's CPU time,
    the step's wait for it, the step thread's waits for gradient copies, and (``--offload.trace_steps``) the busy
    seconds of the timeline's main kinds of event."""
    kinds = ("step", "copied", "fwd_wait", "piece_wait")
    lines = []
    for run in sorted(p for p in out.iterdir() if (p / "metrics.jsonl").is_file()):
        ms = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [m for m in ms if "host_step_s" in m]
        tail = steps[len(steps) // 3:]
        if not tail:
            continue

        cells = [_median(tail, lambda m: m["host_step_s"]), _median(tail, lambda m: m["host_wait_s"]),
                 _median(tail, lambda m: m.get("host_copy_wait_s"))]
        cells += [_median(tail, lambda m, k=k: (m.get("host_trace") or {}).get(k, {}).get("busy_s")) for k in kinds]
        lines.append(f"| {run.name} | " + " | ".join(cells) + " |")
    if lines:
        print("\n| run | host step s | step waited s | copy waits s | busy: " + " | ".join(kinds) + " |")
        print("|---|---|---|---|" + "---|" * len(kinds))
        print("\n".join(lines))


def plan_table(out: Path) -> None:
    """The planned runs (``plan.json`` beside the metrics): the predicted peak without the allocator margin against
    the largest allocated, and with it against the largest reserved; the predicted step against the median step
    (seconds per step over the last two thirds of the logged rows, each row's time over the steps it covers)."""
    lines = []
    for run in sorted(p for p in out.iterdir() if (p / "plan.json").is_file() and (p / "metrics.jsonl").is_file()):
        plan = json.loads((run / "plan.json").read_text())
        ms = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [m for m in ms if "tokens_per_s" in m]
        if not steps:
            continue
        G = 2**30
        memory = plan.get("memory", {})
        margin = memory.get("allocator margin", 0)
        predicted = plan["predicted_peak_bytes"]
        alloc = max((m.get("peak_memory_bytes") or 0) for m in steps)
        reserved = max((m.get("peak_reserved_bytes") or 0) for m in steps)
        tail = steps[len(steps) // 3:] or steps
        prev = {id(m): (steps[i - 1]["step"] if i else 0) for i, m in enumerate(steps)}
        step_s = statistics.median(m["elapsed_s"] / max(1, m["step"] - prev[id(m)]) for m in tail if "elapsed_s" in m)
        bare, step_p = predicted - margin, plan["predicted_step_seconds"]
        lines.append(f"| {run.name} | {bare / G:.2f} / {alloc / G:.2f} ({bare / alloc:.2f}x) | {predicted / G:.2f} / "
                     f"{reserved / G:.2f} | {step_p:.3f} / {step_s:.3f} ({step_s / step_p:.2f}x) |")
    if lines:
        print("\n| planned run | predicted peak less margin / allocated GiB | predicted peak / reserved GiB | "
              "predicted / measured step s |")
        print("|---|---|---|---|")
        print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/multi-gpu", int(sys.argv[2]) if len(sys.argv) > 2 else 2)
