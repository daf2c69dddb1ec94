"""Where a tensor-parallel micro-batch's time goes: the host's dispatch against the GPU's kernels.

    torchrun --nproc-per-node 2 benchmarks/tp_host.py --preset 7b --layers 4 --seq 4096   # GPUs, NCCL
    torchrun --nproc-per-node 2 benchmarks/tp_host.py --preset tiny --seq 64               # CPU, gloo
    python benchmarks/tp_host.py --preset 7b --layers 4 --seq 4096 --fake-world 2           # one GPU, no comms
    ... --compiled                                                                          # the blocks compiled

Builds the preset with ``--layers`` blocks, splits it by :func:`apply_tensor_parallel` over every rank (the
trainer's layout: sequence parallel, loss parallel) and times forward, loss and backward of one micro-batch,
with and without full recompute. Rank 0 prints, per mode, the wall time per micro-batch, the GPU kernel time
under the profiler, and the ops with the most host (self CPU) time, so that a host-bound step names its cause.
With one process the same model runs unsplit (the baseline).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def _microbatch(model, idx, tgt, loss_parallel: bool) -> None:
    from elbowroom.distributed.tensor_parallel import loss_context

    with loss_context(loss_parallel):
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())
        loss.backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--modes", default="none,full", help="recompute modes, comma-separated")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--compiled", action="store_true", help="each block compiled in place (elbowroom.compile_blocks, "
                    "the trainer's --train.compile): DTensor's per-op dispatch leaves the blocks")
    ap.add_argument("--fake-world", type=int, default=0,
                    help="one process acting as rank 0 of this many over torch's fake process group: collectives "
                         "do nothing, DTensor's dispatch and the local kernels are real (host cost on one GPU)")
    args = ap.parse_args()

    from elbowroom.activations import apply_activation_policy
    from elbowroom.activations.policy import ActivationConfig
    from elbowroom.distributed.tensor_parallel import apply_tensor_parallel
    from elbowroom.models import ModelConfig, build_model

    world = args.fake_world or int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = None
    if args.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    elif world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = ModelConfig.from_preset(args.preset, n_layers=args.layers, max_seq_len=max(args.seq, 64))
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(cfg.vocab_size, (args.batch, args.seq), generator=gen).to(device)
    tgt = torch.randint(cfg.vocab_size, (args.batch, args.seq), generator=gen).to(device)

    def say(*a):
        if rank == 0:
            print(*a, flush=True)

    say(f"{args.preset} x {args.layers} blocks, {args.batch} x {args.seq} tokens, world {world}, {device.type}, "
        f"torch {torch.__version__}{', blocks compiled' if args.compiled else ''}")
    for mode in args.modes.split(","):
        torch.manual_seed(0)
        model = build_model(cfg, device=device).to(dtype)
        if mesh is not None:
            apply_tensor_parallel(model, mesh, loss_parallel=True)
        apply_activation_policy(model, ActivationConfig(checkpoint=mode))
        if args.compiled:
            from elbowroom.activations import compile_blocks

            compile_blocks(model)
        for _ in range(2):  # warm-up: caches of sharding propagation, kernels
            _microbatch(model, idx, tgt, mesh is not None)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            _microbatch(model, idx, tgt, mesh is not None)
            model.zero_grad(set_to_none=True)
        host = (time.perf_counter() - t0) / args.iters  # the host's pace: nothing waits for the GPU here
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.iters
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            _microbatch(model, idx, tgt, mesh is not None)
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
        events = prof.key_averages()
        # the device's own events only (as the table's "Self CUDA time total"): an op's row also carries the time of
        # the kernels it launched, so summing every row counts each kernel twice
        kernels = sum(e.self_device_time_total for e in events
                      if e.device_type != torch.autograd.DeviceType.CPU) / 1e3 if cuda else 0.0
        ops = sum(e.count for e in events if e.key.startswith("aten::"))
        say(f"\n== recompute {mode}: {wall * 1e3:.1f} ms per micro-batch (host issued it in {host * 1e3:.1f} ms), "
            f"GPU kernels {kernels:.1f} ms under the profiler, {ops} aten calls")
        say(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
        del model
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
