"""Config as a tree of dataclasses: loaded from TOML, overridden from the command line.

Every field is typed and carries a one-line docstring (the string literal under it), which
``elbowroom train --help`` shows. Values are checked in ``__post_init__`` with a message that names the
field and the fix. Overrides are ``--section.key VALUE`` (``--section.key`` alone sets a bool to true).

- :mod:`elbowroom.config.schema`: the sections and :class:`Config`, which composes the mechanisms' own configs;
- :mod:`elbowroom.config.loading`: TOML files, overrides, resumed runs, the TOML written back and ``--help``.
"""

from elbowroom.config.loading import (
    ALIASES,
    RESUME_MAY_CHANGE,
    build_config,
    convert,
    field_docs,
    file_kind,
    help_text,
    iter_options,
    load_toml,
    parse_overrides,
    resolve,
    resolve_resume,
    set_dotted,
    to_dict,
    to_toml,
    type_name,
    wrong_file,
)
from elbowroom.config.schema import (
    CheckpointSection,
    Config,
    ConfigError,
    DataSection,
    DistillSection,
    LoggingSection,
    ModelSection,
    OptimizerSection,
    SchedulerSection,
    TrainSection,
    memory_overrides,
)

__all__ = [
    "ALIASES", "RESUME_MAY_CHANGE", "CheckpointSection", "Config", "ConfigError", "DataSection", "DistillSection",
    "LoggingSection", "ModelSection", "OptimizerSection", "SchedulerSection", "TrainSection", "build_config",
    "convert", "field_docs", "file_kind", "help_text", "iter_options", "load_toml", "memory_overrides",
    "parse_overrides", "resolve", "resolve_resume", "set_dotted", "to_dict", "to_toml", "type_name", "wrong_file",
]
