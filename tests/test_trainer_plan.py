"""The trainer under a plan, on CPU: ``--budget`` plans before step 1, ``--plan`` applies a saved plan, ``--resume``
re-applies the run's own plan, ``--profile.steps`` records steps for ``elbowroom report``.

Budgets for the tiny model are found the way ``elbowroom plan`` finds them: a measured CPU profile of the same
model on a micro-batch of the same shape, the minimum from :class:`BudgetError`, the plain peak from the plan that
keeps every activation. On a CPU nothing is offloaded (no host link); recompute can still be chosen.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from elbowroom.cli import main
from elbowroom.config import resolve
from elbowroom.models import build_model
from elbowroom.plan import BudgetError, Plan, plan_for, profile
from elbowroom.train.checkpoint import CheckpointManager
from elbowroom.train.trainer import resolve_model_config

RUN = [
    "--data.seq_len", "32", "--data.batch_size", "4", "--data.num_workers", "0",
    "--train.eval_every", "0", "--train.eval_batches", "1", "--logging.progress", "false", "--log-every", "1",
    "--scheduler.warmup_steps", "2",
]
SMALL = ["--model.dim", "32", "--model.n_heads", "2", "--model.ffn_dim", "64", "--model.n_layers", "2", *RUN]
BYTES = 256  # the built-in corpus is bytes


def run(out: Path, *args: str) -> int:
    return main(["train", "--out", str(out), *SMALL, *args])


def train_losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def budgets() -> tuple[int, int]:
    """(the minimum, the plain peak) of the SMALL model's training step, in bytes."""
    cfg = resolve(None, SMALL)
    model = build_model(resolve_model_config(cfg, BYTES))
    ids = torch.randint(0, BYTES, (cfg.data.batch_size, cfg.data.seq_len))
    prof = profile(model, (ids, ids), source="measured")
    with pytest.raises(BudgetError) as e:
        plan_for(prof, 1, fused_loss_allowed=True)
    keep_all = plan_for(prof, 1 << 40, fused_loss_allowed=True)
    assert all(b.checkpoint == "none" for b in keep_all.blocks)
    plain = sum(v for k, v in keep_all.memory.items() if k != "allocator margin")
    assert e.value.minimum_bytes < plain
    return e.value.minimum_bytes, plain


def between(budgets: tuple[int, int]) -> int:
    low, plain = budgets
    return (low + plain) // 2


# ---------------------------------------------------------------- --budget
def test_budget_plans_then_trains(tmp_path: Path, budgets: tuple[int, int], caplog: pytest.LogCaptureFixture) -> None:
    """A budget between the minimum and the plain peak: the plan recomputes, is logged and saved, and the run learns
    as the unplanned run does (recompute and the fused loss change memory, not the math). Without weight decay:
    ``plan.apply`` builds one parameter group, so norms and embeddings decay too (the unplanned run exempts them)."""
    budget = between(budgets)
    out = tmp_path / "planned"
    no_decay = ("--optimizer.weight_decay", "0")
    with caplog.at_level("INFO"):
        assert run(out, "--steps", "8", "--budget", str(budget), *no_decay) == 0
    assert "elbowroom plan: 2 blocks on cpu" in caplog.text  # the plan's table, before step 1
    assert caplog.text.index("elbowroom plan:") < caplog.text.index("step      1")
    # the machine's numbers are logged, and cached beside the corpus: the next planned run reads them
    assert "host AdamW" in caplog.text
    from elbowroom.plan.machine import _CACHE_VERSION

    cached = list(Path(os.environ["ELBOWROOM_CACHE"]).glob(f"machine-v{_CACHE_VERSION}-cpu-*.json"))
    assert len(cached) == 1, cached
    saved = json.loads((out / "plan.json").read_text())
    assert saved["budget_bytes"] == budget and saved["predicted_peak_bytes"] <= budget
    assert {"predicted_step_seconds", "blocks"} <= saved.keys()
    plan = Plan.load(out / "plan.toml")
    assert plan == Plan.from_dict(saved)
    assert any(b.checkpoint != "none" for b in plan.blocks)  # below the plain peak: something is recomputed
    assert not plan.offloads_optimizer  # a CPU has no host to offload to

    losses = train_losses(out)
    assert losses[8] < losses[1] - 0.1, losses
    assert run(tmp_path / "plain", "--steps", "8", *no_decay) == 0
    want = train_losses(tmp_path / "plain")
    assert losses == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("dtype,profiled", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_the_plan_profiles_the_step_in_the_runs_own_dtype(tmp_path: Path, budgets: tuple[int, int], dtype: str,
                                                          profiled: str) -> None:
    out = tmp_path / dtype
    assert run(out, "--steps", "2", "--budget", str(budgets[1]), "--train.dtype", dtype) == 0
    assert json.loads((out / "plan.json").read_text())["profile"]["compute_dtype"] == profiled


def test_budget_below_the_minimum_names_it_and_writes_nothing(
    tmp_path: Path, budgets: tuple[int, int], capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "tiny-budget"
    assert run(out, "--steps", "2", "--budget", str(budgets[0] // 2)) == 2
    err = capsys.readouterr().err.strip()
    assert "below the minimum" in err and len(err.splitlines()) == 1
    # the hints name the trainer's flags, not fit()'s arguments
    assert "global_batch=" not in err and "--train.gradient_accumulation_steps" in err
    assert not out.exists()


def _models_collected_before(monkeypatch: pytest.MonkeyPatch, replan_name: str) -> list:
    """Check, each time ``elbowroom.train.planning``'s ``replan_name`` has run, that every model built so far is
    collected (the failed try's frames let go of, so that its device memory is free before the next plan
    profiles); the weak references to the models built, in order."""
    import gc
    import weakref

    from elbowroom.train import planning, trainer

    built: list[weakref.ref] = []
    real_build, real_replan = trainer.build_model, getattr(planning, replan_name)

    def build(*args, **kwargs):
        model = real_build(*args, **kwargs)
        if kwargs.get("device") != "meta":
            built.append(weakref.ref(model))
        return model

    def replan(e):
        new = real_replan(e)
        gc.collect()
        assert all(r() is None for r in built), "a failed try's model is still alive"
        return new

    monkeypatch.setattr(trainer, "build_model", build)
    monkeypatch.setattr(planning, replan_name, replan)
    return built


def _caps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int | None]]:
    """The (plan's budget, limit) of each try's allocator cap, as the trainer asks for it (none is set on CPU)."""
    from elbowroom.train import trainer

    caps: list[tuple[int, int | None]] = []
    real = trainer.cap_memory

    def cap(plan, device, limit=None):
        caps.append((plan.budget_bytes, limit))
        return real(plan, device, limit)

    monkeypatch.setattr(trainer, "cap_memory", cap)
    return caps


@pytest.mark.parametrize("ooms, at", [(1, 1), (1, 3), (3, 1)], ids=["recovers", "recovers-at-step-3", "gives-up"])
def test_out_of_memory_in_the_first_steps_replans_tighter(tmp_path: Path, budgets: tuple[int, int], ooms: int,
                                                          at: int, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A step of a --budget run runs out of memory before anything is checkpointed: the run starts over under a
    plan for 90% of the budget, at most twice, the allocator still capped at --budget; the rows of steps that had
    finished move aside, so that metrics.jsonl holds the curve of a run planned for that budget. After two re-plans
    it fails with the error and the OOM report."""
    from elbowroom.plan import parse_budget
    from elbowroom.train import trainer

    budget = max(budgets[1], math.ceil(budgets[0] / 0.8))  # two re-plans at 90% each stay above the minimum
    calls = {"n": 0}
    real = trainer.accumulate_gradients

    def oom(*args, **kwargs):  # step `at` of the first `ooms` tries
        calls["n"] += 1
        if calls["n"] in {k * at for k in range(1, ooms + 1)}:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "accumulate_gradients", oom)
    _models_collected_before(monkeypatch, "replan_after_oom")
    caps = _caps(monkeypatch)
    out = tmp_path / "oom"
    no_decay = ("--optimizer.weight_decay", "0")
    with caplog.at_level("WARNING"):
        if ooms <= 2:
            assert run(out, "--steps", "4", "--budget", str(budget), *no_decay) == 0
        else:
            with pytest.raises(torch.OutOfMemoryError, match="simulated"):
                run(out, "--steps", "4", "--budget", str(budget), *no_decay)
    assert caplog.text.count("planning again for") == min(ooms, 2)
    assert ("an early step ran out of memory" in caplog.text) == (at > 1)
    assert [limit for _, limit in caps] == [budget] * min(ooms + 1, 3)  # the cap stays at --budget
    if ooms > 2:  # the third try fails as any run does: the OOM report, no trained state
        assert "out of memory:" in caplog.text and (out / "oom_report.txt").is_file()
        assert not (out / "metrics.jsonl").exists() and not (out / "plan.json").exists()
        return
    saved = json.loads((out / "plan.json").read_text())
    assert saved["budget_bytes"] == int(budget * 0.9) == caps[-1][0]  # the tighter plan is the run's plan
    assert parse_budget(resolve(out / "config.toml", []).budget) == budget  # the run's config keeps --budget
    rewound = out / "metrics.rewound-0.jsonl"
    assert (len(rewound.read_text().splitlines()) if rewound.exists() else 0) == at - 1  # the rows before the OOM
    # the run that follows is the one a fresh run under the tighter budget gives (its plan may differ by the
    # profile's CPU timings; recompute and the fused loss change memory, not the math)
    monkeypatch.setattr(trainer, "accumulate_gradients", real)
    assert run(tmp_path / "direct", "--steps", "4", "--budget", str(int(budget * 0.9)), *no_decay) == 0
    assert list(train_losses(out)) == [1, 2, 3, 4]
    assert train_losses(out) == pytest.approx(train_losses(tmp_path / "direct"), rel=1e-5)


def _size(n: int) -> str:
    from elbowroom.train.planning import _size_at_least

    return _size_at_least(n)


def _slow_steps(monkeypatch: pytest.MonkeyPatch, pace: float = math.inf) -> None:
    """Every CPU step counts as slow against its plan (a plan predicting nothing, no minimum excess): the retries
    alone decide (BudgetWatch.keeps_retrying; its slowness test is tests/test_trainer.py's). ``pace``: the seconds a
    step the retrying steps report having run, which the plan for less must beat (any plan beats the default)."""
    from elbowroom.train import metrics, trainer

    class Watch(metrics.BudgetWatch):
        def __init__(self, plan: object, limit: int | None = None, suggest: str = "--budget {}") -> None:
            super().__init__(plan, limit, suggest)
            self.predicted_step = 1e-9 if self.predicted_step else None

        def keeps_retrying(self, row: dict) -> bool:
            got = super().keeps_retrying(row)
            if self.pace_s is not None:
                self.pace_s = pace
            return got

    monkeypatch.setattr(trainer, "BudgetWatch", Watch)
    monkeypatch.setattr(metrics.PaceWatch, "MIN_EXCESS_S", 0.0)


def test_the_tries_of_a_run_that_retried_then_ran_out_of_memory() -> None:
    """with_replans over scripted tries (the 7B's fourth call, twenty-sixth session): the 76 GiB plan retries; the
    plan for 72.2 GiB runs out of memory at step 16; the plan for 90% of that is below the minimum; the run goes back
    to the plan that retried, as it was, and may not re-plan again. Every try after one that logged rewinds the log;
    a budget error with no retries before it is the run's error."""
    from dataclasses import replace

    from elbowroom.config import ConfigError
    from elbowroom.plan.plan import BlockPlan
    from elbowroom.train.planning import EarlyOutOfMemory, EarlyStepsRetrying, Try, with_replans

    gib = 1 << 30
    first = Plan(blocks=(BlockPlan(0),), budget_bytes=76 * gib, predicted_peak_bytes=75 * gib,
                 predicted_step_seconds=0.66, predicted_tokens_per_s=1.0)
    lower = int(72.2 * gib)
    script = [EarlyStepsRetrying(Path("out"), first, lower, "4 retries by step 4", 0.8),
              EarlyOutOfMemory(Path("out"), lower, "CUDA out of memory", started=True),
              ConfigError("budget 65.0 GiB is below the minimum 71.9 GiB"), None]
    tries: list[Try] = []

    def train_once(cfg, attempt: Try) -> str:
        tries.append(attempt)
        outcome = script[len(tries) - 1]
        if outcome is not None:
            raise outcome
        return "trained"

    assert with_replans(resolve(None, ["--budget", "76GiB"]), train_once) == "trained"
    assert tries == [Try(may_replan=True),
                     Try(may_replan=True, rewind_metrics=True, plan_budget=lower, beat_seconds=0.8),
                     Try(may_replan=False, rewind_metrics=True, plan_budget=int(lower * 0.9)),
                     Try(may_replan=False, rewind_metrics=True, plan=first)]
    # no retries before it: a budget error is the run's own
    script, tries = [EarlyOutOfMemory(Path("out"), 8 * gib, "CUDA out of memory"), ConfigError("below")], []
    with pytest.raises(ConfigError, match="below"):
        with_replans(resolve(None, ["--budget", "8GiB"]), train_once)
    assert tries == [Try(may_replan=True), Try(may_replan=True, plan_budget=int(8 * gib * 0.9))]
    # and once back under the plan that retried, nothing more is re-planned: its own error is the run's
    script, tries = [EarlyStepsRetrying(Path("out"), first, lower, "", 0.8), ConfigError("no faster"),
                     ConfigError("other")], []
    with pytest.raises(ConfigError, match="other"):
        with_replans(resolve(None, ["--budget", "76GiB"]), train_once)
    assert tries[-1] == replace(Try(rewind_metrics=True, plan=first), may_replan=False)


def _profiles_measured(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The profiles the run measures (elbowroom.plan.profiler.profile's calls), by their source."""
    from elbowroom.plan import profiler

    measure, calls = profiler.profile, []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("source", "auto"))
        return measure(*args, **kwargs)

    monkeypatch.setattr(profiler, "profile", counted)
    return calls


def _first_try_retries(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    """The CUDA counters the trainer logs, simulated: the first try's four rows count 5 allocator retries a step
    after the first row, the later tries' none."""
    from elbowroom.train import trainer

    calls = {"n": 0}

    def retrying(device: torch.device) -> dict[str, int]:
        calls["n"] += 1
        return {"peak_memory_bytes": budget // 3, "peak_reserved_bytes": budget // 2,
                "alloc_retries": 5 * (calls["n"] - 1) if calls["n"] <= 4 else 0}

    monkeypatch.setattr(trainer, "peak_memory", retrying)


def test_early_allocator_retries_replan_lower_and_keep_one_curve(tmp_path: Path, budgets: tuple[int, int],
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The allocator keeps retrying in a --budget run's first steps (CUDA counters, simulated): the run is planned
    again for the lower budget the warning names and starts over, the allocator still capped at --budget; the first
    try's rows move to metrics.rewound-0.jsonl, and metrics.jsonl holds one curve, the one a run planned for that
    budget gives."""
    from elbowroom.plan import parse_budget
    from elbowroom.train import trainer
    from elbowroom.train.metrics import BudgetWatch

    _slow_steps(monkeypatch)
    budget = max(budgets[1], math.ceil(budgets[0] / 0.8))  # a tenth lower stays above the minimum
    _first_try_retries(monkeypatch, budget)
    built = _models_collected_before(monkeypatch, "replan_after_retries")
    caps = _caps(monkeypatch)
    measured = _profiles_measured(monkeypatch)
    out = tmp_path / "retries"
    no_decay = ("--optimizer.weight_decay", "0")
    with caplog.at_level("WARNING"):
        assert run(out, "--steps", "6", "--budget", str(budget), "--logging.log_every", "1", *no_decay) == 0
    assert caplog.text.count("kept the allocator retrying") == 1 and len(built) == 2
    assert len(measured) == 1  # the re-plan planned from the first try's profile
    lower = json.loads((out / "plan.json").read_text())["budget_bytes"]  # the run's plan is the lower one
    assert lower == BudgetWatch(None).lower_budget(budget) == budget - budget // 10  # (a tenth: under 5 GiB)
    assert caps == [(budget, budget), (lower, budget)]  # capped at --budget both times
    # the warning's suggestion, exact at this size, and that this run may take it itself
    assert f"--budget {lower}B; this run plans for that itself if its steps keep retrying" in caplog.text
    first = [json.loads(x) for x in (out / "metrics.rewound-0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in first] == [1, 2, 3, 4]  # the first try stopped at the fourth row, the third slow one
    assert list(train_losses(out)) == [1, 2, 3, 4, 5, 6]  # one curve, from step 1
    monkeypatch.setattr(trainer, "peak_memory", lambda device: {"peak_memory_bytes": 1})
    assert run(tmp_path / "direct", "--steps", "6", "--budget", str(lower), "--logging.log_every", "1",
               *no_decay) == 0
    assert train_losses(out) == pytest.approx(train_losses(tmp_path / "direct"), rel=1e-5)
    # resumed (its config keeps --budget): the plan it trained under, the allocator capped at --budget again
    assert parse_budget(resolve(out / "config.toml", []).budget) == budget
    assert run(out, "--resume", "--steps", "8") == 0
    assert caps[-1] == (lower, budget) and list(train_losses(out)) == list(range(1, 9))


def test_early_retries_under_a_budget_near_the_minimum_keep_the_plan(tmp_path: Path, budgets: tuple[int, int],
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The lower budget the retries ask for is below the run's minimum: the run says so and trains under the plan
    that retried (one curve in metrics.jsonl, the first try's rows aside), instead of failing."""

    _slow_steps(monkeypatch)
    budget = budgets[0] + 1024
    _first_try_retries(monkeypatch, budget)
    out = tmp_path / "near-minimum"
    with caplog.at_level("WARNING"):
        assert run(out, "--steps", "5", "--budget", str(budget), "--logging.log_every", "1") == 0
    assert "below the minimum" in caplog.text
    assert f"training under the plan that retried (for {_size(budget)}) after all" in caplog.text
    assert json.loads((out / "plan.json").read_text())["budget_bytes"] == budget
    assert list(train_losses(out)) == [1, 2, 3, 4, 5]
    assert len((out / "metrics.rewound-0.jsonl").read_text().splitlines()) == 4


def test_early_retries_keep_the_plan_when_the_plan_for_less_is_no_faster(
        tmp_path: Path, budgets: tuple[int, int], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The plan for the lower budget predicts a step no faster than the retrying steps ran (the 7B's plan for 72 GiB:
    0.92 s against 0.77): the run goes back to the plan that retried, capped at --budget, its first try's rows aside,
    and follows the curve of a run under that plan."""
    from elbowroom.train import trainer

    _slow_steps(monkeypatch, pace=0.0)  # the retrying steps ran in no time: nothing beats them
    budget = max(budgets[1], math.ceil(budgets[0] / 0.8))
    _first_try_retries(monkeypatch, budget)
    built = _models_collected_before(monkeypatch, "replan_after_retries")
    caps = _caps(monkeypatch)
    planned: list[int] = []
    real_plan = trainer.plan_for_budget

    def plan_for_budget(*args, **kwargs):
        planned.append(kwargs.get("budget") or budget)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(trainer, "plan_for_budget", plan_for_budget)
    out = tmp_path / "no-faster"
    no_decay = ("--optimizer.weight_decay", "0")
    with caplog.at_level("WARNING"):
        assert run(out, "--steps", "5", "--budget", str(budget), "--logging.log_every", "1", *no_decay) == 0
    assert "no faster than the 0.000 s the plan that retried ran" in caplog.text
    assert f"training under the plan that retried (for {_size(budget)}) after all" in caplog.text
    assert len(built) == 3 and [limit for _, limit in caps] == [budget, budget]  # (the no-faster plan: not run)
    assert planned == [budget, budget - budget // 10]  # the plan that retried is taken back as it was, not re-made
    assert json.loads((out / "plan.json").read_text())["budget_bytes"] == budget
    assert len((out / "metrics.rewound-0.jsonl").read_text().splitlines()) == 4
    monkeypatch.setattr(trainer, "peak_memory", lambda device: {"peak_memory_bytes": 1})
    assert run(tmp_path / "direct", "--steps", "5", "--budget", str(budget), "--logging.log_every", "1",
               *no_decay) == 0
    assert train_losses(out) == pytest.approx(train_losses(tmp_path / "direct"), rel=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "24GiB", "--activations.checkpoint", "full"],
         "--budget plans these; drop --activations.checkpoint"),
        (["--budget", "24GiB", "--optimizer.offload_fraction", "0.5"], "drop --optimizer.offload_fraction"),
        (["--budget", "24GiB", "--train.fused_loss"], "drop --train.fused_loss"),
        (["--budget", "lots"], "cannot read budget 'lots'; accepted: a number with GiB"),
        (["--budget", "24GiB", "--plan", "p.toml"], "drop one of them"),
        (["--plan", "p.toml", "--activations.checkpoint", "full"], "--plan plans these; drop --activations.checkpoint"),
        (["--host-budget", "32GiB"], "--host-budget bounds what --budget plans may put on the host; add --budget"),
        (["--budget", "24GiB", "--host-budget", "lots"], "cannot read host_budget 'lots'"),
    ],
)
def test_settings_a_plan_decides_are_refused(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "refused"
    assert run(out, "--steps", "2", *args) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


# ---------------------------------------------------------------- --plan and --resume
def test_resume_reapplies_the_runs_plan_and_continues_the_loss_curve(
    tmp_path: Path, budgets: tuple[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    """Interrupted at step 4 and resumed with --budget: the resumed run follows OUT/plan.toml (no new planning) and
    its losses are the uninterrupted run's. Two plannings may choose differently where only time decides (which
    block to recompute), so the interrupted run follows the reference's plan with --plan."""
    budget = str(between(budgets))
    ref = tmp_path / "ref"
    assert run(ref, "--steps", "8", "--budget", budget) == 0
    out = tmp_path / "resumed"
    assert run(out, "--steps", "4", "--scheduler.decay_steps", "8", "--plan", str(ref / "plan.json")) == 0
    assert Plan.load(out / "plan.toml") == Plan.load(ref / "plan.toml")
    caplog.clear()
    with caplog.at_level("INFO"):
        assert run(out, "--resume", "--steps", "8", "--budget", budget) == 0
    assert "resuming under the run's plan" in caplog.text
    assert "activation policy" in caplog.text and "measured profile" in caplog.text  # applied, logged
    got, want = train_losses(out), train_losses(ref)
    assert sorted(got) == list(range(1, 9))
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_plan_for_another_model_is_refused(tmp_path: Path, budgets: tuple[int, int], capsys) -> None:
    ref = tmp_path / "ref"
    assert run(ref, "--steps", "1", "--budget", str(between(budgets))) == 0
    capsys.readouterr()
    out = tmp_path / "deeper"
    assert run(out, "--steps", "1", "--model.n_layers", "3", "--plan", str(ref / "plan.toml")) == 2
    assert "the plan has 2 blocks but the model has 3" in capsys.readouterr().err
    assert not out.exists()
    assert run(out, "--steps", "1", "--plan", str(tmp_path / "missing.toml")) == 2
    assert "missing.toml does not exist" in capsys.readouterr().err
    assert run(out, "--steps", "1", "--data.batch_size", "2", "--plan", str(ref / "plan.toml")) == 2
    assert "pass --data.batch_size 4" in capsys.readouterr().err
    assert not out.exists()


def test_resume_with_budget_of_an_unplanned_run_is_refused(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plain"
    assert run(out, "--steps", "1") == 0
    assert run(out, "--resume", "--steps", "2", "--budget", "24GiB") == 2
    assert "trained without a plan" in capsys.readouterr().err


# ---------------------------------------------------------------- --profile.steps
def test_profile_steps_record_for_the_report(tmp_path: Path, budgets: tuple[int, int]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "profiled"
    assert run(out, "--steps", "4", "--profile.steps", "2-3", "--budget", str(between(budgets))) == 0
    rows = [json.loads(line) for line in (out / "profile" / "memory.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if r["kind"] == "step") == [2, 3]
    assert main(["report", str(out)]) == 0
    assert (out / "report" / "report.html").is_file()
    # the report reads the planner's own plan.json: each block's policy and predicted seconds, the step's tokens/s
    from elbowroom.report.html import summary
    from elbowroom.report.rundir import load_run

    plan = Plan.load(out / "plan.toml")
    data = load_run(out)
    assert [b["policy"] for b in data.plan["blocks"]] == [b.policy_label for b in plan.blocks]
    assert [b["predicted_s"] for b in data.plan["blocks"]] == [b.seconds for b in plan.blocks]
    assert summary(data)["predicted_tokens_per_s"] == pytest.approx(plan.predicted_tokens_per_s, rel=1e-3)
    page = (out / "report" / "report.html").read_text()
    assert all(b.policy_label in page for b in plan.blocks)


def test_writing_the_recording_is_not_counted_as_training_time(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # the trace and snapshot are written after the last recorded step; the logged throughput is the step's own
    from elbowroom.report.recorder import Recorder

    stop = Recorder._stop

    def slow_stop(self: Recorder) -> None:
        time.sleep(3.0 if self._active else 0.0)  # far longer than a step of this model, even on a busy machine
        stop(self)

    monkeypatch.setattr(Recorder, "_stop", slow_stop)
    out = tmp_path / "recorded"
    assert run(out, "--steps", "3", "--profile.steps", "2", "--logging.log_every", "1") == 0
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
    assert rows[2]["elapsed_s"] < 2.0, rows[2]


def test_profile_steps_are_validated() -> None:
    from elbowroom.config import ConfigError

    with pytest.raises(ConfigError, match="profile.steps: profile steps must look like"):
        resolve(None, ["--profile.steps", "3-x"])
    assert resolve(None, ["--profile.steps", "3-4"]).profile.step_set == {3, 4}


# ---------------------------------------------------------------- --model.hf
def hf_dir(tmp_path: Path, arch: str, weights: bool, vocab: int = BYTES) -> Path:
    """A tiny Hugging Face model directory: config.json only, or with the weights of a seeded model."""
    transformers = pytest.importorskip("transformers")
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=2)
        cls = transformers.GPT2LMHeadModel
    d = tmp_path / f"hf-{arch}-{'weights' if weights else 'config'}-{vocab}"
    if weights:
        torch.manual_seed(0)
        cls(cfg).save_pretrained(d)
    else:
        cfg.save_pretrained(d)
    return d


def run_hf(out: Path, model_dir: Path, *args: str) -> int:
    return main(["train", "--out", str(out), *RUN, "--model.hf", str(model_dir), "--optimizer.lr", "1e-2", *args])


@pytest.mark.parametrize("arch, weights", [("llama", False), ("llama", True), ("gpt2", False)])
def test_hf_model_trains(tmp_path: Path, arch: str, weights: bool) -> None:
    d = hf_dir(tmp_path, arch, weights)
    out = tmp_path / "run"
    assert run_hf(out, d, "--steps", "3") == 0
    losses = train_losses(out)
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert losses[3] < losses[1], losses
    # the checkpoint holds the Hugging Face model's own keys, and the config it was trained with
    loaded = CheckpointManager(out / "checkpoints").load_latest(map_location="cpu")
    assert any(k.startswith(("model.layers.", "transformer.h.")) for k in loaded.state["model"])
    assert loaded.meta["model"]["source"] == "hf" and loaded.meta["model"]["model_type"] == arch


def test_hf_model_under_a_budget(tmp_path: Path) -> None:
    from elbowroom.train.hf import build_hf_model, load_hf_config

    d = hf_dir(tmp_path, "llama", True)
    model = build_hf_model(str(d), load_hf_config(str(d)), torch.device("cpu"))
    ids = torch.randint(0, BYTES, (4, 32))
    prof = profile(model, (ids, ids), source="measured")
    with pytest.raises(BudgetError) as e:
        plan_for(prof, 1)
    keep_all = plan_for(prof, 1 << 40)
    plain = sum(v for k, v in keep_all.memory.items() if k != "allocator margin")
    budget = (e.value.minimum_bytes + plain) // 2
    out = tmp_path / "run"
    assert run_hf(out, d, "--steps", "3", "--budget", str(budget)) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["predicted_peak_bytes"] <= budget and len(plan["blocks"]) == 2 and not plan["fused_loss"]
    losses = train_losses(out)
    assert losses[3] < losses[1], losses


def test_hf_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"

    def fails(model_dir: Path, *args: str) -> str:
        assert run_hf(out, model_dir, "--steps", "1", *args) == 2
        assert not out.exists()
        return capsys.readouterr().err

    assert "is not a directory" in fails(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in fails(tmp_path / "empty")
    small = hf_dir(tmp_path, "gpt2", False, vocab=128)
    err = fails(small)
    assert "vocab_size 256" in err and "vocab_size 128" in err
    assert "drop --model.dim" in fails(small, "--model.dim", "64")
    assert "drop --train.fused_loss" in fails(small, "--train.fused_loss")
    assert "fewer than --data.seq_len 100" in fails(hf_dir(tmp_path, "gpt2", False), "--data.seq_len", "100")
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    assert "pip install transformers" in fails(small)


@pytest.mark.parametrize("extra,one", [((), True), (("--parallel.data_parallel", "ddp"), False),
                                       (("--parallel.data_parallel", "fsdp"), False)])
def test_a_data_parallel_wrapper_at_world_size_one_plans_as_data_parallel(
        monkeypatch: pytest.MonkeyPatch, extra: tuple[str, ...], one: bool) -> None:
    """``--parallel.data_parallel ddp`` wraps the model in DDP at world size 1 too, which refuses streamed optimizer
    state: the plan must not stream there, and recompute keeps the non-reentrant checkpoint (a DDP run at world size 1
    on the H100 planned 6 streamed blocks and failed as the optimizer was wrapped)."""
    import elbowroom.plan as plan_api
    from elbowroom.train import planning

    cfg = resolve(None, [*SMALL, "--budget", "1GiB", *extra])
    assert not cfg.parallel.enabled  # world size 1 in every case
    seen: dict = {}

    def fake_fit(model, sample, **kw):
        seen.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(plan_api, "fit", fake_fit)
    if cfg.parallel.mode in ("fsdp", "hsdp"):
        assert planning.sharded(cfg)  # FSDP2 plans per rank, never through fit(), with stream_allowed=False
        return
    model = build_model(resolve_model_config(cfg, BYTES))
    ids = torch.randint(0, BYTES, (cfg.data.batch_size, cfg.data.seq_len))
    with pytest.raises(Exception, match="stop here"):
        planning.plan_for_budget(model, {"input_ids": ids, "targets": ids}, cfg, False, torch.float32)
    assert seen["stream"] is one and seen["reentrant"] is one


def test_host_budget_reaches_the_planner(tmp_path: Path, budgets: tuple[int, int], monkeypatch) -> None:
    """--host-budget is the host memory the plan may use: the trainer hands it to fit (which plans the profile's
    machine with that much host memory, tests/test_plan_stream.py), and the run trains."""
    import elbowroom.plan

    seen = {}
    real = elbowroom.plan.fit

    def fit(*a, **k):
        seen["host_memory"] = k.get("host_memory")
        return real(*a, **k)

    monkeypatch.setattr(elbowroom.plan, "fit", fit)
    assert run(tmp_path / "run", "--steps", "2", "--budget", f"{between(budgets)}B", "--host-budget", "3GiB") == 0
    assert seen["host_memory"] == "3GiB"
    assert sorted(train_losses(tmp_path / "run")) == [1, 2]
