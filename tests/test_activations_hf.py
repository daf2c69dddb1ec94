"""Recompute on modules called with keyword arguments, and on real Hugging Face decoder layers.

Hugging Face layers take ``attention_mask``, ``position_embeddings=(cos, sin)``, ``position_ids``,
``use_cache``, ``past_key_values``... as keywords. Every recompute mode (full reentrant, full, selective)
must pass them through, give tensor keywords (nested in tuples included) the gradients of a plain run,
and refuse a KV cache that the recompute would write a second time. The transformers tests build tiny
models from configs (nothing is downloaded) and skip when transformers is not installed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import elbowroom
from elbowroom.activations import checkpoint_blocks
from elbowroom.activations.recompute import find_blocks

MODES = {
    "full-reentrant": dict(mode="full", use_reentrant=True),
    "full": dict(mode="full"),
    "selective": dict(mode="selective"),
}
TOL = 1e-6  # fp32 on CPU: max relative error (norm-wise) per gradient


class KeywordLayer(nn.Module):
    """A decoder-layer-shaped module: tensors as keywords and nested in a tuple, flags, a mask, dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.o = nn.Linear(16, 16)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        scale: float = 1.0,
        debug: bool = False,  # a name torch's checkpoint() takes for itself
    ) -> torch.Tensor:
        h = self.q(x)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            h = h * cos[position_ids] + h.roll(1, -1) * sin[position_ids]
        if attention_mask is not None:
            h = h.masked_fill(~attention_mask, 0.0)
        h = nn.functional.dropout(h.tanh(), 0.2, self.training)
        assert not use_cache and not output_attentions and not debug
        return x + self.o(h) * scale


def keyword_grads(layer: nn.Module, seed: int = 5) -> list[torch.Tensor]:
    """Gradients of a step through ``layer`` called with keywords: its parameters, the input, cos and sin."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 16, generator=g, requires_grad=True)
    cos = torch.randn(8, 16, generator=g, requires_grad=True)
    sin = torch.randn(8, 16, generator=g, requires_grad=True)
    mask = torch.rand(3, 6, 16, generator=g) > 0.1
    pos = torch.arange(6).expand(3, 6)
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    inp = x * 1.0  # an activation, as a block's input is
    out = layer(inp, mask, position_embeddings=(cos, sin), position_ids=pos, use_cache=False,
                output_attentions=False, scale=0.5, debug=False)
    out.square().mean().backward()
    return [p.grad.clone() for p in layer.parameters()] + [x.grad, cos.grad, sin.grad]


@pytest.mark.parametrize("mode", list(MODES))
def test_keyword_tensors_get_the_gradients_of_a_plain_run(mode: str) -> None:
    torch.manual_seed(0)
    layer = KeywordLayer().train()
    ref = keyword_grads(layer)
    assert ref[-1].abs().sum() > 0  # sin, passed inside a keyword tuple, has a gradient
    elbowroom.checkpoint(layer, **MODES[mode])
    for _ in range(2):
        got = keyword_grads(layer)
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mode", list(MODES))
def test_kv_cache_under_recompute_raises_with_the_fix(mode: str) -> None:
    class Cache:  # transformers' Cache API, duck-typed
        def get_seq_length(self) -> int:
            return 0

        def update(self, *args: object) -> None:
            raise AssertionError("not reached")

    layer = elbowroom.checkpoint(nn.Linear(4, 4), **MODES[mode])
    x = torch.randn(2, 4, requires_grad=True)
    layer.forward(x)  # plain call works
    for call in (lambda: layer.forward(x, use_cache=True), lambda: layer.forward(x, past_key_values=Cache()),
                 lambda: layer.forward(x, Cache())):
        with pytest.raises(ValueError, match="use_cache=False"):
            call()


# ------------------------------------------------------------------------------------- transformers
def tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1, bos_token_id=0, eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg).train()


def tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.1, embd_pdrop=0.1,
        attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg).train()


BUILD = {"llama": tiny_llama, "gpt2": tiny_gpt2}
IDX = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))


def hf_step(model: nn.Module, steps: int = 1, **call: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of the last of ``steps`` identical steps (the RNG seeded the same before each)."""
    call.setdefault("use_cache", False)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(42)
        loss = model(IDX, labels=IDX, **call).loss
        loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for k in ref:
        err = ((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item()
        assert err <= TOL, f"{k}: relative error {err:.3e}"


@pytest.mark.parametrize("arch", list(BUILD))
def test_find_blocks_finds_hugging_face_layers(arch: str) -> None:
    model = BUILD[arch]()
    expected = model.model.layers if arch == "llama" else model.transformer.h
    assert find_blocks(model) is expected


@pytest.mark.parametrize("arch", list(BUILD))
@pytest.mark.parametrize("mode", list(MODES))
def test_hugging_face_layers_recompute_with_exact_gradients(arch: str, mode: str) -> None:
    # dropout is on in both models (attention dropout, GPT-2's residual and embedding dropout too): the
    # recompute replays the RNG, so the gradients equal the plain run's
    model = BUILD[arch]()
    ref_loss, ref = hf_step(model)
    checkpoint_blocks(model, **MODES[mode])
    loss, got = hf_step(model, steps=2)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert_grads_close(got, ref)


@pytest.mark.parametrize("arch", list(BUILD))
@pytest.mark.parametrize("mode", list(MODES))
def test_hugging_face_kv_cache_under_recompute_raises_and_generation_keeps_it(arch: str, mode: str) -> None:
    model = BUILD[arch]()
    checkpoint_blocks(model, **MODES[mode])
    with pytest.raises(ValueError, match="use_cache=False"):
        model(IDX, labels=IDX, use_cache=True)
    with torch.no_grad():  # not recomputed: the cache is written once and returned
        out = model(IDX, use_cache=True)
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == IDX.shape[1]


@pytest.mark.parametrize("arch", list(BUILD))
@pytest.mark.parametrize(
    "settings",
    [
        dict(checkpoint="selective", offload_ratio=1.0, offload_checkpoint_inputs=True),
        dict(checkpoint="full", use_reentrant=True, offload_checkpoint_inputs=True),
        dict(offload_ratio=0.5),
    ],
    ids=["selective+offload", "reentrant+ckpt-inputs", "offload-half"],
)
def test_hugging_face_model_under_the_activation_policy(arch: str, settings: dict) -> None:
    from elbowroom.activations import apply_activation_policy, get_offload_engine

    model = BUILD[arch]()
    ref_loss, ref = hf_step(model)
    # a CPU model: simulate_host makes the engine offload anyway, so its bookkeeping runs on HF layers
    apply_activation_policy(model, min_offload_bytes=0, simulate_host=True, **settings)
    loss, got = hf_step(model, steps=3)  # the first step measures the ratios, the later ones run the plan
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert_grads_close(got, ref)
    s = get_offload_engine(model).stats()
    assert s.offloaded_tensors > 0 and s.reloaded_bytes <= s.offloaded_bytes and s.host_pool_in_use_bytes == 0
