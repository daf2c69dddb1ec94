"""Start two gloo processes for a test and bring back what each returned.

CI has two cores: each spawn is costly (~3 s of interpreter and torch start), so a test groups several checks
in one worker function and returns their results; assertions run in the parent on what came back.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)  # two ranks on two cores
    try:
        result: Any = fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - carried to the parent, which fails the test with it
        result = {"__error__": traceback.format_exc()}
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    # the result is on disk: leave without the interpreter's teardown, where a C++ thread of the collectives'
    # libraries was seen to abort the process ("terminate called without an active exception", 1 run in 6)
    os._exit(0)


def run_ranks(fn: Callable[..., Any], *args: Any, world: int = 2, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes; returns each rank's result, rank order.

    ``fn`` must be a module-level function (it is pickled). An exception in any rank fails with its traceback.
    """
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), out, fn, args), nprocs=world, join=False,
                                 start_method="spawn")
        import time

        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"distributed test did not finish in {timeout_s:.0f} s")
        results = [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world)]
    for r, res in enumerate(results):
        if isinstance(res, dict) and "__error__" in res:
            raise AssertionError(f"rank {r} failed:\n{res['__error__']}")
    return results


def trainer_config(base: list[str], out: Path, *args: str) -> Any:
    """The trainer's config of ``base`` + ``args`` writing to ``out``, with the session's corpus cache."""
    from dataclasses import replace

    from elbowroom import config as C

    cfg = C.resolve(None, [*base, "--out", str(out), *args])
    return replace(cfg, data=replace(cfg.data, cache_dir=os.environ["ELBOWROOM_CACHE"]))


def train_losses(base: list[str], out: Path, *args: str) -> dict:
    """Train (in this process, as one rank of whatever group is initialised) and return the losses and step."""
    from elbowroom.train.trainer import train

    r = train(trainer_config(base, out, *args))
    return {"losses": r.losses, "val": r.val_losses, "step": r.step}


def assert_close_curves(a: dict[int, float], b: dict[int, float], rel: float, what: str = "") -> None:
    """Two loss curves: the same steps, the values within ``rel``."""
    import pytest

    assert a.keys() == b.keys(), what
    assert list(a.values()) == pytest.approx(list(b.values()), rel=rel), what


@contextlib.contextmanager
def one_process_group(monkeypatch: Any) -> Iterator[None]:
    """A gloo process group of this process alone (world size 1), destroyed afterwards."""
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


TINY_RUN = [
    "--model.dim", "32", "--model.n_heads", "2", "--model.ffn_dim", "64", "--model.n_layers", "2",
    "--data.seq_len", "32", "--data.batch_size", "4", "--data.num_workers", "0", "--train.dtype", "fp32",
    "--train.device", "cpu", "--train.eval_every", "3", "--train.eval_batches", "2", "--logging.progress", "false",
    "--log-every", "1", "--scheduler.warmup_steps", "2", "--optimizer.lr", "1e-2", "--steps", "6",
    "--checkpoint.every", "3",
]
"""The trainer arguments of the distributed trainer tests: a 2-block model, 6 steps, fp32 on the CPU."""
