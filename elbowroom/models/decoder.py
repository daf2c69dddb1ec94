"""Reference decoder LMs: a Llama-shaped one and a GPT-2-shaped one, built from one config.

Both expose their repeated blocks as ``model.blocks`` (an ``nn.ModuleList``, in forward order) so that
memory policies (recompute, offload) can be applied block by block. ``forward(idx)`` returns logits; the
loss lives in the trainer so that it can be normalised by the tokens of a whole optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from elbowroom.ops.linear_cross_entropy import linear_cross_entropy
from elbowroom.ops.rope import RotaryEmbedding
from elbowroom.ops.swiglu import swiglu

Arch = Literal["llama", "gpt2"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a reference decoder. Use :func:`ModelConfig.from_preset` for the named sizes."""

    arch: Arch = "llama"
    """Block family: "llama" (RMSNorm, RoPE, SwiGLU, no bias) or "gpt2" (LayerNorm, learned positions, GELU)."""
    vocab_size: int = 256
    """Vocabulary size; 256 is the byte-level default corpus."""
    dim: int = 128
    """Model (residual stream) width."""
    n_layers: int = 4
    """Number of repeated blocks."""
    n_heads: int = 4
    """Attention heads; must divide dim."""
    ffn_dim: int = 384
    """Hidden width of the MLP (per branch for SwiGLU)."""
    max_seq_len: int = 128
    """Longest sequence the model accepts (learned positions and RoPE tables are sized by it)."""
    dropout: float = 0.0
    """Dropout on attention output, MLP output and embeddings (GPT-2 style); 0 disables it."""
    fused_qkv: bool = True
    """One matmul for q, k and v (faster) instead of three."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm / LayerNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency (llama only)."""
    tie_embeddings: bool = False
    """Share the token embedding with the output projection."""

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "gpt2"):
            raise ValueError(f"model arch must be 'llama' or 'gpt2', got {self.arch!r}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"model dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2 and self.arch == "llama":
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for RoPE")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> ModelConfig:
        """The named preset with fields replaced by ``overrides`` (None values are ignored)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelConfig] = {
    # trains on two CPU cores in about a minute on the byte-level default corpus
    "tiny": ModelConfig(),
    # the workloads of DESIGN.md (vocab 32000, Llama-shaped by default)
    "w1": ModelConfig(vocab_size=32000, dim=2048, n_layers=24, n_heads=16, ffn_dim=5632, max_seq_len=4096),
    "w2": ModelConfig(vocab_size=32000, dim=4096, n_layers=8, n_heads=32, ffn_dim=14336, max_seq_len=8192),
    "7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=4096),
    # a GPT-2-XL-shaped model (1.6B, LayerNorm, learned positions, GELU, dropout): the planner's unseen shape
    "gpt2-xl": ModelConfig(arch="gpt2", vocab_size=50304, dim=1600, n_layers=48, n_heads=25, ffn_dim=6400,
                           max_seq_len=1024, dropout=0.1),
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        """Heads this module computes: all of them, or this rank's share under tensor parallel."""
        self.head_dim = cfg.head_dim
        self.fused_qkv = cfg.fused_qkv
        if cfg.fused_qkv:
            self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=bias)
        else:
            self.q = nn.Linear(cfg.dim, cfg.dim, bias=bias)
            self.k = nn.Linear(cfg.dim, cfg.dim, bias=bias)
            self.v = nn.Linear(cfg.dim, cfg.dim, bias=bias)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding | None) -> torch.Tensor:
        b, s, _ = x.shape
        shape = (b, s, self.n_heads, self.head_dim)
        if self.fused_qkv:
            qkv = self.qkv(x).view(b, s, 3, *shape[2:])
            if rope is not None:
                # q and k rotate in one pass; v is copied out so that the (b, s, 3d) qkv output is freed
                # here instead of being kept alive for backward through attention's saved view of v.
                qk = rope(qkv[:, :, :2])
                q, k, v = qk[:, :, 0], qk[:, :, 1], qkv[:, :, 2].contiguous()
            else:
                q, k, v = qkv.unbind(2)
        else:
            q, k, v = self.q(x).view(shape), self.k(x).view(shape), self.v(x).view(shape)
            if rope is not None:
                q, k = rope(q), rope(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, h, s, hd)
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        out = self.o(a.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))
        return F.dropout(out, p, self.training) if p else out


class LlamaBlock(nn.Module):
    """Pre-norm block: RMSNorm -> attention (RoPE) -> residual; RMSNorm -> SwiGLU -> residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg, bias=False)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        # gate and up projections fused in one matmul
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.dropout = cfg.dropout
        self.rope: RotaryEmbedding | None = None  # set by the model; shared, not a submodule
        self.fused_swiglu = True
        """SwiGLU through :func:`elbowroom.ops.swiglu.swiglu` (fused on CUDA) instead of chunk, silu, mul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), self.rope)
        gu = self.w13(self.mlp_norm(x))
        if self.fused_swiglu:
            h = self.w2(swiglu(gu))  # one kernel per direction on CUDA (elbowroom.ops.swiglu)
        else:
            g, u = gu.chunk(2, dim=-1)
            h = self.w2(F.silu(g) * u)
        if self.dropout and self.training:
            h = F.dropout(h, self.dropout, True)
        return x + h


class GPT2Block(nn.Module):
    """Pre-norm block: LayerNorm -> attention -> residual; LayerNorm -> GELU MLP -> residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg, bias=True)
        self.mlp_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.fc = nn.Linear(cfg.dim, cfg.ffn_dim)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), None)
        h = self.proj(F.gelu(self.fc(self.mlp_norm(x)), approximate="tanh"))
        if self.dropout and self.training:
            h = F.dropout(h, self.dropout, True)
        return x + h


class OutputHead(nn.Linear):
    """The output head: logits, or with ``targets`` the fused head and cross-entropy summed over the target tokens
    (:func:`~elbowroom.ops.linear_cross_entropy`: chunk by chunk, the logits never whole).

    The fused loss runs inside this module's forward so that a wrapper that hooks the module sees its weight used:
    FSDP2 all-gathers the head's weight only around its own forward and backward, and an optimizer that waits for
    offloaded weights in forward pre-hooks waits for it here.
    """

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, targets, reduction="sum")


class DecoderLM(nn.Module):
    """Token embedding -> ``blocks`` -> final norm -> output projection (logits)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        if cfg.arch == "gpt2":
            self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
            self.blocks = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layers))
            self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
            self.rope = None
        else:
            self.pos_emb = None
            self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
            self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
            for blk in self.blocks:
                # a plain attribute: blocks share one table without registering it n_layers times
                object.__setattr__(blk, "rope", self.rope)
            self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = OutputHead(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 / Llama style init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers)."""
        std = 0.02
        resid_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                else:
                    nn.init.ones_(p)
            elif name.endswith(("attn.o.weight", "w2.weight", "proj.weight")):
                nn.init.normal_(p, 0.0, resid_std)
            else:
                nn.init.normal_(p, 0.0, std)
        if self.rope is not None and self.rope.cos.device.type != "meta":
            fresh = RotaryEmbedding(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta)
            self.rope.cos.copy_(fresh.cos)
            self.rope.sin.copy_(fresh.sin)
            self.rope._cast.clear()

    def forward(self, idx: torch.Tensor, head: bool = True) -> torch.Tensor:
        """Logits ``(b, s, vocab)`` for token ids ``(b, s)``; with ``head=False`` the hidden states the head would
        read (:meth:`hidden_states`), through ``forward`` so that a wrapper such as DDP or FSDP2 sees the call. The
        fused loss then calls the head itself: ``model.output(h, targets)`` (:class:`OutputHead`)."""
        h = self.hidden_states(idx)
        return self.output(h) if head else h

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """The normalised last hidden states ``(b, s, dim)``, the output head's input (for a fused head and
        loss such as :func:`elbowroom.activations.linear_cross_entropy`)."""
        s = idx.shape[1]
        if s > self.config.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq_len {self.config.max_seq_len}")
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(s, device=idx.device))
        if self.config.dropout and self.training:
            x = F.dropout(x, self.config.dropout, True)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


def build_model(cfg: ModelConfig, device: torch.device | str | None = None) -> DecoderLM:
    """Build (and initialise) a reference model; ``device="meta"`` builds it without memory."""
    with torch.device(device) if device is not None else _nullcontext():
        return DecoderLM(cfg)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def count_params(model: nn.Module, *, exclude_embeddings: bool = False) -> int:
    """Number of parameters (shared ones once); optionally without token/position embeddings."""
    seen: set[int] = set()
    n = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embeddings and name.startswith(("tok_emb.", "pos_emb.")):
            continue
        n += p.numel()
    return n


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6 * N_matmul + 6 * n_layers * seq_len * dim.

    N_matmul counts every parameter that takes part in a matmul (blocks and the output head, not the
    embedding lookups), the PaLM / nanoGPT convention. The attention term is the causal one (half of
    PaLM's 12 * L * s * d, since half the score matrix is masked), the convention of the peers' numbers
    in DESIGN.md, so model TFLOP/s compare one to one.
    """
    d, f, L = cfg.dim, cfg.ffn_dim, cfg.n_layers
    if cfg.arch == "llama":
        per_block = 4 * d * d + 3 * d * f
    else:
        per_block = 4 * d * d + 2 * d * f
    n_matmul = L * per_block + d * cfg.vocab_size
    return 6 * n_matmul + 6 * L * seq_len * d
