"""Per-rank profiles and plans under tensor and pipeline parallel (``elbowroom.plan.ranks``), without processes.

A pipeline rank's profile holds exactly the blocks the pipeline's own split gives it, the embeddings on the first
stage and the head on the last; 1F1B's first stage holds two micro-batches' kept activations at p = 2 and the
last one; a tensor-parallel rank's parameter bytes are the real local shards (a one-process fake group of two
ranks splits the model for real); and a tighter per-rank budget never predicts a faster step.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from elbowroom.distributed.config import ParallelConfig
from elbowroom.distributed.pipeline import split_model
from elbowroom.models import ModelConfig, build_model
from elbowroom.plan import BudgetError
from elbowroom.plan.cost import OPTIONS, Decisions, Option, predict
from elbowroom.plan.plan import Plan
from elbowroom.plan.profiler import profile
from elbowroom.plan.ranks import RankPlans, inflight_microbatches, layout_label, rank_profiles
from elbowroom.plan.search import plan_for

LLAMA = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_dim=64, max_seq_len=16)
GPT2 = replace(LLAMA, arch="gpt2")
ROWS, SEQ = 2, 16


def _model_and_profile(cfg: ModelConfig) -> tuple[torch.nn.Module, object]:
    """The whole model (CPU, seeded) and its analytic profile on one micro-batch (deterministic bytes)."""
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.device("meta"):
        meta = build_model(cfg)
    batch = (torch.zeros(ROWS, SEQ, dtype=torch.long), torch.zeros(ROWS, SEQ, dtype=torch.long))
    return model, profile(meta, batch, source="analytic", machine="h100-80gb", dtype=torch.bfloat16)


def _numel(module: torch.nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


@pytest.mark.parametrize("schedule, per_rank", [("1f1b", 0), ("gpipe", 0), ("interleaved_1f1b", 2)])
def test_a_stage_profile_holds_its_stages_blocks(schedule: str, per_rank: int) -> None:
    model, prof = _model_and_profile(LLAMA)
    parallel = ParallelConfig(pp=2, pp_schedule=schedule, pp_microbatches=4, pp_stages_per_rank=per_rank)
    ranks = rank_profiles(prof, model, parallel)
    assert len(ranks) == 2
    for r, got in enumerate(ranks):
        stages = split_model(model, parallel, r)  # the pipeline's own split
        ids = [int(k) for st in stages for k in st.blocks._modules]
        assert got.blocks == tuple(dataclasses.replace(prof.blocks[i], index=j) for j, i in enumerate(ids))
        assert [b.num_params for b in got.blocks] == [_numel(st.blocks[j]) for st in stages
                                                      for j in range(len(st.blocks))]
        outside = sum(_numel(getattr(st, k)) for st in stages for k in ("tok_emb", "pos_emb", "norm", "output"))
        assert got.head.num_params == outside
        last = any(st.output is not None for st in stages)
        assert (got.head.logits_transient_bytes == prof.head.logits_transient_bytes) == last
        assert got.inflight_microbatches == inflight_microbatches(schedule, 2, r, 4)
    assert sum(r.num_params for r in ranks) == prof.num_params  # every parameter on exactly one rank
    if per_rank:  # interleaved: rank 0 holds stages 0 and 2 of 4
        assert [b.index for b in ranks[0].blocks] == [0, 1] and ranks[0].blocks[1] == replace(prof.blocks[2], index=1)


def test_1f1b_first_stage_holds_two_micro_batches_the_last_one() -> None:
    assert [inflight_microbatches("1f1b", 2, r, 4) for r in (0, 1)] == [2, 1]
    assert [inflight_microbatches("gpipe", 2, r, 4) for r in (0, 1)] == [4, 4]
    assert inflight_microbatches("1f1b", 4, 0, 2) == 2  # never more than the step has
    model, prof = _model_and_profile(LLAMA)
    first, last = rank_profiles(prof, model, ParallelConfig(pp=2, pp_schedule="1f1b", pp_microbatches=4))
    budget = 1 << 30
    for rank, held in ((first, 2), (last, 1)):
        n = len(rank.blocks)
        for opt in (Option(), Option("full")):  # kept whole, and recomputed (keeping its inputs)
            d = Decisions(options=(opt,) * n, offload_blocks=(False,) * n, micro_batch=rank.micro_batch)
            one = predict(replace(rank, inflight_microbatches=1), d, budget)
            many = predict(rank, d, budget)
            kept = sum(b.kept_bytes for b in one.blocks)
            # the other micro-batches in flight hold their kept activations and the stage's output (first stage)
            assert many.peak_bytes - one.peak_bytes == (held - 1) * (kept + rank.head.saved_bytes)
            assert many.blocks == one.blocks  # one block's working set and recompute are counted once
    assert first.head.saved_bytes == prof.blocks[1].input_bytes  # the stage's output, held for its backward


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_tensor_parallel_parameter_bytes_are_the_real_shards(cfg: ModelConfig, monkeypatch) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from elbowroom.distributed.tensor_parallel import apply_tensor_parallel

    model, prof = _model_and_profile(cfg)
    (got,) = rank_profiles(prof, model, ParallelConfig(tp=2))
    # two ranks in one process: the fake group's collectives do nothing, the shards are the real ones
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"])

        def local(m: torch.nn.Module | None) -> int:
            if m is None:
                return 0
            return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                       for p in m.parameters())

        assert [b.param_bytes for b in got.blocks] == [local(b) for b in model.blocks]
        assert got.head.param_bytes == sum(local(getattr(model, k)) for k in ("tok_emb", "pos_emb", "norm", "output"))
    finally:
        dist.destroy_process_group()
    # activations: the block input is split, the colwise groups' gathered inputs are not
    for whole, rank in zip(prof.blocks, got.blocks):
        assert rank.input_bytes == whole.input_bytes // 2
        assert rank.largest_saved_bytes >= whole.input_bytes
        assert rank.total_saved_bytes < whole.total_saved_bytes


def _sweep(rank) -> list[Plan]:
    kw = dict(precision="fp32", offload_allowed=False, allocator_allowed=False)
    try:
        plan_for(rank, 1, **kw)
    except BudgetError as e:
        low = e.minimum_bytes
    keep = plan_for(rank, 1 << 34, **kw).predicted_peak_bytes
    return [plan_for(rank, int(b), **kw) for b in np.linspace(low, 1.3 * keep, 40)]


@pytest.mark.parametrize("parallel", [ParallelConfig(pp=2, pp_schedule="1f1b", pp_microbatches=4),
                                      ParallelConfig(pp=2, pp_schedule="gpipe", pp_microbatches=4),
                                      ParallelConfig(tp=2)], ids=["pp-1f1b", "pp-gpipe", "tp"])
def test_a_tighter_rank_budget_never_predicts_a_faster_step(parallel: ParallelConfig) -> None:
    model, prof = _model_and_profile(LLAMA)
    for rank in rank_profiles(prof, model, parallel):
        plans = _sweep(rank)
        steps = [p.predicted_step_seconds for p in plans]
        assert all(a >= b for a, b in zip(steps, steps[1:])), steps
        assert all(p.predicted_peak_bytes <= p.budget_bytes for p in plans)
        assert any(b.checkpoint != "none" for b in plans[0].blocks)  # at the minimum something recomputes
        assert all(b.checkpoint == "none" for b in plans[-1].blocks)  # with room, nothing does
        assert {(b.checkpoint, b.offload_ratio) for p in plans for b in p.blocks} <= {
            (o.checkpoint, 0.0) for o in OPTIONS}  # recompute only: nothing offloaded under tp/pp


def test_rank_plans_save_and_load(tmp_path) -> None:
    model, prof = _model_and_profile(LLAMA)
    parallel = ParallelConfig(pp=2, pp_schedule="1f1b", pp_microbatches=4)
    plans = RankPlans(tuple(
        replace(plan_for(r, 1 << 30, offload_allowed=False), layout=layout_label(parallel, i, ROWS, SEQ))
        for i, r in enumerate(rank_profiles(prof, model, parallel))))
    for name in ("plans.toml", "plans.json"):
        path = tmp_path / name
        path.write_text(plans.to_toml() if name.endswith("toml") else json.dumps(plans.to_dict()))
        assert RankPlans.load(path) == plans
    assert "pipeline rank 1" in plans.plans[1].layout and "pipeline rank 1:" in plans.table()
    assert Plan.from_json(plans.to_json()) == plans.plans[0]  # the report's copy: the rank whose peak is logged
    whole = tmp_path / "whole.toml"
    plans.plans[0].save(whole)  # one whole model's plan is not a model-parallel run's
    with pytest.raises(ValueError, match="not the plans of a model-parallel run"):
        RankPlans.load(whole)


def test_ranks_of_one_host_share_its_memory_and_its_host_optimizer() -> None:
    # measured on 2 H200s under DDP: each rank's host AdamW ran at about half the one-process rate (both step at
    # once, bound by the host's memory bandwidth); a plan priced at the whole rate predicted 374 ms for 516
    from test_plan_support import GiB, make_profile

    from elbowroom.plan.ranks import host_share, per_rank_profile

    p = make_profile(n_layers=6)
    m = p.machine
    two = host_share(m, 2)
    assert two.host_adam_params_per_s == m.host_adam_params_per_s / 2
    assert two.host_memory_bytes == m.host_memory_bytes // 2
    assert two.h2d_bandwidth == m.h2d_bandwidth and host_share(m, 1) is m  # each GPU's own link
    assert per_rank_profile(p, 2, ranks_per_host=2).machine == two
    with pytest.raises(ValueError, match="ranks_per_host"):
        host_share(m, 0)
    # the same plan's host step takes twice as long on a shared host
    shared = dataclasses.replace(p, machine=two)
    d = plan_for(p, 60 * GiB).decisions()
    d = dataclasses.replace(d, offload_blocks=(True,) * len(p.blocks))
    alone, both = predict(p, d, 60 * GiB), predict(shared, d, 60 * GiB)
    assert both.step_seconds > alone.step_seconds



def test_ranks_of_one_host_may_share_its_link() -> None:
    # measured on 4 H200s (benchmarks/host_link.py): 55 GB/s each way for one GPU alone, 40 to the device, 33 from
    # it and 21 each way at once with all four copying. The rates every rank sees replace the single process's
    # where lower (never where higher), and a plan that offloads activations prices its copies at them
    from test_plan_support import GiB, make_profile

    from elbowroom.plan.ranks import host_share, per_rank_profile

    p = make_profile(n_layers=6)
    m = p.machine
    link = (m.h2d_bandwidth * 0.7, m.d2h_bandwidth * 0.6, m.duplex_bandwidth * 0.4)
    four = host_share(m, 4, link)
    assert (four.h2d_bandwidth, four.d2h_bandwidth, four.duplex_bandwidth) == link
    assert four.host_adam_params_per_s == m.host_adam_params_per_s / 4  # the rest as without a link
    faster = host_share(m, 4, (m.h2d_bandwidth * 2, m.d2h_bandwidth * 2, m.duplex_bandwidth * 2))
    assert faster.h2d_bandwidth == m.h2d_bandwidth and faster.duplex_bandwidth == m.duplex_bandwidth
    assert host_share(m, 1, link) is m  # one rank: its link alone
    assert per_rank_profile(p, 4, ranks_per_host=4, link=link).machine == four
    for bad in ((1.0, 2.0), (1.0, 0.0, 1.0)):
        with pytest.raises(ValueError, match="three positive rates"):
            host_share(m, 2, bad)
    # every block offloads its activations: the copies take longer on the shared link, and the plan says so
    d = dataclasses.replace(plan_for(p, 60 * GiB).decisions(), options=(Option("none", 1.0),) * len(p.blocks))
    shared = dataclasses.replace(p, machine=dataclasses.replace(four, host_adam_params_per_s=m.host_adam_params_per_s))
    alone, slow = predict(p, d, 60 * GiB), predict(shared, d, 60 * GiB)
    assert slow.step_seconds > alone.step_seconds


def test_measuring_the_shared_link_needs_a_gpu_and_a_process_group() -> None:
    from elbowroom.plan.machine import measure_shared_link

    with pytest.raises(ValueError, match="CUDA device"):
        measure_shared_link("cpu")


def test_fit_plans_one_rank_of_a_shared_host(monkeypatch) -> None:
    # fit(ranks_per_host=N), as a DDP loop of N ranks on one host calls it: the plan is priced on the host's share
    import torch

    from elbowroom.plan import fit, search

    seen = []

    def planned(prof, *args, **kwargs):
        seen.append((prof.machine, kwargs.get("persistent_gradients")))
        return plan_for(prof, *args, **kwargs)

    monkeypatch.setattr(search, "plan_for", planned)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16)
    ids = torch.randint(0, 64, (2, 16))
    for n in (1, 2):
        torch.manual_seed(0)
        _, opt, plan = fit(build_model(cfg), (ids, ids), budget="1GiB", machine="h100-80gb", source="analytic",
                           ranks_per_host=n, persistent_gradients=n > 1, lr=1e-3)
        assert plan.persistent_gradients == (n > 1)
        assert any("one of 2 ranks on this host" in note for note in plan.notes) == (n > 1)  # printed with it
        if hasattr(opt, "close"):
            opt.close()
    (one, p1), (two, p2) = seen
    assert two.host_adam_params_per_s * 2 == one.host_adam_params_per_s and not p1 and p2
    assert two.host_memory_bytes == one.host_memory_bytes // 2


def test_units_gathered_ahead_are_held_too() -> None:
    # parallel.fsdp_prefetch N: the block in flight and N ahead are gathered at once (FSDP2's default counts two)
    from elbowroom.plan.ranks import fsdp_held_bytes

    _, prof = _model_and_profile(LLAMA)
    default = fsdp_held_bytes(prof, 4)["gathered blocks"]
    assert fsdp_held_bytes(prof, 4, prefetch=1)["gathered blocks"] == default
    assert fsdp_held_bytes(prof, 4, prefetch=3)["gathered blocks"] == 2 * default
