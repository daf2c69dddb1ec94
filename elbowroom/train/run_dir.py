"""The run directory: claimed by a new run, checked before anything is written, released when nothing was.

A run's directory appears with its first finished step (:mod:`elbowroom.train.trainer`); before that every check
here refuses bad input without writing. A run that names no ``--out`` claims ``runs/<timestamp>`` with ``os.mkdir``
(one process wins a name) and gives it back if it fails before its first step. The files a run rewrites
(``config.toml``, ``plan.toml``, ``plan.json``) are replaced whole, never left half written.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from elbowroom.config import ConfigError
from elbowroom.train.checkpoint import CheckpointError, CheckpointManager, Loaded

__all__ = ["atomic_write_text", "check_out_dir", "load_resume_checkpoint", "new_run_directory",
           "release_run_directory"]


def check_out_dir(out: Path, resume: bool) -> None:
    """Refuse a run directory that cannot be one (a file, or under a file), and an earlier run unless resuming it."""
    existing_part = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing_part is not None and not existing_part.is_dir():
        raise ConfigError(f"--out {out}: {existing_part} is a file, not a directory; choose another --out")
    if resume:
        return
    existing = [p.name for p in (out / "metrics.jsonl", out / "checkpoints") if p.exists()]
    if existing:
        raise ConfigError(
            f"{out} already holds a run ({', '.join(existing)}); continue it with --resume, "
            "or choose another --out"
        )


def load_resume_checkpoint(out: Path, ckpts: CheckpointManager) -> Loaded:
    """The newest valid checkpoint of the run in ``out``; CheckpointError (nothing touched) when there is none."""
    if not out.is_dir():
        raise CheckpointError(
            f"--resume: {out} does not exist, so there is no run to continue; check --out (a typo?), "
            "or drop --resume to start a new run"
        )
    if not ckpts.checkpoints():
        raise CheckpointError(
            f"--resume: {out} holds no checkpoint (nothing under {ckpts.directory}); check --out, "
            "or drop --resume to start a new run in another directory"
        )
    loaded = ckpts.load_latest(map_location="cpu")
    if loaded is None:
        reasons = "; ".join(reason for _, reason in ckpts.corrupt()) or "none loads"
        raise CheckpointError(
            f"--resume: no checkpoint in {ckpts.directory} verifies ({reasons}); nothing was changed. "
            "Restore a good copy of one, or start a new run with another --out"
        )
    return loaded


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` whole: a temporary file beside it, then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def new_run_directory(root: str | os.PathLike = "runs", stamp: str | None = None) -> tuple[Path, bool]:
    """Create a run directory no other run has: ``root/YYYYmmdd-HHMMSS``, or ``-2``, ``-3``... after it when
    another run took that name (two runs started in the same second). ``os.mkdir`` is the claim: it fails for
    every process but one.

    Returns:
        The directory, and whether ``root`` was created for it.
    """
    root = Path(root)
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    made_root = not root.is_dir()
    root.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        path = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            os.mkdir(path)
            return path, made_root
        except FileExistsError:
            n += 1


def release_run_directory(path: Path, made_root: bool) -> None:
    """Remove a claimed run directory that nothing was written to (and ``runs/`` if it was made for it)."""
    with contextlib.suppress(OSError):  # not empty: something was written, it stays
        path.rmdir()
        if made_root:
            path.parent.rmdir()
