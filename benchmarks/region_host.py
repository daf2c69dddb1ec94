"""What each block option costs the host: the forward and backward of a model too small for its kernels to matter.

    python3 benchmarks/region_host.py [--device cuda] [--blocks 24] [--repeats 20]

Every block of a small llama-shaped model (dim 64, 16 tokens) runs under one option at a time, and the script
prints the median wall time of the forward and of the backward, per block, beside plain's. With kernels this
small the time is the host's: Python, dispatch, hooks. On a GPU each timing ends with a synchronize, so a host
time above the block's GPU time (W1: 3.5 ms forward) leaves the GPU waiting for launches.

Options: plain, kept region (an offload region that moves nothing), selective (elbowroom's modes), selective
(torch's ``create_selective_checkpoint_contexts``, for comparison), full (non-reentrant), full (reentrant).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.utils.checkpoint as torch_ckpt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elbowroom.activations import BlockPolicy, apply_block_policies, selective  # noqa: E402, F401
from elbowroom.models import ModelConfig, build_model  # noqa: E402

OPTIONS = ("plain", "kept region", "selective", "selective (torch's modes)", "full", "full (reentrant)")


def _apply(model: torch.nn.Module, option: str) -> None:
    n = len(model.blocks)
    if option == "plain":
        return
    if option == "kept region":
        # offloads nothing (every tensor is under the size floor), so only the region's hooks run
        apply_block_policies(model, [BlockPolicy(offload_ratio=1.0)] * n, min_offload_bytes=1 << 40,
                             simulate_host=model.blocks[0].attn.qkv.weight.device.type == "cpu")
        return
    mode = "full" if option.startswith("full") else "selective"
    apply_block_policies(model, [BlockPolicy(mode)] * n, use_reentrant=option == "full (reentrant)")


def _time(model: torch.nn.Module, idx: torch.Tensor, repeats: int, sync: object) -> tuple[float, float]:
    fwd, bwd = [], []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        loss = model(idx).float().square().mean()
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        if i >= 3:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    base = build_model(ModelConfig(dim=64, n_heads=4, ffn_dim=128, n_layers=args.blocks, max_seq_len=16))
    base = base.to(dev, torch.bfloat16)
    idx = torch.randint(0, 256, (1, 16), device=dev)
    own = selective.selective_contexts
    rows = []
    for option in OPTIONS:
        model = copy.deepcopy(base)
        _apply(model, option)
        if option == "selective (torch's modes)":
            selective.selective_contexts = lambda policy, group, record=None: (
                torch_ckpt.create_selective_checkpoint_contexts(policy))
        try:
            rows.append((option, *_time(model, idx, args.repeats, sync)))
        finally:
            selective.selective_contexts = own
    plain_f, plain_b = rows[0][1], rows[0][2]
    print(f"{args.blocks} blocks on {dev} ({torch.__version__}); host ms per block, median of {args.repeats}")
    print(f"{'option':28s} {'forward':>8s} {'over plain':>10s} {'backward':>9s} {'over plain':>10s}")
    for option, f, b in rows:
        n = args.blocks
        print(f"{option:28s} {f * 1e3 / n:8.3f} {(f - plain_f) * 1e3 / n:+10.3f} {b * 1e3 / n:9.3f} "
              f"{(b - plain_b) * 1e3 / n:+10.3f}")


if __name__ == "__main__":
    main()
