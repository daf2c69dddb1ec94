"""What a run carries outside the model: RNG states, the global settings it changes, and signals.

Signals become a flag the loop reads after each step (a second SIGINT aborts, except during a save, which it
waits for); ``train()`` restores the global settings and RNG states it changes.
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
from typing import Any

import torch

log = logging.getLogger("elbowroom.train")


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def _restored_global_state() -> Any:
    """Give back what train() changes process-wide: deterministic-algorithm flags and the RNG states."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        # (only where train() changed them: the call imports torch._inductor, which a Ctrl-C may have left
        # half-imported)
        if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
                deterministic, warn_only):
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_rng_state(torch_rng)
        random.setstate(python_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


class _StopSignal:
    """Turns SIGTERM/SIGINT into a flag the loop checks after each step and after each save.

    A second SIGINT aborts at once (KeyboardInterrupt; the previous checkpoint stands), except during a
    save: there it is noted and ignored, so that the checkpoint the first signal asked for is completed.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._saving = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no signal handling there
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            if self._saving:
                log.warning("received %s while saving the checkpoint: finishing the save first", name)
            elif signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.received = signum
        if self._saving:  # the loop stops once this save is written
            log.warning("received %s while saving a checkpoint: finishing the save, then exiting", name)
        else:
            log.warning("received %s: finishing this step, saving a checkpoint, then exiting", name)

    @contextlib.contextmanager
    def saving(self) -> Any:
        self._saving = True
        try:
            yield
        finally:
            self._saving = False

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
