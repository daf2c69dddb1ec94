"""Streamed optimizer placement: a block's AdamW state lives on the host and steps on the device, streamed through a
device ring (``CPUOffloadOptimizer(stream_params=...)``). The cost model's bytes and seconds for it, the search's
choice between the host and streaming, the plan's file formats and table, and what apply hands the optimizer."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest
from test_plan_support import GiB, make_profile

from elbowroom.optim import CPUOffloadConfig
from elbowroom.plan import BudgetError, Plan, apply, cost, phases, plan_for, streaming
from elbowroom.plan import host_pipeline as pipeline
from elbowroom.plan.budget_error import size_text
from elbowroom.plan.cli import cmd_plan
from elbowroom.plan.cost import Decisions, Option
from elbowroom.plan.host_pipeline import (
    HOST_RATE_BESIDE_STREAMS,
    fill_after,
    host_exposed_seconds,
    host_rate,
    stream_link_seconds,
)
from elbowroom.plan.plan import BlockPlan


def decisions(n: int, **kw) -> Decisions:
    """All blocks kept, the profile's micro-batch of 4 (make_profile's default), nothing off the device."""
    kw.setdefault("micro_batch", 4)
    kw.setdefault("options", (Option(),) * n)
    kw.setdefault("offload_blocks", (False,) * n)
    return Decisions(**kw)


def one(n: int, i: int) -> tuple[bool, ...]:
    return tuple(j == i for j in range(n))


def with_machine(p, **kw):
    return dataclasses.replace(p, machine=dataclasses.replace(p.machine, **kw))


# ---------------------------------------------------------------------------------------------- cost model
@pytest.mark.parametrize("layout, weight", [("fp32", 4), ("bf16", 2), ("fp32-offload-bf16", 2)])
def test_a_streamed_block_s_device_and_host_bytes(layout: str, weight: int) -> None:
    """Its weight in the offloaded weights' dtype on the device the whole step, offloaded gradients or not (it steps
    where its gradient is); its gradient, as many bytes again, only in the phases that hold it
    (``cost.streamed_gradient_bytes``, in the states under accumulation); 12 B of state on the host and no host
    gradient; one ring of ``stream_slots`` slots of min(stream_slot_numel, its parameters rounded up to 64) x 16 B
    for all streamed blocks."""
    from elbowroom.optim.config import CPUOffloadConfig

    p = make_profile(n_layers=4, dim=256, ffn=512, vocab=1000, seq_len=128)
    n, P = len(p.blocks), p.blocks[2].num_params
    base = decisions(n, layout=layout)
    streamed = dataclasses.replace(base, stream_blocks=one(n, 2))
    cfg = CPUOffloadConfig()
    ring = cfg.stream_slots * min(cfg.stream_slot_numel, -(-P // 64) * 64) * 16
    assert streaming.ring_bytes(p, streamed) == ring == 2 * (-(-P // 64) * 64) * 16  # a small block: its own size
    resident = 16  # weight, gradient and AdamW's moments (bf16 weights: their fp32 masters besides)
    chunk = 4 * (min(cfg.device_chunk_numel, p.num_params - P) - min(cfg.device_chunk_numel, p.num_params)) \
        if layout == "bf16" else 0  # (the device masters' fp32 chunk is sized by the resident parameters)
    assert cost.streamed_gradient_bytes(p, streamed) == (0, 0, weight * P, 0)
    assert cost.globals_for(p, streamed).streamed_grads == weight * P
    assert cost.state_bytes(p, streamed) - cost.state_bytes(p, base) == (weight - resident) * P + ring + chunk
    accumulated = dataclasses.replace(streamed, accumulation=2)  # held through every micro-batch: a model state
    assert cost.state_bytes(p, accumulated) - cost.state_bytes(p, streamed) == weight * P
    assert cost.globals_for(p, accumulated).streamed_grads == 0
    # no staging slots (no gradient of it goes to the host), and offloaded gradients leave its bytes as they are
    og = dataclasses.replace(streamed, offload_gradients=True)
    assert cost.state_bytes(p, og) == cost.state_bytes(p, streamed)
    for d in (streamed, og):
        assert cost.globals_for(p, d).host_bytes == 12 * P
    # not a resident gradient: not among those that come and go with the backward
    assert cost.gradient_bytes(p, streamed)[1][2] == 0 < cost.gradient_bytes(p, base)[1][2]
    # a bigger block than a slot: the slots hold stream_slot_numel elements each
    small = CPUOffloadConfig(stream_slot_numel=1024, stream_slots=3)
    assert streaming.ring_bytes(p, dataclasses.replace(streamed, offload_config=small)) == 3 * 1024 * 16
    assert streaming.ring_bytes(p, base) == 0


def test_a_streamed_block_is_a_job_of_the_link_alone() -> None:
    """Block 0 (needed first) after a clipped backward: streamed, the next forward waits for its 12 B per parameter
    to come up at the duplex rate, whatever the host's pace; stepped on the host, for 4 B down, its host step and
    4 B up. Its device step is 32 B of memory traffic per parameter, priced in the device's step."""
    p = make_profile(n_layers=4)
    n, P = len(p.blocks), p.blocks[0].num_params
    bw = p.machine.duplex_bandwidth
    streamed = decisions(n, stream_blocks=one(n, 0))
    host = decisions(n, offload_blocks=one(n, 0))
    for rate in (4e9, 1e7):
        q = with_machine(p, host_adam_params_per_s=rate)
        h = host_rate(rate, True)  # clipped: the gradient's scaling pass beside the fused step
        assert h == pytest.approx(rate * 28 / 36)
        assert host_exposed_seconds(q, streamed, 0.0) == (0.0, pytest.approx(stream_link_seconds(P, bw)))
        assert host_exposed_seconds(q, host, 0.0) == (pytest.approx(P / h), pytest.approx(8 * P / bw + P / h))
        unclipped = dataclasses.replace(host, grad_clipping=False)
        assert host_exposed_seconds(q, unclipped, 0.0)[0] == pytest.approx(P / rate)
        # the clip coefficient inside the fused kernel (CPUOffloadConfig.scale_in_kernel): no scaling pass to price
        in_kernel = dataclasses.replace(host, offload_config=CPUOffloadConfig(scale_in_kernel=True))
        assert host_rate(rate, True, in_kernel.offload_config) == rate
        assert host_exposed_seconds(q, in_kernel, 0.0)[0] == pytest.approx(P / rate)
    # no host at all: streaming still works, host stepping cannot
    none = with_machine(p, host_adam_params_per_s=0.0)
    assert host_exposed_seconds(none, streamed, 0.0)[1] == pytest.approx(stream_link_seconds(P, bw))
    assert math.isinf(host_exposed_seconds(none, host, 0.0)[1])
    g_s, g_h = cost.globals_for(p, streamed), cost.globals_for(p, host)
    # the fused step's device traffic, and the launches of its chunks on the host
    launches = streaming.LAUNCH_SECONDS_PER_CHUNK * streaming.chunks(p, streamed)
    assert launches > 0
    assert g_s.device_step_s - g_h.device_step_s == pytest.approx(32 * P / p.machine.memory_bandwidth + launches)


def test_streamed_chunks_follow_the_parameter_shapes() -> None:
    """Each streamed parameter steps in chunks of ``stream_slot_numel`` elements, read from the block signature."""
    p = make_profile(n_layers=2)
    blocks = (dataclasses.replace(p.blocks[0], signature="GPT2Block(1600,4800x1600,6400x1600)"), p.blocks[1])
    p = dataclasses.replace(p, blocks=blocks)
    from elbowroom.optim import CPUOffloadConfig

    d = decisions(2, stream_blocks=(True, False), offload_config=CPUOffloadConfig(stream_slot_numel=4096 * 1024))
    # 1600: 1 chunk; 7.68M: 2 chunks of 4.19M; 10.24M: 3
    assert streaming.chunks(p, d) == 6
    assert streaming.chunks(p, decisions(2)) == 0


def test_streamed_and_host_jobs_share_the_link() -> None:
    """Block 0 streams and block 1 steps on the host. After a clipped backward both are ready at once: the streamed
    job holds both directions from then on, block 1's gradients go down beside it at half the rate, and its weights
    come back after it (the optimizer enqueued the streamed states first). Without clipping, in the order their
    gradients become final: block 1's go down alone, before the stream starts at the backward's end, and its weights
    come back beside the stream at half the rate. The stream loses what the copies beside it take: half of the time
    they overlap it."""
    p = with_machine(make_profile(n_layers=2), host_adam_params_per_s=1e12)
    rate = host_rate(1e12, True)  # a host step shorter than the stream (clipped: with the scaling pass)
    P0, P1 = p.blocks[0].num_params, p.blocks[1].num_params
    bw = p.machine.duplex_bandwidth
    need_1 = p.blocks[0].forward_s  # the next forward reaches block 1 (at the profile's micro-batch)
    d = decisions(2, offload_blocks=(False, True), stream_blocks=(True, False))
    down = fill_after([(0.0, stream_link_seconds(P0, bw))], 0, 0.0, 4 * P1 / bw)[0]
    assert down == pytest.approx(2 * 4 * P1 / bw)  # (the gradients' copy ends inside the stream: half the rate)
    stream = (0.0, stream_link_seconds(P0, bw) + 0.5 * down)  # (and the stream lost half of that time to it)
    # its weights come back behind the streamed states, enqueued before them when step() opened the gate
    back = max(down + P1 / rate, stream[1]) + 4 * P1 / bw
    assert back > fill_after([stream], 0, down + P1 / rate, 4 * P1 / bw)[0]  # (later than sharing the link)
    want = max(stream[1], back - need_1)
    assert host_exposed_seconds(p, d, 0.0) == (pytest.approx(P1 / rate), pytest.approx(want))
    # without clipping: block 1's gradients are final first, block 0's at the backward's end
    b0, b1, head = p.blocks[0].backward_s, p.blocks[1].backward_s, p.head.backward_s
    t_end = head + b1 + b0
    stream = (t_end, t_end + stream_link_seconds(P0, bw))
    eager = dataclasses.replace(d, grad_clipping=False)
    rate = 1e12  # (no clipping: no scaling pass)
    down = fill_after([stream], 0, head + b1, 4 * P1 / bw)[0]
    back_begin = down + P1 / rate
    back = fill_after([stream], 0, back_begin, 4 * P1 / bw)[0]
    unshared = max(stream[1] - t_end, back - (t_end + need_1))  # the stream as if alone on the link
    total, exposed = host_exposed_seconds(p, eager, 0.0)
    assert total == pytest.approx(P1 / rate)
    # the weights' copy overlaps the stream: the stream ends later by half that overlap, which at half the rate is
    # at most twice the copy's own time; the copy's end moves as much
    overlap = max(0.0, min(back, stream[1]) - max(back_begin, stream[0]))
    assert overlap > 0
    assert unshared < exposed <= unshared + 4 * P1 / bw + 1e-9
    # the copies beside busy time: 3 s before an interval from 3 to 5, then 1 s of copy in its 2 s at half the rate
    assert fill_after([(3.0, 5.0), (9.0, 10.0)], 0, 0.0, 4.0) == (5.0, 0)
    assert fill_after([(3.0, 5.0), (9.0, 10.0)], 0, 0.0, 5.0) == (6.0, 1)
    assert fill_after([(3.0, 5.0)], 0, 4.0, 1.0) == (5.5, 1)
    assert fill_after([(3.0, 5.0)], 0, 4.0, 0.25) == (4.5, 0)
    assert fill_after([(3.0, 5.0)], 0, 6.0, 1.0) == (7.0, 1)


def test_the_host_steps_slower_while_streamed_states_hold_the_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host AdamW and the copies' DMA share host memory: a host-stepped block whose step runs while streamed states
    hold the link steps at HOST_RATE_BESIDE_STREAMS of the rate, and its weights come back later by as much."""
    n, rate = 4, 4e9
    p = with_machine(make_profile(n_layers=n), duplex_bandwidth=45e9, host_adam_params_per_s=rate)
    host_only = decisions(n, offload_blocks=(True, True, False, False), grad_clipping=True)
    beside = decisions(n, offload_blocks=(True, True, False, False), stream_blocks=(False, False, True, True),
                       grad_clipping=True)
    alone = host_exposed_seconds(p, host_only, 0.0)[1]
    shared = host_exposed_seconds(p, beside, 0.0)[1]
    # the work itself is priced at the measured rate either way ...
    assert host_exposed_seconds(p, beside, 0.0)[0] == pytest.approx(host_exposed_seconds(p, host_only, 0.0)[0])
    # ... but beside the streams it ends later: by at most the slower pace over the whole host step, plus the streams'
    # own time on the link
    host_s = sum(b.num_params for b in p.blocks[:2]) / rate
    streams_s = sum(stream_link_seconds(b.num_params, 45e9) for b in p.blocks[2:])
    assert alone < shared <= alone + host_s * (1 / HOST_RATE_BESIDE_STREAMS - 1) + 2 * streams_s + 1e-9
    # and the slower pace is what moves it: at the full pace beside the streams it would end sooner
    monkeypatch.setattr(pipeline, "HOST_RATE_BESIDE_STREAMS", 1.0)
    assert host_exposed_seconds(p, beside, 0.0)[1] < shared
    # the pace itself: 1 s of host work inside a busy interval takes 1 / share s; half inside, half after
    assert fill_after([(0.0, 10.0)], 0, 0.0, 1.0, HOST_RATE_BESIDE_STREAMS) == (
        pytest.approx(1 / HOST_RATE_BESIDE_STREAMS), 0)
    end, _ = fill_after([(0.0, 0.5)], 0, 0.0, 1.0, HOST_RATE_BESIDE_STREAMS)
    assert end == pytest.approx(0.5 + 1.0 - 0.5 * HOST_RATE_BESIDE_STREAMS)


def test_half_streamed_matches_the_optimizer_s_benchmark() -> None:
    """``benchmarks/stream_step.py`` on the H100 (2026-11-24, call 3): 53 matrices of 4096x11008 after a clipped
    backward, the late ones streamed, with nothing to hide behind (no forward), on a link that moves 45-47 GB/s each
    way at once (the lent H100s' measured duplex; 46 here) where the streamed states moved at 38
    (``STREAM_LINK_EFFICIENCY``): measured
    0.84 s none streamed (the host at 2.85 G params/s), 0.59 half, 0.57 at 60%, 0.75 all. Beside that benchmark's
    streamed states the host's AdamW slowed from 2.8 to 2.0 G params/s: one machine rate prices all four, the model
    slowing the host while streamed states hold the link (``HOST_RATE_BESIDE_STREAMS``)."""
    p = make_profile(n_layers=53)
    blocks = tuple(dataclasses.replace(b, num_params=4096 * 11008, forward_s=0.0, backward_s=0.0) for b in p.blocks)
    p = dataclasses.replace(p, blocks=blocks)
    n = len(blocks)
    got = {}
    for k in (0, 26, 32, 53):
        # the rate the clipped benchmark's host stepped at alone (its scaling pass included): the machine's fused
        # AdamW rate is 36 / 28 of it
        q = with_machine(p, duplex_bandwidth=46e9, host_adam_params_per_s=2.85e9 * 36 / 28)
        streamed = tuple(i >= n - k for i in range(n))
        d = decisions(n, offload_blocks=tuple(not x for x in streamed), stream_blocks=streamed if k else ())
        got[k] = host_exposed_seconds(q, d, 0.0)[1]
    assert got[0] == pytest.approx(0.84, rel=0.05)
    assert got[26] == pytest.approx(0.59, rel=0.1)
    assert got[32] == pytest.approx(0.57, rel=0.15)
    assert got[53] == pytest.approx(0.75, rel=0.05)


def test_streamed_states_slow_the_activation_copies_beside_them() -> None:
    """Streamed states take both directions of the link, so the activation copies of the micro-batch beside the
    optimizer's get half the duplex rate instead of all of it, and nothing hides them (what they take of the link
    they take from the streamed states); host-stepped jobs leave them the other direction."""
    p = with_machine(make_profile(n_layers=4), h2d_bandwidth=2e9, d2h_bandwidth=2e9, duplex_bandwidth=1.5e9)
    n = len(p.blocks)
    opts = (Option("none", 1.0),) * 3 + (Option(),)
    host = decisions(n, options=opts, offload_blocks=one(n, 3))
    streamed = decisions(n, options=opts, stream_blocks=one(n, 3))
    x_host = cost.predict(p, host, 80 * GiB).time["exposed activation copies"]
    x_stream = cost.predict(p, streamed, 80 * GiB).time["exposed activation copies"]
    b = p.blocks[0]
    copy = b.total_saved_bytes
    # blocks 0 and 1 hide behind the next block (it offloads too); block 2, the last that offloads, behind block 3's
    # forward and backward and the head's forward
    last = p.blocks[3]
    assert x_host == pytest.approx(3 * 2 * copy / 1.5e9 - 2 * (b.forward_s + b.backward_s)
                                   - (last.forward_s + p.head.forward_s + last.backward_s))
    assert cost.stream_share(streamed, p) == cost.duplex_share(streamed) == 1.0  # the link held the whole window
    assert x_stream == pytest.approx(3 * 2 * copy / 0.75e9)


def test_decisions_refuse_a_block_both_on_the_host_and_streamed() -> None:
    with pytest.raises(ValueError, match="both steps on the host and streams"):
        decisions(2, offload_blocks=(True, False), stream_blocks=(True, False))
    with pytest.raises(ValueError, match="one per block"):
        decisions(2, stream_blocks=(True,))


def test_peak_bytes_is_predicts_peak_with_streamed_blocks() -> None:
    p = make_profile(n_layers=6, vary=True)
    n = len(p.blocks)
    rng = random.Random(0)
    for _ in range(20):
        where = [rng.choice("dhs") for _ in range(n)]
        idx = [rng.randrange(len(cost.OPTIONS)) for _ in range(n)]
        d = decisions(n, options=tuple(cost.OPTIONS[i] for i in idx), layout=rng.choice(list(cost.LAYOUTS)),
                      offload_blocks=tuple(w == "h" for w in where), stream_blocks=tuple(w == "s" for w in where),
                      grad_clipping=rng.random() < 0.5, offload_gradients=rng.random() < 0.5)
        assert phases.peak_bytes(p, d, np.asarray(idx), 30 * GiB, 1 << 28) == cost.predict(
            p, d, 30 * GiB, prefetch_window_bytes=1 << 28).peak_bytes


# ---------------------------------------------------------------------------------------------- search
SLOW_HOST = dict(host_adam_params_per_s=5e8)


@pytest.mark.parametrize("clip", [True, False])
def test_a_slow_host_and_a_free_link_stream(clip: bool) -> None:
    """W1 with a host stepping 0.5 G params/s: where the optimizer must leave the device, streaming it is faster
    than stepping it on the host, and the search takes it."""
    p = with_machine(make_profile(), **SLOW_HOST)
    kw = dict(precision="bf16", fused_loss_allowed=True, grad_clipping=clip)
    for budget in (14 * GiB, 20 * GiB):
        streams = plan_for(p, budget, **kw)
        host = plan_for(p, budget, stream_allowed=False, **kw)
        assert host.optimizer_offload_blocks and not host.optimizer_stream_blocks
        assert streams.optimizer_stream_blocks
        assert streams.predicted_step_seconds < 0.9 * host.predicted_step_seconds
        assert streams.predicted_peak_bytes <= budget
        # its prediction is the cost model's for its decisions (one expression)
        again = cost.predict(p, streams.decisions(), budget).step_seconds
        assert math.isclose(again, streams.predicted_step_seconds, rel_tol=1e-9)
        # late blocks leave the device first: the streamed ones, then the host-stepped ones needed last
        off = streams.optimizer_stream_blocks + streams.optimizer_offload_blocks
        assert off == tuple(range(len(p.blocks) - len(off), len(p.blocks)))


def test_a_fast_host_and_a_busy_link_step_on_the_host() -> None:
    """A host stepping 40 G params/s, where the link carries activations: the host's 8 B per parameter on the link
    beat streaming's 24 and leave the activations' direction free; the search keeps the host."""
    p = with_machine(make_profile(), host_adam_params_per_s=4e10)
    for budget in (12 * GiB, 16 * GiB, 24 * GiB):
        plan = plan_for(p, budget, precision="bf16", fused_loss_allowed=True)
        assert plan.optimizer_offload_blocks and not plan.optimizer_stream_blocks
        assert sum(b.offloaded_bytes for b in plan.blocks) > GiB  # (the link carries activations)
    plan = plan_for(p, 12 * GiB, precision="bf16", fused_loss_allowed=True)
    # the same decisions with the host's blocks streamed: slower, the activation copies most of all
    d = plan.decisions()
    streamed = dataclasses.replace(d, offload_blocks=(False,) * len(d.offload_blocks), stream_blocks=d.offload_blocks)
    a, b = cost.predict(p, d, 12 * GiB), cost.predict(p, streamed, 12 * GiB)
    assert b.step_seconds > a.step_seconds
    assert b.time["exposed activation copies"] > a.time["exposed activation copies"]


@pytest.mark.parametrize("clip", [True, False])
def test_tighter_budgets_never_predict_faster_steps_when_blocks_stream(clip: bool) -> None:
    p = with_machine(make_profile(vary=True, n_layers=16), host_adam_params_per_s=1e9)
    kw = dict(precision="bf16", fused_loss_allowed=True, grad_clipping=clip, global_batch=8)
    with pytest.raises(BudgetError) as e:
        plan_for(p, 1 << 20, **kw)
    low = e.value.minimum_bytes
    rng = random.Random(int(clip))
    prev, streamed = None, 0
    for b in sorted({low, 60 * GiB, *(rng.randint(low, 60 * GiB) for _ in range(16))}):
        plan = plan_for(p, b, **kw)
        assert plan.predicted_peak_bytes <= b
        streamed += bool(plan.optimizer_stream_blocks)
        if prev is not None:
            assert plan.predicted_step_seconds <= prev
        prev = plan.predicted_step_seconds
    assert streamed  # (the sweep exercised streamed plans)


def test_streaming_can_be_ruled_out_and_never_loses() -> None:
    """``stream_allowed=False`` plans as before streaming existed; allowed, a plan is never predicted slower."""
    p = with_machine(make_profile(n_layers=8), host_adam_params_per_s=1e9)
    for budget in (10 * GiB, 14 * GiB, 40 * GiB):
        off = plan_for(p, budget, precision="bf16", stream_allowed=False)
        on = plan_for(p, budget, precision="bf16")
        assert not off.optimizer_stream_blocks
        assert on.predicted_step_seconds <= off.predicted_step_seconds


def test_a_hundred_blocks_with_a_slow_host_plan_in_seconds() -> None:
    p = with_machine(make_profile(n_layers=100, dim=1024, ffn=2816, vary=True), **SLOW_HOST)
    kw = dict(precision="bf16", fused_loss_allowed=True, global_batch=16)
    t0 = time.perf_counter()
    plan = plan_for(p, 16 * GiB, **kw)
    took = time.perf_counter() - t0
    assert plan.optimizer_stream_blocks and plan.predicted_peak_bytes <= 16 * GiB
    assert took < 10.0, f"search took {took:.1f} s"


# ---------------------------------------------------------------------------------------------- the plan
@pytest.fixture(scope="module")
def streaming_plan() -> Plan:
    p = with_machine(make_profile(n_layers=8), **SLOW_HOST)
    plan = plan_for(p, 8 * GiB, precision="bf16", fused_loss_allowed=True)
    assert plan.optimizer_stream_blocks
    return plan


def test_a_streaming_plan_round_trips_toml_and_json(streaming_plan: Plan, tmp_path: Path) -> None:
    assert Plan.from_toml(streaming_plan.to_toml()) == streaming_plan
    assert Plan.from_json(streaming_plan.to_json()) == streaming_plan
    for name in ("p.toml", "p.json"):
        assert Plan.load(streaming_plan.save(tmp_path / name)) == streaming_plan
    rows = json.loads(streaming_plan.to_json())["blocks"]
    assert [r["optimizer_streamed"] for r in rows] == [b.optimizer_streamed for b in streaming_plan.blocks]
    # a plan file from before the field: no block streams
    old = streaming_plan.to_dict()
    for r in old["blocks"]:
        del r["optimizer_streamed"]
    assert not Plan.from_dict(old).optimizer_stream_blocks
    # the decisions read back as they were made
    assert streaming_plan.decisions().stream_blocks == tuple(b.optimizer_streamed for b in streaming_plan.blocks)


def test_the_table_shows_streamed_blocks(streaming_plan: Plan) -> None:
    text = streaming_plan.table()
    rows = {int(line[:5]): line for line in text.splitlines() if line[:5].strip().isdigit()}
    for b in streaming_plan.blocks:
        want = "host" if b.optimizer_on_host else "stream" if b.optimizer_streamed else "device"
        assert rows[b.index].split()[-5] == want  # (then kept, offloaded, recomputed, ms)
    s = streaming_plan.optimizer_stream_blocks
    assert f"streamed to step on the device: blocks {s[0]}-{s[-1]} ({len(s)})" in text
    assert "host and streamed optimizer steps (exposed)" in text


def test_a_block_row_cannot_be_both_on_the_host_and_streamed() -> None:
    with pytest.raises(ValueError, match=r"blocks\[3\] sets both optimizer_on_host and optimizer_streamed"):
        BlockPlan(index=3, optimizer_on_host=True, optimizer_streamed=True)


def test_the_cli_plans_without_streaming_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(with_machine(make_profile(), **SLOW_HOST).to_dict()))
    args = ["--profile", str(path), "--budget", "16GiB", "--precision", "bf16", "--json"]
    assert cmd_plan(args) == 0
    assert any(b["optimizer_streamed"] for b in json.loads(capsys.readouterr().out)["blocks"])
    assert cmd_plan([*args, "--no-stream"]) == 0
    assert not any(b["optimizer_streamed"] for b in json.loads(capsys.readouterr().out)["blocks"])


# ---------------------------------------------------------------------------------------------- apply
def _tiny():
    import torch

    from elbowroom.models import ModelConfig, build_model

    torch.manual_seed(0)
    return build_model(ModelConfig.from_preset("tiny")).train()


def _stream_plan(n: int = 4) -> Plan:
    rows = [BlockPlan(index=0), BlockPlan(index=1, checkpoint="full"), BlockPlan(index=2, optimizer_streamed=True),
            BlockPlan(index=3, optimizer_on_host=True)][:n]
    return Plan(blocks=tuple(rows), budget_bytes=1 << 30, predicted_peak_bytes=0, predicted_step_seconds=1.0,
                predicted_tokens_per_s=1.0)


def _split_plan() -> Plan:
    rows = tuple(BlockPlan(index=i, optimizer_streamed=i >= 2, checkpoint="full" if i == 1 else "none")
                 for i in range(4))
    return Plan(blocks=rows, budget_bytes=1 << 30, predicted_peak_bytes=0, predicted_step_seconds=1.0,
                predicted_tokens_per_s=1.0, optimizer_split_share=0.5)


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The keyword arguments ``apply`` builds its CPUOffloadOptimizer with (the optimizer replaced by a recorder)."""
    import elbowroom.optim

    got: dict = {}

    class Recorder:
        def __init__(self, params, optimizer_class, **kw) -> None:
            got.update(kw, optimizer_class=optimizer_class)

        def overlap_with_forward(self, model) -> None:
            pass

    monkeypatch.setattr(elbowroom.optim, "CPUOffloadOptimizer", Recorder)
    return got


def test_apply_hands_the_streamed_parameters_to_the_optimizer(built: dict) -> None:
    """Streamed blocks' parameters are offloaded parameters that the optimizer streams: ``offload_params`` holds
    them and the host-stepped ones, ``stream_params`` them alone (the optimizer's keyword, captured here)."""
    import torch

    got = built
    model = _tiny()
    apply(model, _stream_plan(), torch.optim.AdamW, lr=1e-3)
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(got["stream_params"]) == ids(model.blocks[2].parameters())
    assert ids(got["offload_params"]) == ids(model.blocks[2].parameters()) | ids(model.blocks[3].parameters())
    # a plan that streams nothing builds the optimizer as before: no such keyword
    got.clear()
    rows = tuple(dataclasses.replace(b, optimizer_streamed=False) for b in _stream_plan().blocks)
    apply(_tiny(), dataclasses.replace(_stream_plan(), blocks=rows), torch.optim.AdamW, lr=1e-3)
    assert "stream_params" not in got and got["offload_params"]


def test_only_adam_and_adamw_stream() -> None:
    import torch

    with pytest.raises(ValueError, match="only Adam and AdamW without amsgrad can .* not SGD with .*: plan again"):
        apply(_tiny(), _stream_plan(), torch.optim.SGD, lr=1e-3)
    with pytest.raises(ValueError, match="not AdamW with {'amsgrad': True}"):
        apply(_tiny(), _stream_plan(), torch.optim.AdamW, amsgrad=True)


def _streams() -> bool:
    from elbowroom.optim import CPUOffloadOptimizer

    return "stream_params" in inspect.signature(CPUOffloadOptimizer.__init__).parameters


@pytest.mark.skipif(not _streams(), reason="CPUOffloadOptimizer has no stream_params yet")
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_a_streaming_plan_trains_like_plain(split: bool) -> None:
    """Streamed, host-stepped and device blocks together take the steps torch's AdamW takes (fp32, CPU); so do split
    blocks (their largest tensors on the host, the rest streamed)."""
    import torch
    import torch.nn.functional as F

    from elbowroom.optim import CPUOffloadConfig

    ref = _tiny()
    model = copy.deepcopy(ref)
    knobs = CPUOffloadConfig(bucket_bytes=1 << 16, num_staging_slots=2, cpu_threads=1, stream_slot_numel=1 << 12)
    plan = _split_plan() if split else _stream_plan()
    model, opt = apply(model, plan, torch.optim.AdamW, offload_config=knobs, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(3):
            F.cross_entropy(m(idx).flatten(0, 1).float(), idx.flatten()).backward()
            o.step()
            o.zero_grad()
    opt.wait_for_weights()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):  # (as tests/test_plan_apply.py: 1e-5)
        err = ((a.detach() - b.detach()).norm() / b.detach().norm().clamp_min(1e-30)).item()
        assert err <= 1e-5, f"{name}: relative error {err:.3e}"


def test_fit_streams_only_for_adam_and_adamw(monkeypatch: pytest.MonkeyPatch) -> None:
    """fit knows the optimizer: it lets the search stream blocks for Adam and AdamW (without AMSGrad) alone."""
    import torch

    from elbowroom.plan import fit, search

    asked: list[bool] = []

    class Planned(Exception):
        pass

    def plan_for_spy(*args, **kw):
        asked.append(kw["stream_allowed"])
        raise Planned

    monkeypatch.setattr(search, "plan_for", plan_for_spy)
    for opt, kw in ((torch.optim.AdamW, {}), (torch.optim.Adam, {}), (torch.optim.SGD, {"lr": 0.1}),
                    (torch.optim.AdamW, {"amsgrad": True})):
        with pytest.raises(Planned):
            fit(_tiny(), torch.randint(0, 256, (1, 16)), "1GiB", opt, source="analytic", machine="h100-80gb", **kw)
    assert asked == [True, True, False, False]


def test_a_host_memory_limit_keeps_offloaded_parameters_near_their_12_bytes() -> None:
    """The 7B shape at one sequence per step on an 80 GB card: unbounded, the fastest plan sends host-stepped
    gradients to the host (16 B per offloaded parameter); on a host of ~12 B per offloaded parameter the planner keeps
    them on the device (staged at the step) and streams state instead, within the host's memory, at a step no
    faster than an unbounded host's. (The limited plan gets 1 GiB more of the device than the plan that sized the
    limit: its streamed gradients are held past the backward, their link job being long.)"""
    p = make_profile(dim=4096, n_layers=32, ffn=11008, micro_batch=1, seq_len=4096)
    budget = 76 * GiB

    def per_param(plan: Plan) -> tuple[int, float]:
        off = sum(b.num_params for b, bp in zip(p.blocks, plan.blocks) if bp.optimizer_on_host or bp.optimizer_streamed)
        other = p.head.num_params if plan.offload_other_params else 0
        n = off + other
        return n, plan.host_bytes / n

    kw = dict(precision="bf16", fused_loss_allowed=True, grad_clipping=False, gradient_offload_allowed=True)
    free = plan_for(p, budget, **kw)
    n_free, b_free = per_param(free)
    assert free.offload_gradients and b_free > 13.5
    limit = int(12.3 * n_free)  # the same parameters at 12.3 B each: no room for their host gradients
    tight = plan_for(with_machine(p, host_memory_bytes=limit), budget + GiB, **kw)
    n_tight, b_tight = per_param(tight)
    assert tight.host_bytes <= limit and b_tight <= 12.3
    assert not tight.offload_gradients
    assert tight.predicted_step_seconds >= plan_for(p, budget + GiB, **kw).predicted_step_seconds


def test_a_plan_the_host_binds_says_what_more_host_memory_would_buy() -> None:
    """The 7B shape on a 40 GiB host at a budget where the host binds (BENCHMARKS.md, twenty-sixth session: on a
    32 GiB host the fp32 layout no longer fits the host at 72 GiB): the plan is the same as without the note, and
    the note names the host memory and the step of the plan made without the host's limit. A plan without that
    limit, or on a host with room, has no note."""
    from elbowroom.plan import search

    p = make_profile(dim=4096, n_layers=32, ffn=11008, micro_batch=1, seq_len=4096)
    kw = dict(precision="bf16", fused_loss_allowed=True, grad_clipping=False, gradient_offload_allowed=True)
    host, budget = 40 * GiB, 70 * GiB  # (here the limit costs 7%: 0.79 s against 0.73)
    tight = with_machine(p, host_memory_bytes=host)
    plan, free = plan_for(tight, budget, **kw), plan_for(with_machine(p, host_memory_bytes=0), budget, **kw)
    assert free.predicted_step_seconds < (1 - search.HOST_NOTE_GAIN) * plan.predicted_step_seconds
    note = [n for n in plan.notes if "binds this plan" in n]
    assert len(note) == 1 and plan.host_bytes >= search.HOST_BINDS * host
    assert f"with {size_text(free.host_bytes)} of host memory" in note[0]
    assert f"would take {free.predicted_step_seconds * 1e3:.0f} ms ({plan.predicted_step_seconds * 1e3:.0f} here)" in (
        note[0])
    assert dataclasses.replace(plan, notes=()) == dataclasses.replace(
        plan_for(tight, budget, **kw), notes=())  # the note changes nothing else
    assert not any("binds this plan" in n for n in free.notes)
    roomy = plan_for(with_machine(p, host_memory_bytes=1024 * GiB), budget, **kw)
    assert not any("binds this plan" in n for n in roomy.notes)


# ---------------------------------------------------------------------------------------------- split blocks
def test_a_split_block_puts_its_largest_tensors_on_the_host() -> None:
    """The rule the planner prices and ``apply`` builds: largest first, each taken where it brings the host's part
    nearer the share. W1's block (fused qkv 6144x2048, output 2048x2048, gate-and-up 11264x2048, down 2048x5632, two
    norms): at 1/2 the gate-and-up and the output (53%), at 2/3 the gate-and-up and the qkv (69%)."""
    sizes = (2048, 6144 * 2048, 2048 * 2048, 2048, 11264 * 2048, 2048 * 5632)  # block.parameters() order
    assert streaming.split_on_host(sizes, 0.5) == (False, False, True, False, True, False)
    assert streaming.split_on_host(sizes, 2 / 3) == (False, True, False, False, True, False)
    assert streaming.split_on_host(sizes, 1 / 3) == (False, False, False, False, True, False)
    sig = "LlamaBlock(2048,6144x2048,2048x2048,2048,11264x2048,2048x5632)"
    total = sum(sizes)
    assert streaming.host_part(sig, total, 0.5) == 11264 * 2048 + 2048 * 2048
    assert streaming.host_part(sig, total, 0.0) == 0
    assert streaming.host_part("Opaque()", 1000, 0.5) == 500  # no shapes listed: the share of its parameters


def test_a_split_block_is_a_host_job_and_a_link_job() -> None:
    """Split, a block's host part steps on the host (its 4 B down and up, its host step) and the rest streams (12 B
    each way): its device bytes are the two parts' and its host bytes 12 B per parameter plus its host part's
    gradient where gradients leave; priced between streamed whole and stepped on the host whole."""
    p = make_profile(n_layers=4)
    n = len(p.blocks)
    whole = decisions(n, stream_blocks=(True,) * n, grad_clipping=False)
    split = dataclasses.replace(whole, split_share=0.5)
    host, stream = streaming.optimizer_parts(p, split)
    sig = p.blocks[0].signature
    assert host == tuple(streaming.host_part(sig, b.num_params, 0.5) for b in p.blocks)
    assert all(0 < h < b.num_params for h, b in zip(host, p.blocks))
    assert stream == tuple(b.num_params - h for h, b in zip(host, p.blocks))
    assert streaming.optimizer_parts(p, whole) == ((0,) * n, tuple(b.num_params for b in p.blocks))
    # device bytes: the host part's weight (and gradient, kept until its copy) where the stream's weight was
    _, p_off, p_str = cost._param_split(p, split)
    assert (p_off, p_str) == (sum(host), sum(stream))
    # with the host and the link each too slow to carry every block alone, a split that keeps both busy beats both
    # extremes
    slow = with_machine(p, duplex_bandwidth=p.machine.duplex_bandwidth / 8,
                        host_adam_params_per_s=p.machine.host_adam_params_per_s / 8)
    on_host = decisions(n, offload_blocks=(True,) * n, grad_clipping=False)
    t = {name: host_exposed_seconds(slow, d, 0.0)[1] for name, d in
         (("stream", whole), ("split", split), ("host", on_host))}
    assert t["split"] < t["stream"] and t["split"] < t["host"]
    with pytest.raises(ValueError, match=r"split_share is a share .* in \[0, 1\)"):
        dataclasses.replace(whole, split_share=1.0)


def test_apply_hands_a_split_block_s_largest_tensors_to_the_host(built: dict) -> None:
    import torch

    got = built
    model = _tiny()
    apply(model, _split_plan(), torch.optim.AdamW, lr=1e-3)
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    split = [model.blocks[2], model.blocks[3]]
    assert ids(got["offload_params"]) == set().union(*(ids(b.parameters()) for b in split))
    for b in split:
        own = list(b.parameters())
        host = streaming.split_on_host(tuple(p.numel() for p in own), 0.5)
        assert any(host) and not all(host)
        assert ids(p for p, h in zip(own, host) if not h) <= ids(got["stream_params"])
        assert not ids(p for p, h in zip(own, host) if h) & ids(got["stream_params"])


def test_a_split_plan_round_trips_reads_in_the_table_and_needs_streamed_blocks(tmp_path: Path) -> None:
    plan = _split_plan()
    for name in ("p.toml", "p.json"):
        assert Plan.load(plan.save(tmp_path / name)) == plan
    assert plan.decisions().split_share == 0.5
    old = plan.to_dict()
    del old["optimizer_split_share"]  # a plan file from before the field: streamed blocks stream whole
    assert Plan.from_dict(old).optimizer_split_share == 0.0
    text = plan.table()
    assert "each split: its largest tensors, as near 50% of its parameters as they come, step on the host" in text
    rows = {int(line[:5]): line for line in text.splitlines() if line[:5].strip().isdigit()}
    assert rows[2].split()[-5] == "split" and rows[0].split()[-5] == "device"
    none = tuple(dataclasses.replace(b, optimizer_streamed=False) for b in plan.blocks)
    with pytest.raises(ValueError, match="optimizer_split_share splits the streamed blocks, and no block streams"):
        dataclasses.replace(plan, blocks=none)


def test_the_search_splits_where_the_host_and_the_link_are_both_needed() -> None:
    """Eight W1-shaped blocks with room for every one's weight but not its optimizer: streamed whole, the early
    blocks' states wait for the backward's end; the plan splits the blocks between the host and the link, and is
    predicted faster than the best plan that may not split."""
    p = make_profile(n_layers=8)
    kw = dict(precision="bf16", fused_loss_allowed=True, grad_clipping=False)
    with pytest.raises(BudgetError) as e:
        plan_for(p, 1 << 20, **kw)
    budget = e.value.minimum_bytes + 3 * GiB
    plan = plan_for(p, budget, **kw)
    assert plan.optimizer_split_share > 0 and len(plan.optimizer_stream_blocks) == 8
    from elbowroom.plan import search

    old = search.streaming.SPLIT_SHARES
    search.streaming.SPLIT_SHARES = ()
    try:
        unsplit = plan_for(p, budget, **kw)
    finally:
        search.streaming.SPLIT_SHARES = old
    assert unsplit.optimizer_split_share == 0
    assert plan.predicted_step_seconds < unsplit.predicted_step_seconds


def test_a_streamed_gradient_is_held_until_its_block_s_next_forward() -> None:
    """The optimizer holds a streamed block's gradient from that block's backward to its forward pre-hook in the next
    step (``Handover.release_grads``), however fast the link: backward block i holds the streamed gradients of blocks
    i..n-1, forward block i those of blocks i+1..n-1, the forward's end none, the optimizer step all of them. A plan
    whose streamed blocks come after device-resident ones keeping their activations (the 7B shape at 48 GiB, which
    ran out of memory when they were not counted) pays for them in its early blocks; one whose first block streams
    holds them beside few activations."""
    p = make_profile(n_layers=8)
    n = len(p.blocks)
    idx = np.zeros(n, dtype=np.int64)  # every block kept
    late = decisions(n, stream_blocks=tuple(i >= 4 for i in range(n)), grad_clipping=False)
    g = cost.globals_for(p, late)
    per = cost.streamed_gradient_bytes(p, late)
    assert per[:4] == (0,) * 4 and all(x > 0 for x in per[4:]) and g.streamed_grads == sum(per)
    ph = phases.phases(p, g, late, idx, 1 << 30)
    assert ph.streamed.tolist() == [sum(per[i:]) for i in range(n)] + [0]
    assert ph.describe(0)[1]["streamed gradients held"] == sum(per)  # forward block 0: all still held
    assert "streamed gradients held" not in ph.describe(n - 1)[1]  # the last block's own is released by its hook
    assert "streamed gradients held" not in ph.describe(n)[1]  # forward end
    assert ph.describe(n + 1 + 5)[1]["streamed gradients held"] == sum(per[5:])  # backward block 5
    assert ph.describe(2 * n + 1)[1]["streamed gradients held"] == sum(per)  # optimizer step
    # the peak the search checks is the one predict reports
    budget = 80 * GiB
    pred = cost.predict(p, dataclasses.replace(late, options=(cost.Option(),) * n), budget)
    assert phases.peak_bytes(p, late, idx, budget, 1 << 30, g) == pred.peak_bytes
    # streamed first: the gradients are held beside the early blocks' few kept bytes, so the plan costs less than
    # the same streamed bytes after four blocks that keep everything
    early = decisions(n, stream_blocks=tuple(i < 4 for i in range(n)), grad_clipping=False)
    assert sum(cost.streamed_gradient_bytes(p, early)) == pytest.approx(sum(per), rel=0.01)
    lo = cost.predict(p, dataclasses.replace(early, options=(cost.Option(),) * n), budget).peak_bytes
    assert lo <= pred.peak_bytes
    # a split block holds its streamed tensors' gradients alone
    split = dataclasses.replace(late, split_share=0.5)
    item = 2 if cost.LAYOUTS[split.layout][1] == "bfloat16" else 4
    assert 0 < sum(cost.streamed_gradient_bytes(p, split)) == item * sum(streaming.optimizer_parts(p, split)[1]) \
        < sum(per)


def test_the_minimum_with_streamed_blocks_names_them_and_plans() -> None:
    """With a host that cannot step, the least plan streams every block: the minimum the error names plans, 64 MiB
    less does not, and the error names the streamed gradients its least plan holds (at backward block 0, all of
    them)."""
    p = with_machine(make_profile(n_layers=8, dim=1024, ffn=4096, seq_len=64), host_adam_params_per_s=0.0)
    kw = dict(grad_clipping=False, fused_loss_allowed=True)  # (a small head: the backward's phases bind)
    with pytest.raises(BudgetError, match="streamed gradients held") as e:
        plan_for(p, 1 << 20, **kw)
    low = e.value.minimum_bytes
    plan = plan_for(p, low, **kw)
    assert plan.optimizer_stream_blocks and plan.predicted_peak_bytes <= low
    assert plan.memory["streamed gradients held"] == sum(cost.streamed_gradient_bytes(p, plan.decisions()))
    with pytest.raises(BudgetError):
        plan_for(p, low - (64 << 20), **kw)
