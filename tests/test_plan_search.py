"""The search on hand-made profiles: plans fit their budget, a tighter budget never predicts a faster step,
impossible budgets name the minimum, and 100 blocks plan in seconds."""

from __future__ import annotations

import dataclasses
import math
import random
import re
import time

import pytest
from test_plan_support import GiB, make_profile

from elbowroom.plan import BudgetError, budget_error, cost, knapsack, options, plan_for, search


def _minimum(profile, **kw) -> int:
    with pytest.raises(BudgetError) as e:
        plan_for(profile, 1 << 20, **kw)
    return e.value.minimum_bytes


CASES = {
    "w1-fp32": (dict(), dict()),
    "w1-bf16-fused": (dict(), dict(precision="bf16", fused_loss_allowed=True)),
    "mixed-blocks-global-batch": (dict(vary=True, n_layers=12, micro_batch=2), dict(global_batch=8,
                                                                                   fused_loss_allowed=True)),
    "gpt-ish-no-clip": (dict(dim=1024, n_layers=16, ffn=4096, vocab=50257, micro_batch=8, seq_len=1024),
                        dict(grad_clipping=False, precision="bf16")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tighter_budgets_never_predict_faster_steps(case: str) -> None:
    prof_kw, kw = CASES[case]
    p = make_profile(**prof_kw)
    low = _minimum(p, **kw)
    high = plan_for(p, 80 * GiB, **kw).predicted_peak_bytes + 4 * GiB
    rng = random.Random(case)
    budgets = sorted({low, high, *(rng.randint(low, high) for _ in range(24))})
    prev = None
    for b in budgets:
        plan = plan_for(p, b, **kw)
        assert plan.predicted_peak_bytes <= b
        assert plan.budget_bytes == b
        again = cost.predict(p, plan.decisions(), b).step_seconds
        assert math.isclose(again, plan.predicted_step_seconds, rel_tol=1e-9)
        if prev is not None:
            assert plan.predicted_step_seconds <= prev, f"budget {b} predicts a slower step than a smaller one"
        prev = plan.predicted_step_seconds
        if "global_batch" in kw:
            assert plan.micro_batch * plan.gradient_accumulation_steps == kw["global_batch"]


def test_impossible_budget_names_the_minimum() -> None:
    p = make_profile()
    low = _minimum(p)
    with pytest.raises(BudgetError, match=r"budget 4\.0 GiB is below the minimum .* GiB: model states need") as e:
        plan_for(p, 4 * GiB)
    assert isinstance(e.value, ValueError)
    assert "with the optimizer on the host" in str(e.value) and "precision='bf16'" in str(e.value)
    plan_for(p, low)  # the minimum itself plans
    with pytest.raises(BudgetError):
        plan_for(p, low - (64 << 20))
    # a budget just under the minimum reads below it, with the decimals (or bytes) that tell them apart
    for under in (low - (8 << 20), low - (64 << 10)):
        with pytest.raises(BudgetError) as e:
            plan_for(p, under)
        said, minimum = re.match(r"budget (.+) is below the minimum (.+?):", str(e.value)).groups()
        assert said != minimum, str(e.value)
    # bf16 weights lower the minimum
    assert _minimum(p, precision="bf16") < low


def test_plenty_of_memory_keeps_everything() -> None:
    p = make_profile(n_layers=6)
    plan = plan_for(p, 79 * GiB)
    assert all(b.checkpoint == "none" and b.offload_ratio == 0 for b in plan.blocks)
    assert plan.weight_dtype == "float32" and plan.offload_param_dtype == "float32"
    assert plan.micro_batch == p.micro_batch and plan.gradient_accumulation_steps == 1
    assert not plan.fused_loss


def test_tight_budget_uses_the_mechanisms() -> None:
    p = make_profile()
    plan = plan_for(p, 20 * GiB, fused_loss_allowed=True)
    assert plan.fused_loss
    assert any(b.checkpoint != "none" for b in plan.blocks)
    assert plan.offloads_optimizer
    # late blocks first: the offloaded blocks are a suffix
    off = plan.optimizer_offload_blocks
    assert off == tuple(range(len(plan.blocks) - len(off), len(plan.blocks)))


def test_no_offload_when_not_allowed_or_no_link() -> None:
    p = make_profile(n_layers=6)
    low = _minimum(p, offload_allowed=False)
    plan = plan_for(p, low, offload_allowed=False)
    assert not plan.offloads_optimizer and all(b.offload_ratio == 0 and not b.offload_input for b in plan.blocks)
    cpu = dataclasses.replace(p, machine=dataclasses.replace(p.machine, name="cpu", h2d_bandwidth=0,
                                                             d2h_bandwidth=0, duplex_bandwidth=0))
    plan = plan_for(cpu, _minimum(cpu))
    assert not plan.offloads_optimizer and plan.allocator_settings == ""
    assert any("no host link" in n for n in plan.notes)


def test_global_batch_trades_micro_batch_for_memory() -> None:
    p = make_profile(micro_batch=4)
    roomy = plan_for(p, 79 * GiB, global_batch=16)
    assert roomy.micro_batch == 16 // roomy.gradient_accumulation_steps
    tight_min = _minimum(p, global_batch=16)
    assert tight_min < _minimum(p)  # smaller micro-batches fit where the profile's does not
    tight = plan_for(p, tight_min, global_batch=16)
    assert tight.micro_batch < p.micro_batch


def test_fp32_precision_never_casts_weights() -> None:
    p = make_profile()
    for b in (20 * GiB, 24 * GiB, 60 * GiB):
        plan = plan_for(p, b)
        assert plan.weight_dtype == "float32" and plan.offload_param_dtype == "float32"


def test_float32_profiles_cannot_plan_bf16_weights() -> None:
    p = make_profile(n_layers=4, compute_dtype="float32")
    plan = plan_for(p, 30 * GiB, precision="bf16")
    assert plan.weight_dtype == "float32"
    assert any("bf16 weights need a profile" in n for n in plan.notes)


def test_budget_above_the_device_is_capped() -> None:
    p = make_profile(n_layers=4)
    plan = plan_for(p, 200 * GiB)
    assert plan.budget_bytes == 200 * GiB and plan.predicted_peak_bytes <= p.machine.device_memory_bytes
    assert any("above the device" in n for n in plan.notes)


_SEARCH_S = 15.0
"""The bound on one 100-block search: 4.4 s before the programme carried the gap between offloading blocks as a
state (six of them), 8.2 s after, on a 2-core machine like CI's."""


def test_hundred_blocks_plan_in_seconds() -> None:
    p = make_profile(n_layers=100, dim=1024, ffn=2816, vary=True)
    # an untied head: the search also tries the head alone on the host
    p = dataclasses.replace(p, head=dataclasses.replace(p.head, after_params=p.head.num_params // 2))
    low = _minimum(p, precision="bf16", fused_loss_allowed=True, global_batch=16)
    t0 = time.perf_counter()
    plan = plan_for(p, low + 6 * GiB, precision="bf16", fused_loss_allowed=True, global_batch=16)
    took = time.perf_counter() - t0
    assert len(plan.blocks) == 100 and plan.predicted_peak_bytes <= low + 6 * GiB
    assert took < _SEARCH_S, f"search took {took:.1f} s"
    # without clipping, with offloaded gradients: the host steps' order is simulated for every outer choice
    kw = dict(precision="bf16", fused_loss_allowed=True, grad_clipping=False)
    low = _minimum(p, **kw)
    t0 = time.perf_counter()
    plan = plan_for(p, low, **kw)
    took = time.perf_counter() - t0
    assert plan.offload_gradients and plan.predicted_peak_bytes <= low
    assert took < _SEARCH_S, f"search took {took:.1f} s"


def test_bad_arguments() -> None:
    p = make_profile(n_layers=2)
    for bad in (0, -1, 1.5, True, "24GiB"):
        with pytest.raises(ValueError, match="budget_bytes must be a positive int"):
            plan_for(p, bad)
    with pytest.raises(ValueError, match="precision"):
        plan_for(p, GiB, precision="fp16")
    with pytest.raises(ValueError, match="global_batch"):
        plan_for(p, GiB, global_batch=0)


def test_selective_can_be_ruled_out() -> None:
    p = make_profile(n_layers=8)
    for b in (22 * GiB, 28 * GiB, 40 * GiB):
        plan = plan_for(p, b, selective_allowed=False)
        assert all(x.checkpoint != "selective" for x in plan.blocks)
        assert plan.predicted_step_seconds >= plan_for(p, b).predicted_step_seconds


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_monotone_on_random_models_and_machines(seed: int) -> None:
    # shapes, link and host speeds the planner was not written for
    rng = random.Random(seed)
    machine = dataclasses.replace(
        make_profile(n_layers=1).machine,
        matmul_flops=rng.uniform(1e14, 1e15),
        h2d_bandwidth=rng.uniform(5e9, 60e9),
        d2h_bandwidth=rng.uniform(5e9, 60e9),
        duplex_bandwidth=rng.uniform(3e9, 40e9),
        host_adam_params_per_s=rng.uniform(5e8, 8e9),
        device_memory_bytes=rng.choice([24, 48, 80]) * GiB,
    )
    heads = rng.choice([8, 16])
    p = make_profile(dim=heads * rng.choice([64, 128]), n_layers=rng.randint(3, 40), ffn=rng.choice([1024, 4096, 8192]),
                     vocab=rng.choice([256, 32000, 128256]), micro_batch=rng.choice([1, 2, 8]),
                     seq_len=rng.choice([512, 2048, 8192]), machine=machine, vary=rng.random() < 0.5)
    kw = dict(precision=rng.choice(["fp32", "bf16"]), fused_loss_allowed=rng.random() < 0.5,
              grad_clipping=rng.random() < 0.5, global_batch=rng.choice([None, 16]))
    try:
        low = _minimum(p, **kw)
    except pytest.fail.Exception:  # even 1 MiB is enough: a tiny model
        low = 1 << 20
    if low > machine.device_memory_bytes:
        pytest.skip("the model does not fit this device at all")
    high = machine.device_memory_bytes
    prev = None
    for b in sorted({low, high, *(rng.randint(low, high) for _ in range(10))}):
        plan = plan_for(p, b, **kw)
        assert plan.predicted_peak_bytes <= b
        if prev is not None:
            assert plan.predicted_step_seconds <= prev
        prev = plan.predicted_step_seconds


def test_bf16_layouts_are_priced_with_their_own_bytes() -> None:
    # a profile under autocast saves fp32 norm and residual outputs; a bf16 model saves them in bf16. Given the
    # bf16 bytes, only bf16-weight layouts use them: the same bytes change nothing, fewer bytes never cost more
    from elbowroom.plan.search import with_bytes_of

    p = make_profile()
    fewer = dataclasses.replace(p, blocks=tuple(
        dataclasses.replace(b, saved_bytes={k: v // 2 for k, v in b.saved_bytes.items()},
                            selective_saved_bytes=b.selective_saved_bytes // 2) for b in p.blocks))
    assert with_bytes_of(p, fewer).blocks[0].forward_s == p.blocks[0].forward_s  # times stay the profile's
    for budget in (18 * GiB, 24 * GiB, 32 * GiB):
        base = plan_for(p, budget, precision="bf16", fused_loss_allowed=True)
        same = plan_for(p, budget, precision="bf16", fused_loss_allowed=True, bf16_bytes=p)
        assert same.predicted_step_seconds == base.predicted_step_seconds
        cheaper = plan_for(p, budget, precision="bf16", fused_loss_allowed=True, bf16_bytes=fewer)
        assert cheaper.predicted_step_seconds <= base.predicted_step_seconds
        assert cheaper.predicted_peak_bytes <= budget
        fp32 = plan_for(p, budget, precision="fp32", fused_loss_allowed=True, bf16_bytes=fewer)
        assert fp32 == plan_for(p, budget, precision="fp32", fused_loss_allowed=True)  # fp32 weights: untouched


def test_exact_peaks_admit_more_than_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # the knapsack's bound adds every kept byte to every gradient; checking the exact phases above it keeps
    # more at the same budget: a faster step, still within the budget
    p = make_profile()
    kw = dict(precision="bf16", fused_loss_allowed=True)
    refined = plan_for(p, 24 * GiB, **kw)
    monkeypatch.setattr(search, "_refine", lambda profile, best, *a: best)
    bound = plan_for(p, 24 * GiB, **kw)
    assert bound.predicted_peak_bytes <= refined.predicted_peak_bytes <= 24 * GiB
    assert refined.predicted_step_seconds < 0.98 * bound.predicted_step_seconds
    assert sum(b.kept_bytes for b in refined.blocks) > sum(b.kept_bytes for b in bound.blocks)


def test_gradient_offload_only_where_it_is_needed() -> None:
    """Gradients of host-stepped parameters may leave the device in the backward: it lowers the minimum by their
    bytes at no time (their fp32 copy travels either way) but 4 host bytes each; a loop that clips with torch's
    function (the default assumption) never gets it."""
    p = make_profile()  # W1
    kw = dict(grad_clipping=False, precision="bf16", fused_loss_allowed=True)
    kept = _minimum(p, gradient_offload_allowed=False, **kw)
    low = _minimum(p, **kw)
    assert low < kept - GiB  # ~2 bytes per offloaded parameter of W1's 1.36B
    tight = plan_for(p, low, **kw)
    assert tight.offload_gradients and tight.offloads_optimizer and tight.gradient_accumulation_steps == 1
    assert not plan_for(p, 80 * GiB, offload_allowed=False, **kw).offload_gradients  # nothing on the host
    with pytest.raises(BudgetError):
        plan_for(p, low, precision="bf16", fused_loss_allowed=True)  # clipping with torch's function: not allowed
    # the same decisions without it: no faster (with it the host steps the landed job needed first), more device
    # memory, 4 host bytes less per offloaded parameter
    d = tight.decisions()
    off = dataclasses.replace(d, offload_gradients=False)
    a, b = cost.predict(p, d, 80 * GiB), cost.predict(p, off, 80 * GiB)
    p_off = sum(blk.num_params for blk, o in zip(p.blocks, d.offload_blocks) if o) + (
        p.head.num_params if d.offload_other else 0)
    assert a.step_seconds <= b.step_seconds and a.host_bytes - b.host_bytes == 4 * p_off
    assert cost.state_bytes(p, off) - cost.state_bytes(p, d) == 2 * p_off
    # the host steps the landed job needed first (the default): priced as that order; in arrival order
    # (CPUOffloadConfig.step_order) it is the staged gradients' pipeline
    from elbowroom.optim.config import CPUOffloadConfig as _Cfg

    arrival = dataclasses.replace(d, offload_config=_Cfg(step_order="arrival"))
    g_d, g_off, g_a = cost.globals_for(p, d), cost.globals_for(p, off), cost.globals_for(p, arrival)
    assert g_a.host_exposed_s == pytest.approx(g_off.host_exposed_s)
    assert g_a.host_step_s == pytest.approx(g_d.host_step_s) and g_d.host_exposed_s < g_a.host_exposed_s
    # their device gradients wait for their copies where the backward outpaces the link: counted in the backward
    assert cost.gradient_backlog_bytes(p, d) > 0 == cost.gradient_backlog_bytes(p, off)
    # with the casts of bf16 weights on the host the host gradient stays bf16: 2 bytes
    from elbowroom.optim.config import CPUOffloadConfig

    host_cast = dataclasses.replace(d, offload_config=CPUOffloadConfig(cast_on_device=False))
    assert cost.predict(p, host_cast, 80 * GiB).host_bytes - b.host_bytes == 2 * p_off


def test_weight_layouts_limit_the_search() -> None:
    """A loop that cannot run a layout (FSDP2: no bf16 device copies of fp32 shards) names the ones it can."""
    p = make_profile(n_layers=8)
    for budget in (10 * GiB, 14 * GiB, 40 * GiB):
        plan = plan_for(p, budget, precision="bf16", weight_layouts=("fp32", "bf16"))
        assert (plan.weight_dtype, plan.offload_param_dtype) in (("float32", "float32"), ("bfloat16", "bfloat16"))
    assert plan_for(p, 40 * GiB, precision="bf16", weight_layouts=("bf16",)).weight_dtype == "bfloat16"
    with pytest.raises(ValueError, match="weight_layouts must name some of"):
        plan_for(p, 40 * GiB, weight_layouts=("fp16",))


def test_a_small_model_s_budget_error_names_sizes_in_a_unit_that_shows_them() -> None:
    from test_plan_support import make_profile

    from elbowroom.plan import BudgetError
    from elbowroom.plan.search import plan_for

    p = make_profile(n_layers=2, dim=32, ffn=64, vocab=64, seq_len=16)
    with pytest.raises(BudgetError) as e:
        plan_for(p, 1024)
    msg = str(e.value)
    assert "0.0 GiB" not in msg and ("MiB" in msg or "KiB" in msg), msg


def test_expandable_segments_preferred_where_both_fit() -> None:
    """On a CUDA machine a plan that fits either way takes expandable segments (they fragment less: a plan that
    frees gradients one by one in the backward ran out of memory under a capped allocator with the defaults); the
    defaults only where they alone fit, and never on CPU."""
    p = make_profile(n_layers=6)
    roomy = plan_for(p, 60 * GiB)
    assert roomy.allocator_settings == "expandable_segments:True"
    assert not roomy.offloads_optimizer  # the setting changes no decision that costs time
    # a measured margin larger with expandable segments than without: at the edge only the defaults fit
    wide = dataclasses.replace(p, allocator_overhead_bytes=64 << 20, allocator_overhead_expandable_bytes=4 * GiB)
    edge = _minimum(wide)
    assert plan_for(wide, edge).allocator_settings == "expandable_segments:False"  # said: the process may run on
    cpu = dataclasses.replace(p, machine=dataclasses.replace(p.machine, name="cpu"))
    assert plan_for(cpu, 60 * GiB).allocator_settings == ""


def test_a_plan_that_rests_on_the_host_step_hiding_pays_for_its_spread() -> None:
    """The host step's pace varies between runs: the exposed host time is the mean of the pipeline at the measured
    rate and at HOST_STEP_SPREAD of it, and a plan whose step would grow by 3% or more at the slow end says so in a
    note (exact to the cost model at that rate); a plan with slack to spare says nothing; re-predicting keeps one
    such note, not two."""
    p = make_profile()  # W1
    # (streamed blocks step on the device: the plans here lean on the host's step alone)
    kw = dict(precision="bf16", fused_loss_allowed=True, grad_clipping=False, gradient_offload_allowed=False,
              stream_allowed=False)
    roomy = plan_for(p, 80 * GiB, **kw)
    assert not [n for n in roomy.notes if "must hide" in n]
    tight = plan_for(p, 16 * GiB, **kw)
    d = tight.decisions()
    assert tight.offloads_optimizer
    g = cost.globals_for(p, d)
    fast = cost.host_terms(p, d, g.device_step_s)[1]
    slow = cost.host_terms(p, d, g.device_step_s, cost.HOST_STEP_SPREAD)[1]
    assert slow > fast and g.host_exposed_s == pytest.approx((fast + slow) / 2)
    (note,) = [n for n in tight.notes if "must hide" in n]
    t = tight.predicted_step_seconds
    assert f"would take {(t - g.host_exposed_s + slow) * 1e3:.0f} ms (predicted {t * 1e3:.0f}" in note
    again = tight.repredicted(p)
    assert [n for n in again.notes if "must hide" in n] == [note]
    # offloaded gradients or not, the mean of the two rates (their copies travel in fp32 either way)
    for og in (True, False):
        other = dataclasses.replace(d, offload_gradients=og)
        go = cost.globals_for(p, other)
        at = [cost.host_terms(p, other, go.device_step_s, r)[1] for r in (1.0, cost.HOST_STEP_SPREAD)]
        assert go.host_exposed_s == pytest.approx(0.5 * sum(at))


def test_a_plan_whose_recompute_hides_host_time_gives_the_range() -> None:
    """The recompute in the backward hides host optimizer time too; the search leaves it out (its cost stays a sum),
    so a plan where that is 3% of the step or more says what the step would take with it counted: exactly the
    pipeline with each block's recompute in its backward, never more than the prediction; kept once on re-predicting;
    never with clipping (the host steps wait for the whole backward)."""
    from elbowroom.plan.host_pipeline import host_exposed_seconds

    p = make_profile()  # W1
    kw = dict(precision="bf16", fused_loss_allowed=True, grad_clipping=False)
    tight = plan_for(p, _minimum(p, **kw) + GiB // 2, **kw)
    d = tight.decisions()
    assert any(o.checkpoint != "none" for o in d.options) and tight.offloads_optimizer
    (note,) = [n for n in tight.notes if n.startswith("the recompute in the backward")]
    g = cost.globals_for(p, d)
    recompute = [b.recompute_s if o.checkpoint == "full" else b.selective_recompute_s if o.checkpoint == "selective"
                 else 0.0 for b, o in zip(p.blocks, d.options)]
    hidden = 0.5 * sum(host_exposed_seconds(p, d, g.device_step_s, r, recompute)[1]
                       for r in (1.0, cost.HOST_STEP_SPREAD))
    low = tight.predicted_step_seconds - g.host_exposed_s + hidden
    assert low < 0.97 * tight.predicted_step_seconds
    assert f"would take {low * 1e3:.0f} ms (predicted {tight.predicted_step_seconds * 1e3:.0f})" in note
    assert [n for n in tight.repredicted(p).notes if n.startswith("the recompute")] == [note]
    clipped = plan_for(p, 40 * GiB, precision="bf16", fused_loss_allowed=True)
    assert not [n for n in clipped.notes if n.startswith("the recompute")]


def test_budget_hints_name_fit_s_keywords() -> None:
    """The hints name the keywords of ``elbowroom.fit``, which users read them against (one named
    ``fused_loss_allowed``, which fit does not have)."""
    import inspect

    from elbowroom.plan import fit

    with pytest.raises(BudgetError) as e:
        plan_for(make_profile(), 4 * GiB)
    text = str(e.value)
    assert budget_error.FUSED_LOSS_HINT in text and "fused_loss_allowed" not in text
    for keyword in ("fused_loss", "precision", "global_batch"):
        assert f"{keyword}=" in text and keyword in inspect.signature(fit).parameters
    # a front end's mapping keyed by the hint as it read before still maps it (the trainer's, until it changes)
    before = "fused_loss_allowed=True (elbowroom.linear_cross_entropy) shrinks the head and loss"
    assert "--train.fused_loss true shrinks the head and loss;" in e.value.reworded(
        {before: "--train.fused_loss true shrinks the head and loss"})
    assert "  " not in e.value.reworded({"(elbowroom plan --host-memory)": ""})


def test_a_budget_above_the_device_below_the_minimum_names_the_device() -> None:
    """Planned for the device's memory (the budget is above it) and still too small: the error names the device's
    memory, not the budget it was never planned with ("budget 200 GiB is below the minimum 90 GiB")."""
    p = make_profile(micro_batch=64)
    with pytest.raises(BudgetError, match=r"budget 200\.0 GiB is above the 80\.0 GiB of h100-test, which is below "
                                          r"the minimum"):
        plan_for(p, 200 * GiB)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_programme_is_exact_over_the_gaps_between_offloading_blocks(seed: int) -> None:
    """The knapsack carries the gap to the next offloading block as a state: its best time at each capacity equals
    the least summed cost of every assignment (priced as ``cost.predict`` prices them), and its backtrack returns
    one that attains it. Blocks of varied size on a slow link, so that gaps matter."""
    import itertools

    import numpy as np

    rng = random.Random(seed)
    p = make_profile(n_layers=4, vary=True)
    p = dataclasses.replace(p, machine=dataclasses.replace(
        p.machine, d2h_bandwidth=rng.uniform(2e9, 8e9), h2d_bandwidth=rng.uniform(2e9, 8e9),
        duplex_bandwidth=rng.uniform(1e9, 6e9)))
    tables = options.block_tables(p)
    ks = knapsack.Knapsack(p, tables, offload_ok=True, prefetch_window=1 << 40)
    level = len(ks.levels) - 1
    allowed = ks.allowed[level]
    n = ks.n
    w = (0.5, 0.0)
    best = ks.best(level, w)
    per_block = [[o for o in range(len(cost.OPTIONS)) if allowed[i, o]] for i in range(n)]
    brute = np.full(ks.M + 1, np.inf)
    for combo in itertools.product(*per_block):
        if not any(combo):
            continue  # every block kept whole: level 0's plan
        idx = np.array(combo)
        units = int(ks.units[np.arange(n), idx].sum())
        if units > ks.M:
            continue
        c = tables.chosen(idx, *w)
        t = 0.0
        for x in c[::-1]:
            t += float(x)
        brute[units:] = np.minimum(brute[units:], t)
    finite = np.isfinite(brute)
    assert np.array_equal(finite, np.isfinite(best))
    assert np.allclose(best[finite], brute[finite], rtol=1e-12, atol=0)
    some_offload = False
    for cap in sorted({int(x) for x in np.linspace(0, ks.M, 25)} | {ks.keep_units}):
        if not np.isfinite(best[cap]):
            continue
        idx = np.array(ks.backtrack(level, w, cap))
        assert int(ks.units[np.arange(n), idx].sum()) <= cap
        assert float(tables.chosen(idx, *w)[::-1].sum()) == pytest.approx(best[cap], rel=1e-9)
        some_offload |= bool(tables.offloads[np.arange(n), idx].any())
    assert some_offload


def test_the_head_alone_may_step_on_the_host() -> None:
    """With an untied head (``HeadProfile.after_params``), the parameters outside the blocks may go to the host all
    together or the head and final norm alone. With clipping the host steps in forward order after the backward, so
    the embeddings' step stands before the next forward's first kernel and the head's runs beside the blocks: the
    head alone exposes less at the same placement, for the embeddings' device state. The search uses it where it
    pays, never predicts a faster step at a tighter budget, and the plan carries it through TOML and JSON."""
    from elbowroom.plan import Plan

    p = make_profile()
    p = dataclasses.replace(p, head=dataclasses.replace(p.head, after_params=p.head.num_params // 2 + 2048))
    n = len(p.blocks)
    base = dict(options=(cost.Option("full"),) * n, offload_blocks=(True,) * n, layout="bf16", micro_batch=4,
                fused_loss=True, grad_clipping=True)
    none, head, every = (cost.Decisions(**base, offload_other=o, offload_head=h)
                         for o, h in ((False, False), (False, True), (True, False)))
    gn, gh, ge = (cost.globals_for(p, d) for d in (none, head, every))
    assert ge.host_exposed_s > gh.host_exposed_s >= gn.host_exposed_s
    assert gn.states > gh.states > ge.states  # the device state of what stays
    before, after = p.head.before_params, p.head.after_params
    assert cost.outside_on_host(p, head) == (0, after) and cost.outside_on_host(p, every) == (before, after)
    assert gn.host_bytes < gh.host_bytes < ge.host_bytes  # host memory grows with the parameters there

    times, chosen = [], []
    for gib in (9, 10, 11, 12, 13, 14, 16):
        plan = plan_for(p, gib * GiB, precision="bf16", fused_loss_allowed=True)
        assert plan.predicted_peak_bytes <= gib * GiB
        assert not (plan.offload_other_params and plan.offload_head_params)
        times.append(plan.predicted_step_seconds)
        chosen.append(plan.offload_head_params)
        assert Plan.from_toml(plan.to_toml()) == plan and Plan.from_json(plan.to_json()) == plan
        assert plan.decisions().offload_head == plan.offload_head_params
        again = plan.repredicted(p)
        assert again.predicted_step_seconds == pytest.approx(plan.predicted_step_seconds)
        if plan.offload_head_params:
            assert "head/norm on the host, embeddings on the device" in plan.table()
    assert all(a >= b for a, b in zip(times, times[1:])), times
    assert any(chosen), chosen
    # a profile that does not split its outside parameters (older, or everything before the blocks) never offers it
    assert not any(plan_for(make_profile(), gib * GiB, precision="bf16", fused_loss_allowed=True).offload_head_params
                   for gib in (10, 12, 14))
