"""Reference decoder LMs (Llama- and GPT-2-shaped), their named presets and FLOP counts."""

from elbowroom.models.decoder import (
    PRESETS,
    DecoderLM,
    GPT2Block,
    LlamaBlock,
    ModelConfig,
    build_model,
    count_params,
    flops_per_token,
)

__all__ = [
    "PRESETS",
    "DecoderLM",
    "GPT2Block",
    "LlamaBlock",
    "ModelConfig",
    "build_model",
    "count_params",
    "flops_per_token",
]
