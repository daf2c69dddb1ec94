"""The cost model on hand-made profiles: model states by layout, activation bytes by option, scaling, the host
step's exposed part, and one expression of the step time shared with the search."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_plan_support import GiB, make_profile

from elbowroom.optim.config import CPUOffloadConfig
from elbowroom.plan import cost, options, phases
from elbowroom.plan.cost import OPTIONS, Decisions, Option


def decisions(n: int, **kw) -> Decisions:
    """All blocks kept, nothing offloaded, the profile's micro-batch of 4 (make_profile's default)."""
    kw.setdefault("micro_batch", 4)
    kw.setdefault("options", (Option(),) * n)
    kw.setdefault("offload_blocks", (False,) * n)
    return Decisions(**kw)


def test_model_states_per_parameter_by_layout() -> None:
    p = make_profile(n_layers=4, dim=256, ffn=512, vocab=1000, seq_len=128)
    n, P = len(p.blocks), p.num_params
    bucket, slots, chunk = cost._optimizer_config(decisions(n))  # the defaults
    assert cost.state_bytes(p, decisions(n)) == 16 * P
    off = dict(offload_blocks=(True,) * n, offload_other=True)
    # each staging slot holds one bucket of the offloaded gradients, or all of them when they are fewer
    assert cost.state_bytes(p, decisions(n, **off)) == 8 * P + slots * min(bucket, 4 * P)
    # bf16 device copies of the offloaded matrices, but the embedding table (before the blocks) stays fp32: its
    # output is the residual stream, fp32 under autocast as profiled (with after_params unknown, all of the head's)
    emb = 1000 * 256
    p = dataclasses.replace(p, head=dataclasses.replace(p.head, after_params=p.head.num_params - emb))
    assert cost.fp32_offloaded_params(p, decisions(n, layout="fp32-offload-bf16", **off)) == emb
    # and the two copy streams' buffers the casts to and from fp32 go through on the device
    casts = cost.CAST_STREAMS * CPUOffloadConfig().cast_chunk_bytes
    assert cost.state_bytes(p, decisions(n, layout="fp32-offload-bf16", **off)) == (
        4 * P + 4 * emb + slots * min(bucket, 2 * P) + casts)
    assert cost.state_bytes(p, decisions(n, layout="fp32-offload-bf16", offload_gradients=True, **off)) == (
        2 * P + 2 * emb + slots * min(bucket, P) + casts)
    assert cost.fp32_offloaded_params(p, decisions(n, layout="fp32-offload-bf16", offload_blocks=(True,) * n)) == 0
    half = (False, False, True, True)
    p_off = sum(b.num_params for b in p.blocks[2:])
    got = cost.state_bytes(p, decisions(n, layout="bf16", offload_blocks=half))
    assert got == 16 * (P - p_off) + 4 * p_off + slots * min(bucket, 2 * p_off) + 4 * min(chunk, P - p_off) + casts
    # none when the casts run on the host (the staging slots then hold bf16)
    on_host = decisions(n, layout="bf16", offload_blocks=half,
                        offload_config=CPUOffloadConfig(cast_on_device=False))
    assert cost.state_bytes(p, on_host) == got - casts


def test_option_bytes_follow_the_policies() -> None:
    b = make_profile(n_layers=1).blocks[0]
    kept, off, extra = options.option_bytes(b)
    S, sel, inp = b.total_saved_bytes, b.selective_saved_bytes, b.input_bytes
    by = {o: (k, f) for o, k, f in zip(OPTIONS, kept, off)}
    assert by[Option()] == (S, 0)
    assert by[Option("none", 0.5)] == (S / 2, S / 2)
    assert by[Option("selective")] == (sel, 0)
    assert by[Option("selective", 0.5)] == (sel - (sel - inp) / 2, (sel - inp) / 2)
    assert by[Option("selective", 1.0, True)] == (0, sel)
    assert by[Option("full")] == (inp, 0)
    assert by[Option("full", 0.0, True)] == (0, inp)
    assert (extra == S - kept).all() and (kept + off <= S + 1e-6).all()


def test_activations_and_times_scale_with_the_micro_batch() -> None:
    p = make_profile(n_layers=4, micro_batch=2)  # decisions at micro-batch 2 and 4
    n = len(p.blocks)
    opts = (Option("full"), Option("selective"), Option(), Option())
    one = cost.predict(p, decisions(n, options=opts, micro_batch=2), 80 * GiB)
    two = cost.predict(p, decisions(n, options=opts, micro_batch=4), 80 * GiB)
    for a, b in zip(one.blocks, two.blocks):
        assert b.kept_bytes == pytest.approx(2 * a.kept_bytes, abs=2)
        assert b.seconds == pytest.approx(2 * a.seconds)
    # autocast's weight casts happen once per micro-batch, whatever its size
    assert two.time["autocast casts"] == pytest.approx(one.time["autocast casts"])
    assert two.time["compute"] == pytest.approx(2 * one.time["compute"])


def test_recompute_costs_time_and_saves_memory() -> None:
    p = make_profile(n_layers=4)
    n = len(p.blocks)
    keep = cost.predict(p, decisions(n, options=(Option("selective"),) * n), 80 * GiB)
    full = cost.predict(p, decisions(n, options=(Option("full"),) * n), 80 * GiB)
    assert full.step_seconds > keep.step_seconds
    assert full.peak_bytes < keep.peak_bytes
    assert full.time["recompute"] == pytest.approx(sum(b.recompute_s for b in p.blocks))


def test_offload_beyond_what_compute_hides_is_exposed() -> None:
    p = make_profile(n_layers=4)
    slow = dataclasses.replace(p, machine=dataclasses.replace(p.machine, h2d_bandwidth=1e9, d2h_bandwidth=1e9,
                                                             duplex_bandwidth=1e9))
    n = len(p.blocks)
    d = decisions(n, options=(Option("none", 1.0),) * 3 + (Option(),))
    fast_t = cost.predict(p, d, 80 * GiB).time["exposed activation copies"]
    slow_t = cost.predict(slow, d, 80 * GiB).time["exposed activation copies"]
    assert slow_t > fast_t
    b = p.blocks[0]
    # blocks 0 and 1: the next block offloads too, so only its forward and backward hide their copies; block 2, the
    # last that offloads: the forward of block 3 and of the head, and block 3's backward (it starts them back)
    want = 3 * 2 * b.total_saved_bytes / 1e9 - 2 * (b.forward_s + b.backward_s) \
        - (p.blocks[3].forward_s + p.head.forward_s + p.blocks[3].backward_s)
    assert slow_t == pytest.approx(want)


def test_blocks_that_offload_nothing_lend_their_compute_to_the_copies_before_them() -> None:
    """One region in flight: the engine waits for a block's copies at the end of the next block that offloads, and
    that block starts them back within PREFETCH_LEAD_BLOCKS, so the kept blocks between hide them both ways."""
    p = make_profile(n_layers=8)
    slow = dataclasses.replace(p, machine=dataclasses.replace(p.machine, h2d_bandwidth=1e9, d2h_bandwidth=1e9,
                                                             duplex_bandwidth=1e9))
    n = len(slow.blocks)
    b = slow.blocks[0]
    copy = b.total_saved_bytes / 1e9
    for gap in range(1, 5):
        opts = [Option()] * n
        opts[0] = opts[gap] = Option("none", 1.0)
        got = cost.predict(slow, decisions(n, options=tuple(opts)), 80 * GiB)
        first = got.blocks[0].seconds - (b.forward_s + b.backward_s)
        lead = min(gap, options.PREFETCH_LEAD_BLOCKS)
        want = max(0.0, copy - gap * b.forward_s) + max(0.0, copy - lead * b.backward_s)
        assert first == pytest.approx(want)
    # consecutive blocks that offload: each hides behind the next block only (the engine's one region in flight)
    both = cost.predict(slow, decisions(n, options=(Option("none", 1.0),) * 2 + (Option(),) * (n - 2)), 80 * GiB)
    assert both.blocks[0].seconds == pytest.approx(b.forward_s + b.backward_s + 2 * copy - b.forward_s - b.backward_s)


def test_host_step_hides_behind_the_next_forward_up_to_its_blocks() -> None:
    p = make_profile(n_layers=8)
    n = len(p.blocks)
    late = tuple(i >= n - 2 for i in range(n))
    early = tuple(i < 2 for i in range(n))
    whole_late, exposed_late = cost.host_exposed_seconds(p, decisions(n, offload_blocks=late), 0.0)
    whole_early, exposed_early = cost.host_exposed_seconds(p, decisions(n, offload_blocks=early), 0.0)
    assert whole_late == pytest.approx(whole_early)
    # the late blocks are needed last: their step hides behind the forward of the first six blocks
    assert exposed_late < exposed_early
    # without clipping the step starts during backward and hides more
    _, exposed_eager = cost.host_exposed_seconds(p, decisions(n, offload_blocks=early, grad_clipping=False), 0.0)
    assert exposed_eager <= exposed_early
    # everything on the host with a slow host: the exposed part is most of the step
    slow = dataclasses.replace(p, machine=dataclasses.replace(p.machine, host_adam_params_per_s=1e8))
    w, x = cost.host_exposed_seconds(slow, decisions(n, offload_blocks=(True,) * n, offload_other=True), 0.0)
    assert x > 0.9 * w - sum(b.forward_s for b in p.blocks) * 1.01


def test_bf16_weights_save_the_autocast_casts() -> None:
    p = make_profile(n_layers=4)
    n = len(p.blocks)
    fp32 = cost.predict(p, decisions(n), 80 * GiB)
    bf16 = cost.predict(p, decisions(n, layout="bf16"), 80 * GiB)
    assert fp32.time["autocast casts"] == pytest.approx(p.num_params * cost.CAST_BYTES_PER_PARAM
                                                         / p.machine.memory_bandwidth)
    assert bf16.time["autocast casts"] == 0.0
    assert bf16.step_seconds < fp32.step_seconds


def test_no_policy_keeps_autocasts_cache() -> None:
    p = make_profile(n_layers=4)
    n = len(p.blocks)
    plain = cost.predict(p, decisions(n), 80 * GiB)
    assert plain.peak_phase == "forward end" and plain.memory["autocast weight cache"] == 2 * sum(
        b.num_params for b in p.blocks)
    one = cost.predict(p, decisions(n, options=(Option("selective"),) + (Option(),) * (n - 1)), 80 * GiB)
    assert "autocast weight cache" not in one.memory


def test_fused_loss_lowers_the_forward_end() -> None:
    p = make_profile(n_layers=2)
    n = len(p.blocks)
    plain = cost.predict(p, decisions(n), 80 * GiB)
    fused = cost.predict(p, decisions(n, fused_loss=True), 80 * GiB)
    assert fused.peak_bytes < plain.peak_bytes
    assert fused.step_seconds == plain.step_seconds


def test_measured_allocator_overhead_replaces_the_margin() -> None:
    p = dataclasses.replace(make_profile(n_layers=2), allocator_overhead_bytes=123 << 20)
    got = cost.predict(p, decisions(len(p.blocks)), 80 * GiB)
    assert got.memory["allocator margin"] == 123 << 20


def test_resident_gradients_come_with_the_backward() -> None:
    # one micro-batch per step: no gradient exists in forward; backward block i holds the head's and those of
    # blocks i..n-1 (resident ones only); the optimizer step holds all of them
    p = make_profile(n_layers=4, dim=256, ffn=512, vocab=1000, seq_len=128)
    n = len(p.blocks)
    half = (False, False, True, True)
    for layout, per in (("fp32", 4), ("bf16", 2)):
        d = decisions(n, layout=layout, offload_blocks=half)
        g = cost.globals_for(p, d)
        head = per * p.head.num_params
        own = [per * b.num_params * (not o) for b, o in zip(p.blocks, half)]
        assert g.transient_grads == head + sum(own) and g.head_grads == head
        idx = np.zeros(n, dtype=np.int64)
        ph = phases.phases(p, g, d, idx, 1 << 30)
        assert ph.grads.tolist() == [head + sum(own[i:]) for i in range(n)]
        assert ph.describe(2 * n + 1) == ("optimizer step", {"gradients": g.transient_grads})
        # the prediction's parts add up to its peak, gradients included where the peak falls in backward
        pred = cost.predict(p, d, 80 * GiB)
        assert sum(pred.memory.values()) == pred.peak_bytes
        assert pred.memory["model states"] == cost.state_bytes(p, d) - g.transient_grads
        # under accumulation they live through the forward: counted in the states, never as a phase term
        acc = cost.globals_for(p, dataclasses.replace(d, accumulation=2))
        assert acc.transient_grads == 0 and acc.states == g.states


def test_forward_end_peak_leaves_out_the_gradients() -> None:
    # everything kept: the forward's end is the peak, and it is lower by exactly the resident gradients than
    # the same plan under accumulation (where the gradients of the previous micro-batch are still there)
    p = make_profile(n_layers=4)
    n = len(p.blocks)
    one = cost.predict(p, decisions(n, fused_loss=True), 80 * GiB)
    two = cost.predict(p, decisions(n, fused_loss=True, accumulation=2), 80 * GiB)
    assert one.peak_phase == two.peak_phase == "forward end"
    assert two.peak_bytes - one.peak_bytes == cost.globals_for(p, decisions(n)).transient_grads
    # DDP's buckets hold every gradient from its construction on: the forward's end holds them too (measured on
    # 2 H200s: a DDP plan priced without them reserved 2.6 GiB over a 24 GiB budget)
    ddp = cost.predict(p, decisions(n, fused_loss=True, persistent_gradients=True), 80 * GiB)
    assert ddp.peak_phase == "forward end" and ddp.peak_bytes == two.peak_bytes
    assert cost.globals_for(p, decisions(n, persistent_gradients=True)).transient_grads == 0


def test_plans_under_ddp_count_the_buckets_and_keep_gradients_on_the_device() -> None:
    from elbowroom.plan import Plan
    from elbowroom.plan.search import plan_for

    p = make_profile(n_layers=8)
    single = plan_for(p, 40 * GiB, grad_clipping=False)
    ddp = plan_for(p, 40 * GiB, grad_clipping=False, persistent_gradients=True)
    assert ddp.persistent_gradients and not ddp.offload_gradients
    grads = cost.globals_for(p, single.decisions()).transient_grads
    assert grads > 0
    # the same decisions cost the buckets more, and a plan made for DDP fits its budget with them counted
    assert cost.predict(p, dataclasses.replace(single.decisions(), persistent_gradients=True),
                        40 * GiB).peak_bytes >= single.predicted_peak_bytes
    assert ddp.predicted_peak_bytes <= 40 * GiB
    assert cost.predict(p, ddp.decisions(), 40 * GiB).peak_bytes == ddp.predicted_peak_bytes
    assert Plan.from_json(ddp.to_json()).persistent_gradients  # saved with the plan: re-predicted the same


def test_peak_bytes_is_predicts_peak() -> None:
    p = make_profile(n_layers=6, vary=True)
    n = len(p.blocks)
    rng = np.random.default_rng(0)
    for _ in range(20):
        idx = rng.integers(0, len(OPTIONS), n)
        d = decisions(n, options=tuple(OPTIONS[i] for i in idx), layout=str(rng.choice(list(cost.LAYOUTS))),
                      offload_blocks=tuple(bool(x) for x in rng.integers(0, 2, n)))
        assert phases.peak_bytes(p, d, idx, 30 * GiB, 1 << 28) == cost.predict(
            p, d, 30 * GiB, prefetch_window_bytes=1 << 28).peak_bytes


def test_each_allocator_setting_has_its_own_measured_margin() -> None:
    p = dataclasses.replace(make_profile(n_layers=2), allocator_overhead_bytes=3 * GiB,
                            allocator_overhead_expandable_bytes=256 << 20)
    n = len(p.blocks)
    assert cost.predict(p, decisions(n), 80 * GiB).memory["allocator margin"] == 3 * GiB
    assert cost.predict(p, decisions(n, expandable_segments=True), 80 * GiB).memory["allocator margin"] == 256 << 20
    # not measured for that setting: the argued fraction of the budget
    q = dataclasses.replace(p, allocator_overhead_expandable_bytes=0)
    got = cost.predict(q, decisions(n, expandable_segments=True), 80 * GiB).memory["allocator margin"]
    assert got == int(cost.ALLOCATOR_MARGIN["expandable_segments"] * 80 * GiB)


@pytest.mark.parametrize("clip", [False, True])
def test_an_output_head_after_the_blocks_hides_its_host_step(clip: bool) -> None:
    """The parameters outside the blocks are two host jobs: the embedding (final last, needed first) and what comes
    after the blocks (``after_params``: final first, needed last), which hides behind the step where the embedding
    cannot; the same host work either way."""
    p = make_profile()  # W1: embedding and output head of 65.5M parameters each
    assert p.head.after_params == 0  # (a hand-made profile: all of it priced as the embedding)
    split = dataclasses.replace(p, head=dataclasses.replace(p.head, after_params=p.head.num_params // 2))
    n = len(p.blocks)
    for og in (False, True):
        d = decisions(n, offload_blocks=(True,) * n, offload_other=True, grad_clipping=clip, offload_gradients=og,
                      layout="bf16")
        whole, hid = cost.host_terms(p, d, 0.01), cost.host_terms(split, d, 0.01)
        assert hid[0] == pytest.approx(whole[0])
        assert hid[1] < whole[1]
