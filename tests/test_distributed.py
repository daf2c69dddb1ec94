"""Data parallel on 2 gloo processes: DDP, FSDP2 and HSDP give a single process's losses over the global batch.

Every training check runs in one spawn (CI has two cores); the reference single-process runs happen in the
test process itself. fp32 throughout, no dropout: the ranks' losses must equal the single process's within
1e-5 relative (the only difference is the order of the gradient sums).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from elbowroom.distributed.comm_hooks import int8_compress, int8_decompress, topk_compress, topk_decompress
from elbowroom.distributed.config import ParallelConfig
from elbowroom.models import ModelConfig, build_model
from tests.distributed_utils import run_ranks

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16)
GLOBAL_BATCH, SEQ, STEPS = 4, 16, 10


def _batches(step: int, accum: int) -> torch.Tensor:
    """Learnable sequences (each counts up from a random start by a random stride of 1-3), so losses fall."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, CFG.vocab_size, (accum, GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (accum, GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % CFG.vocab_size


def _train(model, optimizer, steps: int, accum: int, *, sync=None, scale: float = 1.0,
           reduce=lambda v: v, rank_slice=slice(None), first_step: int = 0) -> list[float]:
    """The loop every check runs: the loss of a step is normalised by the global step's tokens."""
    import contextlib

    losses = []
    step_tokens = accum * GLOBAL_BATCH * SEQ
    for step in range(first_step, first_step + steps):
        data = _batches(step, accum)
        total = 0.0
        for i in range(accum):
            x, y = data[i, rank_slice, :-1], data[i, rank_slice, 1:]
            ctx = sync(model, i == accum - 1) if sync is not None else contextlib.nullcontext()
            with ctx:
                logits = model(x)
                loss_sum = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), y.reshape(-1), reduction="sum")
                (loss_sum / step_tokens * scale).backward()
            total += loss_sum.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(reduce(total) / step_tokens)
    return losses


def _reference(steps: int = STEPS, accum: int = 1) -> list[float]:
    torch.manual_seed(0)
    model = build_model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return _train(model, opt, steps, accum)


def _rank_loop(topo) -> dict:
    """The data-parallel arguments of :func:`_train` for this rank: gradient sync off but at the last micro-batch,
    the loss scaled for the ranks' gradient average, its slice of each global batch, the loss summed over ranks."""
    from elbowroom.distributed.data_parallel import all_reduce_sum, gradient_sync, loss_scale

    local = GLOBAL_BATCH // topo.dp_size
    return dict(sync=gradient_sync, scale=loss_scale(topo),
                rank_slice=slice(topo.dp_rank * local, (topo.dp_rank + 1) * local),
                reduce=lambda v: all_reduce_sum(v, topo, torch.device("cpu")))


def _ranks_train(rank: int, world: int) -> dict:
    """On each rank: every data-parallel mode, with and without accumulation; losses and hook counts."""
    from elbowroom.distributed.data_parallel import (
        apply_data_parallel,
        init_distributed,
    )

    out = {}
    cases = {
        "ddp": ParallelConfig(dp_replicate=2),
        "fsdp": ParallelConfig(dp_shard=2),
        "hsdp_2x1": ParallelConfig(dp_replicate=2, data_parallel="hsdp"),
        "hsdp_1x2": ParallelConfig(dp_shard=2, data_parallel="hsdp"),
    }
    for name, parallel in cases.items():
        for accum in (1, 3):
            topo = init_distributed(parallel, rank=rank, world_size=world, local_rank=rank,
                                    device=torch.device("cpu"))
            torch.manual_seed(0)
            model = build_model(CFG)
            model, comm = apply_data_parallel(model, topo)
            calls = []
            if comm is not None:  # count the all-reduces: one per bucket per optimizer step, never per micro-batch
                inner = comm.hook

                def counting(state, bucket, _inner=inner, calls=calls):
                    calls.append(bucket.index())
                    return _inner(state, bucket)

                comm.hook = counting
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = _train(model, opt, STEPS, accum, **_rank_loop(topo))
            full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                    for n, p in model.named_parameters()}
            out[(name, accum)] = {"losses": losses, "calls": len(calls), "params": full}
    return out


@pytest.mark.slow
def test_data_parallel_modes_equal_single_process() -> None:
    ref = {accum: _reference(accum=accum) for accum in (1, 3)}
    r0, r1 = run_ranks(_ranks_train)
    for key, res in r0.items():
        name, accum = key
        assert res["losses"] == pytest.approx(ref[accum], rel=1e-5), key
        assert r1[key]["losses"] == res["losses"], key  # every rank logs the same global loss
        for n, p in res["params"].items():  # and holds the same weights after 10 steps
            torch.testing.assert_close(p, r1[key]["params"][n], rtol=0, atol=0, msg=f"{key} {n}")
        if name == "ddp":  # the tiny model fits one bucket: one all-reduce per optimizer step
            assert res["calls"] == STEPS, (key, res["calls"])


# ---------------------------------------------------------------- compression: exact error feedback
def test_topk_error_feedback_is_exact() -> None:
    x = torch.randn(1000)
    values, indices, residual = topk_compress(x, 0.05)
    assert values.numel() == 50 and indices.dtype == torch.int32
    torch.testing.assert_close(topk_decompress(values, indices, x.numel()) + residual, x, rtol=0, atol=0)
    # what is sent is the largest in magnitude
    assert values.abs().min() >= residual.abs().max()


def test_int8_error_feedback_is_exact_and_unbiased() -> None:
    x = torch.randn(5000)
    x[4500] = 1000.0  # one outlier: it sets the scale of its own block only
    q, scale, residual = int8_compress(x, torch.Generator().manual_seed(0))
    assert q.dtype == torch.int8 and scale.numel() == 3 and q.numel() == 5000  # blocks of 2048, the last short
    torch.testing.assert_close(int8_decompress(q, scale) + residual, x, rtol=0, atol=1e-4)
    # stochastic rounding moves by less than one step of the entry's own block
    assert (residual.abs() <= scale.repeat_interleave(2048)[:5000] + 1e-6).all()
    assert residual[:4096].abs().max() < 0.05  # the blocks without the outlier keep a fine step
    # unbiased: the mean of many roundings of one value is the value
    v = torch.full((20000,), 0.3 * 127 / 127)
    v[0] = 1.0  # sets the scale to 1/127
    qs, s, _ = int8_compress(v, torch.Generator().manual_seed(1))
    assert int8_decompress(qs, s)[1:].mean().item() == pytest.approx(0.3, abs=2e-3)


def test_int8_scales_follow_each_parameter() -> None:
    # pieces quantised one after another: each starts a block of its own, so a bucket's layout changes nothing
    from elbowroom.distributed.comm_hooks import int8_decompress_pieces

    x = torch.randn(3010)
    x[2500] = 100.0  # in the first piece's second block: its scale is that block's alone
    pieces = [int8_compress(p, torch.Generator().manual_seed(i)) for i, p in enumerate(x.split([3000, 10]))]
    q = torch.cat([p[0] for p in pieces])
    scales = torch.cat([p[1] for p in pieces])
    assert scales.numel() == 3  # 2048 + 952 entries, then 10 in a block of their own
    values = int8_decompress_pieces(q, scales, [3000, 10], block=2048)
    torch.testing.assert_close(values + torch.cat([p[2] for p in pieces]), x, rtol=0, atol=1e-4)
    assert (x - values)[:2048].abs().max() < 0.05 and (x - values)[3000:].abs().max() < 0.05
    # added into a running sum in place (every rank's bucket into one tensor): the same values, the same tensor
    total = torch.full((3010,), 0.5)
    assert int8_decompress_pieces(q, scales, [3000, 10], block=2048, add_to=total) is total
    torch.testing.assert_close(total, values + 0.5, rtol=0, atol=0)


# ---------------------------------------------------------------- bad set-ups
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dp_shard": 0}, "parallel.dp_shard must be an integer >= 1"),
        ({"tp": 2, "dp_replicate": 2}, "DDP does not compose with tensor or pipeline parallel"),
        ({"pp": 2, "pp_microbatches": 1}, "set --parallel.pp_microbatches 2 or more"),
        ({"dp_shard": 2, "comm_hook": "fp16"}, "set --parallel.dp_shard 1 or --parallel.comm_hook none"),
        ({"dp_shard": 2, "data_parallel": "ddp"}, "set --parallel.dp_shard 1"),
        ({"topk_ratio": 0.0}, "parallel.topk_ratio must be in (0, 1]"),
    ],
)
def test_bad_parallel_configs(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        ParallelConfig(**kwargs)


def test_mesh_must_match_world_size() -> None:
    from elbowroom.distributed.data_parallel import init_distributed

    with pytest.raises(ValueError, match="torchrun --nproc-per-node 4"):
        init_distributed(ParallelConfig(dp_replicate=2, dp_shard=2), rank=0, world_size=2, local_rank=0,
                         device=torch.device("cpu"))


def test_rank_batches_tile_the_global_batch() -> None:
    from elbowroom.distributed.sampler import RankBatchSampler
    from elbowroom.train.data import ResumableSampler

    stream = ResumableSampler(100, seed=3)
    parts = [iter(RankBatchSampler(stream, global_batch=8, dp_rank=r, dp_size=2)) for r in range(2)]
    single = iter(RankBatchSampler(stream, global_batch=8, dp_rank=0, dp_size=1))
    for _ in range(30):  # across epoch boundaries too
        assert next(parts[0]) + next(parts[1]) == next(single)
    with pytest.raises(ValueError, match="must divide by the data-parallel size 3"):
        RankBatchSampler(stream, global_batch=8, dp_rank=0, dp_size=3)


def _ranks_compose(rank: int, world: int) -> dict:
    """DDP with each compression hook, with recompute, with the CPU-offloaded optimizer."""
    from elbowroom.activations import apply_activation_policy
    from elbowroom.distributed.data_parallel import (
        apply_data_parallel,
        init_distributed,
    )
    from elbowroom.optim import CPUOffloadOptimizer

    out = {}
    cases = {
        "fp16": (ParallelConfig(dp_replicate=2, comm_hook="fp16"), 10, None, False),
        "bf16": (ParallelConfig(dp_replicate=2, comm_hook="bf16"), 10, None, False),
        "powersgd": (ParallelConfig(dp_replicate=2, comm_hook="powersgd", powersgd_rank=4), 50, None, False),
        "topk": (ParallelConfig(dp_replicate=2, comm_hook="topk", topk_ratio=0.1), 50, None, False),
        "int8": (ParallelConfig(dp_replicate=2, comm_hook="int8"), 50, None, False),
        # buckets of 10 KB, which DDP rebuilds after the first step into others (first one up to 1 MiB): the
        # residuals carried across follow the parameters, not the bucket's index
        "topk_rebucketed": (ParallelConfig(dp_replicate=2, comm_hook="topk", topk_ratio=0.1), 50, None, False),
        "int8_rebucketed": (ParallelConfig(dp_replicate=2, comm_hook="int8"), 50, None, False),
        "none50": (ParallelConfig(dp_replicate=2), 50, None, False),
        "recompute": (ParallelConfig(dp_replicate=2), 10, "full", False),
        "fsdp_recompute": (ParallelConfig(dp_shard=2), 10, "selective", False),
        "offload_optim": (ParallelConfig(dp_replicate=2), 10, None, True),
    }
    for name, (parallel, steps, recompute, offload) in cases.items():
        topo = init_distributed(parallel, rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
        torch.manual_seed(0)
        model = build_model(CFG)
        if recompute:
            apply_activation_policy(model, checkpoint=recompute)
        params = list(model.parameters())
        model, comm = apply_data_parallel(model, topo, **({"bucket_cap_mb": 0.01} if "rebucketed" in name else {}))
        if offload:
            opt = CPUOffloadOptimizer(params, torch.optim.AdamW, lr=1e-2, offload_fraction=0.5)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = _train(model, opt, steps, 1, **_rank_loop(topo))
        if offload:
            opt.close()
        out[name] = {"losses": losses, "bytes": comm.take_bytes() if comm is not None else None}
        if "rebucketed" in name:
            sizes = {k: v.numel() for k, v in comm.state_dict()["residuals"].items()}
            out[name]["residuals"] = sizes == {n: p.numel() for n, p in model.module.named_parameters()}
    return out


@pytest.mark.slow
def test_compression_recompute_and_offload_under_data_parallel() -> None:
    ref10, ref50 = _reference(steps=10), _reference(steps=50)
    r0, r1 = run_ranks(_ranks_compose)
    for name in ("recompute", "fsdp_recompute", "offload_optim"):
        assert r0[name]["losses"] == pytest.approx(ref10, rel=1e-5), name
    for name in ("fp16", "bf16"):  # bf16 keeps 8 bits of mantissa, fp16 11
        assert r0[name]["losses"] == pytest.approx(ref10, rel=1e-2 if name == "bf16" else 1e-4), name
    # the uncompressed 50-step baseline; beyond ~10 steps at this learning rate the order of the gradient sums
    # shows in the 5th digit, so it is compared over the first 10
    assert r0["none50"]["losses"][:10] == pytest.approx(ref10, rel=1e-5)
    for name in ("topk", "int8"):
        rebucketed = f"{name}_rebucketed"
        assert r0[rebucketed]["residuals"] and r1[rebucketed]["residuals"], name  # one residual per parameter
        # parameter by parameter: the same selection, scales and noise whatever DDP's buckets
        assert r0[rebucketed]["losses"] == r0[name]["losses"], name
    for name in ("powersgd", "topk", "int8", "topk_rebucketed", "int8_rebucketed"):
        # compressed and error-fed: the curve still falls with plain's
        assert r0[name]["losses"][-1] < ref50[0] * 0.8, (name, r0[name]["losses"][-1], ref50[0])
        assert abs(r0[name]["losses"][-1] - ref50[-1]) < 0.15 * ref50[0], (name, r0[name]["losses"][-1], ref50[-1])
    full = r0["none50"]["bytes"] / 50
    assert r0["fp16"]["bytes"] / 10 == full / 2  # half the bytes of fp32 on the wire
    assert r0["int8"]["bytes"] / 50 < full / 3.9
    assert r0["topk"]["bytes"] / 50 < full / 4


# ---------------------------------------------------------------- sharded checkpoints across world sizes
def _ranks_checkpoint(rank: int, world: int, ckpt_dir: str) -> dict:
    """FSDP2 on 2 ranks: continue a world-size-1 checkpoint for 5 steps; then train 5 fresh steps, save, train 5."""
    from pathlib import Path

    from elbowroom.distributed import checkpoint as C
    from elbowroom.distributed.data_parallel import (
        apply_data_parallel,
        init_distributed,
    )

    topo = init_distributed(ParallelConfig(dp_shard=2), rank=rank, world_size=world, local_rank=rank,
                            device=torch.device("cpu"))
    kw = _rank_loop(topo)

    def fresh():
        torch.manual_seed(0)
        model, _ = apply_data_parallel(build_model(CFG), topo)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = fresh()
    extra = C.load(Path(ckpt_dir, "ws1"), model, opt)  # written by one process: resharded over two
    resumed = _train(model, opt, 5, 1, first_step=extra["step"], **kw)
    model, opt = fresh()
    first = _train(model, opt, 5, 1, **kw)
    C.save(Path(ckpt_dir, "ws2"), model, opt, extra={"step": 5})
    return {"resumed": resumed, "first": first, "rest": _train(model, opt, 5, 1, first_step=5, **kw)}


@pytest.mark.slow
def test_resume_across_world_sizes(tmp_path) -> None:
    """FSDP2 checkpoints through DCP: world size 2 -> 1 and 1 -> 2 continue the uninterrupted curve (1e-6)."""
    from elbowroom.distributed import checkpoint as C

    ref = _reference(steps=10)
    torch.manual_seed(0)
    model = build_model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 5, 1)
    C.save(tmp_path / "ws1", model, opt, extra={"step": 5})
    assert not list(tmp_path.glob(".tmp-*"))  # published by rename, nothing left half-written

    r0, r1 = run_ranks(_ranks_checkpoint, str(tmp_path))
    assert r0["resumed"] == pytest.approx(ref[5:], rel=1e-6, abs=1e-6)  # 1 -> 2
    assert r0["first"] + r0["rest"] == pytest.approx(ref, rel=1e-5)
    model = build_model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert C.load(tmp_path / "ws2", model, opt) == {"step": 5}
    assert _train(model, opt, 5, 1, first_step=5) == pytest.approx(r0["rest"], rel=1e-6, abs=1e-6)  # 2 -> 1
