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
