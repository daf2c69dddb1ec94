"""The package surface: a small public API, lazy re-exports, no CUDA initialisation at import."""

from __future__ import annotations

import subprocess
import sys


def test_import_never_initialises_cuda() -> None:
    """Importing every module must not touch CUDA (a recorder replaces torch's lazy CUDA init)."""
    code = """
import torch, torch.cuda
calls = []
torch.cuda._lazy_init = lambda *a, **k: calls.append(1)
import elbowroom
for name in elbowroom.__all__:
    getattr(elbowroom, name)
import elbowroom.cli, elbowroom.config, elbowroom.train.trainer, elbowroom.train.data, elbowroom.ops.rope
import elbowroom.activations, elbowroom.optim, elbowroom.plan, elbowroom.report, elbowroom.distributed
import elbowroom.plan.profiler, elbowroom.plan.cli
assert not calls, calls
print("clean")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr


def test_public_api() -> None:
    import elbowroom
    import elbowroom.plan.fit  # noqa: F401 - nor does importing the module that defines one
    import elbowroom.train.trainer  # noqa: F401 - a subpackage import must not shadow a public verb
    for name in ("checkpoint", "offload", "CPUOffloadOptimizer", "gradient_checkpointing_enable", "build_model", "fit",
                 "profile", "plan_for", "apply"):
        assert name in elbowroom.__all__
        assert callable(getattr(elbowroom, name))
    try:
        elbowroom.no_such_thing  # noqa: B018
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("unknown attribute did not raise")


def test_a_config_file_that_cannot_be_read_is_one_line_from_the_command(tmp_path) -> None:
    """`elbowroom train --config` of a binary file, as a shell runs it: code 2 and one line naming the file, where
    it was code 1 and a UnicodeDecodeError traceback; no run directory."""
    import os
    from pathlib import Path

    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
    repo = str(Path(__file__).resolve().parents[1])  # (run from tmp_path: this checkout, installed or not)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "elbowroom", "train", "--out", "o", "--config", "bin.toml"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == ["elbowroom train: error: config file bin.toml is not UTF-8 text (byte 0xff at "
                                       "offset 0); a config is TOML text: save it as UTF-8"]
    assert [p.name for p in tmp_path.iterdir()] == ["bin.toml"]


def test_ctrl_c_during_the_first_imports_waits_for_them() -> None:
    """The command line holds a Ctrl-C back while its first imports run and raises it once they end, so no module is
    left half-imported (torch swallowed one raised in its import of numpy, and the run went on to an AttributeError
    of numpy's); main() then prints its one line and returns 130."""
    import os
    import signal

    import pytest

    from elbowroom.cli import _interrupt_held

    # Python's own handler, as in a shell's foreground (a suite started in the background inherits SIGINT ignored,
    # where _interrupt_held leaves it alone)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        finished = []
        with pytest.raises(KeyboardInterrupt):
            with _interrupt_held():
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, halfway through an import
                for _ in range(10_000):  # (bytecode boundaries, where a KeyboardInterrupt would be raised)
                    pass
                finished.append(True)
        assert finished == [True]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is a KeyboardInterrupt again
        with _interrupt_held():  # and nothing is raised where none came
            finished.append(True)
    finally:
        signal.signal(signal.SIGINT, before)
