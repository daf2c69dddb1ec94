"""The trainer under tensor and pipeline parallel (2 gloo processes): the same losses as one process.

Every distributed run happens in one spawn (CI has two cores); the single-process references run in the test
process. fp32, no dropout, clipping on: the ranks' losses (and, under tensor parallel, validation losses) must
equal the single process's within 1e-5 relative. Tensor- and pipeline-parallel checkpoints resume in one process
on the uninterrupted curve. Bad layouts exit 2 with a sentence and write nothing. (TP x FSDP2 and PP x FSDP2 need
4 ranks; the library's tests cover those meshes.)
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from elbowroom.cli import main
from tests.distributed_utils import TINY_RUN, assert_close_curves, run_ranks, train_losses, trainer_config

BASE = TINY_RUN  # the same tiny run whatever the layout: its single-process curve is the reference
TP = ["--parallel.tp", "2"]
PP_1F1B = ["--parallel.pp", "2", "--parallel.pp_schedule", "1f1b", "--parallel.pp_microbatches", "4"]
# 2 x 2 rows per step in 4 micro-batches; validation's batches of 2 rows are padded to 4 with ignored targets
ACCUM = ["--data.batch_size", "2", "--train.gradient_accumulation_steps", "2"]
PP_GPIPE_ACCUM = ["--parallel.pp", "2", "--parallel.pp_schedule", "gpipe", "--parallel.pp_microbatches", "4", *ACCUM]
RECOMPUTE = ["--activations.checkpoint", "full"]
FIRST_HALF = ["--steps", "3", "--scheduler.decay_steps", "6"]  # stopped at 3 on the 6-step schedule

CASES = {"tp": TP, "tp_recompute": TP + RECOMPUTE, "pp_1f1b": PP_1F1B, "pp_gpipe_accum": PP_GPIPE_ACCUM}
BAD_HEADS = [*TP, "--model.dim", "48", "--model.n_heads", "3"]


def _config(out: Path, *args: str):
    return trainer_config(BASE, out, *args)


def _train(out: Path, *args: str) -> dict:
    return train_losses(BASE, out, *args)


def _ranks(rank: int, world: int, tmp: str) -> dict:
    """Each case on 2 ranks inside one process group (``train(cfg)`` joins it); a TP first half; a bad layout."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    tmp_path = Path(tmp)
    res = {name: _train(tmp_path / name, *args) for name, args in CASES.items()}
    res["half"] = _train(tmp_path / "tp-half", *TP, *FIRST_HALF)
    res["tp_compile"] = _train(tmp_path / "tp-compile", *TP, *RECOMPUTE, "--train.compile")  # DTensor blocks compiled
    res["pp_compile"] = _train(tmp_path / "pp-compile", *PP_1F1B, "--train.compile")  # each stage's blocks compiled
    res["pp_half"] = _train(tmp_path / "pp-half", *PP_1F1B, *FIRST_HALF)
    res["bad_heads"] = _cli(tmp_path / "bad-heads", *BAD_HEADS)
    # the parent's single-process checkpoint of step 3: a pipeline stage refuses it, tensor parallel continues it
    before = sorted(p.name for p in (tmp_path / "single-half").rglob("*"))
    res["single_pp"] = (*_cli(tmp_path / "single-half", *PP_1F1B, "--resume"),
                        sorted(p.name for p in (tmp_path / "single-half").rglob("*")) == before)
    res["single_tp"] = _train(tmp_path / "single-half", *TP, "--resume")
    return res


def _cli(out: Path, *args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", *BASE, "--out", str(out), *args])
    return code, err.getvalue()


_close = assert_close_curves


@pytest.mark.slow
def test_trainer_model_parallel_equals_one_process(tmp_path: Path) -> None:
    ref = {"plain": _train(tmp_path / "ref"), "accum": _train(tmp_path / "ref-accum", *ACCUM)}
    _train(tmp_path / "single-half", *FIRST_HALF)

    r0, r1 = run_ranks(_ranks, str(tmp_path))

    for name, args in CASES.items():
        want = ref["accum" if ACCUM[0] in args else "plain"]
        got = r0[name]
        _close(got["losses"], want["losses"], 1e-5, name)  # the global loss, logged by rank 0
        assert r1[name]["losses"] == got["losses"], name  # every rank agrees on the loss it reports
        _close(got["val"], want["val"], 1e-5, name)  # validation (whole logits, or through the pipeline)
    # the blocks compiled in place, over their tensor-parallel shards or in their stage (compiled kernels round
    # differently)
    for name in ("tp_compile", "pp_compile"):
        _close(r0[name]["losses"], ref["plain"]["losses"], 1e-4, name)
        assert r1[name]["losses"] == r0[name]["losses"], name
    # rank 0 alone writes the metrics: one row per step and evaluation
    assert len((tmp_path / "tp" / "metrics.jsonl").read_text().splitlines()) == 6 + 2

    assert r0["half"]["step"] == r0["pp_half"]["step"] == 3
    # tp 2 -> tp 1 and pp 2 -> pp 1: the step-3 checkpoints continued in one process
    later = {s: v for s, v in ref["plain"]["losses"].items() if s > 3}
    for half, args in (("tp-half", []), ("pp-half", [])):
        resumed = _train(tmp_path / half, *args, "--resume")
        _close({s: v for s, v in resumed["losses"].items() if s > 3}, later, 1e-5, half)

    # one process -> tp 2; one process -> pp 2 is refused before anything is written
    _close({s: v for s, v in r0["single_tp"]["losses"].items()}, later, 1e-5, "single -> tp 2")
    for r in (r0, r1):
        code, err, unchanged = r["single_pp"]
        assert code == 2 and "which a pipeline stage cannot pick its part of" in err and unchanged, err
    assert r0["single_tp"]["step"] == 6

    # a tp that does not divide the heads: exit 2 on every rank, a sentence, nothing written
    for r in (r0, r1):
        code, err = r["bad_heads"]
        assert code == 2 and "model.n_heads = 3 must be divisible by parallel.tp = 2" in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "bad-heads").exists()


# ---------------------------------------------------------------- bad set-ups: exit 2, a sentence, nothing written
@pytest.mark.parametrize(
    "args, message",
    [
        ([*TP, "--parallel.pp", "2"], "= 4 processes, but the world size is 2"),
        (["--parallel.pp", "2", "--parallel.pp_microbatches", "1"], "fewer than the pipeline's 2 stages"),
        ([*TP, "--optimizer.param_dtype", "bfloat16"], "--optimizer.param_dtype bfloat16 does not run with"),
        ([*TP, "--optimizer.offload_fraction", "0.5"], "--optimizer.offload_fraction does not run with"),
        ([*TP, "--train.qat", "int8"], "--train.qat does not run with"),
        ([*PP_1F1B, "--train.fused_loss"], "drop --train.fused_loss"),
    ],
)
def test_bad_model_parallel_setups_exit_2(tmp_path: Path, monkeypatch, capsys, args: list[str],
                                          message: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    out = tmp_path / "run"
    assert main(["train", *BASE, "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err
    assert not out.exists()


def test_dcp_load_restores_the_learning_rate(tmp_path: Path) -> None:
    """DCP loads tensors in place but puts plain values (a scheduled learning rate) into the dict it is given:
    the loaders copy those back, so a resumed optimizer steps with the saved LR, not its constructor's."""
    import torch

    from elbowroom.distributed import checkpoint as DC
    from elbowroom.train import sharded_checkpoint as S
    from elbowroom.train.checkpoint import CheckpointManager

    def fresh(lr: float):
        model = torch.nn.Linear(4, 3)
        return model, torch.optim.AdamW(model.parameters(), lr=lr)

    model, opt = fresh(0.5)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.param_groups[0]["lr"] = 0.123  # as a scheduler leaves it
    DC.save(tmp_path / "dcp", model, opt, extra={"step": 1})
    S.save_sharded(CheckpointManager(tmp_path / "ckpts"), 1, model, opt, {}, {}, is_main=True)
    for load in (lambda m, o: DC.load(tmp_path / "dcp", m, o),
                 lambda m, o: S.load_sharded(tmp_path / "ckpts" / "step_00000001", m, o)):
        m, o = fresh(0.5)
        load(m, o)
        assert o.param_groups[0]["lr"] == 0.123
        assert torch.equal(o.state[o.param_groups[0]["params"][0]]["exp_avg"],
                           opt.state[opt.param_groups[0]["params"][0]]["exp_avg"])
