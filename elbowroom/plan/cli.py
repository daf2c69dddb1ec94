"""``elbowroom plan``: plan a built-in model for a device and a budget, on the CPU, before any step runs.

::

    elbowroom plan --model w1 --device h100-80gb --budget 24GiB [--batch 4x4096] [--precision bf16]
                   [--global-batch N] [--no-stream] [--json] [--out plan.toml]
    elbowroom plan --profile profile.json --budget 24GiB     # a saved Profile (Profile.to_dict() as JSON)
    elbowroom plan --hf DIR --device rtx4090 --budget 20GiB --batch 2x2048   # a local Hugging Face causal LM

The model (a preset, or a Hugging Face causal LM from the ``config.json`` of a local directory: no download, no
weights read) is built on the meta device (no memory) and profiled analytically (bytes from a trace, speeds from
the device table ``elbowroom.plan.devices``). Prints the plan's table (or its JSON with ``--json``) and the
predicted peak and step time; ``--out`` saves the plan as TOML or JSON for ``Plan.load``, whole or not at all (a
temporary file renamed into place). Bad input (an unknown model or device, a bad budget or batch, a budget below the
minimum) prints one line on stderr (``elbowroom plan: error: ...``, as ``elbowroom train``'s) and returns 2,
writing nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["cmd_plan"]


class _UsageError(Exception):
    """Bad input: its message, which ``cmd_plan`` prints after "elbowroom plan: error: " as the one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{message} (see elbowroom plan --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="elbowroom plan", description="Plan a training step under a device-memory budget.")
    p.add_argument("--model", default=None, help=f"model preset: {', '.join(_presets())} (default tiny), or a Hugging "
                   "Face model's directory (as --hf)")
    p.add_argument("--arch", choices=("llama", "gpt2"), default=None, help="block family (default: the preset's)")
    p.add_argument("--hf", "--model.hf", dest="hf", default=None, metavar="DIR", help="plan the Hugging Face causal "
                   "LM of this local directory (its config.json; as `elbowroom train --model.hf DIR` trains it) "
                   "instead of a preset")
    p.add_argument("--device", default=None, help=f"device to plan for, from the table elbowroom.plan.devices: "
                   f"{', '.join(_known_devices())} (any case; aliases: {', '.join(_device_aliases())}); required "
                   "unless --profile gives the machine")
    p.add_argument("--host-memory", default=None, help="host memory of the machine planned for, e.g. 128GiB "
                   "(default: this machine's): the host optimizer state and pinned activations must fit it")
    p.add_argument("--budget", required=True, help="device memory for the step: 24GiB, 24GB, 512MiB or bytes")
    p.add_argument("--batch", default=None, help="micro-batch as SAMPLESxTOKENS, e.g. 4x4096 (default 1 x the "
                   "preset's max_seq_len)")
    p.add_argument("--global-batch", type=int, default=None, help="samples per optimizer step (the planner then "
                   "chooses micro-batch and accumulation)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16 allows bf16 device weights "
                   "with fp32 masters (default: %(default)s)")
    p.add_argument("--compile", action="store_true", help="the blocks will run compiled as planned runs compile them "
                   "(fit(compile=True), --train.compile; pointwise results recomputed): a block kept whole is priced "
                   "at what selective recompute keeps")
    p.add_argument("--no-fused-loss", action="store_true", help="the loop cannot use the fused head + loss")
    p.add_argument("--no-clip", action="store_true", help="the loop does not clip gradients")
    p.add_argument("--no-stream", action="store_true", help="no block's optimizer state streams through the device "
                   "to step there (host-stepped or on the device only; streaming needs Adam or AdamW)")
    p.add_argument("--dp-shard", type=int, default=1, help="plan one rank of FSDP2 sharding over this many ranks "
                   "(the trainer's --parallel.dp_shard; --budget is then one GPU's, --batch one rank's micro-batch, "
                   "8 ranks per host at most share its memory)")
    p.add_argument("--fsdp-prefetch", type=int, default=0, help="with --dp-shard: the units each block unit "
                   "all-gathers ahead (the trainer's --parallel.fsdp_prefetch), held at once beside the one in flight")
    p.add_argument("--dp-replicate", type=int, default=1, help="plan one rank of DDP over this many replicas (the "
                   "trainer's --parallel.dp_replicate; with --dp-shard, HSDP): DDP's buckets hold every gradient "
                   "all step, and up to 8 ranks share the host's memory and optimizer rate")
    p.add_argument("--shared-link", default=None, metavar="TO,FROM,BOTH", help="with --dp-shard or --dp-replicate: "
                   "the host link's rates in GB/s with every rank of the host copying at once (to the device, from "
                   "it, each way with both busy), as the trainer's log prints them or benchmarks/host_link.py "
                   "measures them; default: each GPU's link alone (the trainer measures the shared one itself)")
    p.add_argument("--profile", default=None, help="plan from a saved profile (JSON of Profile.to_dict()) instead "
                   "of profiling --model")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--out", default=None, help="save the plan to this .toml or .json file")
    return p


def _presets() -> list[str]:
    from elbowroom.models.decoder import PRESETS

    return list(PRESETS)


_VALUED = ("--budget", "--host-memory", "--batch", "--global-batch", "--dp-shard", "--dp-replicate", "--shared-link",
           "--fsdp-prefetch")
"""Options whose value may begin with a minus sign."""


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--budget -3GiB`` as ``--budget=-3GiB``: argparse takes ``-3GiB`` for an option and says only "expected one
    argument"; joined, the value reaches its own check, which names what is wrong with it."""
    out: list[str] = []
    it = iter(range(len(argv)))
    for i in it:
        a = argv[i]
        if a in _VALUED and i + 1 < len(argv) and re.match(r"^-[0-9.]", argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            next(it)
        else:
            out.append(a)
    return out


def _check_out(path: str) -> None:
    """Refuse an --out the plan cannot be saved to, before any work (a missing or read-only folder ended in a
    traceback after the whole plan was printed)."""
    out = Path(path)
    if out.suffix not in (".toml", ".json"):
        raise _UsageError(f"--out must end in .toml or .json, got {path!r}")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise _UsageError(f"--out {path!r}: the folder {str(parent)!r} does not exist; create it or "
                          "choose another path")
    if out.is_dir():
        raise _UsageError(f"--out {path!r} is a folder; name a .toml or .json file")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise _UsageError(f"--out {path!r} cannot be written (no write permission); choose "
                          "another path")


def _size(n: float) -> str:
    """Bytes as ``--budget`` reads them, in the largest unit they fill: 24.00 GiB, 512.00 MiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _at_most(n: int) -> str:
    """``n`` bytes rounded down to two decimals of the largest unit it fills, as --budget reads it."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{math.floor(n * 100 / size) / 100:g}{unit}"
    return f"{n}B"


def _parse_batch(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    try:
        b, s = (int(x) for x in parts)
    except ValueError:
        raise _UsageError(f"--batch must read SAMPLESxTOKENS such as 4x4096, got {text!r}") from None
    if b < 1 or s < 1:
        raise _UsageError(f"--batch needs positive sizes, got {text!r}")
    return b, s


def _known_devices() -> list[str]:
    from elbowroom.plan.devices import DEVICES

    return sorted(DEVICES)


def _device_aliases() -> list[str]:
    from elbowroom.plan.devices import ALIASES

    return list(ALIASES)


def _hf_model(args: argparse.Namespace) -> tuple[Any, int]:
    """The Hugging Face causal LM of ``--hf DIR`` on the meta device, and the longest sequence its position table
    holds (0: none)."""
    import torch

    from elbowroom.config import ConfigError
    from elbowroom.train.hf import hf_max_positions, load_hf_config

    if args.model is not None or args.arch is not None:
        raise _UsageError("--hf plans the model of its directory; leave out --model and --arch")
    try:
        config = load_hf_config(args.hf)  # (it says how to install transformers where it is missing)
    except ConfigError as e:
        raise _UsageError(f"--hf {str(e).removeprefix('model.hf ')}") from None
    import transformers

    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, KeyError) as e:
        raise _UsageError(f"--hf {args.hf}: transformers cannot build a causal LM from its "
                          f"config.json ({e})") from None
    model.config.use_cache = False  # training: no KV cache
    return model.train(), hf_max_positions(config) or 0


def _profile_from_args(args: argparse.Namespace) -> Any:
    import torch

    from elbowroom.models import ModelConfig, build_model
    from elbowroom.models.decoder import PRESETS

    if args.hf is None and args.model not in PRESETS and args.model is not None and \
            (Path(args.model) / "config.json").is_file():
        args.hf, args.model = args.model, None  # a Hugging Face model's directory given as the model: --hf
    if args.hf is None and (args.model or "tiny") not in PRESETS:
        raise _UsageError(f"unknown model {args.model!r}; choose one of {', '.join(PRESETS)}, or "
                          "pass --hf DIR for a local Hugging Face model")
    if args.device is None:
        raise _UsageError("--device is needed to profile a model (e.g. --device h100-80gb), or "
                          "pass --profile FILE.json")
    from elbowroom.plan.devices import ALIASES, get_device

    try:
        get_device(args.device, host_memory=0)  # the table's names, any case, and its short aliases (h100, l4...)
    except ValueError:
        raise _UsageError(f"unknown device {args.device!r}; known: {', '.join(_known_devices())} "
                          f"(aliases: {', '.join(ALIASES)})") from None
    try:
        from elbowroom.plan.profiler import profile
    except ImportError:
        raise _UsageError("the profiler (elbowroom.plan.profiler) is not in this build; pass "
                          "--profile FILE.json") from None
    if args.hf is not None:
        model, positions = _hf_model(args)
        if args.batch:
            b, s = _parse_batch(args.batch)
        elif 0 < positions <= 8192:
            b, s = 1, positions
        else:
            raise _UsageError(f"--hf {args.hf} holds sequences of up to "
                              f"{positions or 'any number of'} tokens; say which with --batch SAMPLESxTOKENS, "
                              "e.g. --batch 1x4096")
        if positions and s > positions:
            raise _UsageError(f"--batch {b}x{s}: the model's position table holds {positions} tokens; "
                              f"pass at most {b}x{positions}")
    else:
        preset = PRESETS[args.model or "tiny"]
        b, s = _parse_batch(args.batch) if args.batch else (1, preset.max_seq_len)
        cfg = ModelConfig.from_preset(args.model or "tiny", arch=args.arch, max_seq_len=max(preset.max_seq_len, s))
        model = build_model(cfg, device="meta")
    sample = torch.zeros((b, s), dtype=torch.long, device="meta")
    try:
        from elbowroom.plan.fit import planned_compile_options

        compiled = planned_compile_options() if args.compile else False
        prof = profile(model, sample, source="analytic", machine=get_device(args.device, host_memory=args.host_bytes),
                       compiled=compiled)
        if args.dp_shard > 1:  # FSDP2 gathers in the compute dtype: the blocks save what a bf16 model saves
            from elbowroom.plan.ranks import as_fsdp_computes

            prof = as_fsdp_computes(model, sample, prof, getattr(torch, prof.compute_dtype), compiled)
        return prof
    except (KeyError, ValueError) as e:
        raise _UsageError(str(e)) from None


def _untied(args: argparse.Namespace) -> bool:
    """The preset's parameters outside the blocks are FSDP2 units of their own (no tied embedding), as the trainer
    wraps them; a profile read from a file does not say, and is planned with them gathered all step."""
    if args.hf is not None:
        from elbowroom.train.hf import load_hf_config

        return not getattr(load_hf_config(args.hf), "tie_word_embeddings", False)
    from elbowroom.models import ModelConfig

    return not ModelConfig.from_preset(args.model or "tiny", arch=args.arch).tie_embeddings


def cmd_plan(argv: Sequence[str] | None = None) -> int:
    """Run ``elbowroom plan`` with ``argv`` (without the program and command names).

    Returns:
        0 on success; 2 on bad input (one line on stderr, nothing written).
    """
    from elbowroom.plan.fit import parse_budget
    from elbowroom.plan.search import BudgetError, plan_for
    from elbowroom.plan.types import profile_from_dict

    try:
        args = _parser().parse_args(_join_negative_values(list(argv) if argv is not None else sys.argv[1:]))
        try:
            budget = parse_budget(args.budget, name="--budget")
            args.host_bytes = parse_budget(args.host_memory, name="--host-memory") if args.host_memory else None
        except ValueError as e:
            raise _UsageError(str(e)) from None
        if args.out is not None:
            _check_out(args.out)
        if args.global_batch is not None and args.global_batch < 1:
            raise _UsageError(f"--global-batch must be positive, got {args.global_batch}")
        if args.dp_shard < 1:
            raise _UsageError(f"--dp-shard must be a positive number of ranks, got {args.dp_shard}")
        if args.dp_replicate < 1:
            raise _UsageError(f"--dp-replicate must be a positive number of ranks, got "
                              f"{args.dp_replicate}")
        if args.fsdp_prefetch < 0 or (args.fsdp_prefetch and args.dp_shard == 1):
            raise _UsageError(f"--fsdp-prefetch {args.fsdp_prefetch} needs --dp-shard above 1 and a "
                              "number of units >= 0")
        link = _shared_link(args.shared_link, args.dp_shard * args.dp_replicate)
        if args.profile is not None and args.hf is not None:
            raise _UsageError("--profile plans a saved profile, --hf profiles a model; pass one")
        if args.profile is not None and args.compile:  # its blocks ran as they were profiled: compiled or not
            raise _UsageError("--compile prices the model's blocks compiled, and --profile plans a "
                              "saved profile as it was measured (profile it with compiled=... instead); pass one")
        if args.profile is not None:
            from elbowroom.config import file_kind

            kind = file_kind(args.profile)
            if kind in ("plan", "config"):  # a plan or a run config given as the profile
                use = "elbowroom train --plan" if kind == "plan" else "elbowroom train --config"
                what = "a plan file" if kind == "plan" else "a run config"
                raise _UsageError(f"--profile {args.profile} is {what}, not a profile: it is used as "
                                  f"`{use} {args.profile}`; --profile takes the JSON of a profile "
                                  "(elbowroom.profile(...).to_dict())")
            try:
                prof = profile_from_dict(json.loads(Path(args.profile).read_text()))
            except KeyError as e:
                raise _UsageError(f"{args.profile} is not a profile: it has no {e} entry; give the "
                                  "JSON of elbowroom.profile(...).to_dict() (the bench keeps them with "
                                  "ELBOWROOM_BENCH_PROFILES=DIR)") from None
            except (OSError, ValueError, TypeError) as e:
                raise _UsageError(f"cannot read profile {args.profile!r}: {e}") from None
            from elbowroom.plan.ranks import with_host_memory

            prof = with_host_memory(prof, args.host_bytes)  # a measured profile planned for another host's memory
        else:
            prof = _profile_from_args(args)
        device = prof.machine.device_memory_bytes
        if 0 < device < budget:
            # planning for less than was asked would print a plan "of" a budget it never had: say so instead
            raise _UsageError(f"--budget {_size(budget)} is above the {_size(device)} of "
                              f"{prof.machine.name}; pass --budget {_at_most(device)} or less")
        sharded: dict[str, Any] = {}
        per_host = min(args.dp_shard * args.dp_replicate, 8)
        if args.dp_shard > 1:  # as the trainer plans a rank under FSDP2 (elbowroom.train.planning)
            from elbowroom.plan.ranks import per_rank_profile

            prof = per_rank_profile(prof, args.dp_shard, ranks_per_host=per_host, link=link,
                                    root_apart=float(args.profile is None and _untied(args)),
                                    prefetch=args.fsdp_prefetch)
            sharded = {"weight_layouts": ("fp32", "bf16")}  # no bf16 device copies of fp32 shards
        elif args.dp_replicate > 1:  # as the trainer plans a rank under DDP
            from dataclasses import replace

            from elbowroom.plan.ranks import host_share

            prof = replace(prof, machine=host_share(prof.machine, per_host, link))
            sharded = {"persistent_gradients": True}
        try:
            plan = plan_for(
                prof,
                budget,
                global_batch=args.global_batch,
                precision=args.precision,
                # (under data parallel too: the trainer's fused loss runs in the head's forward, which FSDP2 sees)
                fused_loss_allowed=not args.no_fused_loss,
                grad_clipping=not args.no_clip,
                # (in one process only: the optimizer does not stream under DDP, nor FSDP2's shards)
                stream_allowed=not args.no_stream and args.dp_shard == args.dp_replicate == 1,
                # as the trainer plans: it clips through the optimizer, which sees the gradients already on the host
                gradient_offload_allowed=True,
                **sharded,
            )
        except BudgetError as e:
            raise _UsageError(e.reworded(_HINTS)) from None
        if per_host > 1 and link is None:
            from dataclasses import replace

            plan = replace(plan, notes=(*plan.notes, _LINK_ALONE_NOTE))
        if args.hf is not None:
            from dataclasses import replace

            plan = replace(plan, notes=(*plan.notes, _HF_TIME_NOTE))
    except _UsageError as e:
        print("elbowroom plan: error: " + str(e).replace("\n", " "), file=sys.stderr)
        return 2
    if args.out is not None:
        try:
            _save(plan, Path(args.out))
        except OSError as e:
            print(f"elbowroom plan: error: cannot write --out {args.out!r}: {e.strerror or e}", file=sys.stderr)
            return 2
    try:
        if args.json:
            print(plan.to_json())
        else:
            print(plan.table())
            print(f"\npredicted peak {_size(plan.predicted_peak_bytes)} of {_size(budget)}; "
                  f"step {plan.predicted_step_seconds:.3f} s ({plan.predicted_tokens_per_s:,.0f} tokens/s)")
        sys.stdout.flush()  # here, so that a closed pipe is seen here and not at the interpreter's exit
    except BrokenPipeError:
        # the reader left (``| head``): stop quietly as Unix tools do; stdout goes to devnull so that the
        # interpreter's own flush at exit does not complain again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool that a closed pipe stopped
    except KeyboardInterrupt:
        if args.out is None:
            raise  # (the command line's one line: nothing written)
        print(f"elbowroom plan: interrupted; the plan was saved to {args.out}", file=sys.stderr)
        return 130  # 128 + SIGINT
    return 0


def _save(plan: Any, out: Path) -> None:
    """Save ``plan`` at ``out`` whole or not at all: written beside it under a temporary name, then renamed over it
    (written in place, a Ctrl-C or a full disk mid-write would leave a truncated plan at ``out``)."""
    tmp = out.with_name(f".{out.stem}.tmp-{os.getpid()}{out.suffix}")  # (Plan.save reads the format off the suffix)
    try:
        plan.save(tmp)
        if out.exists():
            shutil.copymode(out, tmp)  # a plan saved over keeps its file's permissions, as a write in place did
        os.replace(tmp, out)
    except BaseException:  # a Ctrl-C included: the temporary file goes, an older plan at --out stands
        tmp.unlink(missing_ok=True)
        raise


_HF_TIME_NOTE = ("times are the device table's, for efficient kernels: a Hugging Face model's own eager layers took "
                 "about 1.7x the predicted time (TinyLlama's shape on an H200: 0.179 s a step against 0.108 "
                 "predicted, 0.121 with its blocks compiled); the memory held within 3%. fit() measures the model "
                 "itself")
_LINK_ALONE_NOTE = ("copies priced at one GPU's link alone: the ranks of a host may share it (4 H200s: 21 GB/s each "
                    "way with all copying, 49 alone); --shared-link gives the shared rates, which the trainer "
                    "measures itself")


def _shared_link(value: str | None, ranks: int) -> tuple[float, float, float] | None:
    """``--shared-link TO,FROM,BOTH`` (GB/s) as bytes/s, or None; a usage error names what is wrong."""
    if value is None:
        return None
    if ranks < 2:
        raise _UsageError("--shared-link is the link of several ranks on one host: pass it with "
                          "--dp-shard or --dp-replicate above 1")
    try:
        rates = tuple(float(x) for x in value.split(","))
    except ValueError:
        rates = ()
    if len(rates) != 3 or not all(0 < r < float("inf") for r in rates):
        raise _UsageError(f"--shared-link takes three positive rates in GB/s, TO,FROM,BOTH (e.g. "
                          f"37,32,19), got {value!r}")
    return rates[0] * 1e9, rates[1] * 1e9, rates[2] * 1e9


_FUSED = "fused_loss=True (elbowroom.linear_cross_entropy) shrinks the head and loss"  # budget_error.FUSED_LOSS_HINT
_HINTS = {
    "global_batch= lets the planner split the batch into micro-batches":
        "--global-batch lets the planner split the batch into micro-batches",
    "precision='bf16' allows bf16 device weights": "--precision bf16 allows bf16 device weights",
    _FUSED: "the fused head and loss (no --no-fused-loss) shrinks the head and loss",
    "(elbowroom plan --host-memory)": "(--host-memory)",
}
"""The planner's hints name ``fit``'s arguments; this command's user has its flags."""
