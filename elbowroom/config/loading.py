"""Reading and writing a run's config: TOML files, ``--section.key VALUE`` overrides (``--section.key`` alone sets a
bool to true), a resumed run's saved config, the TOML written back into the run directory, and the ``--help`` text
made from the fields' docstrings."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import re
import sys
import textwrap
import types
import typing
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from elbowroom.config.schema import _OFFLOAD_PLACEMENT, Config, ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


# Short flags users expect from nanoGPT/torchtitan-style CLIs, mapped to their dotted keys.
ALIASES = {
    "steps": "train.steps",
    "log-every": "logging.log_every",
    "log_every": "logging.log_every",
    "seed": "train.seed",
    "device": "train.device",
    "host-budget": "host_budget",
    "cap-memory": "cap_memory",
}


# ---------------------------------------------------------------- field docs
_ROLE = re.compile(r":(?:py:)?(\w+):`([^`]+)`")  # :func:`name`, :class:`~pkg.Name`, :meth:`title <target>`


def _plain_text(doc: str) -> str:
    """A docstring as ``--help`` shows it: a reST role as its target's name (a function's with "()", a ``~`` target's
    last component) and double-backquoted literals without their backquotes."""

    def role(m: re.Match[str]) -> str:
        kind, target = m.groups()
        if target.endswith(">") and "<" in target:  # an explicit title
            return target.split("<", 1)[0].strip()
        if target.startswith("~"):  # shown as its last component
            target = target[1:].rsplit(".", 1)[-1]
        return f"{target}()" if kind in ("func", "meth") else target

    return _ROLE.sub(role, doc).replace("``", "")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings under each field of a dataclass, read from its source, as plain text."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # source unavailable (frozen app): no help text, nothing breaks
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = _plain_text(" ".join(nxt.value.value.split()))
    return docs


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _resolved_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def iter_options(cfg_cls: type = Config) -> list[tuple[str, Any, Any, str]]:
    """Every option as (dotted key, type, default, doc), in declaration order."""
    out = []
    hints = _resolved_types(cfg_cls)
    docs = field_docs(cfg_cls)
    for f in fields(cfg_cls):
        tp = hints[f.name]
        if _is_section(tp):
            sub_hints = _resolved_types(tp)
            sub_docs = field_docs(tp)
            for sf in fields(tp):
                out.append((f"{f.name}.{sf.name}", sub_hints[sf.name], _default(sf), sub_docs.get(sf.name, "")))
        else:
            out.append((f.name, tp, _default(f), docs.get(f.name, "")))
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def type_name(tp: Any) -> str:
    """A short human name of a field type, for help and errors."""
    origin = get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return type_name(args[0]) if len(args) == 1 else "|".join(type_name(a) for a in args)
    if origin is tuple:
        return ",".join("..." if a is Ellipsis else type_name(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


# ---------------------------------------------------------------- value conversion
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null", ""}


def convert(key: str, value: Any, tp: Any) -> Any:
    """Convert a TOML or command-line value to the field type ``tp``; ConfigError on a mismatch."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in _NONE)):
            return None
        inner = [a for a in args if a is not type(None)]
        return convert(key, value, inner[0])
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if origin is tuple:
        args = get_args(tp)
        items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[int, ...]: any number, written 0,3,5
            if not isinstance(items, (list, tuple)):
                raise ConfigError(f"{key} expects values like 0,3,5, got {value!r}")
            return tuple(convert(key, v, args[0]) for v in items)
        if not isinstance(items, (list, tuple)) or len(items) != len(args):
            raise ConfigError(f"{key} expects {len(args)} values like 0.9,0.95, got {value!r}")
        return tuple(convert(key, v, a) for v, a in zip(items, args))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{key} expects true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} expects an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key} expects an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} expects a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} expects a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")  # our own bug if reached


# ---------------------------------------------------------------- building
def _known_keys() -> list[str]:
    return [k for k, *_ in iter_options()]


def _flag(key: str) -> str:
    """The command-line flag of a dotted key as ``--help`` and the README spell it: a top-level key hyphenated
    (``--host-budget``; ``--host_budget`` is read too), a section's key as it is (``--data.batch_size``)."""
    return f"--{key}" if "." in key else f"--{key.replace('_', '-')}"


def _unknown_key(key: str, option: bool = False) -> ConfigError:
    """The error for an unknown key, with the nearest known one. ``option``: ``key`` came from the command line
    (hyphens read as underscores), where a key without a section is nearest a shortcut or top-level flag
    (``--stepz``: ``--steps``), suggested as its flag."""
    import difflib

    names = {k: k for k in _known_keys()}
    if option and "." not in key:
        names = {k: _flag(k) for k in names} | {k.replace("-", "_"): f"--{k}" for k in ALIASES if "_" not in k}
    near = difflib.get_close_matches(key, list(names), n=1)
    hint = f"; did you mean {names[near[0]]}?" if near else "; `elbowroom train --help` lists every option"
    return ConfigError(f"unknown config key {key!r}{hint}")


def build_config(raw: dict[str, Any]) -> Config:
    """Build a validated Config from a nested dict (TOML layout); unknown keys and wrong types raise."""
    hints = _resolved_types(Config)
    top: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in hints:
            raise _unknown_key(name)
        tp = hints[name]
        if _is_section(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"[{name}] must be a table of keys, got {value!r}")
            sub_hints = _resolved_types(tp)
            kwargs = {}
            for k, v in value.items():
                if k not in sub_hints:
                    raise _unknown_key(f"{name}.{k}")
                kwargs[k] = convert(f"{name}.{k}", v, sub_hints[k])
            try:
                top[name] = tp(**kwargs)
            except ConfigError:
                raise
            except (ValueError, TypeError) as e:  # validation that lives in a mechanism's own dataclass
                raise ConfigError(_section_message(name, tp, list(kwargs), str(e))) from None
        else:
            top[name] = convert(name, value, tp)
    return Config(**top)


def _section_message(section: str, tp: type, given: list[str], message: str) -> str:
    """A mechanism's own validation message, made to name the key: ``[offload] bucket_bytes must ...``, or
    ``profile.steps: ...`` when the message does not start with a field name and one key was given."""
    if f"{section}." in message:
        return message
    if message.split(" ", 1)[0] in {f.name for f in fields(tp)} or len(given) != 1:
        return f"[{section}] {message}"
    return f"{section}.{given[0]}: {message}"


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file, with a clear error for a missing, unreadable or malformed one."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass an existing --config FILE.toml") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder; pass a TOML file as --config FILE.toml") from None
    except OSError as e:  # (no read permission, an I/O error)
        raise ConfigError(f"config file {path} cannot be read ({e.strerror or e}); pass a readable --config "
                          "FILE.toml") from None
    except UnicodeDecodeError as e:  # tomllib reads UTF-8 only
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start}); a config is TOML text: save it as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


# ---------------------------------------------------------------- a file given to the wrong option
# each of elbowroom's files: what it is, and how `elbowroom train` takes it
_FILE_KINDS = {
    "plan": ("a plan file", "pass it with --plan {path}"),
    "config": ("a run config", "pass it with --config {path}"),
    "profile": ("a profile", "plan from it with `elbowroom plan --profile {path} --budget SIZE --out plan.toml`, then "
                "pass --plan plan.toml"),
}


def file_kind(path: str | os.PathLike[str]) -> str | None:
    """Which of elbowroom's files ``path`` is, read from its keys: "plan" (``elbowroom plan --out``, a run's
    OUT/plan.toml), "profile" (the JSON ``elbowroom plan --profile`` reads), "config" (a run's config.toml), or None
    (another file, or none at all)."""
    p = Path(path)
    if p.suffix not in (".toml", ".json") or not p.is_file():
        return None  # (a token file may be gigabytes: only these are read)
    try:
        data = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError):  # (TOML's and JSON's decode errors are ValueErrors)
        return None
    if not isinstance(data, dict):
        return None
    if {"blocks", "budget_bytes"} <= data.keys():
        return "plan"
    if {"blocks", "machine", "head"} <= data.keys():
        return "profile"
    hints = _resolved_types(Config)
    if data.keys() <= hints.keys() and any(_is_section(hints[k]) for k in data):
        return "config"
    return None


def wrong_file(option: str, path: str | os.PathLike[str], takes: str) -> str | None:
    """The fix-it message for one of elbowroom's files given to ``option``, which takes ``takes`` (a kind of
    :func:`file_kind`, or words such as "a token file"), or None when the file is that kind or none of elbowroom's.
    """
    kind = file_kind(path)
    if kind is None or kind == takes:
        return None
    what, fix = _FILE_KINDS[kind]
    expected = _FILE_KINDS[takes][0] if takes in _FILE_KINDS else takes
    return f"{option} {path}: {path} is {what}, not {expected}; {fix.format(path=path)}"


def _section_as_option(section: str, value: str | None) -> ConfigError:
    """``--profile FILE`` (an option of ``elbowroom plan``) or ``--train 3``: a section given as an option."""
    first = next(k for k in _known_keys() if k.startswith(f"{section}."))
    message = (f"--{section} is the [{section}] section, not an option: set its keys as --{section}.KEY VALUE "
               f"(such as --{first})")
    kind = file_kind(value) if value is not None else None
    if kind is not None:
        what, fix = _FILE_KINDS[kind]
        message += f"; {value} is {what}: {fix.format(path=value)}"
    return ConfigError(message)


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set ``raw["a"]["b"] = value`` for key "a.b" (creating the table)."""
    parts = key.split(".")
    if len(parts) > 2:
        raise _unknown_key(key)
    if len(parts) == 1:
        raw[key] = value
        return
    section = raw.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise ConfigError(f"{parts[0]} is a section; set its keys as --{parts[0]}.KEY VALUE")
    section[parts[1]] = value


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Parse ``--a.b VALUE``, ``--a.b=VALUE`` and bare ``--a.b`` (true for bools) into (key, value)."""
    hints = {k: tp for k, tp, *_ in iter_options()}
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--") or tok == "--":
            raise ConfigError(f"unexpected argument {tok!r}; options look like --section.key VALUE")
        name, eq, value = tok[2:].partition("=")
        if name in ALIASES:
            name = ALIASES[name]
        name = name.replace("-", "_") if name not in hints else name
        if name not in hints:
            if any(k.startswith(f"{name}.") for k in hints):  # --profile plan.toml
                nxt = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
                raise _section_as_option(name, value if eq else nxt)
            raise _unknown_key(name, option=True)
        tp = hints[name]
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            is_bool = tp is bool
            if is_bool and nxt is not None and not nxt.startswith("--") and nxt.lower() not in _TRUE | _FALSE:
                # (no positional argument follows an option: this was meant as its value)
                raise ConfigError(f"--{tok[2:]} takes true or false (alone: true), got {nxt!r}")
            if is_bool and (nxt is None or nxt.startswith("--")):
                value = "true"
            elif nxt is None or (nxt.startswith("--") and not _looks_numeric(nxt)):
                raise ConfigError(f"{_flag(name)} needs a value ({type_name(tp)})")
            else:
                value = nxt
                i += 1
        out.append((name, value))
        i += 1
    return out


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _load_config_file(path: str) -> dict[str, Any]:
    """The ``--config`` file, refused with the fix when it is another of elbowroom's files (a plan, a profile)."""
    wrong = wrong_file("--config", path, takes="config")
    if wrong is not None:
        raise ConfigError(wrong)
    return load_toml(path)


def resolve(config_file: str | None, overrides: list[str]) -> Config:
    """The config of a run: defaults, then the TOML file, then command-line overrides."""
    raw: dict[str, Any] = _load_config_file(config_file) if config_file else {}
    for key, value in parse_overrides(overrides):
        set_dotted(raw, key, value)
    return build_config(raw)


# What a resumed run may change: how long it runs and how it evaluates, saves, logs and is laid out in memory and
# across devices. Everything else (model, data, optimizer, schedule, seed, precision, ...) is the run's trajectory.
# (train.qat is the trainer's to check, against the checkpoint; --budget and --plan against the run's OUT/plan.toml.)
RESUME_MAY_CHANGE = (
    "out", "resume", "budget", "host_budget", "plan", "cap_memory", "train.steps", "train.eval_every",
    "train.eval_batches", "train.device", "train.gc_every",
    "train.compile", "train.qat", "scheduler.decay_steps", "data.num_workers", "data.pin_memory", "data.cache_dir",
    "checkpoint.", "logging.", "profile.", "activations.", "offload.", "parallel.",
)
# Saved settings a resume does not carry over: the checkpoint keeps the schedule's length (see the trainer's
# schedule_length), the run's OUT/plan.toml its plan, and profiling is asked for per command.
_NOT_CARRIED = ("plan", "scheduler.decay_steps", "profile")


def _may_change(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_MAY_CHANGE)


def resolve_resume(saved: dict[str, Any], where: str, config_file: str | None, overrides: list[str]) -> Config:
    """The config of a resumed run: its saved config, then the options given explicitly (file and command line).

    An explicit option that would change the run's training (anything not in ``RESUME_MAY_CHANGE``) and differs
    from the saved value raises ConfigError naming it: a resumed run continues the exact loss curve.

    Args:
        saved: the run's saved config as a nested dict (its ``OUT/config.toml``).
        where: the file it came from, for messages.
        config_file: this command's ``--config`` file, if any.
        overrides: this command's ``--section.key VALUE`` arguments.
    """
    explicit: dict[str, Any] = _load_config_file(config_file) if config_file else {}
    for key, value in parse_overrides(overrides):
        set_dotted(explicit, key, value)
    base = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items() if k not in _NOT_CARRIED}
    for key in _NOT_CARRIED:
        sec, _, name = key.rpartition(".")
        if sec and isinstance(base.get(sec), dict):
            base[sec].pop(name, None)
    try:
        run_cfg = build_config(base)
    except ConfigError as e:
        raise ConfigError(f"--resume: the run's saved config {where} does not load ({e}); fix or remove it") from None
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in _flat(explicit):
        set_dotted(merged, key, value)
    cfg = build_config(merged)
    changed = []
    for key, _ in _flat(explicit):
        if _may_change(key):
            continue
        now, was = _get(cfg, key), _get(run_cfg, key)
        if now != was:
            changed.append(f"--{key} {_shown(now)} (the run has {_shown(was)})")
    if changed:
        raise ConfigError(
            f"--resume continues the run as saved in {where}, and these would change its training: "
            f"{', '.join(changed)}; drop them to resume, or start a new run with another --out"
        )
    return cfg


def _get(cfg: Config, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config as a plain nested dict (tuples as lists, so it is TOML- and JSON-friendly)."""
    d = dataclasses.asdict(cfg)

    def fix(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return list(x)
        return x

    return fix(d)


def to_toml(cfg: Config) -> str:
    """Serialise a config to TOML (None values are left out: they mean "the default")."""
    # TOML has no null: a None whose default is also None is left out; one that overrides a default
    # is written as "none", which the loader reads back as None.
    defaults = {key: default for key, _, default, _ in iter_options()}
    lines: list[str] = []
    sections: dict[str, list[str]] = {}
    for key, value in _flat(to_dict(cfg)):
        if value is None:
            if defaults[key] is None:
                continue
            value = "none"
        sec, _, name = key.rpartition(".")
        (sections.setdefault(sec, []) if sec else lines).append(f"{name} = {_toml_value(value)}")
    for sec, body in sections.items():
        lines.append(f"\n[{sec}]")
        lines.extend(body)
    return "\n".join(lines) + "\n"


def _flat(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        out.extend(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)])
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _registry_choices() -> dict[str, list[str]]:
    """The values of options whose choices are a registry's keys rather than their type's: ``--help`` lists them as
    the code has them (a docstring's list went stale when gpt2-xl was added)."""
    from elbowroom.models import PRESETS

    return {"model.preset": list(PRESETS)}


def help_text() -> str:
    """Every option with its type, default and docstring, grouped by section."""
    lines = []
    section = None
    choices = _registry_choices()
    for key, tp, default, doc in iter_options():
        if key.startswith("offload.") and key.removeprefix("offload.") in _OFFLOAD_PLACEMENT:
            continue  # set from [optimizer]; refused here
        sec = key.split(".")[0] if "." in key else ""
        if sec != section:
            section = sec
            lines.append(f"\n[{sec}]" if sec else "\n[top level]")
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        lines.append(f"  {_flag(key)} {type_name(tp).upper() if tp is not bool else ''}".rstrip())
        if key in choices:
            doc = f"{doc} One of: {', '.join(choices[key])}."
        lines.append(f"      {doc} (default: {shown})")
    return "\n".join(lines)
