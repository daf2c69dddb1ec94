"""Training checkpoints: atomic, checksummed, the newest K valid ones kept, the newest valid one found on resume.

A checkpoint is a directory ``step_00000010/`` holding ``state.pt`` (model, optimizer, schedule, RNG,
data position) and ``meta.json`` (step, sha256 and size of state.pt, model config). It is written into a
hidden temporary directory and renamed into place, so a crash mid-save never leaves a half checkpoint
under a real name and never touches the previous one.

A run on several processes writes a *sharded* checkpoint instead (``format`` 2, see
:mod:`elbowroom.train.sharded_checkpoint`): the same directory holds torch.distributed.checkpoint's files, each
rank's shards and ``.metadata``, plus ``extra.pt`` (schedule, RNG, data position); its ``meta.json`` lists every
file with its size and sha256. It is published by :meth:`CheckpointManager.publish` with the same rename, and
verified, rotated and found on resume by the same rules.

Rotation counts only checkpoints that verify: a corrupt one (truncated, bit-flipped, meta missing) is
renamed ``corrupt-step_00000060`` with a warning, never deleted and never counted, so the valid ones
older than it are kept. Verifying hashes the whole state file, so what verified is remembered (by the
files' size, mtime and inode) for the life of the manager: a save does not re-hash the checkpoints it keeps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{8})$")
_CORRUPT_PREFIX = "corrupt-"


class CheckpointError(ValueError):
    """A checkpoint cannot be used for this run (wrong model, nothing valid); the message says why."""


class _HashingWriter:
    """A file wrapper that hashes what is written through it (one pass: no re-read after saving)."""

    def __init__(self, f) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.size += len(b)
        return self._f.write(b)

    def flush(self) -> None:
        self._f.flush()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _signature(path: Path) -> tuple[Any, ...]:
    """Name, size, mtime and inode of every file of a checkpoint: any rewrite of them changes it."""
    sig: list[Any] = []
    try:
        files = sorted(p for p in path.iterdir() if p.is_file())
    except OSError:
        return (-1,)
    for p in files:
        try:
            st = p.stat()
        except OSError:
            sig += [p.name, -1, -1, -1]
        else:
            sig += [p.name, st.st_size, st.st_mtime_ns, st.st_ino]
    return tuple(sig)


_WRITER_PID = re.compile(r"-(\d+)$")


def _writer_alive(name: str) -> bool:
    """Whether the temporary ``name`` (``.tmp-step_N-PID``) belongs to a live process other than this one."""
    m = _WRITER_PID.search(name.removeprefix(".tmp-step_").removeprefix(".old-step_"))
    if m is None:  # no writer named (a sharded save's, whose ranks clear their own): a leftover
        return False
    pid = int(m.group(1))
    if pid == os.getpid():  # our own, from a save that failed earlier in this process
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists (PermissionError: it does, another user's)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


SHARDED_FORMAT = 2
"""``meta.json``'s ``format`` of a sharded (torch.distributed.checkpoint) checkpoint."""


@dataclass(frozen=True)
class Loaded:
    """A checkpoint read back: its step, its state dict and its metadata."""

    step: int
    state: dict[str, Any]
    meta: dict[str, Any]
    path: Path


class CheckpointManager:
    """Saves and finds checkpoints under one directory.

    Args:
        directory: where ``step_*`` directories live (created on first save).
        keep: how many of the newest checkpoints to keep.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        # path -> (file signature, meta) of checkpoints verified by this process; see _signature
        self._verified: dict[Path, tuple[tuple[int, ...], dict[str, Any]]] = {}

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete-looking checkpoints as (step, path), newest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found, reverse=True)

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None) -> Path:
        """Write a checkpoint for ``step`` atomically and prune old ones; returns its path."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temporaries()
        final = self.directory / f"step_{step:08d}"
        tmp = self.directory / f".tmp-step_{step:08d}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        with open(tmp / "state.pt", "wb") as f:
            w = _HashingWriter(f)
            torch.save(state, w)
            f.flush()
            os.fsync(f.fileno())
        info = dict(meta or {}, step=step, sha256=w.sha.hexdigest(), size=w.size, format=1)
        with open(tmp / "meta.json", "w") as f:
            json.dump(info, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        return self._publish(final, tmp, info)

    def publish(self, step: int, tmp: Path, meta: dict[str, Any]) -> Path:
        """Publish a sharded checkpoint written into ``tmp`` (all its files complete): hash every file into
        ``meta.json``, rename it into place and prune old ones, as :meth:`save` does; returns its path."""
        files = {}
        for p in sorted(tmp.iterdir()):
            if p.is_file():
                files[p.name] = {"size": p.stat().st_size, "sha256": _sha256_file(p)}  # reads back what was written
        info = dict(meta, step=step, files=files, format=SHARDED_FORMAT)
        with open(tmp / "meta.json", "w") as f:
            json.dump(info, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        return self._publish(self.directory / f"step_{step:08d}", tmp, info)

    def _publish(self, final: Path, tmp: Path, info: dict[str, Any]) -> Path:
        if final.exists():
            try:
                self._verified_meta(final)
            except ValueError as e:  # a corrupt one of the same step is set aside, not overwritten
                self.set_aside(final, str(e))
        if final.exists():  # the same step saved again (e.g. on a signal right after a periodic save)
            old = self.directory / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(self.directory)
        self._verified[final] = (_signature(final), info)  # hashed while writing: no need to read it back
        self._prune()
        return final

    def _remove_stale_temporaries(self) -> None:
        """Delete what crashed saves left behind, but not the temporaries of a save under way in another live
        process (``.tmp-step_N-PID``: another run writing here, or one shutting down)."""
        for p in self.directory.iterdir():
            if p.name.startswith((".tmp-", ".old-")) and not _writer_alive(p.name):
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self) -> None:
        """Keep the newest ``keep`` checkpoints that verify; set corrupt ones aside, delete older valid ones."""
        valid = 0
        for _, path in self.checkpoints():
            try:
                self._verified_meta(path)
            except ValueError as e:
                self.set_aside(path, str(e))
                continue
            valid += 1
            if valid > self.keep:
                shutil.rmtree(path, ignore_errors=True)
                self._verified.pop(path, None)

    def set_aside(self, path: Path, reason: str) -> Path:
        """Rename a corrupt checkpoint to ``corrupt-step_N`` (kept for inspection, no longer found); returns it."""
        target = self.directory / f"{_CORRUPT_PREFIX}{path.name}"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"{_CORRUPT_PREFIX}{path.name}-{n}"
        os.replace(path, target)
        self._verified.pop(path, None)
        log.warning("checkpoint %s is corrupt (%s); moved it to %s", path, reason, target)
        return target

    def corrupt(self) -> list[tuple[Path, str]]:
        """Checkpoints under real names that fail to verify, as (path, reason), newest first."""
        bad = []
        for _, path in self.checkpoints():
            try:
                self.validate(path)
            except ValueError as e:
                bad.append((path, str(e)))
        return bad

    def validate(self, path: Path) -> dict[str, Any]:
        """The metadata of a checkpoint if its files are whole; ValueError saying what is wrong if not.

        Always reads and hashes the files; rotation uses :meth:`_verified_meta`, which does not repeat that.
        """
        meta = self._verify(path)
        self._verified[path] = (_signature(path), meta)
        return meta

    def _verified_meta(self, path: Path) -> dict[str, Any]:
        """:meth:`validate`, except that a checkpoint this manager wrote or verified before, whose files are
        unchanged (size, mtime, inode), is not hashed again: a save must not re-read every kept checkpoint."""
        cached = self._verified.get(path)
        if cached is not None and cached[0] == _signature(path):
            return cached[1]
        return self.validate(path)

    def _verify(self, path: Path) -> dict[str, Any]:
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path.name}: meta.json unreadable ({e})") from None
        if meta.get("format") == SHARDED_FORMAT:
            for name, want in meta.get("files", {}).items():
                f = path / name
                if not f.is_file():
                    raise ValueError(f"{path.name}: {name} missing")
                if f.stat().st_size != want["size"]:
                    raise ValueError(f"{path.name}: {name} has {f.stat().st_size} bytes, expected {want['size']} "
                                     "(truncated)")
                if _sha256_file(f) != want["sha256"]:
                    raise ValueError(f"{path.name}: {name} checksum mismatch (corrupt)")
            return meta
        state = path / "state.pt"
        if not state.is_file():
            raise ValueError(f"{path.name}: state.pt missing")
        size = state.stat().st_size
        if size != meta.get("size"):
            raise ValueError(f"{path.name}: state.pt has {size} bytes, expected {meta.get('size')} (truncated)")
        if _sha256_file(state) != meta.get("sha256"):
            raise ValueError(f"{path.name}: state.pt checksum mismatch (corrupt)")
        return meta

    def load_latest(self, map_location: Any = "cpu") -> Loaded | None:
        """The newest checkpoint that validates and loads; corrupt ones are skipped with a warning.

        Nothing is moved or deleted here: the caller decides whether the run proceeds (the next
        :meth:`save` sets the corrupt ones aside).
        """
        for step, path in self.checkpoints():
            try:
                meta = self.validate(path)
                if meta.get("format") == SHARDED_FORMAT:  # the tensors load into the built model (sharded_checkpoint)
                    state = {**torch.load(path / "extra.pt", map_location=map_location, weights_only=True),
                             "sharded": True}
                else:
                    state = torch.load(path / "state.pt", map_location=map_location, weights_only=True)
            except Exception as e:  # noqa: BLE001 - any failure to read means "use the previous one"
                log.warning("skipping checkpoint %s: %s; falling back to the previous one", path, e)
                continue
            return Loaded(step=step, state=state, meta=meta, path=path)
        return None
