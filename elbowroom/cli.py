"""The ``elbowroom`` command: ``train``, ``prepare``, ``plan``, ``report`` and ``export``.

Bad input (an unknown key, a wrong type, a missing data file, a checkpoint of another model) prints one
line naming the problem and the fix and exits with code 2, without a traceback and without writing
anything. A run stopped by SIGTERM or SIGINT saves a checkpoint and exits with 128 + the signal's number
(143, 130), as shells and schedulers expect of a process a signal ended; Ctrl-C anywhere else (while importing,
reading the config, planning) prints one line saying what was left and exits 130, without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elbowroom.train.distributed_run import Launch

USAGE = """usage: elbowroom COMMAND [options]

commands:
  train     train the reference LM (default: the tiny model on Python's own stdlib source, CPU-friendly)
  prepare   turn a text file or folder into a token file (.bin) for --data.path
  plan      plan a model under a memory budget before any step runs (analytic profile, no GPU needed)
  report    draw where a run's memory and time went (RUN_DIR/report/: pictures and one HTML page)
  export    turn a run's checkpoint into a Hugging Face, ONNX, quantized or pruned model

`elbowroom COMMAND --help` shows a command's options.
"""

TRAIN_USAGE = """usage: elbowroom train [--config FILE.toml] [--section.key VALUE ...]

Train a reference decoder LM (or a local Hugging Face causal LM: --model.hf DIR). Values come from the
defaults, then the TOML file, then the command line.
Shortcuts: --out DIR, --steps N, --resume, --log-every N, --seed N, --device DEV, --host-budget SIZE.
Memory: --budget 24GiB plans recompute, offload, optimizer placement and precision before step 1 (or --plan FILE
applies a saved plan); --profile.steps 3-4 records those steps for `elbowroom report OUT`.
Writes OUT/metrics.jsonl (one JSON object per logged step), OUT/checkpoints/, OUT/config.toml, and with a plan
OUT/plan.toml and OUT/plan.json (a --resume re-applies OUT/plan.toml).
--resume continues the run as saved in OUT/config.toml: give only what changes (--steps N); an option that would
change its training (model, data, optimizer, schedule, ...) is refused.
"""

EXIT_BAD_INPUT = 2


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(  # the other ranks' warnings (their own memory, their own faults) say whose they are
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname).1s %(message)s" if rank == 0 else
        f"%(asctime)s %(levelname).1s [rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def _fail(command: str, message: str) -> int:
    print(f"elbowroom {command}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def cmd_train(argv: list[str]) -> int:
    from elbowroom import config as C

    if "-h" in argv or "--help" in argv:
        print(TRAIN_USAGE + C.help_text())
        return 0
    config_file = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--config":
            if i + 1 >= len(argv):
                return _fail("train", "--config needs a FILE.toml")
            config_file = argv[i + 1]
            i += 2
        elif argv[i].startswith("--config="):
            config_file = argv[i].split("=", 1)[1]
            i += 1
        else:
            rest.append(argv[i])
            i += 1
    try:
        cfg = C.resolve(config_file, rest)
        saved = _saved_run_config(cfg.out) if cfg.resume else None
        if saved is not None:  # a resumed run continues as it was saved; this command changes only what it names
            cfg = C.resolve_resume(saved[0], saved[1], config_file, rest)
    except C.ConfigError as e:
        return _fail("train", str(e))
    cfg = _from_environment(cfg)

    with _interrupt_held():
        # (torch._dynamo is imported by the model's first meta-device init: a Ctrl-C there left sympy half-imported,
        # and the trainer's clean-up, importing torch._inductor, ended in an AttributeError instead)
        import torch._dynamo  # noqa: F401

        from elbowroom.train.checkpoint import CheckpointError
        from elbowroom.train.data import DataError
        from elbowroom.train.trainer import train

    _setup_logging()
    try:
        from tqdm.contrib.logging import logging_redirect_tqdm

        with logging_redirect_tqdm():
            result = train(cfg, launch_from_environment(os.environ))  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK
    except (C.ConfigError, DataError, CheckpointError) as e:
        return _fail("train", str(e))
    except KeyboardInterrupt:  # Ctrl-C before the loop, or a second one outside a save: the previous checkpoint stands
        logging.getLogger("elbowroom").warning("aborted; %s", _what_stands(cfg.out))
        return 128 + signal.SIGINT
    if result.interrupted:  # (the trainer said where it stopped and what it saved)
        return 128 + (result.signal or signal.SIGTERM)
    return 0


def _what_stands(out: str | None) -> str:
    """What an aborted run leaves to resume from, for its last log line."""
    if out is None:  # (a directory of its own, named in the log)
        return "the newest checkpoint saved before, if any, stands"
    from pathlib import Path

    from elbowroom.train.checkpoint import CheckpointManager

    found = CheckpointManager(Path(out) / "checkpoints").checkpoints()
    if not found:
        return f"no checkpoint was saved in {out}"
    return f"the newest checkpoint saved before stands ({found[0][1]})"


def _saved_run_config(out: str) -> tuple[dict[str, Any], str] | None:
    """The config a run was trained with, as (nested dict, where it was read): its ``OUT/config.toml`` (written with
    its first step), else the newest checkpoint's ``meta.json``; None when the run has neither (the trainer says
    there is nothing to resume)."""
    import json
    from pathlib import Path

    from elbowroom.config import load_toml
    from elbowroom.train.checkpoint import CheckpointManager

    path = Path(out) / "config.toml"
    if path.is_file():
        return load_toml(str(path)), str(path)
    for _, ckpt in CheckpointManager(Path(out) / "checkpoints").checkpoints():
        try:
            saved = json.loads((ckpt / "meta.json").read_text()).get("config")
        except (OSError, ValueError):
            continue  # the trainer skips or refuses it, with its reason
        if isinstance(saved, dict):
            return saved, str(ckpt / "meta.json")
    return None


def launch_from_environment(environ: Mapping[str, str]) -> Launch | None:
    """torchrun's placement of this process (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR) as a
    ``Launch``, or None when they are absent (a plain ``python``/``elbowroom`` process)."""
    from elbowroom.config import ConfigError
    from elbowroom.train.distributed_run import Launch

    if "WORLD_SIZE" not in environ:
        return None
    try:
        return Launch(int(environ.get("RANK", "0")), int(environ["WORLD_SIZE"]), int(environ.get("LOCAL_RANK", "0")),
                      rendezvous="MASTER_ADDR" in environ,
                      local_world_size=int(environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        raise ConfigError("RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers (torchrun sets them)"
                          ) from None


def _from_environment(cfg: Any) -> Any:
    """The environment's say in a run, read here and nowhere below: ``ELBOWROOM_CACHE`` (where the built-in
    corpus is cached, unless the config names a place) and ``CI`` (no progress bar)."""
    from dataclasses import replace

    cache = os.environ.get("ELBOWROOM_CACHE")
    if cache and cfg.data.cache_dir is None:
        cfg = replace(cfg, data=replace(cfg.data, cache_dir=cache))
    if os.environ.get("CI") and cfg.logging.progress:
        cfg = replace(cfg, logging=replace(cfg.logging, progress=False))
    return cfg


def cmd_prepare(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="elbowroom prepare",
        description="Turn a text file (or a folder of .txt files) into a memory-mapped token file for --data.path.",
    )
    p.add_argument("input", help="a UTF-8 text file, or a folder whose .txt files are read in sorted order")
    p.add_argument("output", help="the token file to write (.bin); a .json sidecar describes it")
    p.add_argument("--tokenizer", default=None, help="a local Hugging Face tokenizer.json (default: bytes)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    from elbowroom.train.data import DataError, prepare

    _setup_logging()
    try:
        meta = prepare(args.input, args.output, tokenizer=args.tokenizer, progress=not args.no_progress)
    except (DataError, ImportError) as e:
        return _fail("prepare", str(e))
    except KeyboardInterrupt:  # prepare() removed what it was writing (a file there from before stands)
        logging.getLogger("elbowroom").warning("interrupted; %s was not written", args.output)
        return 128 + signal.SIGINT
    logging.getLogger("elbowroom").info(
        "wrote %s: %s tokens (%s, vocab %s)", args.output, f"{meta['num_tokens']:,}", meta["dtype"], meta["vocab_size"]
    )
    return 0


def cmd_plan(argv: list[str]) -> int:
    from elbowroom.plan.cli import cmd_plan as run

    _setup_logging()
    return run(argv)


def cmd_report(argv: list[str]) -> int:
    from elbowroom.report.cli import cmd_report as run

    _setup_logging()
    return run(argv)


def cmd_export(argv: list[str]) -> int:
    from elbowroom.export.cli import cmd_export as run

    _setup_logging()
    cache = os.environ.get("ELBOWROOM_CACHE")
    if cache and not any(a == "--cache-dir" or a.startswith("--cache-dir=") for a in argv) and len(argv) > 1:
        argv = [*argv, "--cache-dir", cache]  # the library reads no environment: the CLI passes it on
    return run(argv)


COMMANDS = {"train": cmd_train, "prepare": cmd_prepare, "plan": cmd_plan, "report": cmd_report, "export": cmd_export}

# What a Ctrl-C that reaches main() leaves, per command. train's reaches it only before train() (which saves, or
# says which checkpoint stands, itself), prepare's only outside prepare() (which removes its partial file), plan
# writes --out through a temporary file and export through a temporary folder, each renamed into place at the end.
_LEFT_WHEN_INTERRUPTED = {
    "train": "nothing written",
    "prepare": "nothing written",
    "plan": "nothing written",
    "report": "RUN_DIR/report/ may be incomplete; run `elbowroom report RUN_DIR` again",
    "export": "nothing written at --out",
}

# The commands that import torch anyway, first thing: they import it first and whole (see _interrupt_held).
_TORCH_COMMANDS = ("train", "prepare", "plan", "export")


@contextlib.contextmanager
def _interrupt_held() -> Iterator[None]:
    """Hold a Ctrl-C back until the block ends, then raise it: an import it stops midway can be left half-done
    without a word (torch swallows a KeyboardInterrupt raised while it imports numpy: the run went on, to an
    AttributeError of numpy's where it read its tokens)."""
    import threading

    held: list[int] = []
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler or \
            threading.current_thread() is not threading.main_thread():
        yield  # (SIGINT ignored, as in a background job, or handled by whoever called main; or not ours to set)
        return
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        if not argv:
            print(f"elbowroom: error: no command given; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
            return EXIT_BAD_INPUT
        return 0
    if argv[0] in ("-V", "--version"):
        from elbowroom import __version__

        print(f"elbowroom {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        return _fail(argv[0], f"unknown command; choose one of {', '.join(COMMANDS)}")
    try:
        if argv[0] in _TORCH_COMMANDS and not {"-h", "--help"} & set(argv[1:]):
            with _interrupt_held():
                import torch  # noqa: F401
        return command(argv[1:])
    except KeyboardInterrupt:  # Ctrl-C where no command handles it: while importing, reading the config, planning
        print(f"elbowroom {argv[0]}: interrupted; {_LEFT_WHEN_INTERRUPTED[argv[0]]}", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
