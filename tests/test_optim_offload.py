"""CPUOffloadOptimizer on CPU: the same bookkeeping as on a GPU, checked against torch's own optimizers.

On CPU the "device" parameters and the host masters are both CPU tensors, copies are plain copies and the
copy and step threads run as on a GPU. Tolerances: exact (bitwise) against torch's fused CPU kernels, which
the offloaded part runs; 1e-6 absolute where the reference takes another arithmetic path (unfused kernels,
GradScaler's division inside a fused kernel).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import elbowroom
from elbowroom.optim import (
    CPUOffloadConfig,
    CPUOffloadOptimizer,
    _host_adam,
    build_optimizer,
    clipping,
    first_fraction,
    last_fraction,
)
from elbowroom.optim import buffers as buffers_mod
from elbowroom.optim import engine as engine_mod
from elbowroom.optim import placement as placement_mod

OPTIMS = {
    "adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95)}),
    "sgd": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
}


_KNOBS: dict[str, object] = {}  # the CPUOffloadConfig fields of the optimizers the current test builds


@pytest.fixture(autouse=True)
def small_buckets() -> Iterator[None]:
    # several buckets even for these small models, so bucketing and the slot pool are exercised
    _KNOBS.update(bucket_bytes=2048, num_staging_slots=2)
    # two OpenMP teams on CI's two cores slow each other down a lot; these models need no threads
    _KNOBS.update(cpu_threads=1)
    yield
    _KNOBS.clear()


def knobs(**fields: object) -> None:
    """Set CPUOffloadConfig fields for the optimizers this test builds next with ``make_opt``."""
    _KNOBS.update(fields)


def make_opt(params, *args, config: CPUOffloadConfig | None = None, **kwargs) -> CPUOffloadOptimizer:
    """A CPUOffloadOptimizer with this test's settings (small buckets, see ``small_buckets`` and ``knobs``)."""
    return CPUOffloadOptimizer(params, *args, config=config or CPUOffloadConfig(**_KNOBS), **kwargs)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the training thread's own team (OpenMP thread counts are per thread)
    yield
    torch.set_num_threads(n)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def groups_of(model: nn.Module, with_groups: bool) -> list:
    ps = list(model.parameters())
    if not with_groups:
        return ps
    return [
        {"params": ps[:4], "wd_mult": 1.0, "lr_mult": 1e-4, "lr": 2e-2},
        {"params": ps[4:], "wd_mult": 0.0, "lr_mult": 2e-4, "weight_decay": 0.0},
    ]


def batches(n: int, seed: int = 1, bsz: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(bsz, 12, generator=g) for _ in range(n)]


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean() + model(x).sum() * 0.01


def train(model, opt, data, *, accum: int = 1, clip: float | None = None, torch_clip: bool = False, sched=None):
    norms = []
    ours = isinstance(opt, CPUOffloadOptimizer)
    for s in range(0, len(data), accum):
        mbs = data[s : s + accum]
        for i, x in enumerate(mbs):
            ctx = opt.accumulating(i < len(mbs) - 1) if ours else torch.enable_grad()
            with ctx:
                (loss_of(model, x) / len(mbs)).backward()
        if clip is not None:
            if ours and not torch_clip:
                norms.append(opt.clip_grad_norm_(clip))
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return norms


def assert_same(m1: nn.Module, m2: nn.Module, atol: float = 0.0, rtol: float = 0.0) -> None:
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, n=n: f"{n}: {m}")


# ------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("with_groups", [False, True])
@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_matches_torch_exactly(name: str, with_groups: bool, fraction: float, overlap: bool) -> None:
    cls, kw = OPTIMS[name]
    m1, m2 = make_model(), make_model()
    o1 = make_opt(groups_of(m1, with_groups), cls, offload_fraction=fraction, overlap=overlap, **kw)
    o2 = cls(groups_of(m2, with_groups), fused=True, **kw)
    data = batches(10)
    train(m1, o1, data)
    train(m2, o2, data)
    assert_same(m1, m2)  # exact: the same fused CPU kernel on the same values
    if with_groups:
        assert o1.param_groups[0]["wd_mult"] == 1.0 and o1.param_groups[1]["lr_mult"] == 2e-4
        assert o1.param_groups[0]["lr"] == 2e-2 and o1.param_groups[1]["weight_decay"] == 0.0
    expected = {0.0: 0, 1.0: 8}.get(fraction)
    if expected is not None:
        assert o1.stats()["offloaded_params"] == expected
    o1.close()


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_close_to_unfused_torch(name: str) -> None:
    cls, kw = OPTIMS[name]
    m1, m2 = make_model(), make_model()
    o1 = make_opt(m1.parameters(), cls, offload_fraction=0.5, **kw)
    o2 = cls(m2.parameters(), **kw)  # torch's default (for-loop) implementation
    data = batches(10)
    train(m1, o1, data)
    train(m2, o2, data)
    assert_same(m1, m2, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", [None, True, False])
def test_step_in_backward_modes(mode: bool | None) -> None:
    m1, m2 = make_model(), make_model()
    o1 = make_opt(m1.parameters(), torch.optim.AdamW, lr=1e-2)
    o1.step_in_backward = mode
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    data = batches(6)
    train(m1, o1, data)
    train(m2, o2, data)
    assert_same(m1, m2)
    assert o1.step_in_backward is (True if mode is None else mode)  # learned: nothing needed all grads


def test_step_in_backward_learned_off_by_clipping() -> None:
    m = make_model()
    o = make_opt(m.parameters(), torch.optim.AdamW, lr=1e-2)
    train(m, o, batches(2), clip=1.0)
    assert o.step_in_backward is False


def test_eager_step_then_clip_raises() -> None:
    m = make_model()
    o = make_opt(m.parameters(), torch.optim.AdamW, lr=1e-2)
    o.step_in_backward = True
    loss_of(m, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="step_in_backward"):
        o.clip_grad_norm_(1.0)


def test_closure() -> None:
    m1, m2 = make_model(), make_model()
    o1 = make_opt(m1.parameters(), torch.optim.Adam, offload_fraction=0.5, lr=1e-2)
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-2, fused=True)
    for x in batches(4):
        for m, o in ((m1, o1), (m2, o2)):

            def closure(m=m, o=o, x=x):
                o.zero_grad()
                loss = loss_of(m, x)
                loss.backward()
                return loss

            loss = o.step(closure)
            assert loss is not None
    assert_same(m1, m2)


# ------------------------------------------------------------------------------------------ accumulation
@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_accumulation(fraction: float, offload_gradients: bool, clip: float | None) -> None:
    m1, m2 = make_model(), make_model()
    o1 = make_opt(
        m1.parameters(), torch.optim.AdamW, offload_fraction=fraction, offload_gradients=offload_gradients, lr=1e-2
    )
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    data = batches(12)
    n1 = train(m1, o1, data, accum=4, clip=clip)
    n2 = train(m2, o2, data, accum=4, clip=clip)
    # accumulation on the host adds in the same order as on the device; norms may differ in the last bit
    tol = 0.0 if clip is None else 1e-6
    assert_same(m1, m2, atol=tol, rtol=tol * 10)
    for a, b in zip(n1, n2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_offload_gradients_frees_device_grads() -> None:
    m = make_model()
    o = make_opt(m.parameters(), torch.optim.AdamW, offload_fraction=0.5, offload_gradients=True, lr=1e-2)
    loss_of(m, batches(1)[0]).backward()
    offloaded = [p for p in m.parameters() if p in o._placement.hp_of]
    resident = [p for p in m.parameters() if p not in o._placement.hp_of]
    assert offloaded and resident
    assert all(p.grad is None for p in offloaded)  # taken by the hooks as soon as final
    assert all(p.grad is not None for p in resident)
    o.step()


def test_accumulation_without_signal_raises() -> None:
    m = make_model()
    o = make_opt(m.parameters(), torch.optim.AdamW, lr=1e-2)  # alive: its hooks check
    x = batches(1)[0]
    loss_of(m, x).backward()
    with pytest.raises(RuntimeError, match="accumulating"):
        loss_of(m, x).backward()
    o.close()


def test_sync_gradients_attribute() -> None:
    m1, m2 = make_model(), make_model()
    o1 = make_opt(m1.parameters(), torch.optim.AdamW, offload_gradients=True, lr=1e-2)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    data = batches(4)
    for i, x in enumerate(data):
        o1.sync_gradients = i == len(data) - 1
        (loss_of(m1, x) / 4).backward()
        (loss_of(m2, x) / 4).backward()
    o1.step()
    o2.step()
    assert_same(m1, m2)


# ------------------------------------------------------------------------------------------ clipping
@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_clip_matches_torch(fraction: float, offload_gradients: bool) -> None:
    m1, m2 = make_model(), make_model()
    o1 = make_opt(
        m1.parameters(), torch.optim.AdamW, offload_fraction=fraction, offload_gradients=offload_gradients, lr=1e-2
    )
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    data = batches(6)
    n1 = train(m1, o1, data, clip=0.05)
    n2 = train(m2, o2, data, clip=0.05)
    for a, b in zip(n1, n2):
        torch.testing.assert_close(a, b, atol=0, rtol=1e-6)
    assert any(float(n) > 0.05 for n in n2)  # clipping did something
    assert_same(m1, m2, atol=1e-6, rtol=1e-5)


def test_torch_clip_on_model_params_is_seen() -> None:
    # torch.nn.utils.clip_grad_norm_ edits the device grads in place after the hooks copied them:
    # the optimizer notices (tensor version counters) and copies them again
    m1, m2 = make_model(), make_model()
    o1 = make_opt(m1.parameters(), torch.optim.AdamW, offload_fraction=0.5, lr=1e-2)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    data = batches(5)
    train(m1, o1, data, clip=0.05, torch_clip=True)
    train(m2, o2, data, clip=0.05)
    assert_same(m1, m2)
    assert o1.step_in_backward is False


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_skip_if_nonfinite(offload_gradients: bool) -> None:
    m1, m2 = make_model(), make_model()
    o1 = make_opt(
        m1.parameters(), torch.optim.AdamW, offload_fraction=0.5, offload_gradients=offload_gradients, lr=1e-2
    )
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    data = batches(4)
    data[2] = data[2].clone()
    data[2][0, 0] = float("inf")
    for i, x in enumerate(data):
        loss_of(m1, x).backward()
        n1 = o1.clip_grad_norm_(1.0, skip_if_nonfinite=True)
        o1.step()
        o1.zero_grad()
        loss_of(m2, x).backward()
        n2 = torch.nn.utils.clip_grad_norm_(m2.parameters(), 1.0)
        if torch.isfinite(n2):
            o2.step()
        o2.zero_grad()
        assert bool(torch.isfinite(n1)) == bool(torch.isfinite(n2))
        assert o1.stats()["skipped"] == (i == 2)
    assert_same(m1, m2, atol=1e-6, rtol=1e-5)
    assert all(torch.isfinite(p).all() for p in m1.parameters())


def test_error_if_nonfinite() -> None:
    m = make_model()
    o = make_opt(m.parameters(), torch.optim.AdamW, lr=1e-2)
    x = batches(1)[0].clone()
    x[0, 0] = float("nan")
    loss_of(m, x).backward()
    with pytest.raises(RuntimeError, match="non-finite"):
        o.clip_grad_norm_(1.0, error_if_nonfinite=True)


# ------------------------------------------------------------------------------------------ GradScaler
@pytest.mark.parametrize("unscale_and_clip", [False, True])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_grad_scaler(fraction: float, unscale_and_clip: bool) -> None:
    m1, m2 = make_model(), make_model()
    o1 = make_opt(m1.parameters(), torch.optim.AdamW, offload_fraction=fraction, lr=1e-2)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=False)  # GradScaler unscales its grads in place
    s1 = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    s2 = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    data = batches(6)
    data[3] = data[3].clone()
    data[3][1, 2] = float("inf")
    scales = []
    for x in data:
        for m, o, s in ((m1, o1, s1), (m2, o2, s2)):
            s.scale(loss_of(m, x)).backward()
            if unscale_and_clip:
                s.unscale_(o)
                if o is o1:
                    o.clip_grad_norm_(0.05)
                else:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            s.step(o)
            s.update()
            o.zero_grad()
        assert s1.get_scale() == s2.get_scale()
        scales.append(s1.get_scale())
    assert any(b < a for a, b in zip(scales, scales[1:]))  # the inf step was skipped and backed off
    assert_same(m1, m2, atol=1e-6, rtol=1e-5)


def test_grad_scaler_with_offload_gradients_raises() -> None:
    m = make_model()
    o = make_opt(m.parameters(), torch.optim.AdamW, offload_gradients=True, lr=1e-2)
    s = torch.amp.GradScaler("cpu")
    s.scale(loss_of(m, batches(1)[0])).backward()
    with pytest.raises(ValueError, match="GradScaler"):
        s.step(o)


# ------------------------------------------------------------------------------------------ schedulers
def test_lr_schedulers_take_effect() -> None:
    m1, m2 = make_model(), make_model()
    o1 = make_opt(groups_of(m1, True), torch.optim.AdamW, offload_fraction=0.5, lr=1e-2)
    o2 = torch.optim.AdamW(groups_of(m2, True), lr=1e-2, fused=True)
    assert isinstance(o1, torch.optim.Optimizer)
    # OneCycleLR also cycles Adam's beta1: every hyperparameter in param_groups must reach the inner steps
    s1 = torch.optim.lr_scheduler.OneCycleLR(o1, max_lr=[5e-2, 1e-2], total_steps=10)
    s2 = torch.optim.lr_scheduler.OneCycleLR(o2, max_lr=[5e-2, 1e-2], total_steps=10)
    data = batches(10)
    train(m1, o1, data, sched=s1)
    train(m2, o2, data, sched=s2)
    assert_same(m1, m2)
    assert [g["lr"] for g in o1.param_groups] == [g["lr"] for g in o2.param_groups]
    assert [g["betas"] for g in o1.param_groups] == [g["betas"] for g in o2.param_groups]


def test_step_lr() -> None:
    m1, m2 = make_model(), make_model()
    o1 = make_opt(m1.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9, fused=True)
    s1 = torch.optim.lr_scheduler.StepLR(o1, step_size=2, gamma=0.1)
    s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=2, gamma=0.1)
    data = batches(6)
    train(m1, o1, data, sched=s1)
    train(m2, o2, data, sched=s2)
    assert_same(m1, m2)
    assert o1.param_groups[0]["lr"] == pytest.approx(1e-4)


# ------------------------------------------------------------------------------------------ state dict
def test_state_empty_before_first_step_and_layout() -> None:
    m = make_model()
    o = make_opt(groups_of(m, True), torch.optim.Adam, offload_fraction=0.5, lr=1e-2)
    assert len(o.state_dict()["state"]) == 0
    train(m, o, batches(1))
    sd = o.state_dict()
    assert set(sd["state"]) == set(range(8))
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sd["param_groups"][0]["wd_mult"] == 1.0
    first = sd["state"][0]
    assert set(first) >= {"step", "exp_avg", "exp_avg_sq"}
    assert first["exp_avg"].device.type == "cpu" and first["exp_avg"].shape == (24, 12)
    assert o.state[next(m.parameters())] is sd["state"][0]  # opt.state points at the live state


@pytest.mark.parametrize(("src", "dst"), [(1.0, 0.5), (0.5, 0.0), (0.0, 1.0), (0.5, 0.5)])
def test_state_dict_round_trip(src: float, dst: float) -> None:
    ma = make_model()
    oa = make_opt(groups_of(ma, True), torch.optim.AdamW, offload_fraction=src, lr=1e-2)
    data = batches(6)
    train(ma, oa, data[:3])
    buf = io.BytesIO()
    torch.save({"model": ma.state_dict(), "opt": oa.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    mb = make_model(seed=123)  # different weights: the masters must be re-read after loading
    ob = make_opt(groups_of(mb, True), torch.optim.AdamW, offload_fraction=dst, lr=5.0)
    ob.load_state_dict(ck["opt"])
    mb.load_state_dict(ck["model"])  # after the optimizer: masters are refreshed at the next step
    assert ob.param_groups[0]["lr"] == 2e-2 and ob.param_groups[1]["lr"] == 1e-2
    train(ma, oa, data[3:])
    train(mb, ob, data[3:])
    assert_same(ma, mb)
    sa, sb = oa.state_dict(), ob.state_dict()
    for k in sa["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(sa["state"][k][name].cpu(), sb["state"][k][name].cpu(), atol=0, rtol=0)


@pytest.mark.parametrize(("src", "dst"), [(1.0, 0.5), (0.0, 0.5), (0.5, 0.5)])
def test_load_state_dict_copies_instead_of_sharing(src: float, dst: float) -> None:
    # b.load_state_dict(a.state_dict()) without a save in between: torch keeps a state tensor that is
    # already where it belongs, so without copies a and b would advance the same moments and step counts
    ma, mb = make_model(), make_model()
    oa = make_opt(ma.parameters(), torch.optim.AdamW, offload_fraction=src, lr=1e-2)
    train(ma, oa, batches(3))
    mb.load_state_dict(ma.state_dict())
    ob = make_opt(mb.parameters(), torch.optim.AdamW, offload_fraction=dst, lr=1e-2)
    ob.load_state_dict(oa.state_dict())
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    for k in sa:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert sa[k][name].data_ptr() != sb[k][name].data_ptr(), (k, name)
    data = batches(3, seed=7)
    train(ma, oa, data)
    train(mb, ob, data)
    assert_same(ma, mb)


def test_host_norm_is_accurate_for_big_gradients() -> None:
    # torch's CPU vector_norm of 16.7M float32 values is ~7e-4 too small; the GPU kernel is not
    g = torch.Generator().manual_seed(0)
    for n in (2**24 + 3, 4096, 5, 0):
        x = torch.randn(n, generator=g) * 1e-3
        got = clipping.host_norm(x.view(-1, 1) if n else x)
        want = torch.linalg.vector_norm(x.double())
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_state_dict_interop_with_torch() -> None:
    m1, m2, m3 = make_model(), make_model(), make_model()
    ref = torch.optim.AdamW(m1.parameters(), lr=1e-2, fused=True)
    data = batches(6)
    train(m1, ref, data[:3])
    m2.load_state_dict(m1.state_dict())
    ours = make_opt(m2.parameters(), torch.optim.AdamW, offload_fraction=0.5, lr=1e-2)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch -> ours
    back = torch.optim.AdamW(m3.parameters(), lr=1e-2, fused=True)
    train(m2, ours, data[3:5])
    m3.load_state_dict(m2.state_dict())
    back.load_state_dict(copy.deepcopy(ours.state_dict()))  # ours -> torch
    train(m1, ref, data[3:])
    train(m2, ours, data[5:])
    train(m3, back, data[5:])
    assert_same(m1, m2)
    assert_same(m1, m3)


def test_reload_weights() -> None:
    m1, m2 = make_model(), make_model()
    o1 = make_opt(m1.parameters(), torch.optim.AdamW, offload_fraction=0.5, lr=1e-2)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    data = batches(4)
    train(m1, o1, data[:2])
    train(m2, o2, data[:2])
    with torch.no_grad():
        for a, b in zip(m1.parameters(), m2.parameters()):
            a.mul_(0.5)
            b.mul_(0.5)
    o1.reload_weights()
    train(m1, o1, data[2:])
    train(m2, o2, data[2:])
    assert_same(m1, m2)


def test_load_state_dict_mismatch_raises() -> None:
    m = make_model()
    o = make_opt(groups_of(m, True), torch.optim.AdamW, lr=1e-2)
    other = make_opt(make_model().parameters(), torch.optim.AdamW, lr=1e-2)
    with pytest.raises(ValueError, match="number of parameter groups"):
        o.load_state_dict(other.state_dict())


# ------------------------------------------------------------------------------------------ placement
def test_offload_params_list_and_predicate() -> None:
    m1, m2, m3 = make_model(), make_model(), make_model()
    late = last_fraction(m1.parameters(), 0.3)
    assert late[-1] is list(m1.parameters())[-1]
    o1 = make_opt(m1.parameters(), torch.optim.AdamW, offload_params=late, lr=1e-2)
    assert set(o1._placement.hp_of) == set(late)
    o2 = make_opt(m2.parameters(), torch.optim.AdamW, offload_params=lambda p: p.dim() == 2, lr=1e-2)
    assert {tuple(p.shape) for p in o2._placement.hp_of} == {(24, 12), (24, 24), (16, 24), (3, 16)}
    o3 = torch.optim.AdamW(m3.parameters(), lr=1e-2, fused=True)
    data = batches(4)
    for m, o in ((m1, o1), (m2, o2), (m3, o3)):
        train(m, o, data)
    assert_same(m1, m3)
    assert_same(m2, m3)


def test_fraction_split_is_by_bytes_in_order() -> None:
    m = make_model()
    ps = list(m.parameters())
    o = make_opt(m.parameters(), torch.optim.AdamW, offload_fraction=0.5, lr=1e-2)
    assert set(o._placement.hp_of) == set(first_fraction(ps, 0.5)) == set(ps[:3])  # 288+24+576 >= half of 1587


def test_add_param_group() -> None:
    m1, m2 = make_model(), make_model()
    p1, p2 = list(m1.parameters()), list(m2.parameters())
    o1 = make_opt(p1[:4], torch.optim.AdamW, offload_fraction=0.5, lr=1e-2)
    o2 = torch.optim.AdamW(p2[:4], lr=1e-2, fused=True)
    data = batches(6)
    train(m1, o1, data[:2])
    train(m2, o2, data[:2])
    o1.add_param_group({"params": p1[4:], "lr": 3e-2})
    o2.add_param_group({"params": p2[4:], "lr": 3e-2})
    train(m1, o1, data[2:])
    train(m2, o2, data[2:])
    assert_same(m1, m2)


# Where the casts of bf16 device weights run: on the device (gradients travel upcast, masters travel and are
# cast there), or on the host around torch's fused kernel, chunk by chunk or over whole buckets; all three
# bitwise torch's. Small chunks, so that every parameter spans several.
@pytest.fixture(params=["device", "chunked", "whole"])
def host_step(request: pytest.FixtureRequest) -> str:
    knobs(cast_on_device=request.param == "device", chunked_host_step=request.param == "chunked")
    knobs(host_chunk_numel=128, device_chunk_numel=128)  # the device masters' step, too
    return request.param


def _used_casts(opt: CPUOffloadOptimizer, kind: str) -> None:
    cast = [hp for hp in opt._placement.hps if not hp.same_dtype]
    assert cast and all(hp.device_cast == (kind == "device") for hp in cast)
    assert opt._engine.chunked == (kind == "chunked")
    assert bool(opt._engine.h2d_buffers) == (kind != "device")  # host-side casts stage bf16 copies


def _master_step(masters: list[torch.Tensor], model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The hand-written reference: step fp32 copies with the bf16 model's gradients, cast back, drop the grads."""
    for w, p in zip(masters, model.parameters()):
        w.grad = p.grad.float()
    opt.step()
    with torch.no_grad():
        for w, p in zip(masters, model.parameters()):
            p.copy_(w)
            p.grad = None


def test_master_weights_bf16(host_step: str) -> None:
    # device params in bf16, fp32 masters (host for offloaded, device for the rest): equal to a hand-written
    # mixed-precision loop that steps fp32 copies with the bf16 model's grads and casts back
    m1 = make_model().to(torch.bfloat16)
    m2 = make_model().to(torch.bfloat16)
    masters = [p.detach().float() for p in m2.parameters()]
    o1 = make_opt(m1.parameters(), torch.optim.AdamW, offload_fraction=0.5, master_weights=True, lr=1e-2)
    o2 = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    for x in batches(5):
        loss_of(m1, x.bfloat16()).float().backward()
        o1.step()
        o1.zero_grad()
        loss_of(m2, x.bfloat16()).float().backward()
        _master_step(masters, m2, o2)
    assert all(p.dtype == torch.bfloat16 for p in m1.parameters())
    _used_casts(o1, host_step)
    assert_same(m1, m2)
    sd = o1.state_dict()
    for i, w in enumerate(masters):
        torch.testing.assert_close(sd["state"][i]["master_weight"].cpu(), w, atol=0, rtol=0)


@pytest.mark.parametrize("opt_class", [torch.optim.AdamW, torch.optim.SGD])
def test_device_masters_accumulate_and_step_in_chunks(opt_class, monkeypatch: pytest.MonkeyPatch) -> None:
    # the device half of a bf16 model keeps fp32 masters on the device; Adam(W) steps them through one fp32
    # scratch (no fp32 copy of all gradients at once): a parameter larger than it chunk by chunk, the smaller
    # ones together in one fused call; other optimizers through torch's own step on upcast gradients; all equal
    # a hand-written loop over two accumulated micro-batches per step, bitwise
    knobs(device_chunk_numel=192)
    calls: list[int] = []
    batched: list[list[int]] = []
    real, real_batched = _host_adam.step_chunked, _host_adam.step_batched
    monkeypatch.setattr(
        _host_adam, "step_chunked", lambda *a, **k: calls.append(a[2].numel()) or real(*a, **k)
    )
    monkeypatch.setattr(
        _host_adam, "step_batched", lambda *a, **k: batched.append([m.numel() for m in a[2]]) or real_batched(*a, **k)
    )
    kw = {"lr": 1e-2, "momentum": 0.9} if opt_class is torch.optim.SGD else {"lr": 1e-2, "weight_decay": 0.1}
    m1 = make_model().to(torch.bfloat16)
    m2 = make_model().to(torch.bfloat16)
    masters = [p.detach().float() for p in m2.parameters()]
    o1 = make_opt(m1.parameters(), opt_class, offload_fraction=0.5, master_weights=True, **kw)
    o2 = opt_class(masters, fused=True, **kw)
    data = batches(6)
    for i in range(0, 6, 2):
        for j, x in enumerate(data[i : i + 2]):
            with o1.accumulating(j == 0):
                loss_of(m1, x.bfloat16()).float().backward()
            loss_of(m2, x.bfloat16()).float().backward()
        o1.step()
        o1.zero_grad()
        _master_step(masters, m2, o2)
    assert_same(m1, m2)
    assert all(m.grad is None for m in o1._placement.dev_masters.values())
    device_numel = sorted(m.numel() for m in o1._placement.dev_masters.values())
    if opt_class is torch.optim.AdamW:
        large = [n for n in device_numel if n > 192]
        small = [n for n in device_numel if n <= 192]
        assert large and small and sum(small) <= 192  # both paths run
        assert sorted(calls[: len(large)]) == large and len(calls) == 3 * len(large)
        assert [sorted(b) for b in batched] == [small] * 3  # one fused call per step for all the small ones
        assert max(device_numel) > 192  # some parameter spans several chunks
    else:
        assert calls == []
    sd = o1.state_dict()
    for i, w in enumerate(masters):
        torch.testing.assert_close(sd["state"][i]["master_weight"].cpu(), w, atol=0, rtol=0)


def _wide_model(seed: int = 0, width: int = 72) -> nn.Module:
    # a 40 x 72 matrix (2880 elements, 11.5 kB in fp32) against 2 kB slots: six pieces, the last one partial
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, width), nn.Tanh(), nn.Linear(width, 3))


@pytest.mark.parametrize(
    "weights, host_step, lazy",
    [("fp32", "device", True), ("fp32", "device", False), ("bf16", "device", True), ("bf16", "chunked", True),
     ("bf16", "whole", True), ("bf16", "chunked", False)],
)
def test_parameters_bigger_than_a_slot_step_in_pieces(
    weights: str, host_step: str, lazy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a parameter bigger than a staging slot travels and steps piece by piece, with accumulation and (fp32)
    # clipping: bitwise the whole step, and staging stays bounded by the slot size instead of growing with the
    # largest gradient. bf16 weights with each placement of the casts (the reference clips in bf16 on the
    # device, we in fp32: no clipping there). Its pieces take two paths: streamed by the copy thread through
    # the staging slots when the step's values are known as the gradient arrives (here: the forward waiting
    # per module, whose jobs are copied after step(); and bf16 steps in backward after the first), or copied by
    # the step thread through its own two buffers for a job held at a closed gate (fp32 clipping without
    # overlap_with_forward; the first bf16 step, which learns whether steps may run in backward)
    knobs(cast_on_device=host_step == "device", chunked_host_step=host_step == "chunked", host_chunk_numel=128)
    clip = weights == "fp32"
    m1, m2 = _wide_model(), _wide_model()
    p1 = list(m1.parameters())
    kw = {"lr": 1e-2, "weight_decay": 0.1} if weights == "fp32" else {"lr": 1e-2}  # bf16: the reference's
    if weights == "bf16":
        o1 = make_opt(p1, offload_fraction=1.0, param_dtype=torch.bfloat16, **kw)
        step2, _ = _bf16_reference(m2, list(m2.parameters()))
    else:
        o1 = make_opt(p1, offload_fraction=1.0, **kw)
        o2 = torch.optim.AdamW(m2.parameters(), fused=True, **kw)
    if lazy:
        o1.overlap_with_forward(m1)
    big = o1._placement.hp_of[m1[2].weight].bucket
    host_cast = weights == "bf16" and host_step != "device"  # bf16 gradients staged: 2 B per element
    assert big.piece_numel == (1024 if host_cast else 512)  # a 2 kB slot's worth, a multiple of 64
    assert 2880 % big.piece_numel
    data = batches(6)
    for i in range(0, 6, 2):
        for j, x in enumerate(data[i : i + 2]):
            with o1.accumulating(j == 0):
                (_autocast_loss(m1, x) if weights == "bf16" else loss_of(m1, x)).backward()
            (_autocast_loss(m2, x) if weights == "bf16" else loss_of(m2, x)).backward()
        if clip:
            o1.clip_grad_norm_(0.05)
            torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.05)
        o1.step()
        o1.zero_grad()
        if weights == "bf16":
            step2()
        else:
            o2.step()
            o2.zero_grad()
    o1.wait_for_weights()
    assert_same(m1, m2)
    # every byte of every gradient crossed once per step (the per-step figure lags under overlap_with_forward:
    # count the engine's totals once all steps are done), the big one through the step thread's own buffers
    # (counted as its re-copies) only for the steps held at a closed gate
    engine = o1._engine
    per_step = sum(p.numel() * (2 if p.dtype == torch.bfloat16 and host_cast else 4) for p in p1)
    counts = engine.counters()
    assert counts["d2h_bytes"] + counts["recopy_bytes"] == 3 * per_step
    # which path a held job's pieces take depends on whether the copy thread reaches the job before step()
    # opens the gate (both are exact, as assert_same showed): at most the held steps go through the own buffers,
    # each a whole big gradient, never part of one
    own_steps = 0 if lazy else 3 if clip else 1
    big_bytes = 2880 * (2 if host_cast else 4)
    assert counts["recopy_bytes"] % big_bytes == 0 and counts["recopy_bytes"] <= own_steps * big_bytes
    # staging is bounded by the bucket size (2 kB here; at most twice that for a bucket of bf16 weights staged
    # in fp32), not by the largest gradient: also with the big layer four times as wide
    wider = list(_wide_model(width=288).parameters())
    if weights == "bf16":
        o3 = make_opt(wider, offload_fraction=1.0, param_dtype=torch.bfloat16, **kw)
    else:
        o3 = make_opt(wider, offload_fraction=1.0, **kw)
    for o in (o1, o3):
        e, slot = o._engine, o._slot_bytes
        assert 2048 <= slot <= 4096 and [t.numel() for t in e.piece_slots] == [2048, 2048]
        assert o.stats()["staging_bytes"] == slot * (o.config.num_staging_slots + len(e.h2d_buffers)) + 2 * 2048
    sd = o1.state_dict()
    n = 2  # the big weight's index
    assert sd["state"][n]["step"].item() == 3  # advanced once per step, not once per piece
    assert sd["state"][n]["exp_avg"].shape == (72, 40)


def test_casts_on_the_device_go_through_one_buffer_per_copy_stream() -> None:
    # a copy that changes dtype on the device goes through its stream's fixed buffer a chunk at a time: exact for
    # every length around the chunk, both ways, and the bytes that crossed are the host side's (the wider)
    scratch = torch.empty(24)
    for n in (1, 23, 24, 25, 100):
        src = torch.randn(n).to(torch.bfloat16)
        up = torch.empty(n)
        assert buffers_mod.cast_through(up, src, scratch) == 4 * n
        assert torch.equal(up, src.float())
        down = torch.empty(n, dtype=torch.bfloat16)
        assert buffers_mod.cast_through(down, up, scratch) == 4 * n
        assert torch.equal(down, src)
    # the optimizer with bf16 weights and fp32 masters cast on the device, every parameter through a 96-byte buffer
    # (24 fp32 elements: the big weight in 120 chunks each way): bitwise the reference, and the buffers are the only
    # memory its copies made
    knobs(cast_on_device=True, cast_chunk_bytes=96)
    m1, m2 = _wide_model(), _wide_model()
    o1 = make_opt(list(m1.parameters()), offload_fraction=1.0, param_dtype=torch.bfloat16, lr=1e-2)
    step2, _ = _bf16_reference(m2, list(m2.parameters()))
    _train_beside_reference(m1, o1, m2, step2, batches(3))
    o1.wait_for_weights()
    assert_same(m1, m2)
    casts = o1._streams._casts
    assert casts and all(b.numel() == 96 and b.dtype == torch.uint8 for b in casts.values())
    # a copy in one dtype needs no buffer: a plain copy, its own bytes
    s = buffers_mod.Streams(torch.device("cpu"))
    a, b = torch.randn(10), torch.empty(10)
    assert s.copy_cast(b, a) == 40 and torch.equal(a, b) and not s._casts


def test_a_failed_piece_copy_fails_the_step_without_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    # the copy thread streams a big parameter's pieces to the step thread; if a copy fails there, step() raises
    # the optimizer's error (with the cause) instead of leaving the step thread waiting for pieces
    m = _wide_model()
    o = make_opt(m.parameters(), offload_fraction=1.0, lr=1e-2)
    data = batches(3)
    loss_of(m, data[0]).backward()
    o.step()  # the first step learns that steps may run in backward; the next ones stream their pieces
    o.zero_grad()

    class Unreadable:
        def reshape(self, *shape: int) -> torch.Tensor:
            raise OSError("device copy failed")

    streamed = []

    def failing(engine: engine_mod.Engine, job: engine_mod.Job, g: torch.Tensor) -> None:
        streamed.append(job.params[0].index)
        real(engine, job, Unreadable())  # type: ignore[arg-type]

    real = engine_mod.Engine._stream_pieces
    monkeypatch.setattr(engine_mod.Engine, "_stream_pieces", failing)
    loss_of(m, data[1]).backward()
    done = threading.Event()
    errors: list[BaseException] = []

    def step() -> None:
        try:
            o.step()
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)
        done.set()

    threading.Thread(target=step, daemon=True).start()
    assert done.wait(20), "step() hung after a failed piece copy"
    assert streamed == [2]  # the 40 x 72 weight
    (err,) = errors
    assert isinstance(err, RuntimeError) and "worker failed (OSError: device copy failed)" in str(err)
    assert isinstance(err.__cause__, OSError) and "device copy failed" in str(err.__cause__)
    assert not isinstance(err, torch.OutOfMemoryError)
    o.close()


def test_a_worker_out_of_memory_is_raised_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # a worker's device scratch can run out of memory under a capped allocator: step() raises it as
    # torch.OutOfMemoryError (what the trainer's first-steps guard catches to re-plan), naming the worker
    m = _wide_model()
    o = make_opt(m.parameters(), offload_fraction=1.0, lr=1e-2)
    data = batches(2)
    loss_of(m, data[0]).backward()
    o.step()
    o.zero_grad()

    class NoRoom:
        def reshape(self, *shape: int) -> torch.Tensor:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    real = engine_mod.Engine._stream_pieces
    monkeypatch.setattr(engine_mod.Engine, "_stream_pieces",
                        lambda engine, job, g: real(engine, job, NoRoom()))  # type: ignore[arg-type]
    loss_of(m, data[1]).backward()
    with pytest.raises(torch.OutOfMemoryError, match=r"worker failed \(OutOfMemoryError: CUDA out of memory"):
        o.step()
    o.close()


def test_sgd_parameters_bigger_than_a_slot_widen_the_slots() -> None:
    # pieces are for Adam/AdamW; other optimizers stage a big parameter whole (slots sized by it), exactly
    m1, m2 = _wide_model(), _wide_model()
    o1 = make_opt(m1.parameters(), torch.optim.SGD, offload_fraction=1.0, lr=1e-2, momentum=0.9)
    o2 = torch.optim.SGD(m2.parameters(), lr=1e-2, momentum=0.9, fused=True)
    train(m1, o1, batches(4))
    train(m2, o2, batches(4))
    assert_same(m1, m2)
    assert not any(b.piece_numel for b in o1._placement.buckets)
    assert o1.stats()["staging_bytes"] >= 2 * 2880 * 4


def _bf16_reference(m: nn.Module, late: list[torch.Tensor]):
    """A hand-written hybrid: ``late`` parameters kept in bf16 with fp32 masters stepped by fused AdamW, the rest
    stepped in fp32; returns a step function."""
    late_ids = {id(p) for p in late}
    pairs = []
    for p in m.parameters():
        if id(p) in late_ids and p.dim() >= 2:  # matrices only: vectors keep fp32
            w = p.detach().clone()  # the fp32 value before the cast is the master
            p.data = p.data.bfloat16()
            pairs.append((p, w))
    cast = {id(p) for p, _ in pairs}
    early = [p for p in m.parameters() if id(p) not in cast]
    o_early = torch.optim.AdamW(early, lr=1e-2, fused=True)
    o_late = torch.optim.AdamW([w for _, w in pairs], lr=1e-2, fused=True)

    def step() -> None:
        for p, w in pairs:
            w.grad = p.grad.float()
        o_early.step()
        o_late.step()
        with torch.no_grad():
            for p, w in pairs:
                p.copy_(w)
        for p in m.parameters():
            p.grad = None

    return step, pairs


def _autocast_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return loss_of(m, x).float()


def _train_beside_reference(m1: nn.Module, o1: CPUOffloadOptimizer, m2: nn.Module, step2, data) -> None:
    """The same steps under autocast on ``m1`` with ``o1`` and on ``m2`` with the reference step ``step2``."""
    for x in data:
        _autocast_loss(m1, x).backward()
        o1.step()
        o1.zero_grad()
        _autocast_loss(m2, x).backward()
        step2()


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_param_dtype_casts_offloaded_params(offload_gradients: bool, host_step: str) -> None:
    # param_dtype=bf16: the offloaded parameters become bf16 on the device (same Parameter objects), their
    # fp32 values become host masters; equal (bitwise) to a hand-written bf16-params + fp32-masters loop
    m1, m2 = make_model(), make_model()
    p1 = list(m1.parameters())
    late1 = last_fraction(p1, 0.5)
    original = [p.detach().clone() for p in p1]
    o1 = make_opt(
        p1, offload_params=late1, param_dtype=torch.bfloat16, offload_gradients=offload_gradients, lr=1e-2
    )
    late_ids = {id(p) for p in late1}
    bf16 = [id(p) in late_ids and p.dim() >= 2 for p in p1]
    assert [p.dtype for p in m1.parameters()] == [torch.bfloat16 if b else torch.float32 for b in bf16]
    assert list(m1.parameters()) == p1  # cast in place: the module still holds the same Parameter objects
    for hp in o1._placement.hps:
        if bf16[hp.index]:  # the cast ones' masters hold the full-precision values (the others re-read theirs)
            torch.testing.assert_close(hp.master, original[hp.index], atol=0, rtol=0)
    step2, pairs = _bf16_reference(m2, last_fraction(list(m2.parameters()), 0.5))
    _train_beside_reference(m1, o1, m2, step2, batches(5))
    _used_casts(o1, host_step)
    assert_same(m1, m2)
    sd = o1.state_dict()
    masters = iter(w for _, w in pairs)
    for i, is_bf16 in enumerate(bf16):
        if is_bf16:
            torch.testing.assert_close(sd["state"][i]["master_weight"], next(masters), atol=0, rtol=0)
        else:
            assert "master_weight" not in sd["state"][i]
    # host memory: 12 B per offloaded parameter plus bounded staging (a host gradient in the staged dtype: +4 with
    # the casts on the device, where it is fp32, +2 on the host, where it stays bf16)
    st = o1.stats()
    # fp32 scratch only where a host gradient is not in its master's dtype: none with the casts on the device, one
    # chunk when they step chunk by chunk, a bucket's upcast otherwise
    largest = max(hp.param.numel() for hp in o1._placement.hps if not hp.same_dtype)
    if host_step == "device":
        assert st["scratch_bytes"] == 0
        if offload_gradients:  # fp32 host gradients: the host step is the fused fp32 kernel, no upcast there
            assert all(hp.hgrad.dtype == torch.float32 for hp in o1._placement.hps)
    elif host_step == "chunked":
        assert st["scratch_bytes"] == 4 * min(o1.config.host_chunk_numel, largest)
    else:
        assert st["scratch_bytes"] >= 4 * largest
    staging = st["staging_bytes"] + st["scratch_bytes"]
    hgrad_bytes = sum(hp.hgrad.numel() * hp.hgrad.element_size() for hp in o1._placement.hps if hp.hgrad is not None)
    extra = hgrad_bytes if offload_gradients else 0
    state = st["host_bytes"] - staging - extra
    assert state == pytest.approx(12 * st["offloaded_numel"], rel=0.05)


@pytest.mark.parametrize(
    "cls,kw",
    [
        (torch.optim.AdamW, {"weight_decay": 0.1, "betas": (0.9, 0.95)}),
        (torch.optim.Adam, {"weight_decay": 0.01, "maximize": True}),
    ],
)
def test_chunked_step_matches_torch(cls: type, kw: dict) -> None:
    # chunk by chunk against torch's fused CPU optimizer on fp32 copies of the same bf16 gradients: 10 steps, a
    # learning rate that changes every step, gradient multipliers (clipping): bitwise
    gen = torch.Generator().manual_seed(0)
    shapes = [(37, 5), (300,), (2,)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    ref = [w.clone() for w in init]
    opt_ref = cls(ref, lr=1e-2, fused=True, **kw)
    opt_ours = cls([w.clone() for w in init], lr=1e-2, fused=True, **kw)  # holds the state in torch's layout
    assert _host_adam.supports(opt_ours)
    masters = opt_ours.param_groups[0]["params"]
    scratch = torch.empty(64)
    for step in range(10):
        for o in (opt_ref, opt_ours):
            o.param_groups[0]["lr"] = 1e-2 * (0.8**step)
        mults = [torch.tensor(0.5), torch.tensor(0.9)] if step % 3 == 0 else []
        grads = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
        for w, g in zip(ref, grads):
            w.grad = g.float()
            for m in mults:
                w.grad.mul_(m)
        opt_ref.step()
        for w, g in zip(masters, grads):
            out = torch.empty(w.shape, dtype=torch.bfloat16)
            _host_adam.step_chunked(opt_ours, opt_ours.param_groups[0], w, g, out, scratch, mults, chunk=64)
            assert torch.equal(out, w.bfloat16())  # the device copy is the new master, cast
    for a, b in zip(masters, ref):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt_ours.state[a][key], opt_ref.state[b][key], atol=0, rtol=0)


def test_chunked_step_declines_what_it_cannot_run() -> None:
    w = [torch.zeros(3)]
    assert not _host_adam.supports(torch.optim.AdamW(w, fused=False))  # unfused: foreach arithmetic differs
    assert not _host_adam.supports(torch.optim.AdamW(w, fused=True, amsgrad=True))
    assert not _host_adam.supports(torch.optim.SGD(w, lr=0.1))


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_host_casts_with_clipping_and_accumulation(offload_gradients: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 device weights, 2 micro-batches, global-norm clipping: casts on the device, chunked or whole-bucket
    # casts on the host agree bitwise
    knobs(host_chunk_numel=128)
    results = []
    for kind in ("device", "chunked", "whole"):
        knobs(cast_on_device=kind == "device", chunked_host_step=kind == "chunked")
        m = make_model()
        o = make_opt(
            m.parameters(),
            offload_fraction=0.7,
            param_dtype=torch.bfloat16,
            offload_gradients=offload_gradients,
            lr=1e-2,
            weight_decay=0.1,
        )
        data = batches(8)
        for i in range(0, 8, 2):
            for j in range(2):
                with o.accumulating(j == 0):
                    _autocast_loss(m, data[i + j]).backward()
            o.clip_grad_norm_(0.05)
            o.step()
            o.zero_grad()
        assert o._engine.chunked == (kind == "chunked")
        if offload_gradients:  # host gradients in the staged dtype: fp32 only where the casts run on the device
            want = torch.float32 if kind == "device" else torch.bfloat16
            assert {hp.hgrad.dtype for hp in o._placement.hps if not hp.same_dtype} == {want}
        results.append((m, [hp.master.clone() for hp in o._placement.hps]))
    m2, w2 = results[-1]
    for kind, (m1, w1) in zip(("device", "chunked"), results[:-1]):
        if kind == "device" and offload_gradients:
            # with the casts on the device the host gradient is fp32: the two micro-batches are summed in fp32 on
            # the host, not in bf16 (as the host-cast paths and torch's own bf16 .grad do), so the runs differ by
            # the rounding of that sum, within a bf16 step of the weights
            assert_same(m1, m2, atol=4e-3, rtol=0)
            for a, b in zip(w1, w2):
                torch.testing.assert_close(a, b, atol=4e-3, rtol=0)
            continue
        assert_same(m1, m2)
        for a, b in zip(w1, w2):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_param_dtype_resumes_exactly() -> None:
    # state_dict -> fresh model and optimizer with param_dtype: training continues on the same curve, because
    # the fp32 masters travel in the state dict (the bf16 model weights alone would lose them)
    data = batches(8)
    m1 = make_model()
    o1 = make_opt(m1.parameters(), offload_fraction=0.6, param_dtype=torch.bfloat16, lr=1e-2)
    for x in data[:4]:
        _autocast_loss(m1, x).backward()
        o1.step()
        o1.zero_grad()
    msd, osd = copy.deepcopy(m1.state_dict()), copy.deepcopy(o1.state_dict())
    m2 = make_model(seed=5)
    o2 = make_opt(m2.parameters(), offload_fraction=0.6, param_dtype=torch.bfloat16, lr=1e-2)
    m2.load_state_dict(msd)
    o2.load_state_dict(osd)
    for x in data[4:]:
        for m, o in ((m1, o1), (m2, o2)):
            _autocast_loss(m, x).backward()
            o.step()
            o.zero_grad()
    assert_same(m1, m2)


@pytest.mark.parametrize("bad", [torch.int8, "bfloat16", torch.bool])
def test_param_dtype_rejects_non_float(bad) -> None:
    with pytest.raises(ValueError, match="param_dtype must be a floating-point"):
        make_opt(make_model().parameters(), param_dtype=bad, lr=1e-2)


# ------------------------------------------------------------------------------------------ overlap with forward
class _SlowAdamW(torch.optim.AdamW):
    """AdamW whose step takes a while: a forward that does not wait for its weights reads stale ones."""

    def step(self, closure=None):
        if any(p.device.type == "cpu" and not p.requires_grad for g in self.param_groups for p in g["params"]):
            time.sleep(0.003)  # host masters only (they do not require grad)
        return super().step(closure)


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_overlap_with_forward(clip: float | None, offload_gradients: bool, accum: int) -> None:
    m1, m2 = make_model(), make_model()
    late = last_fraction(m1.parameters(), 0.6)
    o1 = make_opt(
        m1.parameters(), _SlowAdamW, offload_params=late, offload_gradients=offload_gradients, lr=1e-2
    )
    o1.overlap_with_forward(m1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    data = batches(9)
    train(m1, o1, data, accum=accum, clip=clip)
    train(m2, o2, data, accum=accum, clip=clip)
    o1.wait_for_weights()
    tol = 0.0 if clip is None else 1e-6
    assert_same(m1, m2, atol=tol, rtol=tol * 10)
    assert o1.step_in_backward is (clip is None)
    assert o1.stats()["steps"] == 9 // accum


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("use_wait_for", [True, False])
def test_overlap_with_forward_functional_use(
    offload_gradients: bool, use_wait_for: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the last layer's weight read functionally (as a fused head + loss does): wait_for() before the read keeps
    # the result torch's; without it the optimizer notices at the next gradient, waits, and says so
    def fwd(m: nn.Module, x: torch.Tensor, o: CPUOffloadOptimizer | None) -> torch.Tensor:
        h = m[:-1](x)
        if o is not None and use_wait_for:
            o.wait_for(m[-1].parameters())
        y = torch.nn.functional.linear(h, m[-1].weight, m[-1].bias)
        return y.pow(2).mean()

    knobs(bucket_bytes=256)  # the last layer in buckets of its own
    m1, m2 = make_model(), make_model()
    o1 = make_opt(
        m1.parameters(),
        _SlowAdamW,
        offload_params=last_fraction(m1.parameters(), 0.6),
        offload_gradients=offload_gradients,
        lr=1e-2,
    )
    o1.overlap_with_forward(m1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    with caplog.at_level("WARNING", logger="elbowroom.optim.offload"):
        for x in batches(5):
            for m, o in ((m1, o1), (m2, o2)):
                fwd(m, x, o if o is o1 else None).backward()
                o.step()
                o.zero_grad()
    o1.wait_for_weights()
    warned = any("used outside the forward of its module" in r.message for r in caplog.records)
    assert warned != use_wait_for
    if use_wait_for:  # without it the reads may race the CPU step on a GPU; on the CPU they are ordered anyway
        assert_same(m1, m2)


def test_overlap_with_forward_state_dict_waits() -> None:
    m1, m2 = make_model(), make_model()
    o1 = make_opt(m1.parameters(), _SlowAdamW, offload_fraction=1.0, lr=1e-2)
    o1.overlap_with_forward(m1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    data = batches(3)
    train(m1, o1, data, clip=1.0)
    train(m2, o2, data, clip=1.0)
    sa, sb = o1.state_dict(), o2.state_dict()  # waits for the last CPU step
    assert_same(m1, m2, atol=1e-6, rtol=1e-5)
    for k in sb["state"]:
        torch.testing.assert_close(sa["state"][k]["exp_avg"], sb["state"][k]["exp_avg"], atol=1e-6, rtol=1e-5)


def test_overlap_with_forward_needs_the_model() -> None:
    m = make_model()
    o = make_opt(m.parameters(), torch.optim.AdamW, lr=1e-2)
    with pytest.raises(ValueError, match="not parameters of the given model"):
        o.overlap_with_forward(make_model())


# ------------------------------------------------------------------------------------------ memory, stats
def test_host_memory_within_13_bytes_per_param(monkeypatch: pytest.MonkeyPatch) -> None:
    knobs(bucket_bytes=64 << 10)
    model = nn.Sequential(*[nn.Linear(128, 128, bias=False) for _ in range(48)])  # 786k params
    o = make_opt(model.parameters(), torch.optim.AdamW, lr=1e-3)
    before = o.stats()["host_bytes_per_offloaded_param"]
    assert before <= 4.5  # set-up: masters and the staging pool only; moments come with the first step
    model(torch.randn(2, 128)).sum().backward()
    o.step()
    s = o.stats()
    assert 12.0 <= s["host_bytes_per_offloaded_param"] <= 13.0, s
    assert s["offloaded_numel"] == 48 * 128 * 128 and s["device_numel"] == 0
    for key in ("cpu_step_s", "cpu_wait_s", "hidden_fraction", "d2h_bytes", "h2d_bytes", "pinned_bytes"):
        assert key in s
    assert s["d2h_bytes"] == s["h2d_bytes"] == 4 * 48 * 128 * 128


def test_offload_gradients_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    knobs(bucket_bytes=64 << 10)
    model = nn.Sequential(*[nn.Linear(128, 128, bias=False) for _ in range(48)])
    o = make_opt(model.parameters(), torch.optim.AdamW, offload_gradients=True, lr=1e-3)
    model(torch.randn(2, 128)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    o.step()
    b = o.stats()["host_bytes_per_offloaded_param"]
    assert 16.0 <= b <= 17.0, b  # 12 + a 4-byte host gradient per parameter + the staging pool


def test_threads_stop_when_optimizer_is_collected() -> None:
    def workers() -> int:
        return sum(t.name.startswith("elbowroom-optim") for t in threading.enumerate())

    gc.collect()  # optimizers of earlier tests that sit in reference cycles stop now, not in the middle
    n0 = workers()
    m = make_model()
    o = make_opt(m.parameters(), torch.optim.AdamW, lr=1e-2)
    train(m, o, batches(1))
    assert workers() == n0 + 2
    del o
    gc.collect()
    assert workers() == n0
    loss_of(m, batches(1)[0]).backward()  # the hooks are gone with it


def test_cpu_threads_default_leaves_two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    # the training thread, autograd's device thread and the copy thread need cores of their own; torch's own
    # count is not read (a DataLoader's pinning thread sets it to 1 for the whole process)
    knobs(cpu_threads=None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        o = make_opt(make_model().parameters(), torch.optim.AdamW, lr=1e-2)
    finally:
        torch.set_num_threads(n)
    assert o.stats()["cpu_threads"] == 14
    o.close()
    knobs(cpu_threads=3)
    o = make_opt(make_model().parameters(), torch.optim.AdamW, lr=1e-2)
    assert o.stats()["cpu_threads"] == 3
    o.close()


def test_build_optimizer() -> None:
    m = make_model()
    kw = {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "fused": None}
    plain = build_optimizer(m.parameters(), offload_fraction=0.0, offload_gradients=False, **kw)
    assert type(plain) is torch.optim.AdamW
    ours = build_optimizer(m.parameters(), offload_fraction=0.0, offload_gradients=True, **kw)
    assert isinstance(ours, CPUOffloadOptimizer) and ours.param_groups[0]["betas"] == (0.9, 0.95)
    half = build_optimizer(m.parameters(), offload_fraction=0.5, offload_gradients=False, **{**kw, "fused": True})
    assert isinstance(half, CPUOffloadOptimizer)
    assert elbowroom.CPUOffloadOptimizer is CPUOffloadOptimizer


# ------------------------------------------------------------------------------------------ bad settings
@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan"), "0.5", True])
def test_bad_fraction(fraction: object) -> None:
    with pytest.raises(ValueError, match="offload_fraction"):
        make_opt(make_model().parameters(), offload_fraction=fraction)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, 12, 4.0, "64MiB"])
def test_bad_cast_chunk_bytes(size: object) -> None:
    with pytest.raises(ValueError, match="cast_chunk_bytes must be a positive multiple of 8"):
        CPUOffloadConfig(cast_chunk_bytes=size)  # type: ignore[arg-type]


def test_not_an_optimizer_class() -> None:
    with pytest.raises(TypeError, match="optimizer_class"):
        make_opt(make_model().parameters(), object)  # type: ignore[arg-type]


class _DeviceOnlySGD(torch.optim.SGD):
    """Stands for an optimizer with no CPU implementation (apex / TE fused optimizers)."""

    def __init__(self, params, lr=0.1, **kw):  # no `fused` keyword
        super().__init__(params, lr=lr)

    def step(self, closure=None):
        if any(p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
            raise RuntimeError("expected CUDA tensors")
        return super().step(closure)


def test_optimizer_class_not_runnable_on_cpu() -> None:
    with pytest.raises(ValueError, match="cannot step CPU tensors"):
        make_opt(make_model().parameters(), _DeviceOnlySGD)


def test_bad_optimizer_kwargs_raise_the_class_error() -> None:
    with pytest.raises(ValueError, match="learning rate"):
        make_opt(make_model().parameters(), torch.optim.AdamW, lr=-1.0)


def test_offload_params_conflicts() -> None:
    m = make_model()
    with pytest.raises(ValueError, match="offload_params"):
        make_opt(m.parameters(), offload_fraction=0.5, offload_params=list(m.parameters())[:2])
    with pytest.raises(ValueError, match="not parameters"):
        make_opt(list(m.parameters())[:2], offload_params=[torch.zeros(3, requires_grad=True)])


def test_params_on_two_devices() -> None:
    a = nn.Parameter(torch.zeros(3))
    b = nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        make_opt([a, b])


def test_host_memory_too_small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement_mod, "available_host_bytes", lambda: 10_000)
    with pytest.raises(RuntimeError, match="host memory"):
        make_opt(make_model().parameters(), torch.optim.AdamW)


def test_pinned_alloc_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeCudart:
        @staticmethod
        def cudaHostRegister(ptr: int, n: int, flags: int) -> int:
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart)
    mem = buffers_mod.HostMemory(pin=True)
    with pytest.raises(RuntimeError, match="could not pin"):
        mem.empty((1024,), torch.float32, pinned=True)


def test_trace_steps_timeline(monkeypatch: pytest.MonkeyPatch) -> None:
    # trace_steps: each step's timeline, in order, from the previous step() call: hand-over, copy, CPU step
    knobs(trace_steps=True)
    m = make_model()
    o = make_opt(m.parameters(), offload_fraction=1.0, lr=1e-2)
    train(m, o, batches(3))
    trace = o.stats()["trace"]
    kinds = {w for w, *_ in trace}
    assert {"flush", "copied", "step", "step_call"} <= kinds
    assert all(t0 <= t1 for _, _, t0, t1 in trace)
    n_buckets = len(o._placement.buckets)
    assert sum(w == "step" for w, *_ in trace) == n_buckets
    assert trace[-1][0] == "step_call" and trace[-1][2] > 0  # times count from the previous step() call
    assert o.stats()["copy_wait_s"] >= 0.0 and o.stats()["chunked"] is False  # fp32 weights: no casts


@pytest.mark.parametrize("step_order", ["needed_first", "arrival"])
def test_offloaded_gradients_step_earliest_needed_first(step_order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # offload_gradients: gradients reach the host ahead of the CPU steps, so several jobs wait at once; the step
    # thread takes the one the next forward needs first (lowest parameter index), not arrival order (late layers
    # first; step_order="arrival" keeps that), and the values are the same either way (each bucket steps on its
    # own gradients)
    from elbowroom.optim import engine as engine_mod

    knobs(trace_steps=True, bucket_bytes=256, step_order=step_order)  # one bucket per layer or smaller
    data = batches(3)
    m_ref = make_model()
    o_ref = make_opt(m_ref.parameters(), offload_fraction=1.0, offload_gradients=True, lr=1e-2)
    train(m_ref, o_ref, data)
    m = make_model()
    o = make_opt(m.parameters(), offload_fraction=1.0, offload_gradients=True, lr=1e-2)
    train(m, o, data[:2])
    o.stats()  # the trace from here is the last step's
    gate = threading.Event()
    first: list[int] = []
    step_bucket = engine_mod.Engine._step_bucket

    def held_first(self, job, plan):  # the first job of the step holds the step thread until backward is over
        if not first:
            first.append(job.params[0].index)
            assert gate.wait(30)
        step_bucket(self, job, plan)

    monkeypatch.setattr(engine_mod.Engine, "_step_bucket", held_first)
    loss_of(m, data[2]).backward()  # every bucket is handed over while the first one's step is held
    n = len(o._placement.buckets)
    deadline = time.monotonic() + 30
    while o._engine._copy_q.qsize() and time.monotonic() < deadline:  # the copy thread passes every job on
        time.sleep(0.001)
    time.sleep(0.05)
    gate.set()
    o.step()
    o.zero_grad()
    order = [i for w, i, *_ in o.stats()["trace"] if w == "step"]
    assert len(order) == n > 3
    assert order[0] == first[0]  # one of the late layers, whose gradients are final first
    if step_order == "needed_first":
        assert order[1:] == sorted(order[1:])  # then forward order, although they arrived late layers first
    else:
        assert order == sorted(order, reverse=True)  # as they arrived
    assert_same(m, m_ref)
    o.close()
    o_ref.close()


def test_offloaded_gradients_step_landed_jobs_while_a_copy_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # needed_first: a job taken off the queue whose copy has not landed (backward hooks run ahead of the device) is
    # put aside while jobs already on the host step, then taken again: every job steps once, the values are exact
    from elbowroom.optim.buffers import Streams

    knobs(bucket_bytes=256, step_order="needed_first")
    data = batches(4)
    m_ref = make_model()
    o_ref = make_opt(m_ref.parameters(), offload_fraction=1.0, offload_gradients=True, lr=1e-2)
    train(m_ref, o_ref, data)
    asked = [0]

    def every_other(event) -> bool:  # (CPU copies have no events) a copy reads as running every other time asked
        asked[0] += 1
        return asked[0] % 2 == 0

    monkeypatch.setattr(Streams, "done", staticmethod(every_other))
    m = make_model()
    o = make_opt(m.parameters(), offload_fraction=1.0, offload_gradients=True, lr=1e-2)
    train(m, o, data)
    assert asked[0] >= 2  # the step thread put jobs aside while landed ones waited, and took them again
    assert_same(m, m_ref)
    o.close()
    o_ref.close()


# ------------------------------------------------------------------------------------------ config, lifecycle
def test_config_sets_the_knobs_and_keywords_override_it() -> None:
    cfg = CPUOffloadConfig(offload_fraction=0.5, bucket_bytes=1024, num_staging_slots=1, cpu_threads=1)
    o1 = CPUOffloadOptimizer(make_model().parameters(), config=cfg, lr=1e-2)
    assert o1.config is cfg
    s1 = o1.stats()
    assert (s1["num_staging_slots"], s1["cpu_threads"]) == (1, 1) and s1["slot_bytes"] <= 1024
    assert 0 < s1["offloaded_params"] < 8
    o2 = CPUOffloadOptimizer(make_model().parameters(), config=cfg, offload_fraction=1.0, lr=1e-2)
    assert o2.config == dataclasses.replace(cfg, offload_fraction=1.0) and cfg.offload_fraction == 0.5
    assert o2.stats()["offloaded_params"] == 8
    assert o2.offloaded_parameters() == list(o2.param_groups[0]["params"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bucket_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError, match="CPUOffloadConfig"):
        CPUOffloadOptimizer(make_model().parameters(), config={"bucket_bytes": 1})  # type: ignore[arg-type]
    o1.close()
    o2.close()


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"bucket_bytes": 0}, "bucket_bytes must be a positive int"),
        ({"num_staging_slots": 0}, "num_staging_slots must be an int >= 1"),
        ({"cpu_threads": 0}, "cpu_threads must be an int >= 1"),
        ({"host_chunk_numel": 100}, "multiple of 64"),
        ({"device_chunk_numel": -1}, "device_chunk_numel"),
        ({"param_dtype": "int8"}, "param_dtype must name a floating-point dtype"),
        ({"offload_fraction": 2.0}, "offload_fraction"),
        ({"overlap": "yes"}, "overlap must be True or False"),
        ({"join_timeout_s": 0}, "join_timeout_s"),
        ({"step_order": "fifo"}, 'step_order must be "needed_first" or "arrival"'),
    ],
)
def test_config_rejects_bad_values(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CPUOffloadConfig(**fields)


def test_build_optimizer_takes_a_config() -> None:
    kw = {"lr": 1e-2, "weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "fused": None}
    cfg = CPUOffloadConfig(offload_fraction=0.5, num_staging_slots=1, cpu_threads=1)
    o = build_optimizer(make_model().parameters(), config=cfg, **kw)
    assert isinstance(o, CPUOffloadOptimizer) and o.config == cfg and o.stats()["num_staging_slots"] == 1
    o.close()
    plain = build_optimizer(make_model().parameters(), config=cfg, offload_fraction=0.0, **kw)  # keywords win
    assert type(plain) is torch.optim.AdamW


def test_two_optimizers_in_one_process_use_their_own_settings() -> None:
    # two optimizers stepping in turn with different buckets and staging pools (and one tracing): each
    # allocates and uses its own, and both step exactly as torch
    m1, m2, m3 = make_model(), make_model(), make_model()
    a = CPUOffloadOptimizer(
        m1.parameters(), config=CPUOffloadConfig(bucket_bytes=2048, num_staging_slots=2, cpu_threads=1), lr=1e-2
    )
    b = CPUOffloadOptimizer(
        m2.parameters(),
        config=CPUOffloadConfig(bucket_bytes=512, num_staging_slots=1, cpu_threads=1, trace_steps=True),
        lr=1e-2,
    )
    ref = torch.optim.AdamW(m3.parameters(), lr=1e-2, fused=True)
    for x in batches(4):
        for m, o in ((m1, a), (m2, b), (m3, ref)):
            loss_of(m, x).backward()
            o.step()
            o.zero_grad()
    assert_same(m1, m3)
    assert_same(m2, m3)
    sa, sb = a.stats(), b.stats()
    assert (sa["num_staging_slots"], sb["num_staging_slots"]) == (2, 1)
    assert (sa["slot_bytes"], sb["slot_bytes"]) == (2048, 512)  # the largest bucket, or one piece, of each
    assert sb["buckets"] > sa["buckets"]
    assert "trace" in sb and "trace" not in sa
    a.close()
    b.close()


def _new_workers(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.name.startswith("elbowroom-optim")]


def test_close_joins_the_worker_threads_and_a_second_close_does_nothing() -> None:
    before = set(threading.enumerate())
    m = make_model()
    o = make_opt(m.parameters(), lr=1e-2)
    train(m, o, batches(2))
    mine = _new_workers(before)
    assert len(mine) == 2
    o.close()
    assert not any(t.is_alive() for t in mine)  # joined, not left running
    o.close()
    loss_of(m, batches(1)[0]).backward()  # the hooks went with close(): nothing reaches the closed optimizer


def test_close_raises_naming_a_stuck_thread_and_keeps_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # a step thread that does not finish (simulated: it waits before its loop) makes close() raise with its
    # name; the host memory is released only once a later close() has joined it
    release = threading.Event()
    real_loop = engine_mod.Engine._step_loop

    def stuck_loop(engine: engine_mod.Engine) -> None:
        release.wait(30)
        real_loop(engine)

    released: list[int] = []
    real_release = buffers_mod.HostMemory.release
    monkeypatch.setattr(engine_mod.Engine, "_step_loop", stuck_loop)
    monkeypatch.setattr(buffers_mod.HostMemory, "release", lambda mem: released.append(1) or real_release(mem))
    knobs(join_timeout_s=0.2)
    before = set(threading.enumerate())
    o = make_opt(make_model().parameters(), lr=1e-2)
    mine = _new_workers(before)
    with pytest.raises(RuntimeError, match=r"elbowroom-optim-step-\d+ did not finish within 0.2 s"):
        o.close()
    assert released == []
    release.set()
    o.close()  # the thread finishes now: joined, then the memory is released
    assert released == [1] and not any(t.is_alive() for t in mine)
    o.close()
    assert released == [1]


def test_a_stuck_thread_at_collection_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    # without close(), the collection of the optimizer shuts it down; a failure there is reported as an
    # unraisable error (only at interpreter exit is it swallowed), never silently dropped
    release = threading.Event()
    real_loop = engine_mod.Engine._step_loop
    monkeypatch.setattr(engine_mod.Engine, "_step_loop", lambda e: release.wait(30) or real_loop(e))
    reported: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_value))
    knobs(join_timeout_s=0.2)
    o = make_opt(make_model().parameters(), lr=1e-2)
    del o
    gc.collect()
    release.set()
    assert len(reported) == 1 and "did not finish" in str(reported[0])


def test_interpreter_exit_with_a_stuck_thread_is_quiet(tmp_path) -> None:
    # at interpreter exit the same failure is expected (CUDA and threads may be torn down) and swallowed
    script = tmp_path / "exit.py"
    script.write_text(
        "import threading, torch\n"
        "from elbowroom.optim import CPUOffloadConfig, CPUOffloadOptimizer, engine\n"
        "real = engine.Engine._step_loop\n"
        "engine.Engine._step_loop = lambda e: threading.Event().wait(5) or real(e)\n"
        "o = CPUOffloadOptimizer([torch.nn.Parameter(torch.zeros(4))], config=CPUOffloadConfig(join_timeout_s=0.2))\n"
        "print('built')\n"
    )
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "built", proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_closed_optimizer_refuses_new_work_instead_of_hanging() -> None:
    m = make_model()
    o = make_opt(m.parameters(), lr=1e-2)
    train(m, o, batches(1))
    o.close()
    assert set(o.state_dict()["state"]) == set(range(8))  # what it learned can still be saved
    loss_of(m, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="was closed"):
        o.step()


def test_fsdp2_layers_sharded_without_a_mesh_step_like_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    # fully_shard without mesh= makes a new default mesh for each call: the optimizer takes equal meshes as one
    from torch.distributed.fsdp import fully_shard

    from tests.distributed_utils import one_process_group

    with one_process_group(monkeypatch):
        plain = make_model()
        ref = torch.optim.AdamW(plain.parameters(), **OPTIMS["adamw"][1])
        model = make_model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        assert len({id(p.device_mesh) for p in model.parameters()}) > 1  # the layout this test is about
        opt = make_opt(model.parameters(), torch.optim.AdamW, offload_fraction=0.5, **OPTIMS["adamw"][1])
        data = batches(3)
        train(plain, ref, data, clip=1.0)
        train(model, opt, data, clip=1.0)
        opt.close()
        for a, b in zip(plain.parameters(), model.parameters()):
            torch.testing.assert_close(b.full_tensor(), a.detach(), rtol=1e-5, atol=1e-6)


def test_a_finished_step_keeps_no_gradient_alive() -> None:
    """Gradients edited after their hand-over (torch's clip_grad_norm_) are copied again from the step's plan; once
    that step's updates have landed nothing of the optimizer's may keep them alive. (Under DDP they are views of its
    buckets: a plan that held them kept DDP's first buckets allocated through the step that rebuilt them.) The 24 x
    24 weight is bigger than a 2 kB bucket: it steps piece by piece, the others whole."""
    import weakref

    m = make_model()
    o = make_opt(m.parameters(), torch.optim.AdamW, offload_fraction=1.0, lr=1e-2)
    assert o._placement.hp_of[m[2].weight].bucket.piece_numel
    for x in batches(3):
        loss_of(m, x).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)  # edits every gradient in place
        grads = [weakref.ref(p.grad) for p in m.parameters()]
        o.step()
        o.wait_for_weights()
        o.zero_grad(set_to_none=True)
        gc.collect()
        assert [r() is None for r in grads] == [True] * len(grads)
    assert o._engine.counters()["recopy_bytes"] > 0  # the edited gradients went through the plan


# ------------------------------------------------------------------------------------------ scale_in_kernel
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_scale_in_kernel_clips_like_torch_within_rounding(offload_gradients: bool, monkeypatch) -> None:
    # CPUOffloadConfig.scale_in_kernel: the clip coefficient goes into torch's fused kernel (its grad_scale) instead
    # of a scaling pass over the host gradients. The results match torch's clip_grad_norm_ + AdamW within rounding
    # (the kernel divides by the inverse), and the scaling pass is gone: no host gradient is multiplied
    knobs(scale_in_kernel=True)
    scaled = []
    real = _host_adam.step_scaled
    monkeypatch.setattr(_host_adam, "step_scaled", lambda opt, mults: (scaled.append(len(mults)), real(opt, mults)))
    m1, m2 = make_model(), make_model()
    o1 = make_opt(m1.parameters(), torch.optim.AdamW, offload_fraction=1.0, offload_gradients=offload_gradients,
                  lr=1e-2, weight_decay=0.1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    data = batches(6)
    n1, n2 = train(m1, o1, data, clip=0.05), train(m2, o2, data, clip=0.05)
    for a, b in zip(n1, n2):
        torch.testing.assert_close(a, b, atol=0, rtol=1e-6)
    assert any(float(n) > 0.05 for n in n2)  # clipping did something
    assert_same(m1, m2, atol=1e-5, rtol=1e-4)
    assert scaled and set(scaled) == {1}  # every host bucket stepped through the kernel's scale
    # off (the default), the same run is bitwise torch's
    knobs(scale_in_kernel=False)
    scaled.clear()
    m3 = make_model()
    o3 = make_opt(m3.parameters(), torch.optim.AdamW, offload_fraction=1.0, offload_gradients=offload_gradients,
                  lr=1e-2, weight_decay=0.1)
    train(m3, o3, data, clip=0.05)
    assert not scaled
    assert_same(m3, m2)


def test_scale_in_kernel_host_paths_agree_bitwise() -> None:
    # bf16 device weights, clipping: with the scale in the kernel, the casts on the device, chunked or whole-bucket
    # casts on the host still agree bitwise with each other (all divide by the same grad_scale)
    knobs(host_chunk_numel=128, scale_in_kernel=True)
    results = []
    for kind in ("device", "chunked", "whole"):
        knobs(cast_on_device=kind == "device", chunked_host_step=kind == "chunked")
        m = make_model()
        o = make_opt(m.parameters(), offload_fraction=0.7, param_dtype=torch.bfloat16, lr=1e-2, weight_decay=0.1)
        for x in batches(4):
            _autocast_loss(m, x).backward()
            o.clip_grad_norm_(0.05)
            o.step()
            o.zero_grad()
        results.append([hp.master.clone() for hp in o._placement.hps])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_scale_in_kernel_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="scale_in_kernel must be True or False"):
        CPUOffloadConfig(scale_in_kernel=1)


def test_fsdp2_forward_prefetch_waits_for_the_prefetched_units(monkeypatch: pytest.MonkeyPatch) -> None:
    # parallel.fsdp_prefetch: unit i all-gathers unit i + 1 in its own pre-forward, so the offloading optimizer's
    # wait on unit i covers unit i + 1's updated shards too (else that all-gather could read the step before's).
    # Every wait in forward names its own unit's buckets and the next one's, and training follows plain AdamW.
    from torch.distributed.fsdp import fully_shard

    from elbowroom.distributed.data_parallel import set_prefetch
    from elbowroom.optim.handover import Handover
    from tests.distributed_utils import one_process_group

    with one_process_group(monkeypatch):
        plain = make_model()
        ref = torch.optim.AdamW(plain.parameters(), **OPTIMS["adamw"][1])
        model = make_model()
        units = [layer for layer in model if isinstance(layer, nn.Linear)]
        for unit in units:
            fully_shard(unit)
        fully_shard(model)
        set_prefetch(units, 1)
        opt = make_opt(model.parameters(), torch.optim.AdamW, offload_fraction=1.0, **OPTIMS["adamw"][1])
        opt.overlap_with_forward(model)
        own = {id(u): {id(opt._placement.hp_of[p].bucket) for p in u.parameters()} for u in units}
        waited: list[set[int]] = []
        real = Handover.await_buckets
        monkeypatch.setattr(Handover, "await_buckets",
                            lambda self, buckets: (waited.append({id(b) for b in buckets}), real(self, buckets))[1])
        data = batches(3)
        train(plain, ref, data, clip=1.0)
        train(model, opt, data, clip=1.0)
        opt.wait_for_weights()  # (the last step's updates, still landing: nothing read them yet)
        opt.close()
        for a, b in zip(plain.parameters(), model.parameters()):
            torch.testing.assert_close(b.full_tensor(), a.detach(), rtol=1e-5, atol=1e-6)
    want = [own[id(u)] | (own[id(units[i + 1])] if i + 1 < len(units) else set()) for i, u in enumerate(units)]
    assert waited and all(w in want for w in waited), (waited, want)
    assert any(len(w) > len(own[id(units[0])]) for w in waited)  # some wait covered a unit ahead


@pytest.mark.parametrize(("cls", "kwargs"), [
    (torch.optim.AdamW, {"fused": True}),
    (torch.optim.AdamW, {"foreach": True}),
    (torch.optim.Adam, {"amsgrad": True, "foreach": False}),
])
def test_early_state_is_torch_s_layout_and_steps_as_fresh(cls: type, kwargs: dict) -> None:
    """Adam/AdamW state made before the first step (early_state) is the state torch's first step makes, key by
    key (dtype, device, shape), and three steps from it are bitwise three steps from a fresh optimizer; a parameter
    without a gradient keeps its zero state; other classes get none."""
    from elbowroom.optim.early_state import create_state

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3), nn.Linear(3, 2))  # the last one gets no gradient
    early = copy.deepcopy(ref)
    o_ref = cls(ref.parameters(), lr=1e-2, weight_decay=0.1, **kwargs)
    o_early = cls(early.parameters(), lr=1e-2, weight_decay=0.1, **kwargs)
    assert create_state(o_early) == 0 and len(o_early.state) == 0  # CPU parameters: left to the first step
    made = create_state(o_early, cuda_only=False)
    n_moments = 3 if kwargs.get("amsgrad") else 2
    assert made == n_moments * 4 * sum(p.numel() for p in early.parameters())
    assert create_state(o_early, cuda_only=False) == 0  # once
    for _ in range(3):
        x = torch.randn(4, 6)
        for m, o in ((ref, o_ref), (early, o_early)):
            o.zero_grad()
            m[1](m[0](x)).square().mean().backward()  # m[2] unused: no gradient
            o.step()
    for p, q in zip(ref.parameters(), early.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
        if p.grad is None:
            assert p not in o_ref.state and o_early.state[q]["step"].item() == 0
            assert all(not v.any() for k, v in o_early.state[q].items())
            continue
        a, b = o_ref.state[p], o_early.state[q]
        assert a.keys() == b.keys()
        for k in a:
            assert (a[k].dtype, a[k].device, a[k].shape) == (b[k].dtype, b[k].device, b[k].shape), k
            torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)
    assert create_state(torch.optim.SGD(ref.parameters(), lr=0.1), cuda_only=False) == 0
