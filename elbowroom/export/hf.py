"""Export to a Hugging Face transformers directory: ``LlamaForCausalLM`` or ``GPT2LMHeadModel``, no custom code.

The directory holds ``config.json`` and safetensors weights (one ``model.safetensors``, or shards
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` above ``max_shard_size``), so
``AutoModelForCausalLM.from_pretrained(PATH)`` loads it. The weights are renamed and reshaped:

- Llama: our fused ``qkv`` is split into ``q_proj``/``k_proj``/``v_proj`` (rows ``[q; k; v]``, heads in
  order within each) and ``w13`` into ``gate_proj``/``up_proj`` (``silu(gate) * up``). Our RoPE already
  uses the rotate-half convention with the same frequencies as transformers' Llama (``x * cos +
  rotate_half(x) * sin`` over the two halves of the head dim), so q and k need no permutation (the one
  Meta's interleaved checkpoints need when converted).
- GPT-2: transformers' ``Conv1D`` stores ``(in, out)``, the transpose of ``nn.Linear``'s weight; the GELU is
  the tanh one (``gelu_new``).
- Tied embeddings: ``lm_head.weight`` is left out and ``tie_word_embeddings`` is set, so transformers ties
  it back on load (safetensors refuses shared tensors anyway).

The logits of the loaded model equal ours within 1e-4 in fp32 (tested for both architectures).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from elbowroom.export._deps import require
from elbowroom.export.source import ExportError
from elbowroom.models import DecoderLM, ModelConfig

__all__ = ["hf_state_dict", "hf_config", "save_hf", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``"5GB"``, ``"500MB"``, ``"2MiB"`` or ``1000000``.

    Raises:
        ExportError: not a size.
    """
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    unit = (m.group(2) or "").upper() if m else ""
    if not m or unit not in _UNITS:
        raise ExportError(f"--max-shard-size must be a size such as 5GB, 500MB or 2MiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def _split_qkv(sd: dict[str, torch.Tensor], prefix: str, dim: int) -> tuple[torch.Tensor, ...]:
    if f"{prefix}.qkv.weight" in sd:
        return tuple(sd[f"{prefix}.qkv.weight"].split(dim, dim=0))
    return tuple(sd[f"{prefix}.{n}.weight"] for n in ("q", "k", "v"))


def _qkv_bias(sd: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    if f"{prefix}.qkv.bias" in sd:
        return sd[f"{prefix}.qkv.bias"]
    return torch.cat([sd[f"{prefix}.{n}.bias"] for n in ("q", "k", "v")])


def hf_state_dict(model: DecoderLM | dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our weights under transformers' names and layouts (contiguous tensors, the tied head left out).

    Args:
        model: the model or its ``state_dict()``.
        cfg: its config (architecture, width, tying).

    Returns:
        ``{hf_name: tensor}`` for ``LlamaForCausalLM`` (llama) or ``GPT2LMHeadModel`` (gpt2).
    """
    sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
    out: dict[str, torch.Tensor] = {}
    d = cfg.dim
    if cfg.arch == "llama":
        out["model.embed_tokens.weight"] = sd["tok_emb.weight"]
        for i in range(cfg.n_layers):
            p, q = f"blocks.{i}", f"model.layers.{i}"
            wq, wk, wv = _split_qkv(sd, f"{p}.attn", d)
            out[f"{q}.self_attn.q_proj.weight"] = wq
            out[f"{q}.self_attn.k_proj.weight"] = wk
            out[f"{q}.self_attn.v_proj.weight"] = wv
            out[f"{q}.self_attn.o_proj.weight"] = sd[f"{p}.attn.o.weight"]
            gate, up = sd[f"{p}.w13.weight"].split(cfg.ffn_dim, dim=0)
            out[f"{q}.mlp.gate_proj.weight"] = gate
            out[f"{q}.mlp.up_proj.weight"] = up
            out[f"{q}.mlp.down_proj.weight"] = sd[f"{p}.w2.weight"]
            out[f"{q}.input_layernorm.weight"] = sd[f"{p}.attn_norm.weight"]
            out[f"{q}.post_attention_layernorm.weight"] = sd[f"{p}.mlp_norm.weight"]
        out["model.norm.weight"] = sd["norm.weight"]
    elif cfg.arch == "gpt2":
        out["transformer.wte.weight"] = sd["tok_emb.weight"]
        out["transformer.wpe.weight"] = sd["pos_emb.weight"]
        for i in range(cfg.n_layers):
            p, q = f"blocks.{i}", f"transformer.h.{i}"
            out[f"{q}.ln_1.weight"], out[f"{q}.ln_1.bias"] = sd[f"{p}.attn_norm.weight"], sd[f"{p}.attn_norm.bias"]
            # Conv1D keeps (in, out): the transpose of nn.Linear's (out, in)
            out[f"{q}.attn.c_attn.weight"] = torch.cat(_split_qkv(sd, f"{p}.attn", d)).t()
            out[f"{q}.attn.c_attn.bias"] = _qkv_bias(sd, f"{p}.attn")
            out[f"{q}.attn.c_proj.weight"] = sd[f"{p}.attn.o.weight"].t()
            out[f"{q}.attn.c_proj.bias"] = sd[f"{p}.attn.o.bias"]
            out[f"{q}.ln_2.weight"], out[f"{q}.ln_2.bias"] = sd[f"{p}.mlp_norm.weight"], sd[f"{p}.mlp_norm.bias"]
            out[f"{q}.mlp.c_fc.weight"] = sd[f"{p}.fc.weight"].t()
            out[f"{q}.mlp.c_fc.bias"] = sd[f"{p}.fc.bias"]
            out[f"{q}.mlp.c_proj.weight"] = sd[f"{p}.proj.weight"].t()
            out[f"{q}.mlp.c_proj.bias"] = sd[f"{p}.proj.bias"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = sd["norm.weight"], sd["norm.bias"]
    else:
        raise ExportError(f"unknown model architecture {cfg.arch!r}; the hf export knows 'llama' and 'gpt2'")
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    return {k: v.detach().contiguous() for k, v in out.items()}


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32):
    """The transformers config (``LlamaConfig`` or ``GPT2Config``) of a model of shape ``cfg``.

    Raises:
        ExportError: an unknown architecture, or transformers is not installed.
    """
    transformers = require("transformers", "the hf export")
    dtype_name = str(dtype).removeprefix("torch.")
    if cfg.arch == "llama":
        return transformers.LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.dim,
            intermediate_size=cfg.ffn_dim,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=0.0,
            tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=None,
            eos_token_id=None,
            dtype=dtype_name,
            architectures=["LlamaForCausalLM"],
        )
    if cfg.arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.max_seq_len,
            n_embd=cfg.dim,
            n_layer=cfg.n_layers,
            n_head=cfg.n_heads,
            n_inner=cfg.ffn_dim,
            activation_function="gelu_new",  # the tanh approximation, as our GPT2Block
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=0.0,  # our attention dropout is on the attention output, counted in resid_pdrop
            layer_norm_epsilon=cfg.norm_eps,
            tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=None,
            eos_token_id=None,
            dtype=dtype_name,
            architectures=["GPT2LMHeadModel"],
        )
    raise ExportError(f"unknown model architecture {cfg.arch!r}; the hf export knows 'llama' and 'gpt2'")


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Greedy shards in name order, each at most ``limit`` bytes unless one tensor alone is larger."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def save_hf(model: DecoderLM, cfg: ModelConfig, out: str | os.PathLike[str], *,
            max_shard_size: int | str = "5GB", dtype: torch.dtype = torch.float32) -> list[Path]:
    """Write ``config.json`` and safetensors weights into the (existing, empty) directory ``out``.

    Args:
        model: the model to export.
        cfg: its config.
        out: the directory (see :func:`elbowroom.export.source.staged_output` for writing it atomically).
        max_shard_size: bytes per weight file (``"5GB"``, ``"500MB"``, an int); above it the weights are
            sharded with a ``model.safetensors.index.json``.
        dtype: weight dtype in the files (fp32 keeps the logits within 1e-4 of ours).

    Returns:
        The weight files written.
    """
    st = require("safetensors.torch", "the hf export")
    limit = parse_size(max_shard_size)
    out = Path(out)
    hf_config(cfg, dtype).save_pretrained(out)
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in hf_state_dict(model, cfg).items()}
    shards = _shards(tensors, limit)
    files: list[Path] = []
    if len(shards) == 1:
        files.append(out / "model.safetensors")
        st.save_file(shards[0], files[0], metadata={"format": "pt"})
        return files
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        st.save_file(shard, out / name, metadata={"format": "pt"})
        files.append(out / name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files

