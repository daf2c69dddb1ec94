"""The trainer with one of its automatic choices pinned, for A/B runs on the device (not a user interface).

    torchrun --nproc-per-node 1 benchmarks/trainer_variant.py --reentrant off [--stack] -- train --config ...

- ``--reentrant auto|on|off``: whether blocks the plan recomputes whole use torch's reentrant checkpoint (the trainer
  decides this itself: ``elbowroom.train.planning._reentrant``); pinned here, profile and run alike.
- ``--switch-interval S``: ``sys.setswitchinterval(S)`` (Python's default is 5 ms: how long a thread that wants the
  interpreter's lock may wait for another that holds it);
- ``--stack``: the trainer's profiler (``--profile.steps``) records Python stacks too, so that
  ``benchmarks/stack_summary.py`` can say which Python code ran inside an autograd node.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ap = argparse.ArgumentParser()
ap.add_argument("--reentrant", choices=("auto", "on", "off"), default="auto")
ap.add_argument("--stack", action="store_true")
ap.add_argument("--switch-interval", type=float, default=None)
ap.add_argument("rest", nargs=argparse.REMAINDER)
args = ap.parse_args()
rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest

if args.switch_interval is not None:
    sys.setswitchinterval(args.switch_interval)
if args.reentrant != "auto":
    from elbowroom.train import planning

    planning._reentrant = lambda cfg: args.reentrant == "on"  # noqa: E731
if args.stack:
    import torch.profiler

    _profile = torch.profiler.profile

    def _with_stack(*a, **k):
        k["with_stack"] = True
        return _profile(*a, **k)

    torch.profiler.profile = _with_stack

from elbowroom.cli import main  # noqa: E402

sys.exit(main(rest))
