"""FSDP2 shards of bf16 weights with fp32 masters in the CPU-offloaded optimizer (on the host, or on the device
for parameters kept there): the layout that holds 2 bytes per parameter on each GPU plus its gradient shard.

Two gloo processes (one spawn): by hand against one process on the whole batch, and through the trainer
(losses against the single-process run of the same flags, resume at the same world size).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.distributed_utils import TINY_RUN, assert_close_curves, run_ranks, train_losses

BF16 = ["--train.dtype", "bf16", "--optimizer.param_dtype", "bfloat16"]
FSDP = ["--parallel.dp_shard", "2"]
HALF = ["--steps", "3", "--scheduler.decay_steps", "6"]


def _by_hand(rank: int, offload_fraction: float) -> dict:
    """A bf16 model, sharded over the two ranks, stepped 3 times on its half of each batch; beside it the same
    model unsharded, stepped on the whole batch (in each rank, the same)."""
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from elbowroom.models import ModelConfig, build_model
    from elbowroom.optim import CPUOffloadOptimizer

    torch.manual_seed(0)
    base = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16))
    base.to(torch.bfloat16)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    kw = dict(lr=1e-2, offload_fraction=offload_fraction, master_weights=True)
    opt_ref = CPUOffloadOptimizer(ref.parameters(), torch.optim.AdamW, **kw)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, **kw)

    def loss(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x[:, :-1]).float().reshape(-1, 64), x[:, 1:].reshape(-1))

    g = torch.Generator().manual_seed(1)
    grad_err = []
    for _ in range(3):
        x = torch.randint(0, 64, (4, 17), generator=g)
        loss(ref, x).backward()
        loss(model, x[2 * rank: 2 * rank + 2]).backward()  # FSDP2 averages the two halves' gradients
        grad_err.append(max(float((p.grad.full_tensor().float() - q.grad.float()).abs().max() / q.grad.abs().max())
                            for p, q in zip(model.parameters(), ref.parameters())))
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.full_tensor()  # the unsharded optimizer steps on the very gradients FSDP2 reduced
        for o in (opt_ref, opt):
            o.clip_grad_norm_(1.0)
            o.step()
            o.zero_grad()
    for o in (opt_ref, opt):
        o.wait_for_weights()
    local = [p.to_local() for p in model.parameters()]
    state, state_ref = opt.state_dict()["state"], opt_ref.state_dict()["state"]
    out = {
        "shard_dtypes": {str(t.dtype) for t in local},
        "shard_numel": sum(t.numel() for t in local),
        "numel": sum(p.numel() for p in ref.parameters()),
        "master_dtypes": {str(s["master_weight"].dtype) for s in state.values()},
        "grad_err": max(grad_err),
        "master_diff": max(float((state[i]["master_weight"].full_tensor() - state_ref[i]["master_weight"]).abs().max())
                           for i in state),
        "param_diff": max(float((p.detach().full_tensor().float() - q.detach().float()).abs().max())
                          for p, q in zip(model.parameters(), ref.parameters())),
    }
    opt.close()
    opt_ref.close()
    return out


def _unit_layout(rank: int) -> dict:
    """Where the optimizer's forward waits go under FSDP2: on each unit, ahead of its all-gather."""
    from torch.distributed.fsdp import FSDPModule

    from elbowroom.distributed.config import ParallelConfig
    from elbowroom.distributed.data_parallel import apply_data_parallel, init_distributed
    from elbowroom.models import ModelConfig, build_model
    from elbowroom.optim import CPUOffloadOptimizer

    topo = init_distributed(ParallelConfig(dp_shard=2), rank=rank, world_size=2, local_rank=rank,
                            device=torch.device("cpu"))
    out = {}
    for tied in (False, True):
        model = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16,
                                        tie_embeddings=tied))
        apply_data_parallel(model, topo)
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, offload_fraction=1.0)
        opt.overlap_with_forward(model)
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        first_hooks = [next(iter(m._forward_pre_hooks.values())) for m in units]
        out[tied] = {
            "units": [type(m).__name__ for m in units],
            "ours_first": [getattr(h, "__qualname__", "").startswith("forward_hook") for h in first_hooks],
        }
        opt.close()
    return out


def _ranks(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    tmp_path = Path(tmp)
    res = {f"hand_{f}": _by_hand(rank, f) for f in (1.0, 0.5)}
    res["units"] = _unit_layout(rank)
    res["host"] = train_losses(TINY_RUN, tmp_path / "host", *FSDP, *BF16, "--optimizer.offload_fraction", "1.0")
    res["device"] = train_losses(TINY_RUN, tmp_path / "device", *FSDP, *BF16)
    res["half"] = train_losses(TINY_RUN, tmp_path / "resumed", *FSDP, *BF16, "--optimizer.offload_fraction", "1.0",
                               *HALF)
    res["resumed"] = train_losses(TINY_RUN, tmp_path / "resumed", *FSDP, *BF16, "--optimizer.offload_fraction",
                                  "1.0", "--resume")
    return res


@pytest.mark.slow
def test_fsdp2_bf16_shards_with_fp32_masters(tmp_path: Path) -> None:
    ref_host = train_losses(TINY_RUN, tmp_path / "ref-host", *BF16, "--optimizer.offload_fraction", "1.0")
    ref_device = train_losses(TINY_RUN, tmp_path / "ref-device", *BF16)
    r0, r1 = run_ranks(_ranks, str(tmp_path))
    for name in ("hand_1.0", "hand_0.5"):
        for r in (r0, r1):
            h = r[name]
            assert h["shard_dtypes"] == {"torch.bfloat16"} and h["master_dtypes"] == {"torch.float32"}, name
            assert h["shard_numel"] * 2 <= h["numel"] + 64, name  # half of every parameter (padding aside)
            # FSDP2's reduced bf16 gradients are the whole batch's within bf16 rounding of the sums (it reduces
            # in fp32, one process sums in bf16)
            assert h["grad_err"] < 2e-2, (name, h)
            # on the same gradients the sharded step is the unsharded one (the global norm summed in another
            # order: the masters within fp32 rounding, the bf16 weights cast from them)
            assert h["master_diff"] <= 1e-6 and h["param_diff"] <= 4e-3, (name, h)
    # the embedding and the head are units of their own (all-gathered when they run, so the host step of the
    # head may run behind the blocks' forward), except when tied; every unit's first pre-forward hook is the
    # optimizer's wait, ahead of FSDP2's all-gather
    units = r0["units"]
    assert units[False]["units"].count("FSDPEmbedding") == 1 and units[False]["units"].count("FSDPOutputHead") == 1
    assert "FSDPEmbedding" not in units[True]["units"]
    assert units[False]["ours_first"] == [False] + [True] * 5  # the root holds no weight of its own then
    assert all(units[True]["ours_first"]), units[True]  # the root holds the tied embedding
    # the trainer: the single-process curve of the same flags within bf16's rounding of the gradient sums
    assert_close_curves(r0["host"]["losses"], ref_host["losses"], 2e-3, "host masters")
    assert_close_curves(r0["device"]["losses"], ref_device["losses"], 2e-3, "device masters")
    assert r0["host"]["losses"] == r1["host"]["losses"]
    # resumed at step 3 from its sharded checkpoint (bf16 shards, fp32 masters), the curve continues exactly
    assert r0["half"]["step"] == 3
    assert {s: v for s, v in r0["resumed"]["losses"].items() if s > 3} == \
        {s: v for s, v in r0["host"]["losses"].items() if s > 3}
