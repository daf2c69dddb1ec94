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
        (["--steps", "-1"], "train.steps must be >= 0, got -1"),
        (["--steps", "ten"], "train.steps expects an integer, got 'ten'"),
        (["--train.dtype", "fp8"], "train.dtype must be one of auto, fp32, bf16, fp16"),
        (["--activations.offload_ratio", "1.5"], r"activations.offload_ratio must be in \[0, 1\], got 1.5"),
        (["--optimizer.betas", "0.9"], "optimizer.betas expects 2 values"),
        (["--activations.offload_checkpoint_inputs"], "offload_checkpoint_inputs needs checkpointed blocks"),
        (["--resume"], "--resume needs the run to continue"),
        (["--steps"], "--train.steps needs a value"),
        (["steps", "3"], "unexpected argument 'steps'"),
        (["--model.preset", "huge"], "model.preset must be one of tiny, w1, w2, 7b"),
        (["--optimizer.offload_param_dtype", "bfloat16"], "offload_param_dtype needs optimizer.offload_fraction > 0"),
        (["--optimizer.offload_param_dtype", "fp8"], "offload_param_dtype must be one of float32, bfloat16"),
        (["--optimizer.offload_fraction", "0.5", "--optimizer.param_dtype", "bfloat16",
          "--optimizer.offload_param_dtype", "bfloat16"], "drop --optimizer.offload_param_dtype"),
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
    for key, _tp, _default, doc in iter_options():
        assert doc, f"{key} has no docstring"
        assert f"--{key}" in text
    assert "(default: 200)" in text  # train.steps
