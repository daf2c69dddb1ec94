"""Host time a block costs the training thread, by activation policy: a W1-shaped block (llama: RMSNorm, fused qkv,
RoPE, SDPA, SwiGLU) at tiny sizes, so that the kernels take next to nothing and the step's time is the Python and
dispatch work of forward, recompute and backward. Where this exceeds a block's GPU time the GPU waits for launches;
run it on the machine that trains (the device host's Python, beside its other ranks) to compare.

    python3 benchmarks/host_overhead.py [--device cuda] [--blocks 8] [--repeats 30] [--compiled]

Prints one row per policy: median milliseconds per block (forward + backward of one training step).
(2-core CPU of the development machine, 2026-11-28: keep 0.37, full recompute 0.94, selective 1.68 ms a block.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from elbowroom.activations import compile_blocks  # noqa: E402
from elbowroom.activations.policy import BlockPolicy, apply_block_policies  # noqa: E402
from elbowroom.models import ModelConfig, build_model  # noqa: E402

POLICIES = {
    "keep": BlockPolicy(),
    "full recompute": BlockPolicy("full"),
    "full recompute, input offloaded": BlockPolicy("full", offload_input=True),
    "selective": BlockPolicy("selective"),
    "selective, half offloaded": BlockPolicy("selective", offload_ratio=0.5),
    "keep, half offloaded": BlockPolicy(offload_ratio=0.5),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--compiled", action="store_true",
                    help="also each policy with its blocks compiled in place (elbowroom.compile_blocks)")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the kernels are tiny; one thread keeps the Python work what is measured
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=a.blocks, n_heads=4, ffn_dim=128, max_seq_len=16)
    x = torch.randint(0, 64, (1, 16), device=device)
    print(f"| policy | host ms per block ({device.type}) |\n|---|---|")
    rows = [(name, pol, False) for name, pol in POLICIES.items()]
    rows += [(name + ", compiled", pol, True) for name, pol in POLICIES.items()] if a.compiled else []
    for name, pol, compiled in rows:
        if pol.offloads and device.type != "cuda":
            continue  # offload regions copy to pinned host memory: CUDA only
        torch.manual_seed(0)
        model = build_model(cfg).to(device)
        if pol != BlockPolicy():
            apply_block_policies(model, [pol] * a.blocks)
        if compiled:
            compile_blocks(model)
        times = []
        for i in range(a.repeats + 5):
            t0 = time.perf_counter()
            model(x).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 5:
                times.append(time.perf_counter() - t0)
        times.sort()
        print(f"| {name} | {times[len(times) // 2] / a.blocks * 1e3:.2f} |")


if __name__ == "__main__":
    main()
