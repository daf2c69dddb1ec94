"""The offload engine's stream ordering, checked on CPU with a simulated asynchronous copier.

The simulator stands in for the CUDA copier (same four calls: copy_out, copy_in, done, wait). Copies
do not run when issued: each waits in its stream's queue and runs later, in a random order that
respects only the dependencies the engine declared (stream waits on events, in-order streams). A
missing wait therefore shows up as wrong values (restored memory is poisoned with NaN until its copy
runs; a slot overwritten too early corrupts what is read back), and a device tensor released
before its copy ran fails an assertion. This is what CPU can say about the CUDA path's ordering.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from elbowroom.activations import BlockPolicy, OffloadEngine, apply_block_policies
from elbowroom.models import ModelConfig, build_model


class SimEvent:
    def __init__(self, stream: SimStream) -> None:
        self.stream = stream
        self.done = False


class SimStream:
    def __init__(self, sim: SimCopier, name: str) -> None:
        self.sim = sim
        self.name = name
        self.queue: list[tuple[list[SimEvent], object, SimEvent]] = []

    def run_head(self) -> None:
        deps, fn, ev = self.queue[0]
        for d in deps:
            self.sim.complete(d)
        # the head may have run while completing a dependency
        if self.queue and self.queue[0][2] is ev:
            self.queue.pop(0)
            fn()
            ev.done = True


class SimCopier:
    """Asynchronous copies on two simulated streams; the compute stream runs eagerly (it is the CPU)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.d2h = SimStream(self, "d2h")
        self.h2d = SimStream(self, "h2d")
        self.issued = 0

    def _issue(self, stream: SimStream, deps: list, fn) -> SimEvent:  # noqa: ANN001
        ev = SimEvent(stream)
        stream.queue.append(([d for d in deps if d is not None], fn, ev))
        self.issued += 1
        self._progress()
        return ev

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, after: SimEvent | None) -> SimEvent:
        return self._issue(self.d2h, [after], lambda: dst.copy_(src))

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, after: SimEvent | None) -> SimEvent:
        dst.fill_(255)  # poison: bytes 0xff read as NaN in float tensors until the copy runs
        return self._issue(self.h2d, [after], lambda: dst.copy_(src))

    def complete(self, ev: SimEvent) -> None:
        while not ev.done:
            ev.stream.run_head()

    def done(self, ev: SimEvent) -> bool:
        return ev.done

    def wait(self, ev: SimEvent | None, stream: object = None) -> None:
        # the compute stream runs eagerly, so "compute waits for ev" means ev completes now
        if ev is not None:
            self.complete(ev)

    def current_stream(self) -> None:
        return None

    def _progress(self) -> None:
        # now and then run a queued copy, the head of a random stream: copies lag behind compute
        # by a random amount, as they do when the link is the bottleneck
        for _ in range(self.rng.choice((0, 0, 1, 2))):
            ready = [s for s in (self.d2h, self.h2d) if s.queue]
            if not ready:
                return
            self.rng.choice(ready).run_head()


def sim_engine(seed: int) -> tuple[OffloadEngine, SimCopier]:
    eng = OffloadEngine(min_offload_bytes=0, chunk_bytes=64 << 10, simulate_host=True)
    eng._setup(torch.device("cpu"))
    sim = SimCopier(seed)
    eng._copier = sim
    drop = eng._drop_gpu

    def checked_drop(rec):  # noqa: ANN001
        assert rec.d2h.done, "device memory released before its device-to-host copy ran"
        return drop(rec)

    eng._drop_gpu = checked_drop
    return eng, sim


def lm(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, dim=64, n_heads=4, ffn_dim=128, n_layers=5, dropout=0.1)
    return build_model(cfg).train()


def step(model: torch.nn.Module, idx: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


PLANS = {
    "offload-all": [BlockPolicy(offload_ratio=1.0)] * 4 + [BlockPolicy()],
    "ckpt-inputs": [BlockPolicy("full", offload_input=True)] * 4 + [BlockPolicy()],
    "selective": [BlockPolicy("selective", offload_ratio=1.0, offload_input=True)] * 4 + [BlockPolicy()],
    "mix": [
        BlockPolicy(offload_ratio=1.0),
        BlockPolicy(offload_ratio=0.5),
        BlockPolicy("selective", offload_ratio=0.5),
        BlockPolicy("full", offload_input=True),
        BlockPolicy(),
    ],
}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("plan", [*PLANS, "offload-all-small-window"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_schedule_gives_exact_gradients(arch: str, plan: str, seed: int) -> None:
    model = lm(arch)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))
    refs = [step(model, idx, s) for s in range(3)]
    eng, sim = sim_engine(seed)
    if plan.endswith("small-window"):
        plan, eng.prefetch_window_bytes = "offload-all", 24 << 10  # regions come back piece by piece
    apply_block_policies(model, PLANS[plan], engine=eng)
    for s in range(3):  # slots are reused from step 2 on: the slot-reuse ordering is exercised
        loss, grads = step(model, idx, s)
        torch.testing.assert_close(loss, refs[s][0], rtol=0, atol=0)
        for g, r in zip(grads, refs[s][1]):
            torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert sim.issued > 0
    assert eng.stats().host_allocations >= 1 and eng.stats().host_pool_in_use_bytes == 0


def test_simulator_catches_a_missing_wait() -> None:
    # the simulator is only worth something if it fails a broken engine: drop the compute-stream
    # wait before reading restored bytes and the poisoned (NaN) memory must reach the gradients
    model = lm("llama")
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    eng, sim = sim_engine(0)
    sim.rng = random.Random(0)
    sim._progress = lambda: None  # copies run only when waited on
    real_wait = sim.wait
    apply_block_policies(model, PLANS["offload-all"], engine=eng)
    sim.wait = lambda ev, stream=None: None if ev is not None and ev.stream is sim.h2d else real_wait(ev, stream)
    _, grads = step(model, idx, 0)
    assert any(not torch.isfinite(g).all() for g in grads)
