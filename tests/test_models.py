"""Reference models: shapes, parameter counts of every preset, FLOPs per token, blocks exposed."""

from __future__ import annotations

import pytest
import torch

from elbowroom.models import PRESETS, ModelConfig, build_model, count_params, flops_per_token


def expected_params(cfg: ModelConfig) -> int:
    """Parameter count from the architecture, written out independently of the modules."""
    d, f, L, V = cfg.dim, cfg.ffn_dim, cfg.n_layers, cfg.vocab_size
    if cfg.arch == "llama":
        block = 4 * d * d + 3 * d * f + 2 * d  # qkv+o, w13+w2, two RMSNorm weights
        rest = V * d + V * d + d  # embedding, head, final norm
    else:
        block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d  # attention (+biases), MLP (+biases), 2 LayerNorms
        rest = V * d + cfg.max_seq_len * d + V * d + 2 * d
    return L * block + rest


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_parameter_counts(preset: str, arch: str) -> None:
    cfg = ModelConfig.from_preset(preset, arch=arch)
    model = build_model(cfg, device="meta")
    assert count_params(model) == expected_params(cfg)
    assert len(model.blocks) == cfg.n_layers


def test_published_sizes() -> None:
    # the 7b preset is the Llama-2-7B shape: 6.74B parameters
    assert count_params(build_model(ModelConfig.from_preset("7b"), device="meta")) == 6_738_415_616
    w1 = ModelConfig.from_preset("w1")
    assert (w1.dim, w1.n_layers, w1.n_heads, w1.ffn_dim, w1.vocab_size) == (2048, 24, 16, 5632, 32000)
    w2 = ModelConfig.from_preset("w2")
    assert (w2.dim, w2.n_layers, w2.n_heads, w2.ffn_dim) == (4096, 8, 32, 14336)


def test_flops_per_token_convention() -> None:
    cfg = ModelConfig.from_preset("w1")
    model = build_model(cfg, device="meta")
    n_matmul = count_params(model, exclude_embeddings=True) - (2 * cfg.n_layers + 1) * cfg.dim  # minus norm weights
    assert flops_per_token(cfg, 4096) == 6 * n_matmul + 6 * cfg.n_layers * 4096 * cfg.dim


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("fused", [True, False])
def test_forward_shapes_and_causality(arch: str, fused: bool) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch=arch, fused_qkv=fused, dim=32, n_heads=4, ffn_dim=64, n_layers=2))
    idx = torch.randint(0, 256, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 256)
    # changing a later token never changes earlier logits
    idx2 = idx.clone()
    idx2[:, 10] = (idx2[:, 10] + 1) % 256
    torch.testing.assert_close(model(idx2)[:, :10], logits[:, :10])
    assert not torch.allclose(model(idx2)[:, 10:], logits[:, 10:])


def test_dropout_only_in_training() -> None:
    model = build_model(ModelConfig(arch="gpt2", dropout=0.5, dim=32, n_heads=4, ffn_dim=64, n_layers=2))
    idx = torch.randint(0, 256, (2, 8))
    model.eval()
    torch.testing.assert_close(model(idx), model(idx))
    model.train()
    assert not torch.allclose(model(idx), model(idx))


def test_bad_model_config() -> None:
    with pytest.raises(ValueError, match="divisible by n_heads"):
        ModelConfig(dim=30, n_heads=4)
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.from_preset("huge")
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        build_model(ModelConfig(max_seq_len=8))(torch.zeros(1, 9, dtype=torch.long))


def test_rope_scores_depend_only_on_relative_position() -> None:
    from elbowroom.ops.rope import RotaryEmbedding

    rope = RotaryEmbedding(16, 32, 10000.0)
    q, k = torch.randn(16), torch.randn(16)

    def score(m: int, n: int) -> torch.Tensor:
        qs = torch.zeros(1, 32, 16)
        ks = torch.zeros(1, 32, 16)
        qs[0, m], ks[0, n] = q, k
        return rope(qs)[0, m] @ rope(ks)[0, n]

    torch.testing.assert_close(score(5, 2), score(20, 17))
    torch.testing.assert_close(score(0, 0), q @ k)  # position 0 is not rotated
    assert not torch.allclose(score(5, 2), score(5, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_matches_eager_forward_and_backward(dtype: torch.dtype) -> None:
    from elbowroom.ops.rope import RotaryEmbedding, _fused_applies, rotate_eager

    rope = RotaryEmbedding(128, 512, 10000.0).cuda()
    qkv = torch.randn(2, 512, 3, 16, 128, device="cuda", dtype=dtype, requires_grad=True)
    x = qkv[:, :, :2]  # the strided q,k view the model rotates
    assert _fused_applies(x)
    y = rope(x)
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, qkv, g)
    xf = qkv.detach().double()[:, :, :2].requires_grad_()
    ref = rotate_eager(xf, rope.cos.double()[:512], rope.sin.double()[:512])
    (dref,) = torch.autograd.grad(ref, xf, g.double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert ((y.double() - ref).norm() / ref.norm()) < tol
    assert ((dx[:, :, :2].double() - dref).norm() / dref.norm()) < tol
    assert dx[:, :, 2].abs().max() == 0  # v untouched by the rotation's gradient


def test_swiglu_flag_selects_the_same_function() -> None:
    # the fused SwiGLU path (eager off CUDA) and the plain chunk/silu/mul give the same block output and grads
    torch.manual_seed(0)
    model = build_model(ModelConfig(dim=32, n_heads=4, ffn_dim=48, n_layers=2))
    idx = torch.randint(0, 256, (2, 16))
    out = {}
    for fused in (True, False):
        for blk in model.blocks:
            blk.fused_swiglu = fused
        model.zero_grad()
        model(idx).float().square().mean().backward()
        out[fused] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("f", [11008, 100])
def test_fused_swiglu_matches_eager_forward_and_backward(dtype: torch.dtype, f: int) -> None:
    import torch.nn.functional as F

    from elbowroom.ops.swiglu import _fused_applies, swiglu

    # a (b, s, 2f) projection output and an odd element count (the kernel's last block is partial)
    gu = torch.randn(3, 37, 2 * f, device="cuda", dtype=dtype, requires_grad=True)
    assert _fused_applies(gu)
    h = swiglu(gu)
    dh = torch.randn(3, 37, 2 * f, device="cuda", dtype=dtype)[..., ::2]  # a strided incoming gradient
    (dgu,) = torch.autograd.grad(h, gu, dh)
    ref_in = gu.detach().double().requires_grad_()
    g, u = ref_in.chunk(2, dim=-1)
    ref = F.silu(g) * u
    (dref,) = torch.autograd.grad(ref, ref_in, dh.double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert h.shape == ref.shape and h.dtype == dtype and dgu.dtype == dtype
    assert ((h.double() - ref).norm() / ref.norm()) < tol
    assert ((dgu.double() - dref).norm() / dref.norm()) < tol
    # a strided input (the halves of a wider tensor) is read correctly too
    wide = torch.randn(5, 4 * f, device="cuda", dtype=dtype)[:, : 2 * f]
    g2, u2 = wide.double().chunk(2, dim=-1)
    assert ((swiglu(wide).double() - F.silu(g2) * u2).norm() / (F.silu(g2) * u2).norm()) < tol
