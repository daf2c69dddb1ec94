"""The bf16 layout priced on a measured profile of a bf16 copy of the model: its bytes and its times.

A bf16 model runs its norms and residuals in bf16 and casts no weights: on the H100, W1's plain step took 311 ms
against 351 with fp32 weights under autocast, GPT-2-XL's 204 against 240 (BENCHMARKS.md). The autocast profile's
times less a cast estimate priced it 3-4x too close to the autocast step, so the planner passed over the layout.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elbowroom.models import ModelConfig, build_model
from elbowroom.plan import cost, get_device, profile
from elbowroom.plan.cost import OPTIONS, Decisions
from elbowroom.plan.profiler import bf16_copy
from elbowroom.plan.search import with_bf16_measurements

CPU = get_device("cpu")


def _model(arch: str = "llama") -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(arch=arch, n_layers=2, dim=64, n_heads=4, ffn_dim=128, max_seq_len=32))


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bf16_copy_is_the_model_in_bf16(arch: str) -> None:
    model = _model(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = bf16_copy(model)
    assert copy is not model
    for (name, a), (_, b) in zip(model.named_parameters(), copy.named_parameters()):
        assert b.dtype == torch.bfloat16 and b.device == a.device, name
        assert torch.equal(b, a.to(torch.bfloat16)), name
    # every buffer in its own dtype, as apply() leaves them, the non-persistent ones too (RoPE tables are not in
    # the state dict)
    for (name, a), (_, b) in zip(model.named_buffers(), copy.named_buffers()):
        assert b.dtype == a.dtype and torch.equal(b, a), name
    for k, v in model.state_dict().items():  # the model itself is untouched
        assert torch.equal(v, before[k]) and v.dtype == before[k].dtype, k
    with torch.no_grad():  # and the copy computes what the model computes in the planner's bf16 layout
        from elbowroom.plan.apply import _cast_bf16

        ids = _ids()
        _cast_bf16(model)
        torch.testing.assert_close(copy(ids).float(), model(ids).float(), rtol=0, atol=0)


def test_bf16_layout_is_priced_with_the_bf16_times() -> None:
    model = _model()
    fp32 = profile(model, _ids(), machine=CPU, dtype=torch.bfloat16, warmup=0, iters=1)  # autocast
    bf16 = profile(bf16_copy(model), _ids(), machine=CPU, dtype=torch.bfloat16, warmup=0, iters=1)
    # fabricated, distinct times make the arithmetic exact
    bf16 = dataclasses.replace(
        bf16, blocks=tuple(dataclasses.replace(b, forward_s=0.001, backward_s=0.002, recompute_s=0.0,
                                               selective_recompute_s=0.0) for b in bf16.blocks),
        head=dataclasses.replace(bf16.head, forward_s=0.003, backward_s=0.004))
    both = with_bf16_measurements(fp32, bf16)
    assert both.param_dtype == "bfloat16" and not cost.autocast_profiled(both)  # no cast credit on top
    assert [b.saved_bytes for b in both.blocks] == [b.saved_bytes for b in bf16.blocks]
    assert both.num_params == fp32.num_params and both.machine == fp32.machine
    keep = OPTIONS.index(cost.Option())
    n = len(both.blocks)
    d = Decisions(options=(OPTIONS[keep],) * n, offload_blocks=(False,) * n, layout="bf16",
                  micro_batch=both.micro_batch, grad_clipping=False)
    pred = cost.predict(both, d, 1 << 34)
    assert pred.time["compute"] == pytest.approx(n * 0.003 + 0.007)
    assert pred.time["autocast casts"] == 0.0


def test_fit_measures_a_bf16_copy(monkeypatch) -> None:
    # fit(precision="bf16") on a model whose plain step it measured: the bf16 layout's profile is measured too,
    # on a copy, and the model comes back as it was (the plan decides its own layout)
    import importlib

    from elbowroom.plan import search

    fit_module = importlib.import_module("elbowroom.plan.fit")  # the module (the package exports the function)

    seen = {}
    real = search.plan_for

    def spy(prof, budget, **kw):
        seen.setdefault("bf16", kw.get("bf16_bytes"))  # the outer call (it plans each layout again)
        return real(prof, budget, **kw)

    monkeypatch.setattr(search, "plan_for", spy)
    model = _model()
    ids = _ids()
    _, _, plan = fit_module.fit(model, ids, budget="1GiB", precision="bf16", compute_dtype=torch.bfloat16,
                                machine=CPU, lr=1e-3)
    assert seen["bf16"].source == "measured" and seen["bf16"].param_dtype == "bfloat16"
    assert seen["bf16"].blocks[0].forward_s > 0
    assert plan.num_blocks == 2


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_bf16_copy_of_a_hugging_face_model(family: str) -> None:
    # Hugging Face models as they are: the rotary table is a non-persistent buffer, GPT-2's causal mask a buffer
    transformers = pytest.importorskip("transformers")
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        make = transformers.LlamaForCausalLM
    else:
        cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
        make = transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    model = make(cfg).eval()
    copy = bf16_copy(model).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = make(cfg).eval()
        want.load_state_dict(model.state_dict())
        from elbowroom.plan.apply import _cast_bf16

        _cast_bf16(want)
        want = want(ids).logits
        got = copy(ids).logits
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the model stays fp32
    if family == "gpt2":  # the head is tied to the embedding in the copy as in the model
        assert copy.lm_head.weight is copy.transformer.wte.weight


def test_the_layout_follows_the_measured_bf16_times() -> None:
    # The same bytes either way: the bf16 layout wins when its measured step is faster than fp32 weights' and
    # loses when it is slower; priced without its own times it gets the cast estimate's credit instead.
    from elbowroom.plan.search import plan_for

    model = _model()
    fp32 = profile(model, _ids(), machine=CPU, dtype=torch.bfloat16, warmup=0, iters=1)
    bf16 = profile(bf16_copy(model), _ids(), machine=CPU, dtype=torch.bfloat16, warmup=0, iters=1)

    def timed(prof, f):
        return dataclasses.replace(
            prof, blocks=tuple(dataclasses.replace(b, forward_s=0.010 * f, backward_s=0.020 * f,
                                                   recompute_s=0.010 * f, selective_recompute_s=0.004 * f)
                               for b in prof.blocks),
            head=dataclasses.replace(prof.head, forward_s=0.002 * f, backward_s=0.004 * f))

    base = timed(fp32, 1.0)
    budget = 1 << 30  # room for anything: the layout is decided by time alone
    fast = plan_for(base, budget, precision="bf16", bf16_bytes=timed(bf16, 0.7))
    slow = plan_for(base, budget, precision="bf16", bf16_bytes=timed(bf16, 3.0))
    traced = plan_for(base, budget, precision="bf16", bf16_bytes=dataclasses.replace(timed(bf16, 0.7),
                                                                                      source="analytic"))
    assert fast.weight_dtype == "bfloat16"
    assert slow.weight_dtype == "float32"
    # the measured times, not the autocast ones, price the bf16 layout: 30% off its compute
    n = len(base.blocks)
    assert fast.time["compute"] == pytest.approx(0.7 * (n * 0.030 + 0.006))
    assert traced.time["compute"] != pytest.approx(fast.time["compute"])
