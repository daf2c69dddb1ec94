"""The trainer's --train.qat and [distill]: runs of a tiny model on CPU against the plain run they extend."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from elbowroom.cli import main
from elbowroom.config import resolve
from elbowroom.models import build_model
from elbowroom.train import data as D
from elbowroom.train.checkpoint import CheckpointManager
from elbowroom.train.trainer import accumulate_gradients, resolve_model_config

pytest.importorskip("torchao", reason="QAT needs torchao (pip install 'elbowroom[export]')")

SMALL = [
    "--model.dim", "32", "--model.n_heads", "2", "--model.ffn_dim", "64", "--model.n_layers", "2",
    "--data.seq_len", "32", "--data.batch_size", "4", "--data.num_workers", "0", "--scheduler.warmup_steps", "2",
    "--train.eval_every", "0", "--train.eval_batches", "2", "--logging.progress", "false", "--log-every", "1",
]


def run(out: Path, *args: str) -> int:
    return main(["train", "--out", str(out), *SMALL, *args])


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(out) if "loss" in r}


def val_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in rows(out) if "val_loss" in r}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain run of 6 steps: the reference curve, and a teacher."""
    out = tmp_path_factory.mktemp("plain") / "run"
    assert run(out, "--steps", "6") == 0
    return out


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qat") / "run"
    assert run(out, "--steps", "6", "--train.qat", "int8") == 0
    return out


# ------------------------------------------------------------------------------------------------------ QAT
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_qat_loss_falls_and_differs_from_the_plain_curve(tmp_path, plain, scheme):
    out = tmp_path / "run"
    assert run(out, "--steps", "6", "--train.qat", scheme) == 0
    got, ref = losses(out), losses(plain)
    assert got[6] < got[1] - 0.1, got
    assert got[1] != ref[1]  # the forward is fake-quantised from step 1 on
    assert f'qat = "{scheme}"' in (out / "config.toml").read_text()


def test_qat_resume_continues_the_uninterrupted_curve(tmp_path, qat_run, capsys):
    part = tmp_path / "part"
    assert run(part, "--steps", "3", "--scheduler.decay_steps", "6", "--train.qat", "int8") == 0
    before = {p: p.read_bytes() for p in part.rglob("*") if p.is_file()}
    assert run(part, "--steps", "6", "--resume", "--train.qat", "int4") == 2  # another scheme: refused
    assert "was trained --train.qat int8; resume it the same way" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in part.rglob("*") if p.is_file()} == before
    assert run(part, "--steps", "6", "--resume") == 0  # the checkpoint's scheme, without the flag
    assert losses(part) == losses(qat_run)  # bit-identical on CPU


def test_qat_export_equals_the_fake_quantised_model(tmp_path, qat_run, plain, capsys):
    from elbowroom.export.qat import load_trained
    from elbowroom.export.quantize import load_quantized
    from elbowroom.export.source import load_source

    out = tmp_path / "q"
    assert main(["export", "quantize", str(qat_run), "--out", str(out), "--method", "qat"]) == 0
    report = json.loads((out / "export.json").read_text())
    assert report["qat"] == "int8" and report["size_bytes"] < report["fp32_size_bytes"]
    assert report["val_loss_after"] == pytest.approx(report["val_loss_fake_quant"], abs=1e-5)
    src = load_source(qat_run)
    ids = torch.randint(0, src.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fake, real = load_trained(src)(ids), load_quantized(out)(ids)
        torch.testing.assert_close(real, fake, atol=1e-5, rtol=1e-5)
        assert (src.model(ids) - fake).abs().max() > 1e-4  # the float weights compute something else
    capsys.readouterr()
    bad = tmp_path / "not-qat"
    assert main(["export", "quantize", str(plain), "--out", str(bad), "--method", "qat"]) == 2
    assert "was not trained with --train.qat" in capsys.readouterr().err and not bad.exists()


def test_hf_export_of_a_qat_run_says_it_holds_the_float_weights(tmp_path, qat_run, capsys):
    pytest.importorskip("safetensors", reason="the hf export needs safetensors (pip install 'elbowroom[export]')")
    hf = tmp_path / "hf"
    assert main(["export", "hf", str(qat_run), "--out", str(hf)]) == 0
    assert "the float weights of a --train.qat int8 run" in capsys.readouterr().out
    assert json.loads((hf / "export.json").read_text())["qat"] == "int8"


# --------------------------------------------------------------------------------------------- distillation
def test_distill_at_ratio_0_follows_the_plain_curve_exactly(tmp_path, plain):
    out = tmp_path / "run"
    assert run(out, "--steps", "6", "--distill.teacher", str(plain), "--distill.ratio", "0",
               "--distill.temperature", "3") == 0
    assert losses(out) == losses(plain)
    assert val_losses(out) == val_losses(plain)  # validation is plain cross-entropy


def test_distill_with_compiled_student_blocks_follows_the_eager_curve(tmp_path, plain):
    # the student's blocks compiled in place; its head and the distillation loss run eager, chunk by chunk
    args = ["--steps", "4", "--train.dtype", "fp32", "--distill.teacher", str(plain), "--distill.ratio", "0.5"]
    assert run(tmp_path / "eager", *args) == 0
    assert run(tmp_path / "compiled", *args, "--train.compile") == 0
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-4)


def test_distill_resume_continues_the_curve_and_keeps_the_teacher(tmp_path, plain, caplog, capsys):
    args = ["--distill.teacher", str(plain), "--distill.ratio", "0.8", "--distill.temperature", "2"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run(full, "--steps", "4", *args) == 0
    assert run(part, "--steps", "2", "--scheduler.decay_steps", "4", *args) == 0
    assert run(part, "--steps", "4", "--resume", *args) == 0
    assert losses(part) == losses(full)
    with caplog.at_level("WARNING"):
        assert run(part, "--steps", "5", "--resume") == 0  # the run's saved [distill]: its teacher again
    assert "the checkpoint was trained with [distill]" not in caplog.text
    capsys.readouterr()
    assert run(part, "--steps", "6", "--resume", "--distill.ratio", "0.5") == 2  # another loss: refused
    assert "--distill.ratio 0.5 (the run has 0.8)" in capsys.readouterr().err


def _initial_weights(tmp_path: Path) -> Path:
    """A run directory whose checkpoint holds the weights a fresh SMALL run starts from."""
    cfg = resolve(None, SMALL)
    model_cfg = resolve_model_config(cfg, 256)
    torch.manual_seed(cfg.train.seed)
    model = build_model(model_cfg)
    run_dir = tmp_path / "init"
    CheckpointManager(run_dir / "checkpoints").save(0, {"model": model.state_dict()}, {"model": model_cfg.to_dict()})
    return run_dir


def test_distill_from_the_students_own_start_costs_nothing_at_step_1(tmp_path):
    teacher = _initial_weights(tmp_path)
    out = tmp_path / "run"
    assert run(out, "--steps", "2", "--distill.teacher", str(teacher), "--distill.ratio", "1",
               "--distill.temperature", "2") == 0
    assert abs(losses(out)[1]) < 1e-6  # KL(p, p) = 0
    bf16 = tmp_path / "bf16"  # a bf16 teacher: the same distribution, rounded
    assert run(bf16, "--steps", "1", "--distill.teacher", str(teacher), "--distill.ratio", "1",
               "--distill.dtype", "bfloat16") == 0
    assert 0 < losses(bf16)[1] < 1e-3


def test_teacher_gets_no_gradient_and_stays_out_of_optimizer_and_checkpoint(tmp_path, plain):
    from elbowroom.config import DistillSection
    from elbowroom.train.objectives import load_distillation

    distill = load_distillation(DistillSection(teacher=str(plain), ratio=0.5, temperature=2.0), vocab_size=256,
                                seq_len=32, device=torch.device("cpu"))
    student = build_model(resolve_model_config(resolve(None, SMALL), 256))
    accumulate_gradients(student, _micro(4, 1), torch.autocast("cpu", enabled=False), distill=distill)
    assert all(p.grad is not None for p in student.parameters())
    assert all(p.grad is None and not p.requires_grad for p in distill.teacher.parameters())

    out = tmp_path / "run"
    assert run(out, "--steps", "2", "--distill.teacher", str(plain)) == 0
    (ckpt,) = (out / "checkpoints").iterdir()
    ref = torch.load(next((plain / "checkpoints").iterdir()) / "state.pt", weights_only=True)
    got = torch.load(ckpt / "state.pt", weights_only=True)
    assert got["model"].keys() == ref["model"].keys()
    assert len(got["optimizer"]["state"]) == len(ref["optimizer"]["state"]) == len(list(student.parameters()))


def _micro(batch: int, accum: int, variable: bool = False) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(batch * accum):
        n = int(torch.randint(5, 33, (1,), generator=g)) if variable else 32
        toks = torch.randint(0, 256, (n + 1,), generator=g)
        samples.append({"input_ids": toks[:-1], "targets": toks[1:]})
    collate = D.pad_collate if variable else D.collate
    return [collate(samples[i * batch:(i + 1) * batch]) for i in range(accum)]


@pytest.mark.parametrize("variable", [False, True])
def test_distill_accumulation_equals_one_big_batch(plain, variable):
    from elbowroom.config import DistillSection
    from elbowroom.train.objectives import load_distillation

    distill = load_distillation(DistillSection(teacher=str(plain), ratio=0.7, temperature=2.0), vocab_size=256,
                                seq_len=32, device=torch.device("cpu"))
    grads, step_losses = [], []
    for batch, accum in ((8, 1), (4, 2)):
        torch.manual_seed(0)
        student = build_model(resolve_model_config(resolve(None, SMALL), 256))
        loss = accumulate_gradients(student, _micro(batch, accum, variable), torch.autocast("cpu", enabled=False),
                                    distill=distill)
        grads.append([p.grad for p in student.parameters()])
        step_losses.append(loss)
    torch.testing.assert_close(step_losses[1], step_losses[0], atol=1e-5, rtol=0)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_distill_run_with_accumulation_follows_the_big_batch_run(tmp_path, plain):
    args = ["--steps", "3", "--distill.teacher", str(plain), "--distill.temperature", "2",
            "--activations.checkpoint", "full"]  # the memory engines apply to the student
    big, acc = tmp_path / "big", tmp_path / "acc"
    assert run(big, *args, "--data.batch_size", "8") == 0
    assert run(acc, *args, "--data.batch_size", "4", "--train.gradient_accumulation_steps", "2") == 0
    for step, loss in losses(big).items():
        assert losses(acc)[step] == pytest.approx(loss, abs=1e-5)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "args, message",
    [
        (["--distill.teacher", "MISSING"], "distill.teacher MISSING does not exist"),
        (["--distill.teacher", "WIDE"], "has vocab_size 300 and the student 256"),
        (["--distill.teacher", "PLAIN", "--distill.ratio", "1.5"], "distill.ratio must be in [0, 1], got 1.5"),
        (["--distill.teacher", "PLAIN", "--distill.temperature", "0"], "distill.temperature must be > 0, got 0.0"),
        (["--distill.ratio", "0.3"], "--distill.ratio has no effect without --distill.teacher"),
        (["--distill.teacher", "PLAIN", "--budget", "1GiB"], "drop --budget or --distill.teacher"),
        (["--train.qat", "int2"], "train.qat must be one of int8, int4"),
        (["--train.qat", "int8", "--budget", "1GiB"], "the planner does not price fake-quantised layers"),
        (["--train.qat", "int8", "--plan", "p.toml"], "drop --train.qat or --plan"),
        (["--train.qat", "int8", "--model.hf", "somewhere"], "drop --model.hf or --train.qat"),
        (["--train.qat", "int4", "--model.dim", "48"], "int4 QAT groups 32 input features"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, tmp_path_factory, plain, capsys, args, message):
    wide = tmp_path_factory.getbasetemp() / "wide"
    if "WIDE" in args and not wide.exists():
        assert run(wide, "--steps", "1", "--model.vocab_size", "300") == 0
        capsys.readouterr()
    names = {"MISSING": str(tmp_path / "MISSING"), "WIDE": str(wide), "PLAIN": str(plain)}
    message = message.replace("MISSING", names["MISSING"])
    out = tmp_path / "run"
    shape = [] if "--model.hf" in args else SMALL  # a Hugging Face model takes no --model shape
    assert main(["train", "--out", str(out), *shape, *[names.get(a, a) for a in args]]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_qat_without_torchao_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # import fails as if not installed
    out = tmp_path / "run"
    assert run(out, "--train.qat", "int8") == 2
    assert "pip install 'elbowroom[export]'" in capsys.readouterr().err
    assert not out.exists()


def test_help_lists_the_new_keys(capsys):
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for key in ("--train.qat", "--distill.teacher", "--distill.ratio", "--distill.temperature", "--distill.dtype"):
        assert key in text
    assert "loss = (1 - a) * CE + a * T^2 * KL(teacher || student)" in text
