"""Recompute (elbowroom.checkpoint): gradients equal a plain run's, FLOPs show what is recomputed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from activation_modules import NestedCheckpoint
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import FlopCounterMode

import elbowroom
from elbowroom.activations import (
    BlockPolicy,
    apply_block_policies,
    checkpoint_blocks,
    get_offload_engine,
    gradient_checkpointing_disable,
    uncheckpoint,
)
from elbowroom.activations.recompute import default_selective_ops, find_blocks, select_blocks
from elbowroom.models import ModelConfig, build_model

TOL = 1e-6  # fp32 on CPU: max relative error (norm-wise) per parameter gradient
ARCHES = ("llama", "gpt2")


def small_model(arch: str, *, dropout: float = 0.1, n_layers: int = 3) -> nn.Module:
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch=arch, dim=64, n_heads=4, ffn_dim=128, n_layers=n_layers, dropout=dropout))
    return model.train()


def batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 32), generator=g)


def grads(model: nn.Module, idx: torch.Tensor, steps: int = 1) -> dict[str, torch.Tensor]:
    """Gradients of one step (the last of ``steps``), with the RNG seeded the same before each step."""
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        logits = model(idx)
        F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def assert_grads_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float = TOL) -> None:
    assert got.keys() == ref.keys()
    for k in ref:
        err = ((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item()
        assert err <= tol, f"{k}: relative error {err:.3e} > {tol}"


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mode="full"),
        dict(mode="selective"),
        dict(mode="full", every=2),
        dict(mode="full", blocks=[0, -1]),
        dict(mode="selective", blocks=[1]),
        dict(mode="full", use_reentrant=True),
    ],
    ids=["full", "selective", "every2", "index-list", "selective-one", "reentrant"],
)
def test_gradients_equal_plain(arch: str, kwargs: dict) -> None:
    model = small_model(arch)
    idx = batch()
    ref = grads(model, idx)
    checkpoint_blocks(model, **kwargs)
    assert_grads_close(grads(model, idx, steps=2), ref)


def test_state_dict_keys_unchanged_and_load_into_plain_model() -> None:
    model = small_model("llama")
    keys = list(model.state_dict())
    elbowroom.gradient_checkpointing_enable(model, {"mode": "selective"})
    assert list(model.state_dict()) == keys
    plain = small_model("llama")
    plain.load_state_dict(model.state_dict())
    model.load_state_dict(plain.state_dict())
    # a wrapped block is still its own class
    assert type(model.blocks[0]).__name__ == "LlamaBlock"


def test_wrap_unwrap_and_deepcopy() -> None:
    model = small_model("gpt2")
    idx = batch()
    ref = grads(model, idx)
    elbowroom.checkpoint(model.blocks[1])
    assert "forward" in model.blocks[1].__dict__
    clone = copy.deepcopy(model)
    # the copy's wrapped forward runs the copy's weights, not the original's
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    torch.manual_seed(0)
    a = model.eval()(idx)
    torch.manual_seed(0)
    b = clone.eval()(idx)
    assert not torch.allclose(a, b)
    model.train()
    assert_grads_close(grads(model, idx), ref)
    uncheckpoint(model.blocks[1])
    assert "forward" not in model.blocks[1].__dict__
    elbowroom.gradient_checkpointing_enable(model)
    gradient_checkpointing_disable(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_checkpoint_keeps_an_existing_instance_forward() -> None:
    lin = nn.Linear(4, 4)
    calls = []

    def custom(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return nn.Linear.forward(lin, x) * 2

    lin.forward = custom
    elbowroom.checkpoint(lin)
    x = torch.randn(3, 4, requires_grad=True)
    lin(x).sum().backward()
    assert len(calls) == 2  # forward + recompute
    uncheckpoint(lin)
    assert lin.forward is custom


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


@pytest.mark.parametrize("arch", ARCHES)
def test_flops_full_recompute_adds_exactly_the_block_forward(arch: str) -> None:
    # dropout is on, so the last matmul's output feeds a saved mask and is recomputed too
    model = small_model(arch, dropout=0.1)
    idx = batch()

    def step() -> None:
        torch.manual_seed(0)
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()

    plain = _flops(step)
    # forward FLOPs of each block on its real input
    block_fwd = []
    hooks = [
        blk.register_forward_hook(lambda m, a, o: block_fwd.append(_flops(lambda: m.forward(*a))))
        for blk in model.blocks
    ]
    torch.manual_seed(0)
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    assert len(block_fwd) == 3 and all(f > 0 for f in block_fwd)

    checkpoint_blocks(model, "full", blocks=[0, 2])
    assert _flops(step) - plain == block_fwd[0] + block_fwd[2]
    checkpoint_blocks(model, "full")
    assert _flops(step) - plain == sum(block_fwd)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["sdpa-kernel", "sdpa-math"])
def test_flops_selective_recomputes_no_matmul(arch: str, dropout: float) -> None:
    # without dropout CPU SDPA runs _scaled_dot_product_flash_attention_for_cpu; with it, bmm's
    model = small_model(arch, dropout=dropout)
    idx = batch()

    def step() -> None:
        torch.manual_seed(0)
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()

    plain = _flops(step)
    ref = grads(model, idx)
    checkpoint_blocks(model, "selective")
    assert _flops(step) == plain
    assert_grads_close(grads(model, idx), ref)


def test_default_selective_ops_cover_matmul_and_attention() -> None:
    ops = default_selective_ops()
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert op in ops
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"):
        if hasattr(aten, name):
            assert getattr(aten, name).default in ops


def test_custom_policy_callable_and_op_list() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)

    def run() -> tuple[int, list[torch.Tensor]]:
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        n = _flops(lambda: mlp(x).square().sum().backward())
        return n, [p.grad.clone() for p in mlp.parameters()] + [x.grad.clone()]

    plain_flops, ref = run()
    seen = []

    def save_nothing(ctx, op, *args, **kwargs):  # noqa: ANN001
        seen.append(op)
        return CheckpointPolicy.PREFER_RECOMPUTE

    elbowroom.checkpoint(mlp, "selective", policy=save_nothing)
    n, got = run()
    assert seen and n > plain_flops  # everything recomputed, matmuls included
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    elbowroom.checkpoint(mlp, "selective", policy=[torch.ops.aten.addmm.default])
    n, got = run()
    assert n == plain_flops
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_nested_checkpoint_regions(mode: str) -> None:
    torch.manual_seed(0)
    m = NestedCheckpoint()
    x = torch.randn(5, 16, requires_grad=True)

    def run() -> list[torch.Tensor]:
        m.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(7)
        m(x).sum().backward()
        return [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]

    ref = run()
    elbowroom.checkpoint(m, mode)
    for a, b in zip(run(), ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kwargs_pass_through_reentrant_and_not() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
            return self.lin(x).relu() * scale

    m = Scaled()
    x = torch.randn(2, 4, requires_grad=True)
    uncheckpoint(m)
    m(x, scale=3.0).sum().backward()
    ref = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    # keywords reach the module in both implementations (tests/test_activations_hf.py: tensors among them)
    for reentrant in (False, True):
        elbowroom.checkpoint(m, use_reentrant=reentrant)
        x.grad = None
        m.zero_grad(set_to_none=True)
        m(x, scale=3.0).sum().backward()
        for a, b in zip([x.grad] + [p.grad for p in m.parameters()], ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_no_grad_forward_skips_recompute() -> None:
    model = small_model("llama", dropout=0.0)
    checkpoint_blocks(model, "full")
    with torch.no_grad():
        out = model(batch())
    assert out.grad_fn is None


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: elbowroom.checkpoint(m, "partial"), "mode must be one of"),
        (lambda m: elbowroom.checkpoint(m, "selective", use_reentrant=True), "use_reentrant=False"),
        (lambda m: elbowroom.checkpoint(m, "full", policy=[torch.ops.aten.mm.default]), "only applies to"),
        (lambda m: elbowroom.checkpoint(m, determinism_check="strict"), "determinism_check"),
        (lambda m: checkpoint_blocks(m, every=0), "every must be a positive int"),
        (lambda m: checkpoint_blocks(m, blocks=[7]), "out of range"),
        (lambda m: checkpoint_blocks(m, every=2, blocks=[0]), "not both"),
        (lambda m: find_blocks(nn.Linear(2, 2)), "no repeated blocks"),
    ],
)
def test_bad_settings_raise_value_error(call, match: str) -> None:  # noqa: ANN001
    model = small_model("llama", dropout=0.0)
    with pytest.raises(ValueError, match=match):
        call(model)


def test_bad_types_raise_type_error() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        elbowroom.checkpoint(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="OpOverload"):
        elbowroom.checkpoint(nn.Linear(2, 2), "selective", policy=[torch.ops.aten.mm])


def test_select_blocks_and_find_blocks_fallback() -> None:
    assert select_blocks(7, every=3) == [0, 3, 6]
    assert select_blocks(4, blocks=[-1, 1, 1]) == [1, 3]

    class HFLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.heads = nn.ModuleList([nn.Linear(4, 1), nn.ReLU()])

    m = HFLike()
    assert find_blocks(m) is m.layers


class _TwoDropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h * torch.bernoulli(torch.full_like(h, 0.5))  # a random op the policy below keeps
        return F.dropout(self.b(h.tanh()), 0.5).sigmoid()


def test_selective_never_keeps_an_op_that_draws_random_numbers() -> None:
    # A kept random op would not draw in the recompute, so a later dropout of the region would replay
    # with another mask. On CUDA this is fp32 attention with dropout (the efficient kernel's philox
    # draw); here a policy that keeps a bernoulli draw shows the same thing on the CPU.
    torch.manual_seed(0)
    mod = _TwoDropouts()
    x = torch.randn(64, 16, requires_grad=True)

    def run() -> list[torch.Tensor]:
        mod.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(1)
        mod(x).square().sum().backward()
        return [p.grad.clone() for p in mod.parameters()] + [x.grad.clone()]

    ref = run()
    elbowroom.checkpoint(mod, "selective", policy=[torch.ops.aten.bernoulli.default, torch.ops.aten.addmm.default])
    for a, b in zip(run(), ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_policy_recomputes_attention_only_when_it_has_dropout() -> None:
    from elbowroom.activations.recompute import _resolve_policy, draws_random_numbers

    policy = _resolve_policy("selective", None)
    aten = torch.ops.aten
    for name, at in (("_scaled_dot_product_efficient_attention", 5), ("_scaled_dot_product_flash_attention", 3)):
        op = getattr(aten, name).default
        args = [None] * at
        assert policy(None, op, *args, 0.0) == CheckpointPolicy.MUST_SAVE
        assert policy(None, op, *args, 0.1) == CheckpointPolicy.PREFER_RECOMPUTE
        assert policy(None, op, *args, dropout_p=0.1) == CheckpointPolicy.PREFER_RECOMPUTE
        assert policy(None, op, *args[:3]) == CheckpointPolicy.MUST_SAVE  # default dropout_p=0
    assert draws_random_numbers(aten.native_dropout.default, (None, 0.1, True), {})
    assert not draws_random_numbers(aten.mm.default, (None, None), {})
    assert policy(None, aten.mm.default, None, None) == CheckpointPolicy.MUST_SAVE


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_selective_drops_a_last_kept_output_the_recompute_never_reads(arch: str, dropout: float, monkeypatch) -> None:  # noqa: ANN001
    # the MLP's down projection output only feeds the residual add: kept by "keep every matmul", it is never
    # read in the recompute (early stop ends before it), so it leaves the cache after forward. With dropout
    # after it the recompute runs past it, and it stays. No extra matmul either way, gradients unchanged.
    from elbowroom.activations.selective import KeptOutputs

    dropped: list = []
    drop = KeptOutputs.drop_unread_tail

    def spy(self) -> None:  # noqa: ANN001
        drop(self)
        dropped.append(self.dropped)

    monkeypatch.setattr(KeptOutputs, "drop_unread_tail", spy)
    model = small_model(arch, dropout=dropout)
    idx = batch()
    ref = grads(model, idx)
    checkpoint_blocks(model, "selective")

    def step() -> None:
        torch.manual_seed(1234)
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()

    plain_flops = _flops(step)
    dropped.clear()
    assert_grads_close(grads(model, idx), ref)
    last_mm = torch.ops.aten.mm.default if arch == "llama" else torch.ops.aten.addmm.default
    n = len(model.blocks)
    # per block: qkv, o, w13 / fc, w2 / proj -> the fourth matmul (index 3) is dropped
    assert dropped == ([(last_mm, 3)] * n if dropout == 0.0 else [None] * n)
    monkeypatch.setattr(KeptOutputs, "drop_unread_tail", lambda self: None)
    assert _flops(step) == plain_flops  # dropping it adds no recompute


def test_dropped_tail_of_an_offloaded_selective_cache_is_never_brought_back() -> None:
    model = small_model("llama", dropout=0.0)
    idx = batch()
    ref = grads(model, idx)
    apply_block_policies(model, [BlockPolicy("selective", offload_ratio=1.0)] * 2 + [BlockPolicy()],
                         min_offload_bytes=0, simulate_host=True)
    for _ in range(2):
        assert_grads_close(grads(model, idx), ref)
    s = get_offload_engine(model).stats()
    w2_out = idx.numel() * model.config.dim * 4  # the dropped output: (tokens, dim) fp32, one per block and step
    assert s.offloaded_bytes - s.reloaded_bytes == 2 * 2 * w2_out
    assert s.host_pool_in_use_bytes == 0


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compiled_blocks_recompute(mode: str) -> None:
    # torch's own per-block compile (`blk.compile()`, the whole wrapper under the compiler) over recomputed blocks:
    # the wrapper's checkpoint is traced into the graph, and the gradients stay the plain run's
    model = small_model("llama", dropout=0.0, n_layers=2)
    idx = batch()
    ref = grads(model, idx)
    checkpoint_blocks(model, mode=mode)
    for blk in model.blocks:
        blk.compile()
    assert_grads_close(grads(model, idx, steps=2), ref, tol=1e-5)


COMPILED_POLICIES = {
    "keep": None, "full": BlockPolicy("full"), "full, input offloaded": BlockPolicy("full", offload_input=True),
    "keep, half offloaded": BlockPolicy(offload_ratio=0.5), "selective": BlockPolicy("selective"),
    "selective, kept outputs offloaded": BlockPolicy("selective", offload_ratio=1.0),
    "selective, half the kept outputs offloaded": BlockPolicy("selective", offload_ratio=0.5),
    "selective, all offloaded": BlockPolicy("selective", offload_ratio=1.0, offload_input=True),
}


@pytest.mark.parametrize("name", list(COMPILED_POLICIES))
def test_compile_blocks_compiles_one_graph_per_policy(name: str) -> None:
    # regional compilation: one graph serves the three blocks, the gradients are the plain run's, and the state_dict
    # keys do not change. Kept, recomputed and offloading blocks compile their own forward inside the policy's
    # wrapper; selective blocks compile with the wrapper (torch's selective modes under the compiler), and those
    # that offload their kept outputs compile the checkpoint alone, inside the eager offload region
    from torch._dynamo.utils import counters

    from elbowroom.activations import CompiledBlocks, compile_blocks

    model = small_model("llama", dropout=0.0)
    idx = batch()
    ref = grads(model, idx)
    keys = list(model.state_dict())
    pol = COMPILED_POLICIES[name]
    if pol is not None:
        apply_block_policies(model, [pol] * len(model.blocks), min_offload_bytes=0, simulate_host=True)
    torch._dynamo.reset()
    counters.clear()
    done = compile_blocks(model)
    assert_grads_close(grads(model, idx, steps=2), ref, tol=1e-5)
    assert list(model.state_dict()) == keys
    graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    assert done == CompiledBlocks(compiled=3, eager=0)
    assert graphs == 1 and not breaks, breaks  # one block's graph, reused by the other two
    assert compile_blocks(model) == done  # compiled once: a second call changes nothing
    if pol is not None and pol.offloads:
        s = get_offload_engine(model).stats()
        # what the forward saved went out, came back (a selective cache's dropped tail need not), and left no host
        # buffer taken
        assert s.offloaded_bytes >= s.reloaded_bytes > 0 and s.host_pool_in_use_bytes == 0
    if pol is not None:  # a policy removed takes a wrapper's compiled forward with it: compiled again, not skipped
        from elbowroom.activations import remove_activation_policy

        remove_activation_policy(model)
        assert compile_blocks(model) == CompiledBlocks(compiled=3, eager=0)
        assert all("forward" in blk.__dict__ for blk in model.blocks)


def _saved_storages(model: Any, idx: torch.Tensor) -> list[tuple[int, int, bool, torch.dtype]]:
    """(storage pointer, bytes, whether it is the block's input, dtype) of what the blocks' compiled forwards save in
    one forward, by the saved-tensor hooks alone; the model's parameters and buffers (never offloaded) left out."""
    seen: list[tuple[int, int, bool, torch.dtype]] = []
    inputs: set[int] = set()
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    inside = [False]

    def pre(mod: Any, args: tuple) -> None:
        inputs.add(args[0].untyped_storage().data_ptr())
        inside[0] = True

    def post(mod: Any, args: tuple, out: Any) -> None:
        inside[0] = False

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if inside[0] and st.data_ptr() not in state:
            seen.append((st.data_ptr(), st.nbytes(), st.data_ptr() in inputs, t.dtype))
        return t

    handles = [h for blk in model.blocks for h in (blk.register_forward_pre_hook(pre),
                                                    blk.register_forward_hook(post))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(idx).float().pow(2).mean()
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("ratio,offload_input", [(1.0, False), (0.5, False), (1.0, True)])
def test_compiled_selective_block_offloads_its_kept_outputs_largest_first(ratio: float, offload_input: bool) -> None:
    # a compiled selective block that offloads: the region sees what the compiled graph saves (the kept matmul
    # and attention outputs, the input, small per-row statistics). The share of bytes goes largest first over
    # all but the inputs, which stay on the device as the eager checkpoint keeps them, unless all of it leaves
    from elbowroom.activations import compile_blocks

    model = small_model("llama", dropout=0.0, n_layers=2)
    idx = batch()
    ref = grads(small_model("llama", dropout=0.0, n_layers=2), idx)
    apply_block_policies(model, [BlockPolicy("selective")] * 2)
    torch._dynamo.reset()
    compile_blocks(model)
    model(idx).float().pow(2).mean().backward()  # compiled: the hooks then see the compiled graph's tensors
    model.zero_grad(set_to_none=True)
    saved = _saved_storages(model, idx)
    assert any(is_input for _, _, is_input, _ in saved)  # the graph does save its input
    candidates = {ptr: nbytes for ptr, nbytes, is_input, _ in saved if offload_input or not is_input}
    sizes = sorted(candidates.values(), reverse=True)
    one = sizes[::2]  # the two blocks save the same sizes: one block's, largest first
    assert sorted(sizes[1::2], reverse=True) == one
    acc = 0
    for nb in one:
        if acc >= ratio * sum(one):
            break
        acc += nb

    apply_block_policies(model, [BlockPolicy("selective", offload_ratio=ratio, offload_input=offload_input)] * 2,
                         min_offload_bytes=0, simulate_host=True)
    torch._dynamo.reset()
    assert compile_blocks(model).eager == 0
    assert_grads_close(grads(model, idx, steps=3), ref, tol=1e-5)  # a tag's first forward measures (offloads all)
    engine = get_offload_engine(model)
    before = engine.stats().offloaded_bytes
    grads(model, idx)
    assert engine.stats().offloaded_bytes - before == 2 * acc, (ratio, one)


def test_compiled_full_recompute_saves_only_the_inputs_and_evaluates_compiled() -> None:
    # a block recomputed whole compiles its checkpoint with its forward: the backward graph recomputes, so what the
    # compiled forward saves is the block's input alone (as the eager checkpoint saves), whatever the policy's
    # reentrant flag; under no_grad the same compiled function runs the forward alone, no graph break and no eager
    from torch._dynamo.utils import counters

    from elbowroom.activations import CompiledBlocks, compile_blocks

    model = small_model("llama", dropout=0.0, n_layers=2)
    idx = batch()
    ref = grads(copy.deepcopy(model), idx)
    with torch.no_grad():
        ref_out = copy.deepcopy(model).eval()(idx)
    apply_block_policies(model, [BlockPolicy("full")] * 2, use_reentrant=True)
    torch._dynamo.reset()
    counters.clear()
    assert compile_blocks(model) == CompiledBlocks(compiled=2, eager=0)
    assert_grads_close(grads(model, idx, steps=2), ref, tol=1e-5)
    saved = _saved_storages(model, idx)
    # the input, and the CPU generator's state that the checkpoint keeps to replay random ops (16 bytes on CUDA)
    assert saved and all(is_input or dtype == torch.uint8 for _, _, is_input, dtype in saved), saved
    assert sum(is_input for _, _, is_input, _ in saved) == 2
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(idx), ref_out, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2 and not dict(counters["graph_break"])  # training, no_grad


def test_compiled_selective_block_offloading_its_input_and_part_of_the_rest_stays_eager() -> None:
    # the compiled graph's saved tensors do not say which is the input: such a block runs eager, and says so
    from elbowroom.activations import CompiledBlocks, compile_blocks

    model = small_model("llama", dropout=0.0, n_layers=2)
    idx = batch()
    ref = grads(model, idx)
    apply_block_policies(model, [BlockPolicy("selective", offload_ratio=0.5, offload_input=True)] * 2,
                         min_offload_bytes=0, simulate_host=True)
    assert compile_blocks(model) == CompiledBlocks(compiled=0, eager=2)
    assert_grads_close(grads(model, idx, steps=2), ref, tol=1e-5)


def test_compile_blocks_under_a_plan_of_mixed_policies() -> None:
    # a planner's mix: selective blocks (compiled with their wrapper) between blocks that offload, whose backward
    # prefetch chain runs through every block's wrapper; the gradients stay the plain run's
    from elbowroom.activations import CompiledBlocks, compile_blocks

    model = small_model("llama", dropout=0.0, n_layers=4)
    idx = batch()
    ref = grads(model, idx)
    apply_block_policies(model, [BlockPolicy("full", offload_input=True), BlockPolicy("selective"),
                                 BlockPolicy(offload_ratio=0.5), BlockPolicy("selective")],
                         min_offload_bytes=0, simulate_host=True)
    assert compile_blocks(model) == CompiledBlocks(compiled=4, eager=0)
    assert_grads_close(grads(model, idx, steps=2), ref, tol=1e-5)
    s = get_offload_engine(model).stats()
    assert s.offloaded_bytes > 0 and s.offloaded_bytes == s.reloaded_bytes and s.host_pool_in_use_bytes == 0


def test_compiled_blocks_with_the_offloading_optimizer_waiting_in_forward() -> None:
    # CPUOffloadOptimizer.overlap_with_forward: each module owning offloaded weights waits for their update in a
    # forward pre-hook. compile_blocks moves those waits from a block's submodules to the block, outside the
    # compiled forward (traced, a wait guards on the optimizer's state and recompiles at every step): the losses
    # are the eager run's, one graph serves all steps and blocks, and the block alone carries the wait
    from torch._dynamo.utils import counters

    from elbowroom.activations import compile_blocks
    from elbowroom.optim import CPUOffloadOptimizer
    from elbowroom.optim.handover import WEIGHT_WAIT

    def losses(compiled: bool) -> list[float]:
        torch.manual_seed(0)
        model = small_model("llama", dropout=0.0)
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, offload_fraction=1.0)
        opt.overlap_with_forward(model)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            compile_blocks(model)
            for blk in model.blocks:
                assert [getattr(h, WEIGHT_WAIT, False) for h in blk._forward_pre_hooks.values()] == [True]
                assert not any(getattr(h, WEIGHT_WAIT, False) for m in blk.modules() if m is not blk
                               for h in m._forward_pre_hooks.values())
        out = []
        for _ in range(4):
            loss = model(batch()).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        opt.close()
        return out

    eager = losses(compiled=False)
    assert losses(compiled=True) == pytest.approx(eager, rel=1e-5)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"] and not counters["recompiles"]


def test_compiled_selective_blocks_replay_dropout() -> None:
    # GPT-2 blocks with dropout on, compiled: recomputed selectively or whole under the compiler (the checkpoint
    # compiled with the forward), or kept; each run draws the same masks from the same seed, so the three give one
    # gradient
    # (a recompute that drew new masks would not). Another seed gives another, so dropout is on.
    from elbowroom.activations import compile_blocks

    idx = batch()

    def compiled_grads(mode: str | None, seed: int = 1) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = small_model("gpt2", dropout=0.1)
        if mode is not None:
            apply_block_policies(model, [BlockPolicy(mode)] * len(model.blocks))
        compile_blocks(model)
        torch.manual_seed(seed)
        model(idx).float().pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    kept = compiled_grads(None)
    assert_grads_close(compiled_grads("full"), kept, tol=1e-6)
    assert_grads_close(compiled_grads("selective"), kept, tol=1e-6)
    other = compiled_grads(None, seed=2)
    assert max(((other[n] - kept[n]).norm() / kept[n].norm()).item() for n in kept) > 0.1


def test_reentrant_falls_back_where_no_input_needs_a_gradient() -> None:
    # the first block after a frozen embedding: torch's reentrant checkpoint would leave its parameters without
    # gradients (and the loss without a graph); the wrapper runs the non-reentrant one for that call
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1))
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m[0].requires_grad_(False)
    elbowroom.checkpoint(model[1], use_reentrant=True)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    ref(x).sum().backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert (a.grad is None) == (b.grad is None)
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


class _ScaledInPlace(nn.Module):
    """A block that changes a matmul's output in place (as some attention code scales its queries)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.mul_(0.5)
        return self.b(torch.tanh(h))


def test_a_kept_output_changed_in_place_is_recomputed_not_read(caplog) -> None:  # noqa: ANN001
    # the kept addmm output is halved after it was kept: reading it back would halve it twice in the recompute.
    # The region runs that addmm again instead (torch's own modes raise), says so once, and the gradients are plain's
    torch.manual_seed(0)
    mod = _ScaledInPlace()
    x = torch.randn(4, 8, requires_grad=True)

    def step() -> list[torch.Tensor]:
        for t in [*mod.parameters(), x]:
            t.grad = None
        mod(x).square().sum().backward()
        return [t.grad.clone() for t in [*mod.parameters(), x]]

    ref = step()
    plain_flops = _flops(step)
    elbowroom.checkpoint(mod, "selective")
    with caplog.at_level("WARNING", logger="elbowroom.activations.selective"):
        for a, b in zip(step(), ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert _flops(step) == plain_flops + 2 * 4 * 8 * 16  # the one addmm, once more
    assert sum("modified in place" in r.message for r in caplog.records) == 1


def test_a_second_backward_through_a_selective_block_recomputes_what_the_first_took() -> None:
    # retain_graph: the first recompute took the kept outputs; the second runs every op again, and both give
    # plain's gradients
    model = small_model("llama", dropout=0.0, n_layers=2)
    idx = batch()
    ref = grads(model, idx)
    checkpoint_blocks(model, "selective")
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward(retain_graph=True)
    first = {k: p.grad.clone() for k, p in model.named_parameters()}
    loss.backward()
    assert_grads_close(first, ref)
    assert_grads_close({k: p.grad / 2 for k, p in model.named_parameters()}, ref)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compiled_policies_on_hugging_face_layers(arch: str) -> None:
    # Hugging Face decoder layers (keyword inputs, RoPE as a tuple, GPT-2's dropout modules), compiled under a
    # planner's mix: a selective block offloading half of what it keeps (its checkpoint compiled, the region eager),
    # one offloading all (the input too), one kept and half offloaded; gradients within 1e-5 of the eager model's,
    # and everything that left came back
    transformers = pytest.importorskip("transformers")
    from elbowroom.activations import CompiledBlocks, compile_blocks

    torch.manual_seed(0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
    idx = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))

    def hf_grads(m: nn.Module, steps: int = 1) -> dict[str, torch.Tensor]:
        for _ in range(steps):
            m.zero_grad(set_to_none=True)
            m(input_ids=idx, labels=idx, use_cache=False).loss.backward()
        return {k: p.grad.detach().clone() for k, p in m.named_parameters()}

    ref = hf_grads(copy.deepcopy(model))
    apply_block_policies(model, [BlockPolicy("selective", offload_ratio=0.5),
                                 BlockPolicy("selective", offload_ratio=1.0, offload_input=True),
                                 BlockPolicy(offload_ratio=0.5)], min_offload_bytes=0, simulate_host=True)
    torch._dynamo.reset()
    assert compile_blocks(model) == CompiledBlocks(compiled=3, eager=0)
    assert_grads_close(hf_grads(model, steps=3), ref, tol=1e-5)
    s = get_offload_engine(model).stats()
    assert s.offloaded_bytes == s.reloaded_bytes > 0 and s.host_pool_in_use_bytes == 0


def test_compile_blocks_warns_of_a_hugging_face_kv_cache_in_training(caplog: pytest.LogCaptureFixture) -> None:
    # with config.use_cache on, every forward hands each block a fresh KV cache whose state the compiled blocks guard
    # on: they recompile layer after layer until torch turns them back to eager. compile_blocks says so, once
    transformers = pytest.importorskip("transformers")
    from elbowroom.activations import compile_blocks, uncompile_blocks

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32))
    assert model.config.use_cache
    with caplog.at_level("WARNING", logger="elbowroom.activations.compiled"):
        compile_blocks(model)
    assert [r.message for r in caplog.records if "use_cache" in r.message] != []
    caplog.clear()
    model.config.use_cache = False
    uncompile_blocks(model.model.layers)
    with caplog.at_level("WARNING", logger="elbowroom.activations.compiled"):
        compile_blocks(model)
    assert not [r for r in caplog.records if "use_cache" in r.message]


@pytest.mark.parametrize("tp", [False, True])
def test_what_compile_blocks_compiles_of_each_policy(tp: bool) -> None:
    # the arrangement per policy, and over tensor-parallel shards (whose DTensors' device mesh the partitioner will
    # not save for a compiled checkpoint's backward: the checkpoint stays eager there)
    from elbowroom.activations import _wrap
    from elbowroom.activations.compiled import arrangement
    want = {
        None: "wrapper",
        BlockPolicy(): "forward",  # (kept in a plan that offloads: its region recasts the weights' casts)
        BlockPolicy(offload_ratio=0.5): "forward",
        BlockPolicy("full"): "forward" if tp else "checkpoint",
        BlockPolicy("full", offload_input=True): "forward" if tp else "checkpoint",
        BlockPolicy("selective"): "wrapper",
        BlockPolicy("selective", offload_ratio=0.5): "eager" if tp else "checkpoint",
        BlockPolicy("selective", offload_ratio=1.0, offload_input=True): "eager" if tp else "checkpoint",
        BlockPolicy("selective", offload_ratio=0.5, offload_input=True): "eager",
    }
    for pol, how in want.items():
        model = small_model("llama", dropout=0.0, n_layers=2)
        if pol is not None:  # (beside an offloading block: a kept one then has a region that recasts)
            apply_block_policies(model, [pol, BlockPolicy(offload_ratio=0.5)], min_offload_bytes=0,
                                 simulate_host=True)
        blk = model.blocks[0]
        assert arrangement(blk, _wrap.get_policy(blk), tensor_parallel=tp) == how, pol
        if not tp:
            assert arrangement(blk, _wrap.get_policy(blk)) == how  # (these blocks' parameters are plain tensors)


def test_compiled_blocks_recomputing_pointwise_save_less_and_train_alike() -> None:
    # compile_blocks(recompute_pointwise=True): the partitioner recomputes in backward the pointwise results it would
    # save (autocast's bf16 casts of the fp32 weights, the gate's product...): a kept block saves fewer bytes, the
    # gradients are plain compiled's, and in one process a block compiled without the option keeps its own graph
    # (the compiler's cache entries are guarded on the backend, not on the partitioner's settings)
    from elbowroom.activations import compile_blocks, uncompile_blocks

    model = small_model("llama", dropout=0.0, n_layers=2)
    idx = batch()

    def run(recompute_pointwise: bool) -> tuple[int, dict[str, torch.Tensor]]:
        m = copy.deepcopy(model)
        compile_blocks(m, recompute_pointwise=recompute_pointwise)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            saved = sum(n for _, n, _, _ in _saved_storages(m, idx))
            got = grads(m, idx)
        uncompile_blocks(m.blocks)
        return saved, got

    torch._dynamo.reset()
    plain_bytes, plain_grads = run(False)
    less_bytes, less_grads = run(True)
    again_bytes, _ = run(False)
    assert less_bytes < 0.6 * plain_bytes and again_bytes == plain_bytes  # (445 against 216 KB here)
    assert_grads_close(less_grads, plain_grads)  # the recompute rounds as the forward did: equal
    with pytest.raises(ValueError, match="compiles with inductor"):
        compile_blocks(copy.deepcopy(model), recompute_pointwise=True, backend="eager")
