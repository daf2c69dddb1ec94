"""Training a local Hugging Face causal LM (``--model.hf DIR``): read it without downloading, call it as the
trainer calls its own models.

The directory holds a ``config.json`` and, when the model is pretrained, its weights (``*.safetensors`` or
``pytorch_model.bin``); without weights the model is initialised from the config under the run's seed.
:class:`HFCausalLM` wraps it so that the loop, evaluation, the planner and the recorder see ``ids -> logits``
(``model(input_ids=ids, use_cache=False).logits``: training never builds a KV cache), and so that checkpoints hold
the Hugging Face model's own state_dict, loadable with ``from_pretrained``'s key names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from elbowroom.config import ConfigError

__all__ = ["HFCausalLM", "build_hf_model", "hf_config_meta", "load_hf_config"]


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM called as the trainer's models are: ``forward(ids) -> logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    @property
    def state_dict_owner(self) -> nn.Module:
        """The module whose attribute paths this wrapper's state_dict keys are (torch.distributed.checkpoint
        walks them): the Hugging Face model."""
        return self.model

    # checkpoints hold the Hugging Face model's own keys (no "model." prefix from this wrapper)
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.hf needs the transformers package: pip install transformers") from None
    return transformers


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or (path / "pytorch_model.bin").is_file()


def load_hf_config(path: str) -> Any:
    """The transformers config of the model directory ``path`` (local files only); ConfigError with the fix."""
    d = Path(path)
    if not d.is_dir():
        raise ConfigError(f"model.hf {path} is not a directory; pass a local Hugging Face model directory "
                          "(config.json, and weights if it is pretrained)")
    if not (d / "config.json").is_file():
        raise ConfigError(f"model.hf {path} has no config.json; write one with transformers' "
                          "config.save_pretrained(DIR) or pass the model's own directory")
    transformers = _transformers()
    try:
        return transformers.AutoConfig.from_pretrained(d, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(f"model.hf {path}: transformers cannot read its config.json ({e})") from None


def hf_config_meta(config: Any) -> dict[str, Any]:
    """The config as a checkpoint records it, to compare on resume: flat, JSON's types (so that a saved one compares
    equal), without the path and version it was read with, and marked as a Hugging Face model's."""
    meta = json.loads(json.dumps(config.to_dict(), default=str))
    meta = {k: v for k, v in meta.items() if not k.startswith("_") and k != "transformers_version"}
    return {"source": "hf", **meta}


def hf_vocab_size(config: Any) -> int:
    return int(config.vocab_size)


def hf_max_positions(config: Any) -> int | None:
    """The longest sequence the model's position table holds (None: no table, e.g. RoPE without a limit)."""
    for name in ("n_positions", "max_position_embeddings"):
        v = getattr(config, name, None)
        if isinstance(v, int):
            return v
    return None


def build_hf_model(path: str, config: Any, device: torch.device) -> HFCausalLM:
    """The model of ``path`` on ``device``: its weights when the directory has them, else initialised from ``config``
    (under the global RNG: seed first)."""
    transformers = _transformers()
    d = Path(path)
    try:
        if _has_weights(d):
            model = transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True, dtype=torch.float32)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(f"model.hf {path}: transformers cannot build a causal LM from it ({e})") from None
    return HFCausalLM(model.to(device).train())
