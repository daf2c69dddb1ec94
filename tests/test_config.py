"""Config: TOML and command-line layering, type conversion, validation, help text."""

from __future__ import annotations

import pytest

from elbowroom.config import Config, ConfigError, build_config, help_text, iter_options, resolve, to_toml


def test_layering_defaults_file_cli(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = 7\nseed = 3\n[optimizer]\nbetas = [0.8, 0.9]\n')
    cfg = resolve(str(f), ["--train.seed", "5", "--log-every", "2", "--activations.checkpoint", "full",
                           "--activations.offload_checkpoint_inputs"])
    assert cfg.train.steps == 7  # from the file
    assert cfg.train.seed == 5  # the command line wins
    assert cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.logging.log_every == 2
    assert cfg.activations.offload_checkpoint_inputs is True
    assert cfg.data.seq_len == Config().data.seq_len  # untouched default


def test_round_trip_through_toml(tmp_path) -> None:
    cfg = resolve(None, ["--out", "x", "--optimizer.betas", "0.9,0.99", "--train.max_grad_norm", "none"])
    f = tmp_path / "c.toml"
    f.write_text(to_toml(cfg))
    assert resolve(str(f), []) == cfg


@pytest.mark.parametrize(
    "args, message",
    [
        (["--train.stepz", "3"], "unknown config key 'train.stepz'; did you mean train.steps"),
        # a shortcut's typo is offered the shortcut (it said only "unknown config key 'stepz'")
        (["--stepz", "3"], r"unknown config key 'stepz'; did you mean --steps\?"),
        (["--host-budgt", "1GiB"], r"unknown config key 'host_budgt'; did you mean --host-budget\?"),
        (["--log-evry", "5"], r"did you mean --log-every\?"),
        (["--train_steps", "3"], r"did you mean --train.steps\?"),
        (["--host-budget"], "--host-budget needs a value"),
        (["--steps", "-1"], r"train.steps must be >= 1 \(the optimizer steps of the whole run\), got -1"),
        (["--steps", "ten"], "train.steps expects an integer, got 'ten'"),
        (["--train.dtype", "fp8"], "train.dtype must be one of auto, fp32, bf16, fp16"),
        (["--activations.offload_ratio", "1.5"], r"activations.offload_ratio must be in \[0, 1\], got 1.5"),
        (["--optimizer.betas", "0.9"], "optimizer.betas expects 2 values"),
        (["--activations.offload_checkpoint_inputs"], "offload_checkpoint_inputs needs checkpointed blocks"),
        (["--resume"], "--resume needs the run to continue"),
        (["--steps"], "--train.steps needs a value"),
        (["steps", "3"], "unexpected argument 'steps'"),
        (["--cap-memory", "maybe"], "--cap-memory takes true or false \\(alone: true\\), got 'maybe'"),
        (["--train.fused_loss", "yes please"], "--train.fused_loss takes true or false"),
        (["--train.gc_every", "-5"], r"train.gc_every must be >= 0 \(0: Python's automatic collection\), got -5"),
        (["--parallel.ddp_broadcast_buffers", "sometimes"], "--parallel.ddp_broadcast_buffers takes true or false"),
        (["--model.preset", "huge"], "model.preset must be one of tiny, w1, w2, 7b"),
        (["--optimizer.offload_param_dtype", "bfloat16"], "offload_param_dtype needs optimizer.offload_fraction > 0"),
        (["--optimizer.offload_param_dtype", "fp8"], "offload_param_dtype must be one of float32, bfloat16"),
        (["--optimizer.offload_fraction", "0.5", "--optimizer.param_dtype", "bfloat16",
          "--optimizer.offload_param_dtype", "bfloat16"], "drop --optimizer.offload_param_dtype"),
        (["--steps", "5", "--profile.steps", "30-40"],
         r"--profile.steps 30-40 lies past the run's last step, 5: nothing would be recorded; pass steps from 1 to 5"),
    ],
)
def test_bad_values_name_the_problem(args, message) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(None, args)


def test_bad_toml(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[train\nsteps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve(str(f), [])
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(str(tmp_path / "missing.toml"), [])
    with pytest.raises(ConfigError, match="unknown config key 'nope'"):
        build_config({"nope": 1})
    with pytest.raises(ConfigError, match="train.steps expects an integer"):
        build_config({"train": {"steps": "many"}})


def test_every_option_documented() -> None:
    text = help_text()
    from elbowroom.config.schema import _OFFLOAD_PLACEMENT

    for key, _tp, _default, doc in iter_options():
        assert doc, f"{key} has no docstring"
        if key.removeprefix("offload.") in _OFFLOAD_PLACEMENT and key.startswith("offload."):
            assert f"--{key}" not in text  # set from [optimizer], refused in [offload]: not offered
            continue
        flag = f"--{key}" if "." in key else f"--{key.replace('_', '-')}"  # --host-budget, as the README has it
        assert flag in text
    assert "(default: 200)" in text  # train.steps


def test_help_spells_top_level_flags_as_the_readme_and_lists_the_presets(capsys) -> None:
    """`train --help` shows --host-budget and --cap-memory as the README and its own shortcuts line spell them (it
    showed --host_budget), and the presets the registry has (its hand-written list lacked gpt2-xl)."""
    from pathlib import Path

    from elbowroom.cli import main
    from elbowroom.models import PRESETS

    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for flag in ("--host-budget", "--cap-memory"):
        assert f"\n  {flag}" in text and flag in readme
    assert "--host_budget" not in text and "--cap_memory" not in text
    assert "gpt2-xl" in PRESETS and f"One of: {', '.join(PRESETS)}." in text
    # both spellings are read
    assert resolve(None, ["--host_budget", "1GiB", "--budget", "2GiB"]) == resolve(
        None, ["--host-budget", "1GiB", "--budget", "2GiB"])


@pytest.mark.parametrize("kind", ["not utf-8", "a folder"])
def test_a_config_file_that_cannot_be_read_exits_2_writing_nothing(tmp_path, monkeypatch, capsys, kind) -> None:
    """`train --config` of a binary file or of a folder: one line naming the file and the fix, code 2 (it was a
    UnicodeDecodeError or IsADirectoryError traceback and code 1)."""
    from elbowroom.cli import main

    monkeypatch.chdir(tmp_path)
    if kind == "a folder":
        (tmp_path / "adir").mkdir()
        expected = "config file adir is a folder; pass a TOML file as --config FILE.toml"
    else:
        (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
        expected = "config file bin.toml is not UTF-8 text (byte 0xff at offset 0)"
    before = sorted(tmp_path.iterdir())
    assert main(["train", "--out", "o", "--config", "adir" if kind == "a folder" else "bin.toml"]) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elbowroom train: error: " + expected), cap.err
    assert "Traceback" not in cap.err and cap.out == ""
    assert sorted(tmp_path.iterdir()) == before  # no run directory, nothing else


def test_a_plan_file_that_is_a_folder_exits_2_writing_nothing(tmp_path, monkeypatch, capsys) -> None:
    """`train --plan d.toml` of a folder: the file named with the fix (it printed "[Errno 21] Is a directory")."""
    from elbowroom.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.toml").mkdir()
    assert main(["train", "--out", "o", "--plan", "d.toml", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elbowroom train: error: plan file d.toml is a folder; pass a "
                                                   "plan file saved by `elbowroom plan --out FILE.toml`"), err
    assert "Errno" not in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.toml"]


def test_ctrl_c_while_the_config_resolves_exits_130_with_one_line(tmp_path, monkeypatch, capsys) -> None:
    """Ctrl-C before the trainer's own handler (here: while the config resolves) is one line and 128 + SIGINT, not
    a KeyboardInterrupt traceback and -2."""
    import elbowroom.config
    from elbowroom.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(elbowroom.config, "resolve", interrupted)
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["train", "--out", "o", "--steps", "1"])
    except KeyboardInterrupt:  # (not let through to stop the suite)
        pytest.fail("a KeyboardInterrupt came out of main()")
    assert code == 130
    cap = capsys.readouterr()
    assert cap.err.strip().splitlines() == ["elbowroom train: interrupted; nothing written"] and cap.out == ""
    assert list(tmp_path.iterdir()) == []


def test_help_reads_as_plain_text(capsys) -> None:
    """`elbowroom train --help` shows the mechanisms' docstrings without their reST markup."""
    import re

    from elbowroom.cli import main

    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert "``" not in text and not re.search(r":\w+:`", text), re.findall(r".{30}(?:``|:\w+:`).{30}", text)
    # (each from a docstring that has the markup)
    assert "None: default_step_threads() (this process's cores less two)" in text  # :func:`default_step_threads`
    assert "(torch's bucket_cap_mb)" in text  # ``bucket_cap_mb``


# ---------------------------------------------------------------- composed mechanism configs
def test_activations_is_the_mechanisms_own_config() -> None:
    """[activations] is ActivationConfig itself: every field is an option, with the mechanism's docstring."""
    from dataclasses import fields

    from elbowroom.activations.policy import ActivationConfig
    from elbowroom.config import field_docs

    assert type(Config().activations) is ActivationConfig
    docs = field_docs(ActivationConfig)  # read from the source of a class in another module
    text = help_text()
    for f in fields(ActivationConfig):
        assert docs.get(f.name), f"ActivationConfig.{f.name} has no docstring"
        assert f"--activations.{f.name}" in text and docs[f.name] in text
    assert "--activations.checkpoint_blocks INT,..." in text


def test_activation_field_types_from_command_line_and_toml(tmp_path) -> None:
    cfg = resolve(None, ["--activations.checkpoint", "full", "--activations.checkpoint_blocks", "0,3,-1",
                         "--activations.offload_checkpoint_inputs", "--activations.host_memory_limit_bytes",
                         "1_000_000"])
    a = cfg.activations
    assert a.checkpoint_blocks == (0, 3, -1) and a.host_memory_limit_bytes == 1_000_000
    assert resolve(None, ["--activations.host_memory_limit_bytes", "none"]).activations.host_memory_limit_bytes is None
    f = tmp_path / "c.toml"
    f.write_text('[activations]\ncheckpoint = "selective"\nevery = 2\noffload_ratio = 0.5\n'
                 "offload_checkpoint_inputs = true\n")  # the key names of the old section
    b = resolve(str(f), []).activations
    assert (b.checkpoint, b.every, b.offload_ratio, b.offload_checkpoint_inputs) == ("selective", 2, 0.5, True)
    f.write_text(to_toml(cfg))
    assert resolve(str(f), []) == cfg  # tuples and ints survive the round trip
    f.write_text('[activations]\ncheckpoint = "full"\ncheckpoint_blocks = [1, 2]\n')
    assert resolve(str(f), []).activations.checkpoint_blocks == (1, 2)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--activations.checkpoint", "full", "--activations.checkpoint_blocks", "0,x"],
         "activations.checkpoint_blocks expects an integer, got 'x'"),
        (["--activations.use_reentrant"], "activations.use_reentrant has no effect without checkpoint"),
        (["--activations.checkpoint", "full", "--activations.keep_last", "0"], "activations.keep_last must be >= 1"),
        (["--activations.checkpoint", "sometimes"], "activations.checkpoint must be one of none, full, selective"),
    ],
)
def test_the_mechanisms_validation_becomes_a_config_error(args, message) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(None, args)


def test_offload_section_is_the_optimizers_own_config(tmp_path) -> None:
    """[offload] composes CPUOffloadConfig: its engine knobs reach the optimizer; placement stays in [optimizer]."""
    import torch

    from elbowroom.config import ConfigError, resolve
    from elbowroom.models import ModelConfig, build_model
    from elbowroom.optim import CPUOffloadConfig
    from elbowroom.train.trainer import build_optimizer

    cfg = resolve(None, ["--optimizer.offload_fraction", "0.5", "--offload.bucket_bytes", "65536",
                         "--offload.num_staging_slots", "2", "--offload.cpu_threads", "1"])
    assert isinstance(cfg.offload, CPUOffloadConfig) and cfg.offload.bucket_bytes == 65536
    opt = build_optimizer(build_model(ModelConfig.from_preset("tiny")), cfg, torch.device("cpu"))
    try:
        assert opt.config.bucket_bytes == 65536 and opt.config.num_staging_slots == 2
        assert 0 < len(opt.offloaded_parameters()) < len(list(opt.param_groups[0]["params"])) + len(
            list(opt.param_groups[1]["params"]))  # the late half, from [optimizer]
    finally:
        opt.close()
    with pytest.raises(ConfigError, match="set by the trainer from --optimizer.offload_fraction"):
        resolve(None, ["--offload.offload_fraction", "0.5"])
    with pytest.raises(ConfigError, match=r"\[offload\] bucket_bytes must be a positive int"):
        resolve(None, ["--offload.bucket_bytes", "0"])
