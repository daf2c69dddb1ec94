"""``--budget`` under tensor and pipeline parallel (2 gloo processes, one spawn): each rank's plan.

The budget is the planner's own: a run with a budget of one byte exits 2 naming each rank's minimum, writing
nothing, and the planned runs take the largest of those minima (the pipeline a set share above), so that at least
one block recomputes. A planned run trains the same losses as the unplanned run of its layout within 1e-5 relative
(recompute does not change the numbers; fp32, no dropout). Under 1F1B the first stage holds two micro-batches and
the last one, so with the same budget the first stage recomputes where the last keeps. A run's plans applied to
another layout exit 2; ``--resume`` follows them.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from elbowroom.cli import main
from tests.distributed_utils import TINY_RUN, assert_close_curves, run_ranks, train_losses

BASE = [*TINY_RUN, "--steps", "10", "--train.eval_every", "5", "--checkpoint.every", "5"]
TP = ["--parallel.tp", "2"]
PP = ["--parallel.pp", "2", "--parallel.pp_schedule", "1f1b", "--parallel.pp_microbatches", "4",
      "--model.n_layers", "4", "--data.seq_len", "64", "--data.batch_size", "8"]  # 2 blocks a stage
MINIMUM = re.compile(r"needs at least ([\d,]+) bytes")


def _cli(out: Path, *args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", *BASE, "--out", str(out), *args])
    return code, err.getvalue()


def _ranks(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    tmp_path = Path(tmp)
    res: dict = {}
    for name, layout, above in (("pp", PP, 1.6), ("tp", TP, 1.0)):
        low = _cli(tmp_path / f"{name}-low", *layout, "--budget", "1B")
        res[f"{name}_low"] = (*low, (tmp_path / f"{name}-low").exists())
        # the planner's own minimum (the largest rank's); the pipeline's 1.6 x leaves the last stage (one
        # micro-batch in flight) room to keep its blocks while the first (two) still recomputes
        budget = int(above * max(int(m.replace(",", "")) for m in MINIMUM.findall(low[1])))
        res[f"{name}_plain"] = train_losses(BASE, tmp_path / f"{name}-plain", *layout)
        res[name] = train_losses(BASE, tmp_path / name, *layout, "--budget", str(budget))
    # the pipeline's plans under tensor parallel: another layout, refused before anything is written
    res["other"] = (*_cli(tmp_path / "other", *TP, "--plan", str(tmp_path / "pp" / "plan.toml")),
                    (tmp_path / "other").exists())
    # the planned pipeline run, stopped at step 5 and resumed: its own plans, the same curve
    res["half"] = train_losses(BASE, tmp_path / "pp-half", *PP, "--budget", str(budget_of(tmp_path / "pp")),
                               "--steps", "5", "--scheduler.decay_steps", "10")
    planned = (tmp_path / "pp-half" / "plan.toml").read_text()
    res["resumed"] = train_losses(BASE, tmp_path / "pp-half", *PP, "--resume")
    res["same_plans"] = (tmp_path / "pp-half" / "plan.toml").read_text() == planned  # followed, not planned again
    return res


def budget_of(run: Path) -> int:
    from elbowroom.plan.ranks import RankPlans

    return RankPlans.load(run / "plan.toml").budget_bytes


@pytest.mark.slow
def test_budget_under_tensor_and_pipeline_parallel(tmp_path: Path) -> None:
    from elbowroom.plan.ranks import RankPlans

    r0, r1 = run_ranks(_ranks, str(tmp_path))
    for name in ("pp", "tp"):
        for r in (r0, r1):  # a budget below the minimum: exit 2 naming each rank's minimum, nothing written
            code, err, written = r[f"{name}_low"]
            assert code == 2 and "is each rank's budget and is below the minimum" in err and not written, err
            assert "Traceback" not in err
        assert_close_curves(r0[name]["losses"], r0[f"{name}_plain"]["losses"], 1e-5, name)
        assert r1[name]["losses"] == r0[name]["losses"], name
        plans = RankPlans.load(tmp_path / name / "plan.toml")
        assert any(b.checkpoint != "none" for p in plans.plans for b in p.blocks), plans.table()
    assert "pipeline rank 0 (2 blocks) needs at least" in r0["pp_low"][1]
    # 1F1B: the first stage holds two micro-batches, the last one; with the same budget their plans differ
    first, last = RankPlans.load(tmp_path / "pp" / "plan.toml").plans
    assert "pipeline rank 0" in first.layout and "pipeline rank 1" in last.layout
    assert any(b.checkpoint != "none" for b in first.blocks), first.table()
    assert all(b.checkpoint == "none" for b in last.blocks), last.table()
    (tp_plan,) = RankPlans.load(tmp_path / "tp" / "plan.toml").plans
    assert tp_plan.layout.startswith("tp 2 x pp 1")

    for r in (r0, r1):
        code, err, written = r["other"]
        assert code == 2 and "the plans were made for tp 1 x pp 2" in err and not written, err
    resumed = {s: v for s, v in r0["resumed"]["losses"].items() if s > 5}
    assert_close_curves(resumed, {s: v for s, v in r0["pp"]["losses"].items() if s > 5}, 1e-5, "resumed")
    assert r0["resumed"]["step"] == 10 and r0["same_plans"]
