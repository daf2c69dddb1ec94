"""Offload engine on CPU: the same bookkeeping as on CUDA, copying into a separate host buffer.

Covers the cases that break naive engines (in-place ops after a save, a tensor and its transpose,
non-contiguous slices, a tensor saved twice, nested checkpoints, model inputs/outputs), the host
pool (allocates in step 1 only, flat over 20 steps, cap error), ratios, deferred release and
prefetch order.
"""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from activation_modules import NestedCheckpoint
from torch.utils._python_dispatch import TorchDispatchMode

import elbowroom
from elbowroom.activations import BlockPolicy, OffloadEngine, _wrap, apply_block_policies, offload_module
from elbowroom.activations.offload import _RatioState
from elbowroom.models import ModelConfig, build_model


def run_grads(module: nn.Module, x: torch.Tensor, seed: int = 7) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    out = module(x)
    out.float().square().mean().backward()
    return [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]


def assert_same(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def engine(**kw) -> OffloadEngine:  # noqa: ANN003
    """An engine that offloads on the CPU (into a separate host buffer), so that its bookkeeping is tested here."""
    kw.setdefault("min_offload_bytes", 0)
    kw.setdefault("simulate_host", True)
    return OffloadEngine(**kw)


# ----------------------------------------------------------------------------------- tricky modules
class Transposed(nn.Module):
    """mm(h, h.t()): a tensor and its transpose both saved (one storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).tanh()
        return h @ h.t()


class SavedTwice(nn.Module):
    """One tensor saved by two ops, plus a non-contiguous strided slice and a small slice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        twice = h.sin() + h.cos()  # both save h
        strided = h[:, 1::2].sin()  # saves a non-contiguous view of h
        small = h[:1, :4].cos()  # saves a small corner of h's storage
        out = h.t().contiguous().exp()  # saves its own output (a fresh storage)
        return twice.sum(-1) + strided.sum(-1) + small.sum() + out.sum(0)


class InPlaceBeforeSave(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h.relu_()  # saves its output at version 1
        return (h * h).sum(-1)


class StaleSave(nn.Module):
    """``a`` saved at version 0 by an unused branch, modified in place, saved again at version 1."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x) * 1.0
        self.unused = a.sin()  # saves a (v0); never part of the loss
        a.mul_(2.0)
        return a.cos()  # saves a (v1): must not reuse the v0 copy


class OutputSaved(nn.Module):
    """The module's output is itself saved (tanh saves its result); the input is saved too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * x).tanh()


@pytest.mark.parametrize("cls", [Transposed, SavedTwice, InPlaceBeforeSave, StaleSave, OutputSaved])
@pytest.mark.parametrize("event_delay", [0, 3], ids=["sync", "deferred"])
def test_tricky_modules_match_plain(cls: type[nn.Module], event_delay: int) -> None:
    torch.manual_seed(0)
    m = cls()
    x = torch.randn(8, 16, requires_grad=True)
    ref = run_grads(m, x)
    eng = engine(_cpu_event_delay=event_delay)
    offload_module(m, engine=eng)
    for _ in range(2):
        assert_same(run_grads(m, x), ref)
    assert eng.stats().offloaded_tensors > 0
    m.__dict__.pop("unused", None)  # StaleSave keeps its unused branch's graph alive
    assert eng.stats().host_pool_in_use_bytes == 0


def test_transpose_and_saved_twice_share_one_transfer() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    m = Transposed()
    eng = engine()
    offload_module(m, engine=eng)
    run_grads(m, x)
    s = eng.stats()
    # lin output and tanh output are separate storages; h and h.t() share one transfer
    assert s.deduplicated >= 1
    m2 = SavedTwice()
    eng2 = engine()
    offload_module(m2, engine=eng2)
    run_grads(m2, x)
    assert eng2.stats().deduplicated == 3  # h saved by sin and cos, its slices ride along
    assert eng2.stats().offloaded_tensors == 2


def test_small_slice_copies_only_its_extent() -> None:
    eng = engine()
    big = torch.randn(64, 1024, requires_grad=True) * 1.0  # an activation: 256 KiB storage
    corner = big[2:4, 8:24]  # spans 1 row + 16 elements of it
    inside = big[3, 8:12]
    outside = big[40, :4]
    with eng.group() as g:
        p_corner = eng._pack(g, corner, "saved")
        p_inside = eng._pack(g, inside, "saved")
        p_outside = eng._pack(g, outside, "saved")
    s = eng.stats()
    assert s.offloaded_tensors == 2 and s.deduplicated == 1
    assert s.offloaded_bytes == (1024 + 16) * 4 + 4 * 4
    for p, v in ((p_corner, corner), (p_inside, inside), (p_outside, outside)):
        torch.testing.assert_close(eng._unpack(p), v, rtol=0, atol=0)


def test_view_restored_with_its_own_size_stride_offset() -> None:
    # pack/unpack by hand: views of one storage, restored from one transfer
    eng = engine()
    base = torch.randn(6, 10, requires_grad=True).exp()  # an activation (it has a grad_fn)
    views = [base, base.t(), base[1:4, 2:9:3], base.view(60)[5:50:5], base[2]]
    with eng.group() as g:
        packed = [eng._pack(g, v, "saved") for v in views]
    assert all(p is not None for p in packed)
    assert eng.stats().offloaded_tensors == 1 and eng.stats().deduplicated == 4
    cached_table = torch.randn(6, 10)  # a leaf without grad: its views stay where they are
    with eng.group() as g:
        assert eng._pack(g, cached_table[:3], "saved") is None
    for p, v in zip(packed, views):
        out = eng._unpack(p)
        assert out.shape == v.shape and out.stride() == v.stride() and out.storage_offset() == v.storage_offset()
        torch.testing.assert_close(out, v, rtol=0, atol=0)


class _ViewOfBuffer(torch.autograd.Function):
    """Returns a view of a buffer it allocated (as a fused kernel that reshapes its output may): the output's
    base is a tensor without grad_fn that only autograd keeps alive."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(x.numel() * 2, dtype=x.dtype)
        buf[: x.numel()] = (x * 2).reshape(-1)
        return buf[: x.numel()].view(x.shape)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g * 2


def test_tracked_view_of_an_untracked_buffer_is_offloaded() -> None:
    # y is a view whose base has no grad_fn, but y itself is tracked: moving it frees the buffer, unlike a
    # view of a weight or of an input batch (which the leaf rule keeps)
    lin = nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)

    def fwd() -> torch.Tensor:
        y = _ViewOfBuffer.apply(lin(x))
        assert y._base is not None and y._base.grad_fn is None and y.grad_fn is not None
        return (y.t() @ y).tanh().sum()  # mm saves y and its transpose: one transfer

    fwd().backward()
    ref = [t.grad.clone() for t in (x, lin.weight)]
    x.grad = lin.weight.grad = lin.bias.grad = None
    eng = engine()
    with eng.group():
        out = fwd()
    out.backward()
    assert_same([x.grad, lin.weight.grad], ref)
    with eng.group() as g:
        y = _ViewOfBuffer.apply(lin(x))
        assert eng._pack(g, y, "saved") is not None  # offloaded (the rule for leaves' views kept it before)
    weight_view = lin.weight.t()  # a view of a parameter: still kept
    with eng.group() as g:
        assert eng._pack(g, weight_view, "saved") is None


@pytest.mark.parametrize("offloaded", [True, False], ids=["offloaded", "kept"])
def test_in_place_after_save_raises_like_autograd(offloaded: bool) -> None:
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)

    def fwd() -> torch.Tensor:
        y = lin(x).sigmoid()  # sigmoid saves its output y
        out = (y * 3).sum()
        y.mul_(2)  # invalid: y is needed by sigmoid's backward
        return out

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fwd().backward()  # plain autograd
    eng = engine(min_offload_bytes=0 if offloaded else 1 << 30)
    with eng.group():
        out = fwd()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_in_place_on_model_output_after_forward_raises() -> None:
    torch.manual_seed(0)
    m = OutputSaved()
    offload_module(m, engine=engine())
    x = torch.randn(8, 16, requires_grad=True)
    out = m(x)
    loss = out.sum()
    with torch.no_grad():
        out.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("mode", [None, "full", "selective"])
def test_nested_checkpoint_with_offload(mode: str | None) -> None:
    torch.manual_seed(0)
    m = NestedCheckpoint()
    leaf = torch.randn(8, 16, requires_grad=True)
    wrapped = nn.Sequential(nn.Identity(), m)  # the block's input is an activation, not a leaf
    wrapped[0].forward = lambda t: t * 1.0
    ref = run_grads(wrapped, leaf)
    if mode is not None:
        elbowroom.checkpoint(m, mode)
    eng = engine()
    offload_module(m, engine=eng)
    assert_same(run_grads(wrapped, leaf), ref)
    assert eng.stats().offloaded_tensors > 0


def test_parameters_buffers_and_small_tensors_stay() -> None:
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16))
            self.register_buffer("scale", torch.rand(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return ((x @ self.w) * self.scale).tanh() @ self.w.t()

    m = WithBuffer()
    x = torch.randn(8, 16, requires_grad=True)
    ref = run_grads(m, x)
    eng = engine(keep_module=m)
    offloaded: list[torch.Tensor] = []
    orig = eng._offload

    def spy(t, *a):  # noqa: ANN001, ANN002
        offloaded.append(t)
        return orig(t, *a)

    eng._offload = spy
    offload_module(m, engine=eng)
    assert_same(run_grads(m, x), ref)
    ptrs = {p.untyped_storage().data_ptr() for p in (m.w, m.scale, x)}
    assert offloaded and all(t.untyped_storage().data_ptr() not in ptrs for t in offloaded)
    # with a threshold above every tensor, nothing moves
    eng2 = engine(min_offload_bytes=1 << 20)
    offload_module(m, engine=eng2)
    assert_same(run_grads(m, x), ref)
    assert eng2.stats().offloaded_tensors == 0 and eng2.stats().kept > 0


# ------------------------------------------------------------------------------------------ ratios
def test_ratio_plan_picks_largest_until_ratio() -> None:
    st = _RatioState(0.5)
    st.choose([10, 40, 30, 20])
    assert st.chosen == {1, 2}
    st = _RatioState(0.1)
    st.choose([10, 40, 30, 20])
    assert st.chosen == {1}


def test_ratio_first_entry_measures_then_offloads_largest() -> None:
    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(8, 64)
            self.l2 = nn.Linear(64, 32)
            self.l3 = nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.l3(self.l2(self.l1(x).relu()).relu())

    torch.manual_seed(0)
    m = Chain()
    x = torch.randn(32, 8, requires_grad=True)
    ref = run_grads(m, x)
    eng = engine()
    per_step = []
    for _ in range(3):
        before = eng.stats().offloaded_bytes
        with eng.group("chain", ratio=0.5):
            out = m(x)
        out.square().mean().backward()
        per_step.append(eng.stats().offloaded_bytes - before)
        m.zero_grad(set_to_none=True)
    measured = eng._states[("chain", "saved", 0.5)].measured
    total = sum(measured)
    assert per_step[0] == total  # the measuring entry offloads everything
    assert per_step[1] == per_step[2] >= 0.5 * total and per_step[1] < total
    assert_same(run_grads(m, x), ref)


def test_ratio_zero_and_one() -> None:
    torch.manual_seed(0)
    m = SavedTwice()
    x = torch.randn(8, 16, requires_grad=True)
    ref = run_grads(m, x)
    eng = engine()
    with eng.group("t", ratio=0.0):
        out = m(x)
    out.square().mean().backward()
    assert eng.stats().offloaded_tensors == 0
    offload_module(m, 1.0, engine=eng)
    assert_same(run_grads(m, x), ref)
    assert eng.stats().offloaded_tensors > 0


# ------------------------------------------------------------------------------------- host pool
def tiny_model(arch: str = "llama", n_layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, dim=64, n_heads=4, ffn_dim=128, n_layers=n_layers, dropout=0.1)
    return build_model(cfg).train()


def lm_step(model: nn.Module, idx: torch.Tensor, seed: int = 3) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize(
    "plan, steps",
    [
        (BlockPolicy(offload_ratio=1.0), 20),
        (BlockPolicy(offload_ratio=0.5), 5),
        (BlockPolicy("full", offload_input=True), 5),
        (BlockPolicy("selective", offload_ratio=0.5), 5),
    ],
    ids=["all-20-steps", "half", "ckpt-inputs", "selective-half"],
)
def test_pool_allocates_in_step_one_only_and_stays_flat(plan: BlockPolicy, steps: int) -> None:
    model = tiny_model()
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    # small chunks, so step 1 makes several host allocations
    eng = engine(chunk_bytes=20 << 10)
    apply_block_policies(model, [plan] * 3 + [BlockPolicy()], engine=eng)
    lm_step(model, idx)
    s1 = eng.stats()
    assert s1.host_allocations >= 2 and s1.offloaded_tensors > 0
    for step in range(steps - 1):
        lm_step(model, idx, seed=step)
        s = eng.stats()
        assert s.host_allocations == s1.host_allocations
        assert s.host_pool_bytes == s1.host_pool_bytes
        assert s.host_pool_in_use_bytes == 0 and s.pending == 0
    assert eng.stats().offloaded_tensors > s1.offloaded_tensors


def test_host_cap_too_small_raises_naming_cap_and_need() -> None:
    model = tiny_model()
    idx = torch.randint(0, 256, (2, 32))
    elbowroom.activations.apply_activation_policy(
        model, offload_ratio=1.0, host_memory_limit_bytes=4096, min_offload_bytes=0, simulate_host=True
    )
    with pytest.raises(ValueError, match=r"needs at least \d+ bytes.*host_memory_limit_bytes=4096"):
        lm_step(model, idx)
    # the engine recovers: a model without offload still runs, and a big enough cap works
    elbowroom.activations.apply_activation_policy(
        model, offload_ratio=1.0, host_memory_limit_bytes=1 << 30, min_offload_bytes=0, simulate_host=True
    )
    lm_step(model, idx)


def test_reserve_up_front_means_no_allocation_in_step_one() -> None:
    model = tiny_model()
    idx = torch.randint(0, 256, (2, 32))
    eng = engine()
    eng.reserve(32 << 20)
    apply_block_policies(model, [BlockPolicy(offload_ratio=1.0)] * 3 + [BlockPolicy()], engine=eng)
    lm_step(model, idx)
    assert eng.stats().host_allocations == 1


# --------------------------------------------------------------------------- release and prefetch
def test_deferred_release_bounds_what_is_in_flight() -> None:
    model = tiny_model(n_layers=5)
    idx = torch.randint(0, 256, (2, 32))
    ref = lm_step(model, idx)
    ref_grads = [p.grad.clone() for p in model.parameters()]
    eng = engine(_cpu_event_delay=1000)  # copies "never finish" until something waits on them
    apply_block_policies(model, [BlockPolicy(offload_ratio=1.0)] * 4 + [BlockPolicy()], engine=eng)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    # after forward only the last offloaded block's copies are still in flight: each older region was
    # released at the end of the region after it (the compute stream waits; no host sync)
    groups = _wrap.get_policy(model.blocks[0]).chain.groups[:4]
    pending_ids = {r.group_id for r in eng._pending}
    assert pending_ids == {groups[3].id}
    for g in groups[:3]:
        recs = [r() for r in g.records]
        assert recs and all(r is not None and r.gpu is None and not r.in_flight for r in recs)
    assert all(r().gpu is not None for r in groups[3].records)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref, rtol=0, atol=0)
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_more_regions_in_flight_when_asked() -> None:
    model = tiny_model(n_layers=5)
    idx = torch.randint(0, 256, (2, 32))
    ref = lm_step(model, idx)
    eng = engine(_cpu_event_delay=1000, max_inflight_regions=2)
    apply_block_policies(model, [BlockPolicy(offload_ratio=1.0)] * 4 + [BlockPolicy()], engine=eng)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    groups = _wrap.get_policy(model.blocks[0]).chain.groups[:4]
    assert {r.group_id for r in eng._pending} == {groups[2].id, groups[3].id}
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref, rtol=0, atol=0)


def test_backward_prefetches_one_block_ahead() -> None:
    model = tiny_model(n_layers=5)
    idx = torch.randint(0, 256, (2, 32))
    eng = engine()
    apply_block_policies(model, [BlockPolicy(offload_ratio=1.0)] * 4 + [BlockPolicy()], engine=eng)
    events: list[tuple[str, int]] = []
    fetch, restore = eng._fetch, eng._restore

    def spy_fetch(rec):  # noqa: ANN001
        events.append(("fetch", rec.group_id))
        return fetch(rec)

    def spy_restore(p):  # noqa: ANN001
        events.append(("unpack", p.record.group_id))
        return restore(p)

    eng._fetch, eng._restore = spy_fetch, spy_restore
    lm_step(model, idx)
    ids = sorted({g for _, g in events})
    assert len(ids) == 4

    def where(kind: str, g: int) -> list[int]:
        return [i for i, e in enumerate(events) if e == (kind, g)]

    for k, g in enumerate(ids):
        fetches, unpacks = where("fetch", g), where("unpack", g)
        assert fetches and unpacks
        # every transfer of block k was on its way before block k's backward asked for any of them
        assert max(fetches) < min(unpacks)
        if k + 2 < len(ids):
            # ... but only one block ahead: not before block k+2's backward was over
            assert min(fetches) > max(where("unpack", ids[k + 2]))
    order = [g for kind, g in events if kind == "fetch"]
    assert order == sorted(order, reverse=True)


def test_one_region_around_the_whole_model_comes_back_through_a_window() -> None:
    model = tiny_model()
    idx = torch.randint(0, 256, (2, 32))
    ref = lm_step(model, idx)
    ref_grads = [p.grad.clone() for p in model.parameters()]
    window = 200 << 10
    eng = engine(prefetch_window_bytes=window)
    peak_ahead, biggest = 0, 0
    fetch = eng._fetch

    def spy(rec):  # noqa: ANN001
        nonlocal peak_ahead, biggest
        fetch(rec)
        biggest = max(biggest, rec.nbytes)
        ahead = sum(r().nbytes for r in region.records if r() is not None and r().restored is not None)
        peak_ahead = max(peak_ahead, ahead)

    eng._fetch = spy
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    with eng.group(ratio=1.0) as region:  # like save_on_cpu: one region, no blocks
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    offloaded = eng.stats().offloaded_bytes
    assert offloaded > 4 * window  # the region is much larger than the window...
    assert 0 < peak_ahead <= window + biggest  # ...but never more than the window came back at once
    torch.testing.assert_close(loss.detach(), ref, rtol=0, atol=0)
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


@pytest.mark.parametrize("tag", ["block", None])
def test_context_manager_form_per_block(tag: str | None) -> None:
    model = tiny_model()
    idx = torch.randint(0, 256, (2, 32))
    ref = lm_step(model, idx)
    ref_grads = [p.grad.clone() for p in model.parameters()]
    eng = engine()

    def forward(idx: torch.Tensor) -> torch.Tensor:
        x = model.tok_emb(idx)
        x = F.dropout(x, model.config.dropout, True)
        for i, blk in enumerate(model.blocks):
            with elbowroom.offload(0.5 if i < 3 else 0.0, tag=tag, engine=eng):
                x = blk(x)
        return model.output(model.norm(x))

    for _ in range(3):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        loss = F.cross_entropy(forward(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        torch.testing.assert_close(loss.detach(), ref, rtol=0, atol=0)
        for p, g in zip(model.parameters(), ref_grads):
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    assert eng.stats().offloaded_tensors > 0 and eng.stats().host_pool_in_use_bytes == 0
    tags = {key[0] for key in eng._states}
    # without a tag, the k-th region of a pass shares the k-th region's measurement (the fourth offloads
    # nothing, so it measures nothing)
    assert tags == ({"block"} if tag else {("#region", k) for k in range(3)})


def test_retain_graph_backward_twice() -> None:
    torch.manual_seed(0)
    m = SavedTwice()
    x = torch.randn(8, 16, requires_grad=True)
    m.zero_grad(set_to_none=True)
    m(x).square().mean().backward(retain_graph=False)
    ref = [p.grad.clone() * 2 for p in m.parameters()]
    eng = engine()
    offload_module(m, engine=eng)
    m.zero_grad(set_to_none=True)
    loss = m(x).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    for p, g in zip(m.parameters(), ref):
        torch.testing.assert_close(p.grad, g)
    del loss
    assert eng.stats().host_pool_in_use_bytes == 0


def test_graph_freed_without_backward_returns_slots() -> None:
    torch.manual_seed(0)
    m = SavedTwice()
    eng = engine()
    offload_module(m, engine=eng)
    out = m(torch.randn(8, 16, requires_grad=True))
    assert eng.stats().host_pool_in_use_bytes > 0
    del out
    assert eng.stats().host_pool_in_use_bytes == 0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: OffloadEngine(min_offload_bytes=-1), "min_offload_bytes"),
        (lambda: OffloadEngine(host_memory_limit_bytes=0), "host_memory_limit_bytes"),
        (lambda: OffloadEngine(max_inflight_regions=0), "max_inflight_regions"),
        (lambda: OffloadEngine(prefetch_window_bytes=0), "prefetch_window_bytes"),
        (lambda: OffloadEngine().group(ratio=1.5), r"ratio must be in \[0, 1\], got 1.5"),
        (lambda: elbowroom.offload(-0.1), r"must be in \[0, 1\]"),
        (lambda: offload_module(nn.Linear(2, 2), 2.0), r"must be in \[0, 1\]"),
        (lambda: offload_module(nn.Linear(2, 2), 0.5, cache_ratio=3), "cache_ratio"),
    ],
)
def test_bad_offload_settings(call, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        call()


class CastSpy(TorchDispatchMode):
    """Weak references to every bf16 cast of a (64, 64) tensor made while active (autocast's weight casts)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16 and out.shape == (64, 64):
            self.refs.append(weakref.ref(out))
        return out

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)


def autocast_grads(m: nn.Module, x: torch.Tensor, spy: CastSpy | None = None) -> tuple[list[torch.Tensor], int]:
    """Gradients of a bf16-autocast step (cache on, backward outside autocast as in a training loop), and how
    many weight casts were alive at the end of forward."""
    m.zero_grad(set_to_none=True)
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with spy if spy is not None else contextlib.nullcontext():
            out = m(x)
        alive = spy.alive() if spy is not None else -1
    out.float().square().sum().backward()
    return [p.grad.clone() for p in m.parameters()] + [x.grad.clone()], alive


def test_autocast_weight_casts_are_recast_not_kept_or_moved() -> None:
    # a saved bf16 cast of a weight neither travels (it is no activation) nor stays: backward casts again,
    # so it lives only while its op runs. Gradients are bit-identical to the plain autocast run.
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    ref, alive_plain = autocast_grads(m, x, CastSpy())
    assert alive_plain == 2  # plain autocast: both casts alive to the end of forward (cache and saved)
    eng = engine(keep_module=m, min_offload_bytes=0)
    offloaded: list[torch.Tensor] = []
    orig = eng._offload

    def spy(t, *a):  # noqa: ANN001, ANN002
        offloaded.append(t)
        return orig(t, *a)

    eng._offload = spy
    offload_module(m, engine=eng)
    got, alive = autocast_grads(m, x, CastSpy())
    assert alive == 0
    assert_same(got, ref)
    assert offloaded and all(t.shape[0] == 32 for t in offloaded)  # activations only, no (64, 64) weight
    assert eng.stats().recast == 3  # both weights, and the input's cast (a leaf too: alive anyway)


def test_recast_refuses_a_parameter_changed_before_backward() -> None:
    m = nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)  # so that the weight's cast is saved (for x's gradient)
    offload_module(m, engine=engine())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    with torch.no_grad():
        m.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified in place between forward and backward.*recast_parameter_casts"):
        out.float().sum().backward()
    # opting out keeps the cast (plain autograd's behaviour: the old cast is used)
    eng = engine(recast_parameter_casts=False)
    offload_module(m, engine=eng)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    with torch.no_grad():
        m.weight.mul_(0.5)
    out.float().sum().backward()
    assert eng.stats().recast == 0 and m.weight.grad is not None


@pytest.mark.parametrize("mode", ["full", "selective", "offload"])
def test_wrapped_blocks_keep_no_autocast_weight_cache(mode: str) -> None:
    # autocast caches each weight's bf16 copy until forward ends; in a recomputed or offloaded block that copy
    # is never used again, so the block runs with the cache off: no cast outlives its op, gradients unchanged
    torch.manual_seed(0)
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(3)))
    x = torch.randn(32, 64, requires_grad=True)
    ref, alive_plain = autocast_grads(blocks, x, CastSpy())
    assert alive_plain == 6
    eng = engine()
    for blk in blocks:
        if mode == "offload":
            offload_module(blk, engine=eng)
        else:
            elbowroom.checkpoint(blk, mode)
    seen: list[bool] = []
    blocks[1][1].register_forward_hook(lambda *_: seen.append(torch.is_autocast_cache_enabled()))
    got, alive = autocast_grads(blocks, x, CastSpy())
    assert alive == 0 and seen and not any(seen)  # forward (and the recompute, if any) ran without the cache
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        blocks(x)
        assert torch.is_autocast_cache_enabled()  # restored outside the blocks


def test_blocks_kept_whole_in_a_plan_recast_their_weights() -> None:
    # in a plan that recomputes some blocks, the blocks kept whole still drop their saved weight casts (cast
    # again in backward): no cast outlives forward anywhere, gradients bit-identical to plain autocast
    torch.manual_seed(0)

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(3)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for blk in self.blocks:
                x = blk(x)
            return x

    m = Stack()
    x = torch.randn(32, 64, requires_grad=True)
    ref, _ = autocast_grads(m, x)
    apply_block_policies(m, [BlockPolicy("full"), BlockPolicy(), BlockPolicy()])
    assert _wrap.get_policy(m.blocks[1]).offload.ratio == 0.0  # a region that only recasts
    got, alive = autocast_grads(m, x, CastSpy())
    assert alive == 0
    assert_same(got, ref)
    apply_block_policies(m, [BlockPolicy()] * 3)  # an all-default plan wraps nothing
    assert all(_wrap.get_policy(b) is None for b in m.blocks)
