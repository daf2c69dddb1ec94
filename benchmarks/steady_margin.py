"""What the CUDA caching allocator holds beyond the allocated bytes, step after step, in plain training steps.

    python3 benchmarks/steady_margin.py --workload w3 --steps 6 [--optimizer] [--no-expandable]

The profile measures the allocator's margin on one plain step from an empty cache; a planned run reaches its
steady state over several steps (gradients freed by ``zero_grad``, the next forward's activations placed in their
ranges). This prints, for each step, the peak reserved and peak allocated bytes of that step and their difference,
with ``expandable_segments:True`` unless told otherwise, gradients set to None between steps, and with
``--optimizer`` a fused AdamW step (its moments made before the first step, as ``elbowroom.optim.early_state``
makes them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="w1")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--optimizer", action="store_true")
    ap.add_argument("--no-expandable", action="store_true")
    ap.add_argument("--no-cache", action="store_true", help="autocast's weight cache off inside each block, as under "
                    "a plan's block policies (each block casts its weights in forward and again in backward)")
    ap.add_argument("--bf16", action="store_true", help="bf16 weights, no autocast")
    a = ap.parse_args()
    if not a.no_expandable:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch
    import torch.nn.functional as F

    from elbowroom.models import ModelConfig, build_model
    from elbowroom.models.workloads import WORKLOADS
    from elbowroom.optim.early_state import create_state

    w = WORKLOADS[a.workload]
    model = build_model(ModelConfig.from_preset(w.preset), device="cuda")
    if a.bf16:
        model.to(torch.bfloat16)
    if a.no_cache:
        for blk in model.blocks:
            blk.forward = _uncached(blk.forward, torch)
    opt = None
    if a.optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        create_state(opt)
    idx = torch.randint(0, 32000, (w.batch_size, w.seq_len), device="cuda")
    G = 2**30
    for step in range(a.steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not a.bf16):
            logits = model(idx)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), idx.view(-1))
        del logits
        loss.backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        r, al = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
        st = torch.cuda.memory_stats()
        print(json.dumps({"workload": a.workload, "step": step, "optimizer": a.optimizer, "no_cache": a.no_cache,
                          "bf16": a.bf16,
                          "expandable": not a.no_expandable, "reserved_GiB": round(r / G, 3),
                          "allocated_GiB": round(al / G, 3), "held_GiB": round((r - al) / G, 3),
                          "retries": st.get("num_alloc_retries", 0)}), flush=True)


def _uncached(forward, torch):
    """``forward`` under an autocast whose weight cache is off (what a block policy's wrapper runs)."""
    def run(*args, **kwargs):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            return forward(*args, **kwargs)
    return run


if __name__ == "__main__":
    main()
