"""The scripts in examples/ run as a user runs them (a subprocess, on CPU, at a tiny size) and train.

Each example prints one ``step N loss X`` line per optimizer step; a test passes when the script exits 0,
printed a loss for every step, and the last loss is below the first.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
_LOSS = re.compile(r"^step (\d+) loss ([0-9.]+)$", re.MULTILINE)


def run_example(script: str, *args: str, timeout: float = 300) -> list[float]:
    """Run ``examples/<script>`` with ``args`` on CPU; return the printed losses, in step order."""
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the example must not need (or touch) a GPU
    # the elbowroom of this checkout, whatever an editable install elsewhere points at
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    output = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{output}"
    steps = [(int(s), float(v)) for s, v in _LOSS.findall(proc.stdout)]
    assert [s for s, _ in steps] == list(range(len(steps))), f"steps out of order:\n{output}"
    return [v for _, v in steps]


def assert_trains(losses: list[float], steps: int) -> None:
    assert len(losses) == steps, f"expected {steps} losses, got {losses}"
    assert losses[-1] < losses[0] - 0.1, f"the loss did not go down: {losses}"


@pytest.mark.slow
def test_compose_by_hand_trains():
    steps = 6
    losses = run_example("compose_by_hand.py", "--steps", str(steps))  # the tiny preset, its default
    assert_trains(losses, steps)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_huggingface_trains(arch: str):
    pytest.importorskip("transformers", reason="the Hugging Face example needs transformers (the test extra)")
    steps = 6
    losses = run_example("huggingface.py", "--arch", arch, "--steps", str(steps))
    assert_trains(losses, steps)


@pytest.mark.parametrize("script", ["compose_by_hand.py", "huggingface.py"])
def test_example_docstring_says_how_to_run_it(script: str):
    doc = (EXAMPLES / script).read_text().split('"""')[1]
    assert f"python examples/{script}" in doc
    assert "--device cuda" in doc


def test_readme_shows_the_core_of_compose_by_hand_verbatim():
    # the README's Python section quotes the block between the --8<-- markers; edit both together
    source = (EXAMPLES / "compose_by_hand.py").read_text()
    core = source.split("# --8<-- [start:core]\n")[1].split("# --8<-- [end:core]")[0]
    core = textwrap.dedent(core).rstrip()
    assert core.count("\n") > 20
    assert core in (ROOT / "README.md").read_text()
