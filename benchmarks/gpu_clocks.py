"""Each run's GPU SM clock, power and utilisation, from ``nvidia-smi --query-gpu=timestamp,index,clocks.sm,
power.draw,utilization.gpu --format=csv,noheader,nounits -lms 250`` sampled while ``benchmarks/multi_gpu.sh`` ran
and its ``times.txt`` (name, processes, start and end in epoch seconds). Over the samples of each run where its GPUs
(the first ``processes`` of them) were busy (utilisation >= 90%: the training steps, not start-up), the median and
the 10th percentile of the SM clock and the median power: one Markdown row.

    python3 benchmarks/gpu_clocks.py WORK/clocks.csv WORK/times.txt
"""

from __future__ import annotations

import datetime
import statistics
import sys


def read_samples(path: str) -> list[tuple[float, int, float, float, float]]:
    """(epoch seconds, GPU index, SM MHz, watts, utilisation %) per line; lines that do not parse are skipped."""
    samples = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((t, int(parts[1]), float(parts[2]), float(parts[3]), float(parts[4])))
        except ValueError:
            continue
    return samples


def main(clocks: str, times: str) -> None:
    samples = read_samples(clocks)
    print("| run | GPUs | SM MHz (median) | SM MHz (10th percentile) | power W (median) | busy samples |")
    print("|---|---|---|---|---|---|")
    for line in open(times):
        name, nproc, start, end = line.split()
        n, t0, t1 = int(nproc), float(start), float(end)
        busy = [s for s in samples if t0 <= s[0] <= t1 and s[1] < n and s[4] >= 90]
        if not busy:
            print(f"| {name} | {n} | | | | 0 |")
            continue
        mhz = sorted(s[2] for s in busy)
        watts = statistics.median(s[3] for s in busy)
        p10 = mhz[len(mhz) // 10]
        print(f"| {name} | {n} | {statistics.median(mhz):.0f} | {p10:.0f} | {watts:.0f} | {len(busy)} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
