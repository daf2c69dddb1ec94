"""``--train.qat int8|int4``: which scheme a run trains with, and its model prepared for it.

The model's block ``Linear`` layers are swapped for torchao's fake-quantised ones
(:func:`elbowroom.export.qat.prepare_qat`) right after the model is built, before the memory engines and the
optimizer see it; the swapped layers keep their parameters and the state_dict its keys, so checkpoints are those
of the float model. The scheme is recorded with the run's config (``config.toml`` and every checkpoint's
metadata): ``--resume`` prepares the model again with the checkpoint's scheme, and ``elbowroom export quantize
RUN --method qat`` converts the trained weights with it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from torch import nn

from elbowroom.config import Config, ConfigError

if TYPE_CHECKING:
    from elbowroom.train.checkpoint import Loaded

log = logging.getLogger("elbowroom.train")

__all__ = ["resolve_qat", "apply_qat"]


def resolve_qat(cfg: Config, loaded: Loaded | None) -> Config:
    """The run's config with the QAT scheme it trains with: a resumed run keeps its checkpoint's.

    Raises:
        ConfigError: ``--train.qat`` differs from the resumed checkpoint's scheme, or torchao is missing.
    """
    if loaded is not None:
        from elbowroom.export.qat import run_scheme

        saved = run_scheme(loaded.meta)
        if cfg.train.qat is None and saved is not None:
            log.info("resuming a QAT run: the model is prepared with its scheme, %s", saved)
            cfg = replace(cfg, train=replace(cfg.train, qat=saved))  # Config's own checks run again
        elif cfg.train.qat != saved:
            was = f"--train.qat {saved}" if saved else "without --train.qat"
            raise ConfigError(f"checkpoint {loaded.path} was trained {was}; resume it the same way, or start a new "
                              "run with another --out")
    if cfg.train.qat is not None:
        from elbowroom.export._deps import require
        from elbowroom.export.source import ExportError

        try:
            require("torchao.quantization", "train.qat")
        except ExportError as e:  # names pip install 'elbowroom[export]'
            raise ConfigError(str(e)) from None
    return cfg


def apply_qat(model: nn.Module, cfg: Config) -> None:
    """Swap the model's block ``Linear`` layers for fake-quantised ones when ``--train.qat`` asks (in place).

    Raises:
        ConfigError: a layer the scheme cannot quantise (int4 groups 32 input features).
    """
    if cfg.train.qat is None:
        return
    from elbowroom.export.qat import prepare_qat
    from elbowroom.export.source import ExportError

    try:
        prepare_qat(model, cfg.train.qat)
    except ExportError as e:
        raise ConfigError(f"train.qat {cfg.train.qat}: {e}; use --train.qat int8 or other --model widths") from None
