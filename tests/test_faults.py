"""Faults a new user hit, each a specification of what the trainer does instead (CPU, small and fast).

1 rotation keeps valid checkpoints, 2 --resume never starts over or loses rows, 3 only prepared token files
train, 4 resume keeps the LR curve, 5 missing extras fail before anything is written, 6 signals save and exit
128+N, 7 logging does not change training and train() cleans up after itself, 8 a model that cannot fit the
machine's RAM is refused before it is built.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from elbowroom.cli import main
from elbowroom.train import checkpoint as C
from elbowroom.train import trainer as T
from elbowroom.train.checkpoint import CheckpointManager
from elbowroom.train.distributed_run import DistributedRun
from elbowroom.train.schedule import warmup_cosine

SMALL = [
    "--model.dim", "32", "--model.n_heads", "2", "--model.ffn_dim", "64", "--model.n_layers", "2",
    "--data.seq_len", "32", "--data.batch_size", "4", "--data.num_workers", "0",
    "--train.eval_every", "5", "--train.eval_batches", "2", "--logging.progress", "false", "--log-every", "1",
]


def run(out: Path, *args: str) -> int:
    return main(["train", "--out", str(out), *SMALL, *args])


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for directories): what 'nothing changed' compares."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def truncate(ckpt: Path) -> None:
    state = ckpt / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])


def flip_a_bit(ckpt: Path) -> None:
    state = ckpt / "state.pt"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    state.write_bytes(bytes(raw))


def drop_meta(ckpt: Path) -> None:
    (ckpt / "meta.json").unlink()


CORRUPTIONS = {"truncated": truncate, "bit-flipped": flip_a_bit, "meta missing": drop_meta}


# ---------------------------------------------------------------- 1. rotation
@pytest.mark.parametrize("corrupt", list(CORRUPTIONS))
def test_rotation_keeps_the_valid_checkpoint_and_sets_the_corrupt_one_aside(tmp_path: Path, caplog, corrupt) -> None:
    """step_3 and step_6 (keep 2); step_6 is damaged; a resume to step 7 falls back to step_3 and saves step_7.
    Rotation counts only checkpoints that verify: step_3 stays, step_6 is renamed, not deleted."""
    out = tmp_path / "run"
    assert run(out, "--steps", "6", "--checkpoint.every", "3") == 0
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000003", "step_00000006"]
    CORRUPTIONS[corrupt](ckpts / "step_00000006")
    damaged = snapshot(ckpts / "step_00000006")
    with caplog.at_level("WARNING"):
        assert run(out, "--steps", "7", "--checkpoint.every", "0", "--resume") == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["corrupt-step_00000006", "step_00000003", "step_00000007"]
    assert snapshot(ckpts / "corrupt-step_00000006") == damaged  # moved as it was, for inspection
    assert "corrupt-step_00000006" in caplog.text
    assert CheckpointManager(ckpts).load_latest().step == 7


def test_a_corrupt_checkpoint_of_the_step_being_saved_is_set_aside_not_overwritten(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep=1)
    mgr.save(1, {"w": torch.arange(3)})
    mgr.save(2, {"w": torch.arange(4)})
    truncate(tmp_path / "step_00000002")
    mgr = CheckpointManager(tmp_path, keep=1)  # a new process: nothing verified yet
    mgr.save(2, {"w": torch.arange(5)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt-step_00000002", "step_00000002"]
    assert torch.equal(mgr.load_latest().state["w"], torch.arange(5))


def test_rotation_does_not_rehash_what_it_verified(tmp_path: Path, monkeypatch) -> None:
    """A save verifies the checkpoints it keeps, but hashes each file at most once per process."""
    hashed: list[Path] = []
    real = C._sha256_file
    monkeypatch.setattr(C, "_sha256_file", lambda p: hashed.append(p) or real(p))
    mgr = CheckpointManager(tmp_path, keep=3)
    for s in range(1, 6):
        mgr.save(s, {"w": torch.arange(s)})
    assert hashed == []  # written by this manager: hashed while writing
    other = CheckpointManager(tmp_path, keep=3)  # another process finds them on disk
    other.save(6, {"w": torch.arange(6)})
    other.save(7, {"w": torch.arange(7)})
    # each checkpoint found on disk is hashed once, the oldest right before rotation removes it
    assert sorted(p.parent.name for p in hashed) == ["step_00000003", "step_00000004", "step_00000005"]


# ---------------------------------------------------------------- 2. --resume never starts over, rows never lost
@pytest.mark.parametrize("case", ["missing", "typo", "empty", "no checkpoints", "all corrupt"])
def test_resume_without_a_valid_checkpoint_exits_2_and_changes_nothing(tmp_path: Path, capsys, case) -> None:
    out = tmp_path / "run"
    if case in ("typo", "no checkpoints", "all corrupt"):
        assert run(out, "--steps", "4", "--checkpoint.every", "2") == 0
    if case == "empty":
        out.mkdir()
    if case == "no checkpoints":
        for p in (out / "checkpoints").iterdir():
            for f in p.iterdir():
                f.unlink()
            p.rmdir()
    if case == "all corrupt":
        truncate(out / "checkpoints" / "step_00000004")
        flip_a_bit(out / "checkpoints" / "step_00000002")
    target = tmp_path / "rnu" if case == "typo" else out
    before = snapshot(tmp_path)
    capsys.readouterr()
    assert run(target, "--steps", "8", "--resume") == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("elbowroom train: error: --resume: ") and "Traceback" not in err, err
    assert snapshot(tmp_path) == before  # no file created, modified or moved


def test_resume_from_an_older_step_keeps_every_logged_row(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert run(out, "--steps", "10", "--checkpoint.every", "5") == 0
    logged = (out / "metrics.jsonl").read_text().splitlines()
    truncate(out / "checkpoints" / "step_00000010")
    assert run(out, "--steps", "12", "--resume") == 0  # continues from step 5
    side = out / "metrics.rewound-5.jsonl"
    kept = (out / "metrics.jsonl").read_text().splitlines()
    assert set(logged) <= set(kept) | set(side.read_text().splitlines())
    assert all(r["step"] > 5 for r in rows(side)) and {r["step"] for r in rows(side)} == set(range(6, 11))
    steps = [r["step"] for r in rows(out / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 13))  # one curve in the main file


def test_resume_appends_to_metrics(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert run(out, "--steps", "4") == 0
    first = (out / "metrics.jsonl").read_text()
    assert run(out, "--steps", "6", "--resume") == 0
    assert (out / "metrics.jsonl").read_text().startswith(first)
    assert not list(out.glob("metrics.rewound-*"))


def test_resume_past_steps_exits_2_and_changes_nothing(tmp_path: Path, capsys, caplog) -> None:
    """`--resume --steps 2` on a run checkpointed at step 6 (meant as "2 more steps"): exit 2, one line that names
    the step to pass, no schedule advice, no file created, modified or moved (no rows rewound)."""
    out = tmp_path / "run"
    assert run(out, "--steps", "6", "--checkpoint.every", "3") == 0
    before = snapshot(tmp_path)
    capsys.readouterr()
    with caplog.at_level("INFO"):
        assert run(out, "--steps", "2", "--resume") == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        f"elbowroom train: error: --resume: the newest checkpoint of {out} is at step 6, past --steps 2 (--steps "
        "counts from the start of the run); pass --steps 7 or more to train further"), err
    assert "Traceback" not in err
    assert "decay_steps" not in caplog.text and "resumed from" not in caplog.text, caplog.text
    assert snapshot(tmp_path) == before


def test_resume_at_steps_says_the_run_is_done_and_changes_nothing(tmp_path: Path, caplog) -> None:
    out = tmp_path / "run"
    assert run(out, "--steps", "6") == 0
    before = snapshot(tmp_path)
    caplog.clear()
    with caplog.at_level("INFO"):
        assert run(out, "--steps", "6", "--resume") == 0
    assert (f"--resume: the newest checkpoint of {out} is at step 6, --steps 6: the run is done, nothing to train; "
            "pass --steps 7 or more to train further") in caplog.messages, caplog.text
    assert "decay_steps" not in caplog.text and "resumed from" not in caplog.text, caplog.text
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- 3. only prepared token files train
@pytest.mark.parametrize("content", ["text", "random bytes"])
def test_a_file_not_made_by_prepare_is_refused(tmp_path: Path, capsys, content) -> None:
    data = tmp_path / "data.bin"
    if content == "text":
        data.write_text("the quick brown fox jumps over the lazy dog\n" * 2000)
    else:
        data.write_bytes(np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes())
    out = tmp_path / "run"
    assert run(out, "--steps", "2", "--data.path", str(data)) == 2
    err = capsys.readouterr().err
    assert "elbowroom prepare" in err and "sidecar" in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_sidecar_without_prepares_magic_is_refused(tmp_path: Path, capsys) -> None:
    data = tmp_path / "data.bin"
    np.arange(5000, dtype=np.uint16).tofile(data)
    meta = {"dtype": "uint16", "vocab_size": 5000, "num_tokens": 5000, "eos_id": None, "tokenizer": None}
    (tmp_path / "data.bin.json").write_text(json.dumps(meta))
    assert run(tmp_path / "run", "--steps", "2", "--data.path", str(data)) == 2
    assert "re-run `elbowroom prepare`" in capsys.readouterr().err
    (tmp_path / "data.bin.json").write_text(json.dumps({**meta, "format": "something-else", "version": 1}))
    assert run(tmp_path / "run", "--steps", "2", "--data.path", str(data)) == 2
    assert "not written by `elbowroom prepare`" in capsys.readouterr().err


def test_too_few_tokens_names_the_batch_and_the_fix(tmp_path: Path, capsys) -> None:
    """A 1.8 KB text gives 1801 tokens; the default batch needs 16 x 128 + 1: the message says so, not that
    'the validation split has 90 tokens'."""
    text = tmp_path / "small.txt"
    text.write_text("x = 1\n" * 300)
    assert main(["prepare", str(text), str(tmp_path / "small.bin"), "--no-progress"]) == 0
    capsys.readouterr()
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--data.path", str(tmp_path / "small.bin"), "--steps", "2",
                 "--logging.progress", "false", "--data.num_workers", "0"]) == 2
    err = capsys.readouterr().err
    assert "1,801 tokens, too few for one batch" in err, err
    assert "16 x --data.seq_len 128 + 1 = 2,049" in err and "--data.seq_len" in err
    assert "validation split has" not in err
    assert not out.exists()


# ---------------------------------------------------------------- 4. resume keeps the LR curve
def _lrs(out: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in rows(out / "metrics.jsonl") if "lr" in r}


def test_resume_with_more_steps_continues_the_first_lr_curve(tmp_path: Path, caplog) -> None:
    out, lr = tmp_path / "run", 3e-3
    sched = ["--scheduler.warmup_steps", "2"]
    assert run(out, "--steps", "8", *sched) == 0
    with caplog.at_level("WARNING"):
        assert run(out, "--steps", "16", "--resume", *sched) == 0
    assert "--scheduler.decay_steps 16" in caplog.text  # the log line says how to stretch it instead
    lrs = _lrs(out)
    for step in (9, 12, 16):  # the LR logged at step s is the one step s used: lambda(s - 1)
        assert lrs[step] == pytest.approx(lr * warmup_cosine(step - 1, warmup=2, total=8, min_ratio=0.1))
    assert lrs[9] == pytest.approx(lr * 0.1)  # no jump back up
    assert 'decay_steps = 8' in (out / "config.toml").read_text()


def test_resume_honours_a_deliberate_decay_steps(tmp_path: Path) -> None:
    out, lr = tmp_path / "run", 3e-3
    sched = ["--scheduler.warmup_steps", "2"]
    assert run(out, "--steps", "8", *sched) == 0
    assert run(out, "--steps", "16", "--resume", "--scheduler.decay_steps", "16", *sched) == 0
    lrs = _lrs(out)
    for step in (9, 12, 16):
        assert lrs[step] == pytest.approx(lr * warmup_cosine(step - 1, warmup=2, total=16, min_ratio=0.1))


# ---------------------------------------------------------------- 5. missing extras, failures before the first step
def test_missing_tensorboard_exits_2_before_writing(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    out = tmp_path / "run"
    assert run(out, "--steps", "2", "--logging.tensorboard", "true") == 2
    err = capsys.readouterr().err
    assert "pip install 'elbowroom[tensorboard]'" in err and err.count("\n") == 1, err
    assert not out.exists()
    monkeypatch.undo()
    assert run(out, "--steps", "2") == 0  # nothing blocks the rerun


def test_a_run_failing_before_its_first_step_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(T, "accumulate_gradients", boom)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated"):
        run(out, "--steps", "2")
    assert not out.exists()
    monkeypatch.undo()
    assert run(out, "--steps", "2") == 0


# ---------------------------------------------------------------- 6. signals
def _wait_for_steps(out: Path, proc: subprocess.Popen, n: int, timeout: float = 240.0) -> None:
    """Poll metrics.jsonl until ``n`` training rows are logged (generous: the machine may be loaded)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        path = out / "metrics.jsonl"
        if path.exists():
            lines = path.read_text().splitlines()
            if sum('"loss"' in line for line in lines[:-1]) >= n:  # the last line may be half written
                return
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"the run logged fewer than {n} steps in {timeout} s")


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_skips_validation_and_exits_128_plus_n(tmp_path: Path, sig, code) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "elbowroom.cli", "train", "--out", str(out), *SMALL, "--steps", "100000",
           "--checkpoint.every", "0", "--train.eval_every", "1"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    _wait_for_steps(out, proc, 2)
    proc.send_signal(sig)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()  # never leave a 100000-step run behind
        pytest.fail(f"the run did not stop within 240 s of {sig.name}: {proc.communicate()[0][-2000:]}")
    assert proc.returncode == code, output
    logged = rows(out / "metrics.jsonl")
    stopped = max(r["step"] for r in logged)
    assert [s for s, _ in CheckpointManager(out / "checkpoints").checkpoints()] == [stopped]
    if any("val_loss" in r and r["step"] == stopped for r in logged):  # only if the signal landed in that validation
        lines = output.splitlines()
        received = next(i for i, line in enumerate(lines) if f"received {sig.name}" in line)
        logged_step = next(i for i, line in enumerate(lines) if f"step {stopped:>6}  loss" in line)
        assert received > logged_step, f"validated on the way out: {output[-2000:]}"
    assert "--resume" in output


def test_a_second_ctrl_c_during_the_save_does_not_lose_it(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C at step 3, and again while the checkpoint is being written: the save completes, exit 130."""
    real_accumulate, real_save = T.accumulate_gradients, CheckpointManager.save
    calls = {"steps": 0}

    def accumulate(*args, **kwargs):
        calls["steps"] += 1
        if calls["steps"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C, during step 3
        return real_accumulate(*args, **kwargs)

    def save(self, step, state, meta=None):
        os.kill(os.getpid(), signal.SIGINT)  # the second one, as the save begins
        return real_save(self, step, state, meta)

    monkeypatch.setattr(T, "accumulate_gradients", accumulate)
    monkeypatch.setattr(CheckpointManager, "save", save)
    out = tmp_path / "run"
    try:
        code = run(out, "--steps", "50", "--checkpoint.every", "0")
    except KeyboardInterrupt:
        pytest.fail("the second Ctrl-C interrupted the save")
    assert code == 130
    assert CheckpointManager(out / "checkpoints").load_latest().step == 3


def test_a_ctrl_c_during_a_periodic_save_stops_right_after_it(tmp_path: Path, monkeypatch) -> None:
    """The first Ctrl-C lands while step 2's checkpoint is written: the save completes, no step 3 runs, nothing
    is saved twice, exit 130."""
    real_accumulate, real_save = T.accumulate_gradients, CheckpointManager.save
    steps, saves = [], []

    def accumulate(*args, **kwargs):
        steps.append(len(steps) + 1)
        return real_accumulate(*args, **kwargs)

    def save(self, step, state, meta=None):
        saves.append(step)
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs now, inside the save
        return real_save(self, step, state, meta)

    monkeypatch.setattr(T, "accumulate_gradients", accumulate)
    monkeypatch.setattr(CheckpointManager, "save", save)
    out = tmp_path / "run"
    assert run(out, "--steps", "50", "--checkpoint.every", "2") == 130
    assert (steps, saves) == ([1, 2], [2])
    assert [s for s, _ in CheckpointManager(out / "checkpoints").checkpoints()] == [2]
    assert max(r["step"] for r in rows(out / "metrics.jsonl")) == 2


@pytest.mark.parametrize("during", ["validation", "the log line's sync"])
def test_a_ctrl_c_between_steps_stops_after_the_step_it_follows(tmp_path: Path, monkeypatch, during: str) -> None:
    """The first Ctrl-C lands while step 1 is validated (or its loss is read for the log line): that finishes,
    step 1's checkpoint is saved, no step 2 runs, exit 130 ("finishing this step" means this one)."""
    real_accumulate = T.accumulate_gradients
    steps: list[int] = []

    def accumulate(*args, **kwargs):
        steps.append(len(steps) + 1)
        return real_accumulate(*args, **kwargs)

    def ctrl_c_once(real):
        def wrapped(*args, **kwargs):
            if not sent:
                sent.append(True)
                os.kill(os.getpid(), signal.SIGINT)  # the handler runs now, inside the validation or the sync
            return real(*args, **kwargs)
        return wrapped

    sent: list[bool] = []
    monkeypatch.setattr(T, "accumulate_gradients", accumulate)
    if during == "validation":
        monkeypatch.setattr(T, "evaluate", ctrl_c_once(T.evaluate))
    else:
        monkeypatch.setattr(DistributedRun, "global_loss", ctrl_c_once(DistributedRun.global_loss))
    out = tmp_path / "run"
    assert run(out, "--steps", "50", "--train.eval_every", "1", "--checkpoint.every", "0") == 130
    assert sent and steps == [1]
    assert [s for s, _ in CheckpointManager(out / "checkpoints").checkpoints()] == [1]
    logged = rows(out / "metrics.jsonl")
    assert max(r["step"] for r in logged) == 1
    # the validation the signal landed in is finished and logged; after the log line's, none starts on the way out
    assert any("val_loss" in r for r in logged) == (during == "validation")


# ---------------------------------------------------------------- 7. logging does not change training; clean-up
def test_logging_the_grad_norm_does_not_go_through_the_optimizers_clip(tmp_path: Path, monkeypatch) -> None:
    from elbowroom.optim import CPUOffloadOptimizer

    args = ["--steps", "4", "--train.max_grad_norm", "0", "--optimizer.offload_fraction", "0.5"]
    assert run(tmp_path / "plain", "--steps", "4", "--train.max_grad_norm", "0") == 0

    def no_clip(self, *a, **k):
        raise AssertionError("clip_grad_norm_ called with clipping off: it changes the optimizer's overlap")

    monkeypatch.setattr(CPUOffloadOptimizer, "clip_grad_norm_", no_clip)
    assert run(tmp_path / "off", *args) == 0
    a = [r["grad_norm"] for r in rows(tmp_path / "plain" / "metrics.jsonl") if "loss" in r]
    b = [r["grad_norm"] for r in rows(tmp_path / "off" / "metrics.jsonl") if "loss" in r]
    assert b == pytest.approx(a, rel=1e-5)


def test_train_gives_back_global_settings(tmp_path: Path) -> None:
    torch.manual_seed(123)
    random.seed(7)
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        assert run(tmp_path / "run", "--steps", "2", "--train.deterministic", "true") == 0
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == python_rng


@pytest.mark.parametrize("fails", [False, True])
def test_the_optimizer_is_closed_when_the_run_ends(tmp_path: Path, monkeypatch, fails: bool) -> None:
    closed: list[bool] = []
    real_build = T.build_optimizer

    def build(*args, **kwargs):
        opt = real_build(*args, **kwargs)
        real_close = opt.close
        opt.close = lambda: closed.append(True) or real_close()
        return opt

    monkeypatch.setattr(T, "build_optimizer", build)
    if fails:
        real_step = T.clip_gradients

        def failing(*args, **kwargs):
            raise RuntimeError("a step failed (simulated)")

        monkeypatch.setattr(T, "clip_gradients", failing)
        with pytest.raises(RuntimeError, match="simulated"):
            run(tmp_path / "run", "--steps", "2", "--optimizer.offload_fraction", "0.5")
        monkeypatch.setattr(T, "clip_gradients", real_step)
    else:
        assert run(tmp_path / "run", "--steps", "2", "--optimizer.offload_fraction", "0.5") == 0
    assert closed == [True]


# ---------------------------------------------------------------- 8. a model the machine cannot hold
def test_a_model_too_big_for_the_hosts_ram_is_refused_before_it_is_built(tmp_path: Path, capsys, monkeypatch) -> None:
    real_build = T.build_model

    def shapes_only(cfg, device=None):
        if str(device) != "meta":
            raise AssertionError(f"built the model on {device} before checking that it fits")
        return real_build(cfg, device=device)

    monkeypatch.setattr(T, "available_host_memory", lambda: 23 * 2**30, raising=False)
    monkeypatch.setattr(T, "build_model", shapes_only)
    out = tmp_path / "w1"
    w1 = Path(__file__).parents[1] / "configs" / "w1.toml"
    code = main(["train", "--config", str(w1), "--out", str(out), "--train.device", "cpu",
                 "--data.num_workers", "0", "--logging.progress", "false"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "model w1 (1.3" in err and "needs ~" in err and "GiB for weights, gradients and AdamW state" in err
    assert "23.0 GiB of RAM available" in err and err.count("\n") == 1
    assert not out.exists()


def test_the_memory_estimate_lets_the_tiny_model_through(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(T, "available_host_memory", lambda: 2 * 2**30, raising=False)
    assert run(tmp_path / "run", "--steps", "1") == 0
    assert math.isfinite(rows(tmp_path / "run" / "metrics.jsonl")[0]["loss"])


@pytest.mark.parametrize("rank", ["0", "1"])
def test_the_other_ranks_warnings_say_whose_they_are(rank: str) -> None:
    # under torchrun every rank writes to the one stderr: rank 0 logs as one process does, the others only warnings
    # and errors, each marked with its rank (4 ranks' budget warnings read alike without it)
    code = ("import logging; from elbowroom.cli import _setup_logging; _setup_logging(); "
            "log = logging.getLogger('elbowroom.x'); log.info('said'); log.warning('warned')")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, RANK=rank), capture_output=True,
                          text=True, timeout=120, check=True)
    lines = done.stderr.strip().splitlines()
    if rank == "0":
        assert [x.split(" ", 1)[1] for x in lines] == ["I said", "W warned"]
    else:
        assert [x.split(" ", 1)[1] for x in lines] == ["W [rank 1] warned"]
