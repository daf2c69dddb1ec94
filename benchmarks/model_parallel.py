"""Expected efficiency of tensor and pipeline parallel on a workload, by arithmetic (no device needed).

    python benchmarks/model_parallel.py --workload w1

Prints the pipeline bubble for a few degrees and micro-batch counts, and tensor parallel's bytes per rank per
block per step (bf16 activations), with the time they take at a stated link bandwidth. Measured multi-GPU speed
belongs in BENCHMARKS.md once it is measured; these are the numbers it should be compared with.
"""

from __future__ import annotations

import argparse

from elbowroom.distributed.pipeline import bubble_fraction
from elbowroom.distributed.tensor_parallel import tp_bytes_per_block
from elbowroom.models import PRESETS
from elbowroom.models.workloads import WORKLOADS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="w1", choices=sorted(WORKLOADS))
    ap.add_argument("--link-gb-s", type=float, default=200.0,
                    help="per-rank bandwidth the collectives reach (GB/s); NVLink on H100 reaches ~200-350")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    cfg = PRESETS[w.preset]
    tokens = w.tokens_per_step
    print(f"{args.workload}: {w.preset}, dim {cfg.dim}, {cfg.n_layers} blocks, {w.batch_size} x {w.seq_len} tokens "
          f"x {w.gradient_accumulation_steps} micro-batches = {tokens} tokens per step per data-parallel rank\n")

    print("| pp | micro-batches | stages per rank | bubble (p-1)/(v m + p-1) |")
    print("|---|---|---|---|")
    for pp in (2, 4, 8):
        for m in (2 * pp, 8 * pp):  # at least one micro-batch per stage (pp x v)
            for v in (1, 2):
                print(f"| {pp} | {m} | {v} | {bubble_fraction(pp, m, v):.1%} |")

    print(f"\n| tp | per block, SP (MiB) | per block, no SP (MiB) | per block, SP + full recompute (MiB) "
          f"| per step, SP (GiB) | at {args.link_gb_s:.0f} GB/s (ms) |")
    print("|---|---|---|---|---|---|")
    mib, gib = 2**20, 2**30
    for tp in (2, 4, 8):
        sp = tp_bytes_per_block(tokens=tokens, dim=cfg.dim, tp=tp)
        no_sp = tp_bytes_per_block(tokens=tokens, dim=cfg.dim, tp=tp, sequence_parallel=False)
        rc = tp_bytes_per_block(tokens=tokens, dim=cfg.dim, tp=tp, recompute=True)
        step = sp * cfg.n_layers
        print(f"| {tp} | {sp / mib:.0f} | {no_sp / mib:.0f} | {rc / mib:.0f} | {step / gib:.2f} "
              f"| {step / (args.link_gb_s * 1e9) * 1e3:.0f} |")


if __name__ == "__main__":
    main()
