"""linear_cross_entropy against F.cross_entropy(F.linear(...)): loss and gradients, chunking, padding, bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import elbowroom
from elbowroom.activations import LinearCrossEntropy, linear_cross_entropy
from elbowroom.models import ModelConfig, build_model


def make(n_tok: int = 37, d: int = 24, vocab: int = 50, seed: int = 0, pad: int = 5):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n_tok, d, generator=g, dtype=torch.float64).float().requires_grad_(True)
    w = (torch.randn(vocab, d, generator=g) * 0.3).requires_grad_(True)
    t = torch.randint(0, vocab, (n_tok,), generator=g)
    t[torch.randperm(n_tok, generator=g)[:pad]] = -100
    return h, w, t


def grads(loss: torch.Tensor, *ts: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, ts))


def assert_rel(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    """Relative error of the whole tensor (elementwise ratios blow up on entries near zero)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    err = float((a.double() - b.double()).norm() / b.double().norm())
    assert err <= tol, err


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 8, 37, 4096])
def test_matches_cross_entropy_fp32(reduction: str, chunk: int) -> None:
    # fp32 on CPU: loss and both gradients within 1e-6 relative of the plain head + loss (chunks that do not
    # divide the tokens, padding ignored, an upstream gradient that is not 1)
    h, w, t = make()
    ref = F.cross_entropy(F.linear(h, w), t, reduction=reduction) * 3.0
    out = linear_cross_entropy(h, w, t, reduction=reduction, chunk_tokens=chunk) * 3.0
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
    for a, b in zip(grads(out, h, w), grads(ref, h, w)):
        assert_rel(a, b, 1e-6)


def test_batched_shape_and_module_form() -> None:
    h, w, t = make(n_tok=24)
    head = torch.nn.Linear(24, 50, bias=False)
    with torch.no_grad():
        head.weight.copy_(w)
    hb, tb = h.view(4, 6, 24), t.view(4, 6)
    ref = F.cross_entropy(head(hb).view(-1, 50), tb.view(-1))
    out = LinearCrossEntropy(head, chunk_tokens=5)(hb, tb)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
    assert_rel(grads(out, h)[0], grads(ref, h)[0], 1e-6)


def test_bf16_autocast_close_to_plain_autocast() -> None:
    # under bf16 autocast the matmuls run in bf16 as nn.Linear's would; the log-softmax stays fp32
    h, w, t = make(n_tok=64, d=32, vocab=300, pad=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w).float(), t)
        out = linear_cross_entropy(h, w, t, chunk_tokens=16)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    for a, b in zip(grads(out, h, w), grads(ref, h, w)):
        assert_rel(a, b, 1e-2)  # bf16 matmuls: ~3 significant digits


def test_model_hidden_states_feed_the_fused_loss() -> None:
    # DecoderLM.hidden_states + the head weight: same loss and parameter gradients as model(idx) + cross_entropy
    cfg = ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=16)
    m = build_model(cfg)
    idx = torch.randint(0, 61, (3, 16), generator=torch.Generator().manual_seed(1))
    ref = F.cross_entropy(m(idx).view(-1, 61), idx.view(-1))
    ref_g = grads(ref, *m.parameters())
    out = elbowroom.linear_cross_entropy(m.hidden_states(idx), m.output.weight, idx, chunk_tokens=7)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
    for a, b in zip(grads(out, *m.parameters()), ref_g):
        assert_rel(a, b, 1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"reduction": "none"}, "reduction must be 'mean' or 'sum'"),
        ({"chunk_tokens": 0}, "chunk_tokens must be an int >= 1"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    h, w, t = make()
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(h, w, t, **kwargs)
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(h, w.t(), t)
    with pytest.raises(ValueError, match="targets must have shape"):
        linear_cross_entropy(h, w, t[:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_fp64_reference_and_torch_path(dtype: torch.dtype, monkeypatch) -> None:  # noqa: ANN001
    # the Triton kernel (softmax, loss and gradient in one pass over each chunk) against F.cross_entropy in
    # float64 on the same inputs, and against the torch-op path of the same function on the same device;
    # fresh random inputs, padding, a vocabulary no block size divides, chunks that do not divide the tokens
    import importlib

    # the module (the package's attribute of the same name is the function)
    L = importlib.import_module("elbowroom.ops.linear_cross_entropy")

    assert L._kernel_applies(torch.empty(1, device="cuda"))
    torch.manual_seed(3)
    n, d, vocab = 3000, 256, 32003
    h = torch.randn(n, d, device="cuda")
    w = torch.randn(vocab, d, device="cuda") * 0.05
    t = torch.randint(0, vocab, (n,), device="cuda")
    t[torch.randperm(n, device="cuda")[:100]] = -100

    def run(enabled: bool) -> list[torch.Tensor]:
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = linear_cross_entropy(hh, ww, t, chunk_tokens=1024)
        out.backward()
        return [out.detach(), hh.grad, ww.grad]

    got = run(True)
    monkeypatch.setattr(L, "_kernel_applies", lambda h: False)
    torch_path = run(True)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    if dtype == torch.bfloat16:  # the reference sees the inputs the bf16 matmuls see
        h64, w64 = h.bfloat16().double().requires_grad_(), w.bfloat16().double().requires_grad_()
    ref = F.cross_entropy(F.linear(h64, w64), t)
    ref.backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, b in zip(got, [ref.detach(), h64.grad, w64.grad]):
        err = float((a.double() - b).norm() / b.norm())
        assert err < tol, err
    for a, b in zip(got, torch_path):
        err = float((a.double() - b.double()).norm() / b.double().norm())
        assert err < (1e-6 if dtype == torch.float32 else 5e-3), err
