"""What every export starts from: a trained model read from a run directory or one checkpoint, its
validation split, and an output path that is written all at once or not at all.

A source is either a run directory (``RUN/checkpoints/step_*``: the newest checkpoint that verifies is
used, corrupt ones are skipped with a warning as on ``--resume``) or one checkpoint directory
(``step_NNNNNNNN/{state.pt,meta.json}``, a run on several processes' sharded torch.distributed.checkpoint
directory, or an export that writes the same layout, such as ``prune``),
which must verify. The validation loss is measured on the run's own validation split (the run's config
is in the checkpoint's metadata), the first ``eval_batches`` batches in order, as the trainer measures it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elbowroom.models import DecoderLM, ModelConfig, build_model
from elbowroom.train.checkpoint import SHARDED_FORMAT, CheckpointManager

log = logging.getLogger(__name__)

__all__ = ["ExportError", "Source", "load_source", "validation_batches", "validation_loss", "staged_output",
           "dir_size"]


class ExportError(ValueError):
    """An export cannot be done as asked (bad checkpoint, unknown architecture, unsupported option); the
    message says why and what to do. The CLI prints it and exits with code 2, writing nothing."""


@dataclass
class Source:
    """A trained model read back from a checkpoint."""

    model: DecoderLM
    """The model in fp32, in eval mode, on the CPU (a ``--model.hf`` run's: the trainer's wrapper of it)."""
    config: ModelConfig | None
    """Its shape (None for a ``--model.hf`` run's model: :attr:`hf` is its own)."""
    meta: dict[str, Any]
    """The checkpoint's metadata (``step``, ``model``, ``config``: the run's resolved config)."""
    path: Path
    """The checkpoint directory read."""
    hf: Any = None
    """The transformers model of a ``--model.hf`` run (its checkpoints hold that model's own state_dict)."""

    @property
    def step(self) -> int:
        return int(self.meta.get("step", 0))


def _model_config(meta: dict[str, Any], path: Path) -> ModelConfig:
    raw = meta.get("model")
    if not isinstance(raw, dict):
        raise ExportError(f"{path}: meta.json has no model config under 'model'; is this an elbowroom checkpoint?")
    arch = raw.get("arch")
    if arch not in ("llama", "gpt2"):
        raise ExportError(f"{path}: unknown model architecture {arch!r}; elbowroom exports 'llama' and 'gpt2'")
    try:
        return ModelConfig(**raw)
    except (TypeError, ValueError) as e:
        raise ExportError(f"{path}: the model config in meta.json is not valid ({e})") from None


def _sharded_weights(ckpt: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full weights from a sharded checkpoint, read in this one process (DCP gathers the shards of
    every rank that wrote them; the optimizer state in the same files is not read)."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    try:
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    except Exception as e:  # noqa: BLE001 - DCP's errors name missing keys or unreadable shards
        raise ExportError(f"{ckpt}: the sharded checkpoint's weights do not fit the model config in meta.json "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return state["model"]


def load_source(path: str | os.PathLike[str]) -> Source:
    """Read a trained model from a run directory or a checkpoint directory.

    Args:
        path: ``RUN`` (its newest checkpoint that verifies) or ``RUN/checkpoints/step_NNNNNNNN``.

    Returns:
        The :class:`Source`, its model in fp32 eval mode on the CPU.

    Raises:
        ExportError: nothing there, a checkpoint that does not verify, or a model it cannot rebuild.
    """
    p = Path(path)
    if (p / "meta.json").is_file() or (p / "state.pt").is_file():
        manager = CheckpointManager(p.parent)
        try:
            meta = manager.validate(p)
        except ValueError as e:
            raise ExportError(f"checkpoint {p} does not verify: {e}") from None
        state = {"sharded": True} if meta.get("format") == SHARDED_FORMAT else torch.load(
            p / "state.pt", map_location="cpu", weights_only=True)
        ckpt = p
    elif p.is_dir():
        run_ckpts = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        loaded = CheckpointManager(run_ckpts).load_latest()
        if loaded is None:
            raise ExportError(f"{p} holds no checkpoint that verifies (looked for {run_ckpts}/step_NNNNNNNN)")
        meta, state, ckpt = loaded.meta, loaded.state, loaded.path
    else:
        raise ExportError(f"{p} does not exist; give a run directory or a checkpoint directory step_NNNNNNNN")
    raw = meta.get("model")
    if isinstance(raw, dict) and raw.get("source") == "hf":
        return _hf_source(raw, meta, state, ckpt)
    cfg = _model_config(meta, ckpt)
    model = _load_weights(build_model(cfg), state, ckpt)
    return Source(model=model.float().eval(), config=cfg, meta=meta, path=ckpt)


def _load_weights(model: nn.Module, state: Any, ckpt: Path) -> nn.Module:
    """``model`` with the checkpoint's weights: its ``state.pt``'s, or a sharded checkpoint's (a run on several
    processes: torch.distributed.checkpoint)."""
    if isinstance(state, dict) and state.get("sharded"):
        weights = _sharded_weights(ckpt, model)
    else:
        weights = state.get("model") if isinstance(state, dict) else None
        if not isinstance(weights, dict):
            raise ExportError(f"{ckpt}: state.pt holds no model weights under 'model'")
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise ExportError(f"{ckpt}: the weights do not fit the model config in meta.json ({e})") from None
    return model


def _hf_source(raw: dict[str, Any], meta: dict[str, Any], state: Any, ckpt: Path) -> Source:
    """A ``--model.hf`` run's model: rebuilt from the config its checkpoint records, with the weights it holds."""
    try:
        import transformers
    except ImportError:
        raise ExportError(f"{ckpt} holds a Hugging Face model (--model.hf); reading it needs transformers: pip "
                          "install transformers") from None
    from elbowroom.train.hf import HFCausalLM

    fields = {k: v for k, v in raw.items() if k != "source"}
    try:
        config = transformers.AutoConfig.for_model(**fields)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{ckpt}: transformers cannot rebuild the model its meta.json records ({e})") from None
    model = _load_weights(model, state, ckpt).float().eval()
    return Source(model=HFCausalLM(model).eval(), config=None, meta=meta, path=ckpt, hf=model)


def validation_batches(
    source: Source, num_batches: int | None = None, *, cache_dir: str | None = None
) -> list[dict[str, Any]]:
    """The run's validation batches (the trainer's eval batches), or [] when the run config is not known.

    Args:
        source: the checkpoint, whose metadata holds the run's config.
        num_batches: how many batches; the run's ``train.eval_batches`` when None.
        cache_dir: where the built-in corpus is cached, when the run did not name one (the CLI passes
            ``$ELBOWROOM_CACHE``).

    Returns:
        Batches ``{"input_ids", "targets", "num_tokens"}`` on the CPU.
    """
    from elbowroom.config import ConfigError, build_config
    from elbowroom.train import data as D

    raw = source.meta.get("config")
    if not isinstance(raw, dict):
        return []
    try:
        cfg = build_config(raw)
    except ConfigError as e:
        log.warning("validation loss skipped: the run config in %s does not load (%s)", source.path, e)
        return []
    cache_dir = cfg.data.cache_dir or cache_dir
    try:
        tokens = D.load_tokens(cfg.data.path, cache_dir=cache_dir)
    except (OSError, ValueError) as e:
        log.warning("validation loss skipped: the run's data %s is not readable here (%s)", cfg.data.path, e)
        return []
    _, val = D.split(tokens, cfg.data.val_fraction)
    name = f"the validation split of {tokens.path}"
    if cfg.data.variable_length and tokens.eos_id is not None:
        ds, collate = D.DocumentDataset(val, cfg.data.seq_len, tokens.eos_id, name=name), D.pad_collate
    else:
        ds, collate = D.ChunkDataset(val, cfg.data.seq_len, name=name), D.collate
    n = cfg.train.eval_batches if num_batches is None else num_batches
    loader = D.build_eval_loader(ds, batch_size=cfg.data.batch_size, num_batches=max(1, n), collate_fn=collate)
    return list(loader)


@torch.no_grad()
def validation_loss(model: nn.Module | Any, batches: list[dict[str, Any]],
                    device: torch.device | str = "cpu") -> float | None:
    """Mean cross-entropy per target token of ``model(input_ids)`` over ``batches`` (None when empty).

    Args:
        model: anything called as ``model(input_ids) -> logits`` (an ``nn.Module``, a torch.export module,
            an ONNX Runtime session wrapped by :func:`elbowroom.export.onnx_export.run_onnx`).
        batches: from :func:`validation_batches`.
        device: where the inputs go (the model's device).
    """
    if isinstance(model, nn.Module) and not isinstance(model, torch.fx.GraphModule):
        model.eval()  # (an exported program's module refuses eval(); it has no train-mode behaviour anyway)
    total, n = 0.0, 0
    for b in batches:
        logits = model(b["input_ids"].to(device)).float().cpu()
        # .item(): a host sync per batch, what an evaluation is for
        total += F.cross_entropy(logits.flatten(0, 1), b["targets"].flatten(), reduction="sum").item()
        n += b["num_tokens"]
    return total / n if n else None


def dir_size(path: str | os.PathLike[str]) -> int:
    """Bytes of the files under ``path`` (or of the file itself)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


@contextlib.contextmanager
def staged_output(out: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary directory beside ``out`` that becomes ``out`` when the block ends without an error.

    Nothing is ever written at ``out`` itself before that rename, so a failed export leaves no partial
    result under the real name (and an existing ``out`` is refused up front, never overwritten).

    Raises:
        ExportError: ``out`` exists already.
    """
    final = Path(out)
    if final.exists():
        raise ExportError(f"{final} exists; choose a new --out path or remove it first")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, final)
