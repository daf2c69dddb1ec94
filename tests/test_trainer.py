"""The trainer end to end on CPU: learning, accumulation, exact resume, signals, checkpoints, bad input."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elbowroom.cli import main
from elbowroom.models import ModelConfig, build_model
from elbowroom.train import data as D
from elbowroom.train.checkpoint import CheckpointManager
from elbowroom.train.trainer import accumulate_gradients

SMALL = [
    "--model.dim", "32", "--model.n_heads", "2", "--model.ffn_dim", "64", "--model.n_layers", "2",
    "--data.seq_len", "32", "--data.batch_size", "4", "--data.num_workers", "0",
    "--train.eval_every", "5", "--train.eval_batches", "2", "--logging.progress", "false", "--log-every", "1",
]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(out) if "loss" in r}


def run(out: Path, *args: str) -> int:
    return main(["train", "--out", str(out), *SMALL, *args])


# ---------------------------------------------------------------- the main job
@pytest.mark.slow
def test_default_main_job_lowers_validation_loss(tmp_path: Path) -> None:
    """`elbowroom train` with its defaults (tiny model, built-in corpus) learns within its default steps."""
    out = tmp_path / "main"
    assert main(["train", "--out", str(out), "--logging.progress", "false"]) == 0
    val = [r["val_loss"] for r in rows(out) if "val_loss" in r]
    assert len(val) >= 2
    assert val[-1] < val[0] - 0.3, val
    assert val[-1] < 2.6, val  # bytes of Python source: far below ln(256) = 5.5 of a uniform guess
    needed = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_bytes"}
    assert all(needed <= r.keys() for r in rows(out) if "loss" in r)
    assert (out / "checkpoints").is_dir() and (out / "config.toml").is_file()


# ---------------------------------------------------------------- accumulation equivalence
def _batches(variable: bool, n: int, seq: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    samples = []
    for _i in range(n):
        length = int(torch.randint(3, seq + 1, (1,), generator=g)) if variable else seq
        toks = torch.randint(0, 256, (length + 1,), generator=g)
        samples.append({"input_ids": toks[:-1], "targets": toks[1:]})
    return samples


def _grads(model, micro) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, micro, torch.autocast("cpu", enabled=False))
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("variable", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_accumulation_equals_one_big_batch(variable: bool, arch: str) -> None:
    """k micro-batches of b samples give the gradients of one batch of k*b (token-normalised loss)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch=arch, dim=32, n_heads=2, ffn_dim=64, n_layers=2, max_seq_len=24))
    samples = _batches(variable, 8, 24)
    collate = D.pad_collate if variable else D.collate
    big = _grads(model, [collate(samples)])
    k4 = _grads(model, [collate(samples[i : i + 2]) for i in range(0, 8, 2)])
    for a, b in zip(big, k4):
        assert (a - b).norm() / b.norm() <= 1e-6
    if variable:
        # the naive per-micro-batch mean weights short micro-batches up: the test can tell them apart
        model.zero_grad(set_to_none=True)
        for i in range(0, 8, 2):
            b = collate(samples[i : i + 2])
            accumulate_gradients(model, [b], torch.autocast("cpu", enabled=False))
        naive = [p.grad / 4 for p in model.parameters()]
        assert max(float((a - b).norm() / b.norm()) for a, b in zip(naive, big)) > 1e-3


# ---------------------------------------------------------------- resume
@pytest.mark.parametrize("extra", [[], ["--model.arch", "gpt2", "--model.dropout", "0.1", "--data.num_workers", "1",
                                        "--train.gradient_accumulation_steps", "2"],
                                   ["--optimizer.offload_fraction", "0.5", "--train.gradient_accumulation_steps", "2"],
                                   ["--optimizer.offload_fraction", "0.5", "--optimizer.offload_param_dtype",
                                    "bfloat16", "--train.dtype", "bf16"],
                                   ["--optimizer.offload_fraction", "0.5", "--optimizer.param_dtype", "bfloat16",
                                    "--train.dtype", "bf16", "--train.gradient_accumulation_steps", "2"],
                                   ["--optimizer.param_dtype", "bfloat16", "--train.dtype", "bf16"],
                                   # blocks compiled with their whole-block checkpoint, dropout replayed in the
                                   # compiled recompute
                                   ["--train.compile", "--activations.checkpoint", "full", "--model.arch", "gpt2",
                                    "--model.dropout", "0.1"]])
def test_resume_continues_the_exact_loss_curve(tmp_path: Path, extra: list[str]) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    assert run(full, "--steps", "20", *extra) == 0
    assert run(part, "--steps", "10", "--scheduler.decay_steps", "20", "--checkpoint.every", "5", *extra) == 0
    assert run(part, "--steps", "20", "--scheduler.decay_steps", "20", "--resume", *extra) == 0
    a, b = train_losses(full), train_losses(part)
    assert sorted(b) == list(range(1, 21))
    assert a == b  # bit-identical on CPU
    assert [r["lr"] for r in rows(full) if "lr" in r] == [r["lr"] for r in rows(part) if "lr" in r]
    train_rows = [r for r in rows(full) if "loss" in r]
    offloaded = "--optimizer.offload_fraction" in extra
    # the host optimizer's own figures are logged where there is one: the CPU time of its step is real work
    assert all(("host_step_s" in r) == offloaded for r in train_rows)
    if offloaded:
        assert all(r["host_step_s"] >= 0 and r["host_wait_s"] >= 0 and r["host_threads"] >= 1
                   and r["host_copy_wait_s"] >= 0 and "host_trace" not in r for r in train_rows)
        assert sum(r["host_step_s"] for r in train_rows) > 0  # (a lazy step's figures lag one step)


def test_resume_takes_the_runs_saved_config_not_the_defaults(tmp_path: Path, capsys) -> None:
    """`--resume --steps N` alone continues the run as it was configured (batch size, LR and warmup here not the
    defaults): the loss and LR curves are the uninterrupted run's. An explicit setting that would change the
    training is refused (exit 2, one line naming it, nothing written)."""
    settings = ["--data.batch_size", "2", "--optimizer.lr", "1e-3", "--scheduler.warmup_steps", "2"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run(full, "--steps", "12", *settings) == 0
    assert run(part, "--steps", "6", "--scheduler.decay_steps", "12", *settings) == 0
    before = {p: p.read_bytes() for p in part.rglob("*") if p.is_file()}
    assert main(["train", "--out", str(part), "--resume", "--data.batch_size", "4", "--optimizer.lr", "1e-3"]) == 2
    err = capsys.readouterr().err
    assert "--data.batch_size 4 (the run has 2)" in err and "optimizer.lr" not in err, err  # (same lr: allowed)
    assert err.count("\n") == 1, err
    assert {p: p.read_bytes() for p in part.rglob("*") if p.is_file()} == before
    assert main(["train", "--out", str(part), "--steps", "12", "--resume"]) == 0
    assert train_losses(part) == train_losses(full)  # bit-identical on CPU
    assert [r["lr"] for r in rows(full) if "lr" in r] == [r["lr"] for r in rows(part) if "lr" in r]
    assert "batch_size = 2" in (part / "config.toml").read_text()


def test_resume_skips_a_corrupt_newest_checkpoint(tmp_path: Path, caplog) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    assert run(full, "--steps", "12") == 0
    assert run(part, "--steps", "10", "--scheduler.decay_steps", "12", "--checkpoint.every", "5") == 0
    newest = part / "checkpoints" / "step_00000010" / "state.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated, as by a crash
    with caplog.at_level("WARNING"):
        assert run(part, "--steps", "12", "--scheduler.decay_steps", "12", "--resume") == 0
    assert "skipping checkpoint" in caplog.text and "truncated" in caplog.text
    assert train_losses(part) == train_losses(full)  # continued from step 5, same curve


def test_crash_while_saving_keeps_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    mgr = CheckpointManager(tmp_path, keep=2)
    mgr.save(1, {"w": torch.arange(4)})
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        f.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        mgr.save(2, {"w": torch.arange(8)})
    monkeypatch.setattr(torch, "save", real_save)
    assert [s for s, _ in mgr.checkpoints()] == [1]  # the half-written one never got a real name
    loaded = mgr.load_latest()
    assert loaded.step == 1 and torch.equal(loaded.state["w"], torch.arange(4))
    mgr.save(3, {"w": torch.arange(2)})  # the next save clears the leftover temporary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000003"]


def test_save_keeps_the_temporaries_of_a_live_writer(tmp_path: Path) -> None:
    """A save clears what crashed saves left (their writer is gone), never a save under way in another process."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        mgr = CheckpointManager(tmp_path, keep=2)
        mgr.save(1, {"w": torch.arange(4)})
        others = {f".tmp-step_00000002-{live.pid}", f".old-step_00000001-{live.pid}"}
        leftovers = {f".tmp-step_00000002-{dead.pid}", ".tmp-step_00000002"}
        for name in others | leftovers:
            (tmp_path / name).mkdir()
        mgr.save(3, {"w": torch.arange(2)})
        assert {p.name for p in tmp_path.iterdir()} == {"step_00000001", "step_00000003", *others}
    finally:
        live.kill()
        live.wait()


def test_runs_started_in_the_same_second_get_directories_of_their_own(tmp_path: Path, monkeypatch,
                                                                      capsys) -> None:
    from elbowroom.train.run_dir import new_run_directory

    root = tmp_path / "runs"
    got = [new_run_directory(root, stamp="20250101-120000")[0] for _ in range(3)]
    assert [p.name for p in got] == ["20250101-120000", "20250101-120000-2", "20250101-120000-3"]
    assert all(p.is_dir() for p in got)
    # the default directory of a run that fails before its first step is given back: nothing is left
    monkeypatch.chdir(tmp_path / "runs")
    assert main(["train", *SMALL, "--steps", "2", "--data.path", "missing.bin"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(p.name for p in got)


def test_keep_last_k_and_checksum(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep=2)
    for s in (1, 2, 3):
        mgr.save(s, {"s": s})
    assert [s for s, _ in mgr.checkpoints()] == [3, 2]
    state = tmp_path / "step_00000003" / "state.pt"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one flipped bit somewhere inside
    state.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum"):
        mgr.validate(tmp_path / "step_00000003")
    assert mgr.load_latest().step == 2


def test_sigterm_saves_and_resume_finishes_the_same_curve(tmp_path: Path) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    assert run(full, "--steps", "400", "--checkpoint.every", "0") == 0
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "elbowroom.cli", "train", "--out", str(part), *SMALL, "--steps", "400",
           "--checkpoint.every", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        if (part / "metrics.jsonl").exists() and len(train_losses(part)) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output  # 143: stopped by SIGTERM, after saving
    stopped = max(train_losses(part))
    assert stopped < 400, "the run finished before the signal: nothing was tested"
    assert [s for s, _ in CheckpointManager(part / "checkpoints").checkpoints()] == [stopped]
    assert "--resume" in output
    assert run(part, "--steps", "400", "--checkpoint.every", "0", "--resume") == 0
    assert train_losses(part) == train_losses(full)


def test_sigterm_to_the_process_group_saves_with_loader_workers(tmp_path: Path) -> None:
    """`kill -TERM -- -PGID` (a scheduler stopping a job) reaches the loader's worker processes too: they ignore it,
    the main process finishes its step, saves and exits 143, and no worker outlives it."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "elbowroom.cli", "train", "--out", str(out), *SMALL, "--data.num_workers", "1",
           "--steps", "2000", "--checkpoint.every", "0"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and len(train_losses(out)) >= 2):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)  # the whole group: the main process and its loader worker
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "killed by signal" not in output and "Traceback" not in output, output
    stopped = max(train_losses(out))
    assert stopped < 2000, "the run finished before the signal: nothing was tested"
    assert [s for s, _ in CheckpointManager(out / "checkpoints").checkpoints()] == [stopped]
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # no process of the group is left
        os.killpg(proc.pid, 0)


def test_ctrl_c_before_the_first_step_says_nothing_was_saved(tmp_path: Path) -> None:
    """Ctrl-C while the run is still starting (building the corpus here): exit 130, and the last line does not
    speak of a checkpoint that was never saved."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "elbowroom.cli", "train", "--out", str(out), *SMALL, "--steps", "2"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", ELBOWROOM_CACHE=str(tmp_path / "cache"))  # a corpus to build
    # (SIGINT at its default in the child: a suite started in the background inherits it ignored, and Python then
    # installs no KeyboardInterrupt handler, as a program run with `&` should)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "building the built-in corpus" in line:
            proc.send_signal(signal.SIGINT)
            break
    output = "".join(lines) + proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGINT, output
    assert f"aborted; no checkpoint was saved in {out}" in output and "stands" not in output, output


def test_no_command_says_so(capsys) -> None:
    assert main([]) == 2
    captured = capsys.readouterr()
    assert "usage: elbowroom COMMAND" in captured.out
    assert captured.err == "elbowroom: error: no command given; choose one of train, prepare, plan, report, export\n"


# ---------------------------------------------------------------- bad input: message, exit code 2, nothing written
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elbowroom.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_bad_input_exits_2_without_traceback(tmp_path: Path) -> None:
    r = _cli("train", "--out", str(tmp_path / "x"), "--train.stepz", "3")
    assert r.returncode == 2
    assert "unknown config key 'train.stepz'; did you mean train.steps?" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "-3"], "train.steps must be >= 1"),
        (["--steps", "0"], "train.steps must be >= 1"),  # (it named scheduler.decay_steps, which nobody set)
        (["--steps", "abc"], "train.steps expects an integer"),
        (["--data.path", "MISSING"], "does not exist"),
        (["--data.path", "EMPTY"], "empty"),
        (["--optimizer.offload_fraction", "0.5", "--optimizer.offload_param_dtype", "bfloat16"],
         "needs bf16 autocast: set --train.dtype bf16"),
        (["--optimizer.param_dtype", "bfloat16"], "runs the model in bf16: set --train.dtype bf16"),
        (["--activations.checkpoint", "full", "--activations.checkpoint_blocks", "7"],
         "block index 7 out of range for a model with 2 blocks; give indices from 0 to 1"),
        (["--activations.offload_checkpoint_inputs", "--activations.checkpoint", "full", "--activations.keep_last",
          "2"], "pass --activations.keep_last 1 or less"),
    ],
)
def test_bad_input_messages(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    args = [str(tmp_path / "missing.bin") if a == "MISSING" else str(empty) if a == "EMPTY" else a for a in args]
    out = tmp_path / "run"
    assert run(out, *args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.fixture(scope="module")
def own_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One of each of elbowroom's files: a plan (TOML and JSON, from `elbowroom plan --out`), a profile (what
    `elbowroom plan --profile` reads) and a run config (a run's OUT/config.toml)."""
    from elbowroom.config import Config, to_toml
    from elbowroom.plan import profile
    from elbowroom.plan.devices import get_device

    d = tmp_path_factory.mktemp("files")
    for name in ("plan.toml", "plan.json"):
        assert main(["plan", "--budget", "1GiB", "--device", "h100-80gb", "--out", str(d / name)]) == 0
    model = build_model(ModelConfig.from_preset("tiny"), device="meta")
    prof = profile(model, torch.zeros((1, 64), dtype=torch.long, device="meta"), source="analytic",
                   machine=get_device("h100-80gb", host_memory=2**30))
    (d / "profile.json").write_text(json.dumps(prof.to_dict()))
    (d / "config.toml").write_text(to_toml(Config()))
    return {p.name: p for p in d.iterdir()}


_PLAN_IT = "plan from it with `elbowroom plan --profile {profile.json} --budget SIZE --out plan.toml`, then pass --plan"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--profile", "plan.toml"], "--profile is the [profile] section, not an option: set its keys as "
         "--profile.KEY VALUE (such as --profile.steps); {plan.toml} is a plan file: pass it with --plan {plan.toml}"),
        (["--profile=profile.json"], "{profile.json} is a profile: " + _PLAN_IT),
        (["--config", "plan.json"],
         "--config {plan.json}: {plan.json} is a plan file, not a run config; pass it with --plan {plan.json}"),
        (["--config", "profile.json"], "{profile.json} is a profile, not a run config; " + _PLAN_IT),
        (["--plan", "config.toml"],
         "--plan {config.toml}: {config.toml} is a run config, not a plan file; pass it with --config {config.toml}"),
        (["--plan", "profile.json"], "{profile.json} is a profile, not a plan file; " + _PLAN_IT),
        (["--data.path", "plan.toml"],
         "--data.path {plan.toml}: {plan.toml} is a plan file, not a token file; pass it with --plan {plan.toml}"),
        (["--distill.teacher", "plan.toml"], "distill.teacher {plan.toml} is a file, not a directory; give"),
        (["--data.cache_dir", "plan.toml"], "cannot make the corpus cache directory {plan.toml} (a file is in the "
         "way); pass a writable directory as --data.cache_dir"),
    ],
    ids=["profile=plan", "profile=profile", "config=plan", "config=profile", "plan=config", "plan=profile",
         "data.path=plan", "teacher=file", "cache_dir=file"],
)
def test_a_file_given_to_the_wrong_option_names_the_one_that_takes_it(tmp_path: Path, capsys, own_files,
                                                                       args: list[str], message: str) -> None:
    """Each of elbowroom's files passed to a file option of train that takes another kind: exit 2, one line naming
    the file's kind and the option to pass it with, no traceback, nothing written."""
    for name, path in own_files.items():
        args = [a.replace(name, str(path)) for a in args]
        message = message.replace(f"{{{name}}}", str(path))
    out = tmp_path / "run"
    assert run(out, *args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_a_teacher_directory_transformers_cannot_load_exits_2(tmp_path: Path, capsys, own_files) -> None:
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(own_files["plan.json"].read_text())  # not a transformers config
    assert run(tmp_path / "run", "--distill.teacher", str(teacher)) == 2
    err = capsys.readouterr().err
    assert f"distill.teacher: {teacher}: transformers cannot load a causal LM from it" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_checkpoint_of_another_model_is_refused(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert run(out, "--steps", "3") == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert run(out, "--steps", "6", "--resume", "--model.dim", "64") == 2
    err = capsys.readouterr().err
    assert "would change its training: --model.dim 64 (the run has 32)" in err, err
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert before == after  # nothing overwritten


def test_existing_run_is_not_overwritten(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert run(out, "--steps", "2") == 0
    before = (out / "metrics.jsonl").read_bytes()
    assert run(out, "--steps", "2") == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize("below", ["", "run"])
def test_out_that_is_a_file_is_refused(tmp_path: Path, capsys, below: str) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    assert run(file / below if below else file, "--steps", "2") == 2
    err = capsys.readouterr().err
    assert f"{file} is a file, not a directory; choose another --out" in err and err.count("\n") == 1, err
    assert file.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_help_lists_every_option_with_default(capsys) -> None:
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for key in ("--train.gradient_accumulation_steps", "--activations.offload_ratio", "--optimizer.offload_fraction",
                "--data.path", "--scheduler.name", "--checkpoint.keep"):
        assert key in text
    assert "(default: 200)" in text


def test_prepare_then_train_on_token_file(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text(("the quick brown fox jumps over the lazy dog. " * 400 + "\n") * 4)
    assert main(["prepare", str(text), str(tmp_path / "c.bin"), "--no-progress"]) == 0
    out = tmp_path / "run"
    assert run(out, "--steps", "3", "--data.path", str(tmp_path / "c.bin")) == 0
    assert run(tmp_path / "run-var", "--steps", "3", "--data.path", str(tmp_path / "c.bin"),
               "--data.variable_length") == 0
    assert len(train_losses(out)) == 3


# ---------------------------------------------------------------- schedules, precision, logging
def test_schedules() -> None:
    from elbowroom.train.schedule import build_scheduler

    def lrs(name: str, **kw) -> list[float]:
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        sched = build_scheduler(opt, name, total_steps=100, warmup_steps=10, min_lr_ratio=0.1, **kw)
        out = []
        for _ in range(100):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    cos = lrs("cosine")
    assert cos[0] == pytest.approx(0.1) and cos[9] == pytest.approx(1.0)  # linear warmup
    assert all(a >= b for a, b in zip(cos[9:], cos[10:]))  # then monotone decay
    assert cos[-1] == pytest.approx(0.1, abs=1e-3)  # to min_lr_ratio
    const = lrs("constant")
    assert const[0] == pytest.approx(0.1) and set(const[10:]) == {1.0}
    one = lrs("onecycle")
    assert max(one) == pytest.approx(1.0, rel=1e-3) and one[0] < 0.1 and one[-1] < 0.01
    assert one.index(max(one)) in range(8, 12)


def test_the_host_optimizers_timeline_goes_into_the_metrics(tmp_path: Path) -> None:
    # --offload.trace_steps: each row sums the optimizer's timeline per kind of event, so that a slow host step
    # shows whether the step thread computed or waited (4 H200s: the same host step took 0.25 s and 0.60 s)
    from elbowroom.optim.stats import trace_summary

    out = tmp_path / "run"
    assert run(out, "--steps", "4", "--optimizer.offload_fraction", "0.5", "--offload.trace_steps", "true") == 0
    traced = [r["host_trace"] for r in rows(out) if "loss" in r]
    assert len(traced) == 4
    steps = [t["step"] for t in traced if "step" in t]
    assert steps and all(k["count"] >= 1 and k["busy_s"] >= 0 and k["last_s"] >= k["first_s"] for k in steps)
    assert all("step_call" in t for t in traced)
    assert trace_summary([("step", 0, 0.5, 0.75), ("copied", 3, 0.0, 0.25), ("step", 3, 1.0, 1.5)]) == {
        "step": {"count": 2, "busy_s": 0.75, "first_s": 0.5, "last_s": 1.5},
        "copied": {"count": 1, "busy_s": 0.25, "first_s": 0.0, "last_s": 0.25},
    }


def test_grad_norm_logged_without_clipping(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert run(out, "--steps", "4", "--train.max_grad_norm", "0") == 0
    norms = [r["grad_norm"] for r in rows(out) if "loss" in r]
    assert len(norms) == 4 and all(n is not None and n > 0 for n in norms)


def test_fp16_with_grad_scaler(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert run(out, "--steps", "3", "--train.dtype", "fp16") == 0
    losses = train_losses(out)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    state = CheckpointManager(out / "checkpoints").load_latest().state
    assert state["scaler"] is not None and state["scaler"]["scale"] > 0


def test_tensorboard_scalars(tmp_path: Path, monkeypatch) -> None:
    """With logging.tensorboard on, every logged number reaches a SummaryWriter (a recording stand-in here)."""
    import types

    written: list[tuple[str, float, int]] = []

    class Writer:
        def __init__(self, logdir: str) -> None:
            assert logdir.endswith("tensorboard")

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            written.append((tag, value, step))

        def close(self) -> None:
            written.append(("closed", 0, 0))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    assert run(tmp_path / "run", "--steps", "2", "--logging.tensorboard") == 0
    tags = {t for t, _, _ in written}
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "closed"} <= tags
    assert ("loss", train_losses(tmp_path / "run")[2], 2) in written


@pytest.mark.parametrize("extra", [[], ["--data.variable_length", "--train.gradient_accumulation_steps", "2"]])
def test_fused_loss_follows_the_plain_curve(tmp_path: Path, extra: list[str]) -> None:
    """--train.fused_loss (head + cross-entropy chunk by chunk) gives the plain run's losses and grad norms,
    also with padded variable-length batches (ignored targets) and accumulation."""
    args = ["--steps", "6", *extra]
    if extra:
        text = tmp_path / "corpus.txt"
        text.write_text("".join(("word " * (7 + 13 * i % 50)) + "\n\n" for i in range(300)))
        assert main(["prepare", str(text), str(tmp_path / "c.bin"), "--no-progress"]) == 0
        args += ["--data.path", str(tmp_path / "c.bin")]
    assert run(tmp_path / "plain", *args) == 0
    assert run(tmp_path / "fused", *args, "--train.fused_loss") == 0
    a, b = train_losses(tmp_path / "plain"), train_losses(tmp_path / "fused")
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5)
    ga = [r["grad_norm"] for r in rows(tmp_path / "plain") if "loss" in r]
    gb = [r["grad_norm"] for r in rows(tmp_path / "fused") if "loss" in r]
    assert gb == pytest.approx(ga, rel=1e-5)


@pytest.mark.parametrize("extra", [[], ["--optimizer.offload_gradients"]])
def test_offloaded_optimizer_follows_the_plain_curve(tmp_path: Path, extra: list[str]) -> None:
    """The trainer with half the optimizer offloaded (accumulation 2, clipping on) tracks the plain run."""
    args = ["--steps", "6", "--train.gradient_accumulation_steps", "2", "--train.max_grad_norm", "0.5"]
    assert run(tmp_path / "plain", *args) == 0
    assert run(tmp_path / "off", *args, "--optimizer.offload_fraction", "0.5", *extra) == 0
    a, b = train_losses(tmp_path / "plain"), train_losses(tmp_path / "off")
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6)
    ga = [r["grad_norm"] for r in rows(tmp_path / "plain") if "loss" in r]
    gb = [r["grad_norm"] for r in rows(tmp_path / "off") if "loss" in r]
    assert gb == pytest.approx(ga, rel=1e-5)


@pytest.mark.parametrize(
    "mode",
    [
        ["--activations.checkpoint", "full"],
        ["--activations.checkpoint", "selective", "--activations.every", "2"],
        ["--activations.offload_ratio", "1.0"],
        ["--activations.checkpoint", "full", "--activations.offload_checkpoint_inputs"],
        ["--activations.checkpoint", "full", "--activations.checkpoint_blocks", "-1"],
    ],
)
def test_activation_switches_keep_the_loss_curve(tmp_path: Path, mode: list[str]) -> None:
    """Recompute and offload switches of the CLI change memory, not the numbers (fp32, dropout on)."""
    args = ["--steps", "3", "--model.arch", "gpt2", "--model.dropout", "0.1"]
    assert run(tmp_path / "plain", *args) == 0
    assert run(tmp_path / "mode", *args, *mode) == 0
    a, b = train_losses(tmp_path / "plain"), train_losses(tmp_path / "mode")
    assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], rel=1e-6) for k in a)


@pytest.mark.parametrize("fraction", ["0", "0.5"])
def test_bf16_parameters_with_fp32_masters(tmp_path: Path, fraction: str) -> None:
    """optimizer.param_dtype bfloat16: bf16 weights in the checkpoint, fp32 masters in the optimizer state that
    are what the weights round from, and a loss curve close to the fp32-weights run under bf16 autocast."""
    args = ["--steps", "6", "--train.dtype", "bf16", "--optimizer.offload_fraction", fraction,
            "--train.gradient_accumulation_steps", "2"]
    assert run(tmp_path / "amp", *args) == 0
    assert run(tmp_path / "bf16", *args, "--optimizer.param_dtype", "bfloat16") == 0
    a, b = train_losses(tmp_path / "amp"), train_losses(tmp_path / "bf16")
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=2e-2)
    assert b[6] < b[1]
    ck = CheckpointManager(tmp_path / "bf16" / "checkpoints").load_latest(map_location="cpu")
    weights = ck.state["model"]
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    opt_state = ck.state["optimizer"]["state"]
    masters = [st["master_weight"] for st in opt_state.values()]
    assert len(masters) == len(weights) and all(m.dtype == torch.float32 for m in masters)
    # optimizer indices follow the trainer's groups: decayed matrices first, then norms and embeddings
    names = list(weights)
    decay = [n for n in names if weights[n].dim() >= 2 and not n.startswith(("tok_emb.", "pos_emb."))]
    ordered = decay + [n for n in names if n not in decay]
    for i, st in opt_state.items():
        torch.testing.assert_close(st["master_weight"].bfloat16(), weights[ordered[int(i)]], atol=0, rtol=0)


def test_loader_workers_start_before_the_optimizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's first batch (its worker processes forked) comes before the optimizer allocates its host
    state: workers forked after it slowed every host optimizer step 3-4x on the GPU host (BENCHMARKS.md)."""
    import elbowroom.train.trainer as T

    events: list[str] = []
    real_next, real_build = T.D.DevicePrefetcher.__next__, T.build_optimizer

    def spy_next(self):  # noqa: ANN001, ANN202
        events.append("batch")
        return real_next(self)

    def spy_build(*a, **k):  # noqa: ANN002, ANN003, ANN202
        events.append("optimizer")
        return real_build(*a, **k)

    monkeypatch.setattr(T.D.DevicePrefetcher, "__next__", spy_next)
    monkeypatch.setattr(T, "build_optimizer", spy_build)
    assert run(tmp_path / "o", "--steps", "2", "--data.num_workers", "1", "--optimizer.offload_fraction", "0.5") == 0
    assert events.index("batch") < events.index("optimizer"), events[:4]


def test_budget_watch_warns_once_when_reserved_passes_the_budget(caplog) -> None:
    from elbowroom.plan import Plan
    from elbowroom.plan.plan import BlockPlan
    from elbowroom.train.metrics import BudgetWatch

    plan = Plan(blocks=(BlockPlan(0),), budget_bytes=8 << 30, predicted_peak_bytes=7 << 30,
                predicted_step_seconds=1.0, predicted_tokens_per_s=1.0)
    watch = BudgetWatch(plan)
    assert watch.check({"step": 1, "peak_memory_bytes": 6 << 30, "peak_reserved_bytes": 8 << 30}) is None
    assert watch.check({"step": 2, "peak_memory_bytes": 6 << 30}) is None  # a CPU row: no reserved peak
    with caplog.at_level("WARNING"):
        msg = watch.check({"step": 3, "peak_memory_bytes": 7 << 30, "peak_reserved_bytes": 9 << 30})
    assert msg is not None and "1.00 GiB above the budget of 8.00 GiB (the plan's 8.00" in msg
    assert "about 7.00 GiB" in msg
    assert msg in caplog.text
    assert watch.check({"step": 4, "peak_memory_bytes": 7 << 30, "peak_reserved_bytes": 10 << 30}) is None  # once
    assert BudgetWatch(None).check({"step": 1, "peak_reserved_bytes": 1 << 40}) is None  # unplanned run
    # a few MiB over (4 H200s under DDP: 24.02 of 24 GiB) read in MiB, not as "0.00 GiB above"
    row = {"step": 2, "peak_memory_bytes": 7 << 30, "peak_reserved_bytes": (8 << 30) + (20 << 20)}
    msg = BudgetWatch(plan).check(row)
    assert msg is not None and "20 MiB above the budget of 8.00 GiB" in msg
    # a plan made again below --budget (planning.with_replans): reserved is watched against --budget, the lower
    # budget the warning names from the plan's
    low = dataclasses.replace(plan, budget_bytes=7 << 30, predicted_peak_bytes=6 << 30)
    watch = BudgetWatch(low, 8 << 30)
    assert watch.check({"step": 1, "peak_memory_bytes": 6 << 30, "peak_reserved_bytes": (7 << 30) + (1 << 29)}) is None
    msg = watch.check({"step": 2, "peak_memory_bytes": 6 << 30, "peak_reserved_bytes": 9 << 30})
    assert msg is not None and "1.00 GiB above the budget of 8.00 GiB (the plan's 7.00" in msg and "about 6.00" in msg


def test_budget_watch_warns_once_when_the_allocator_keeps_retrying(caplog) -> None:
    from elbowroom.plan import Plan
    from elbowroom.plan.plan import BlockPlan
    from elbowroom.train.metrics import BudgetWatch

    plan = Plan(blocks=(BlockPlan(0),), budget_bytes=76 << 30, predicted_peak_bytes=75 << 30,
                predicted_step_seconds=1.0, predicted_tokens_per_s=1.0)
    watch = BudgetWatch(plan)
    row = {"peak_memory_bytes": 71 << 30, "peak_reserved_bytes": 76 << 30}
    # the first logged row's retries (the first step's warm-up) are the baseline; no new ones, no warning
    assert watch.check({"step": 1, **row, "alloc_retries": 2}) is None
    assert watch.check({"step": 2, **row, "alloc_retries": 2}) is None
    with caplog.at_level("WARNING"):
        msg = watch.check({"step": 3, **row, "alloc_retries": 5})
    assert msg is not None and "3 times since step 1" in msg and "--budget 72.2GiB" in msg
    assert msg in caplog.text
    assert watch.check({"step": 4, **row, "alloc_retries": 9}) is None  # once
    # a CPU row counts none; an unplanned run watches nothing
    assert BudgetWatch(plan).check({"step": 1, "peak_memory_bytes": 1}) is None
    assert BudgetWatch(None).check({"step": 2, **row, "alloc_retries": 9}) is None


def test_budget_watch_keeps_retrying_needs_a_retry_a_step_and_slow_steps() -> None:
    """What the trainer plans again for: since the first row at least one retry a step, and steps slower than the
    prediction as PaceWatch counts slow; a few retries, or retries beside steps at their pace, are left alone."""
    from elbowroom.plan import Plan
    from elbowroom.plan.plan import BlockPlan
    from elbowroom.train.metrics import BudgetWatch

    plan = Plan(blocks=(BlockPlan(0),), budget_bytes=76 << 30, predicted_peak_bytes=75 << 30,
                predicted_step_seconds=1.0, predicted_tokens_per_s=1.0)

    def rows(*spec: tuple[int, int, float]) -> list[bool]:
        watch = BudgetWatch(plan)
        out = []
        for step, retries, elapsed in spec:
            row = {"step": step, "alloc_retries": retries, "elapsed_s": elapsed, "peak_reserved_bytes": 1}
            watch.check(row)
            out.append(watch.keeps_retrying(row))
        return out

    # 3-4 retries a step, 1.4-1.5x: from the third row after the first (one slow row is a warm-up's)
    assert rows((1, 2, 9.0), (2, 5, 1.4), (3, 9, 1.5), (4, 12, 1.4)) == [False, False, False, True]
    assert rows((1, 2, 9.0), (2, 5, 1.05), (3, 9, 1.1), (4, 12, 1.1)) == [False] * 4  # at their pace: left alone
    # the 7B's second step waits for the host's first: its median decides, not its one slow row
    assert rows((1, 1, 0.5), (2, 2, 2.8), (3, 3, 1.0), (4, 4, 1.1), (5, 5, 1.1)) == [False] * 5
    assert rows((1, 0, 9.0), (11, 6, 15.0), (21, 12, 15.0), (31, 18, 15.0)) == [False] * 4  # under one a step
    assert rows((1, 0, 9.0), (11, 10, 15.0), (21, 20, 15.0), (31, 30, 15.0)) == [False, False, False, True]
    assert BudgetWatch(None).keeps_retrying({"step": 2, "alloc_retries": 9, "elapsed_s": 9.0}) is False
    # the median the trainer hands the re-plan to beat (planning.NoFasterPlan)
    watch = BudgetWatch(plan)
    for step, elapsed in ((1, 9.0), (2, 1.4), (3, 1.6), (4, 1.5)):
        row = {"step": step, "alloc_retries": 4 * step, "elapsed_s": elapsed, "peak_reserved_bytes": 1}
        watch.check(row)
        watch.keeps_retrying(row)
    assert watch.pace_s == pytest.approx(1.5)


def test_pace_watch_warns_once_when_steps_run_slower_than_predicted(caplog) -> None:
    from elbowroom.plan import Plan
    from elbowroom.plan.plan import BlockPlan
    from elbowroom.train.metrics import PaceWatch

    plan = Plan(blocks=(BlockPlan(0),), budget_bytes=8 << 30, predicted_peak_bytes=7 << 30,
                predicted_step_seconds=0.5, predicted_tokens_per_s=1.0,
                time={"compute": 0.3, "host optimizer step (whole)": 0.36})
    watch = PaceWatch(plan)
    # the first row (warm-up) is left out; then rows of 10 steps each: 0.8, 0.79 and (an evaluation's window) 2.0 s
    # a step, whose median 0.8 is 1.6x the prediction, with the host at 0.59 s against 0.36 priced
    assert watch.check({"step": 10, "elapsed_s": 30.0, "host_step_s": 0.6}) is None
    assert watch.check({"step": 20, "elapsed_s": 8.0, "host_step_s": 0.59}) is None
    assert watch.check({"step": 30, "elapsed_s": 7.9, "host_step_s": 0.58}) is None
    with caplog.at_level("WARNING"):
        msg = watch.check({"step": 40, "elapsed_s": 20.0, "host_step_s": 0.6})
    assert msg is not None and "steps take 0.800 s, 1.60x the plan's prediction of 0.500 s" in msg
    assert "the host optimizer stepped in 0.59 s against 0.36 s priced, 0.61 of the pace" in msg
    assert msg in caplog.text
    assert watch.check({"step": 50, "elapsed_s": 9.0, "host_step_s": 0.6}) is None  # once
    # within 15%, or slow with the host on time: no host named; faster is no warning
    def rows(per_step: float, host: float) -> list[str | None]:
        w = PaceWatch(plan)
        return [w.check({"step": 5 * k, "elapsed_s": 5 * per_step, "host_step_s": host}) for k in range(1, 6)]

    assert rows(0.57, 0.6) == [None] * 5 and rows(0.3, 0.2) == [None] * 5
    # a small model's steps, over by less than the loop's own costs per step: no warning whatever the ratio
    tiny = Plan(blocks=(BlockPlan(0),), budget_bytes=1, predicted_peak_bytes=1, predicted_step_seconds=0.015,
                predicted_tokens_per_s=1.0, time={"host optimizer step (whole)": 0.001})
    w = PaceWatch(tiny)
    assert [w.check({"step": k, "elapsed_s": 0.027, "host_step_s": 0.01}) for k in range(1, 6)] == [None] * 5
    slow = [m for m in rows(0.7, 0.36) if m]
    assert len(slow) == 1 and "1.40x" in slow[0] and "host optimizer" not in slow[0]
    # an unplanned run, a CPU row without the host figures, a plan without a host step
    assert PaceWatch(None).check({"step": 1, "elapsed_s": 1.0}) is None
    bare = Plan(blocks=(BlockPlan(0),), budget_bytes=1, predicted_peak_bytes=1, predicted_step_seconds=0.5,
                predicted_tokens_per_s=1.0)
    w = PaceWatch(bare)
    got = [w.check({"step": k, "elapsed_s": 1.0}) for k in range(1, 5)]
    assert got[:3] == [None] * 3 and got[3] is not None and "2.00x" in got[3] and "host" not in got[3]


def test_a_planned_run_caps_the_allocator_at_its_budget(monkeypatch) -> None:
    # the trainer's cap: the plan's budget as the share of the device's memory, none on CPU, without a plan or for
    # a budget the device does not exceed; lifted to the whole device after
    from types import SimpleNamespace

    from elbowroom.config import Config, resolve
    from elbowroom.train import planning as M

    calls: list[tuple[float, object]] = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 << 30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    cuda = torch.device("cuda", 0)
    assert M.cap_memory(SimpleNamespace(budget_bytes=20 << 30), cuda) is True
    assert calls == [(0.25, 0)]
    M.uncap_memory(torch.device("cuda"))  # no index (the trainer's device): the current one
    assert calls[-1] == (1.0, 3)
    assert M.cap_memory(SimpleNamespace(budget_bytes=80 << 30), cuda) is False  # the whole device: nothing to cap
    assert M.cap_memory(SimpleNamespace(budget_bytes=8 << 30), torch.device("cpu")) is False
    assert M.cap_memory(None, cuda) is False
    assert len(calls) == 2
    # a plan made again below --budget: capped at --budget (the limit), not at its own budget
    assert M.cap_memory(SimpleNamespace(budget_bytes=18 << 30), cuda, 20 << 30) is True and calls[-1] == (0.25, 0)
    assert M.budget_limit(resolve(None, ["--budget", "20GiB"])) == 20 << 30 and M.budget_limit(Config()) is None
    # on by default; --cap-memory false turns it off
    assert Config().cap_memory is True
    assert resolve(None, ["--cap-memory", "false"]).cap_memory is False
    # a resumed run may change it (and its host budget), as it may change its budget: memory, not the trajectory
    from elbowroom.config.loading import _may_change

    assert _may_change("cap_memory") and _may_change("host_budget") and not _may_change("train.seed")


def test_bf16_offloaded_copies_keep_the_embedding_table_fp32() -> None:
    # --optimizer.offload_param_dtype bfloat16 with everything offloaded: the matrices get bf16 device copies, the
    # embedding table keeps fp32 (its output is the residual stream, fp32 under autocast)
    from elbowroom.config import Config
    from elbowroom.train.trainer import build_optimizer

    cfg = Config()
    cfg.optimizer.offload_fraction = 1.0
    cfg.optimizer.offload_param_dtype = "bfloat16"
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("tiny"))
    opt = build_optimizer(model, cfg, torch.device("cpu"), overlap_forward=False)
    assert model.tok_emb.weight.dtype == torch.float32
    assert model.blocks[0].w13.weight.dtype == torch.bfloat16
    assert opt.config.param_dtype == "bfloat16"


def test_garbage_collection_on_the_trainers_schedule() -> None:
    """``train.gc_every N``: the automatic collector off inside the loop, generation 1 collected at steps N, 2N, ...,
    and the collector as it was afterwards; 0 leaves Python's collector alone."""
    import gc

    from elbowroom.train.collection import GarbageCollection

    collected: list[int] = []
    step = 0

    def seen(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] >= 1:
            collected.append(step)

    assert gc.isenabled()
    gc.callbacks.append(seen)
    try:
        with GarbageCollection(3) as collection:
            assert not gc.isenabled()
            collected.clear()  # the one full collection on entry
            for step in range(1, 8):
                collection.step(step)
        assert collected == [3, 6]
        assert gc.isenabled()
        with GarbageCollection(0) as collection:
            assert gc.isenabled()
            collection.step(3)
    finally:
        gc.callbacks.remove(seen)
    with pytest.raises(ValueError, match="gc_every must be >= 0"):
        GarbageCollection(-1)


@pytest.mark.parametrize("extra", [["--train.fused_loss", "--activations.checkpoint", "full"],
                                   ["--activations.checkpoint", "selective"], ["--budget", "64GiB"],
                                   ["--optimizer.offload_fraction", "1.0"]])
def test_compiled_blocks_follow_the_eager_curve(tmp_path: Path, extra: list[str], caplog) -> None:
    """--train.compile compiles each block's forward in place (regional), beside the fused loss, the recompute
    wrapper and a plan: the losses are the eager run's within the compiled kernels' rounding, and the log says how
    many blocks run compiled."""
    args = ["--steps", "4", "--train.dtype", "fp32", *extra]
    assert run(tmp_path / "eager", *args) == 0
    with caplog.at_level(logging.INFO, logger="elbowroom"):
        assert run(tmp_path / "compiled", *args, "--train.compile") == 0
    assert "compile: 2 blocks compiled in place" in caplog.text
    if "--budget" in extra:  # the plan was priced on the blocks compiled, as they ran
        from elbowroom.plan import Plan
        from elbowroom.plan.fit import COMPILED_NOTE

        notes = Plan.load(tmp_path / "compiled" / "plan.toml").notes
        assert COMPILED_NOTE in notes  # and compiled as planned runs compile (fit.PLANNED_COMPILE)
        assert "the blocks compiled with compile_blocks(recompute_pointwise=True)" in notes
        assert "priced on the eager blocks" not in caplog.text
    a, b = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert a.keys() == b.keys() and b == pytest.approx(a, rel=1e-4)
