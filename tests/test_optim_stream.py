"""Streamed parameters (``stream_params``): host state, stepped on the device through a small ring.

On a CPU-only machine the "device" is the CPU: the same code runs the same kernel (torch's fused AdamW) over the
ring's copies, so a streamed parameter must step bitwise as torch's own fused AdamW, through chunks, accumulation,
clipping, offloaded gradients, the lazy mode and a state_dict round trip. The GPU tests check the same on CUDA.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from elbowroom.optim import CPUOffloadConfig, CPUOffloadOptimizer

LR, WD = 1e-2, 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.GELU(), nn.Linear(64, 8))


def _offload(model: nn.Module, **config: object) -> CPUOffloadOptimizer:
    """The last two linears offloaded; the middle one (weight and bias) streamed."""
    ps = list(model.parameters())
    return CPUOffloadOptimizer(
        model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WD, offload_params=ps[2:], stream_params=ps[2:4],
        config=CPUOffloadConfig(**config),
    )


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, steps: int, *, clip: float = 0.0, micro: int = 2
) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8 * micro, 64, generator=g)
        total = 0.0
        for i in range(micro):
            last = i == micro - 1
            ctx = opt.accumulating(not last) if isinstance(opt, CPUOffloadOptimizer) else contextlib.nullcontext()
            with ctx:
                loss = model(x[8 * i : 8 * (i + 1)]).pow(2).mean() / micro
                loss.backward()
            total += loss.item()
        if clip:
            if isinstance(opt, CPUOffloadOptimizer):
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("slot", [64, 1 << 24])  # chunks smaller than one weight (96 x 64 = 6144), and whole
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_streamed_steps_exactly_as_torch_adamw(slot: int, offload_gradients: bool) -> None:
    ref, m = _model(), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    opt = _offload(m, stream_slot_numel=slot, offload_gradients=offload_gradients)
    assert _train(ref, ref_opt, 4) == _train(m, opt, 4)
    assert _max_diff(ref, m) == 0.0
    stats = opt.stats()
    # 12 B up and back per streamed element and step (fp32 master and both moments); nothing for the host to step
    streamed = 96 * 64 + 64
    assert stats["h2d_bytes"] >= 12 * streamed
    # host memory: 12 B per offloaded element (master and moments, the streamed ones' counted once), and the staging
    offloaded = streamed + 64 * 8 + 8
    extra = 4 * (64 * 8 + 8) if offload_gradients else 0  # the host-stepped ones' host gradients
    steps = 4 * 4  # each offloaded parameter's step count (a float32 scalar)
    assert stats["host_bytes"] - stats["staging_bytes"] - stats["scratch_bytes"] == 12 * offloaded + extra + steps
    opt.close()


def test_streamed_with_clipping_matches_torch() -> None:
    ref, m = _model(), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    opt = _offload(m, stream_slot_numel=128)
    _train(ref, ref_opt, 4, clip=0.05)
    _train(m, opt, 4, clip=0.05)
    assert _max_diff(ref, m) < 1e-6  # the norm is summed in another order than torch's
    opt.close()


def test_streamed_in_lazy_mode_and_bf16_masters_match_host_stepped() -> None:
    """bf16 device weights with fp32 masters, each module waiting for its own weights (overlap_with_forward): a
    streamed parameter steps bitwise as the same parameter stepped on the host."""
    runs = []
    for stream in (False, True):
        m = _model()
        ps = list(m.parameters())
        opt = CPUOffloadOptimizer(
            m.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WD, offload_params=ps[2:],
            stream_params=ps[2:4] if stream else None, param_dtype=torch.bfloat16,
            config=CPUOffloadConfig(stream_slot_numel=256),
        )
        opt.overlap_with_forward(m)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = _train(m, opt, 3)
        opt.wait_for_weights()
        runs.append((losses, [p.detach().clone() for p in m.parameters()], opt.state_dict()))
        opt.close()
    (l0, w0, s0), (l1, w1, s1) = runs
    assert l0 == l1
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert w1[2].dtype == torch.bfloat16
    assert "master_weight" in s1["state"][2]  # the streamed bf16 matrix's fp32 master
    for k in s0["state"]:
        assert s0["state"][k].keys() == s1["state"][k].keys()
        for key in s0["state"][k]:
            assert torch.equal(s0["state"][k][key], s1["state"][k][key]), (k, key)


def test_streamed_state_dict_resumes_the_curve() -> None:
    """Saved after 2 steps and loaded into a new streamed optimizer (its state lands in the pinned buffers) or into
    torch's AdamW: both continue the uninterrupted run's losses exactly."""
    m = _model()
    opt = _offload(m, stream_slot_numel=256)
    whole = _train(m, opt, 5)
    opt.close()

    m = _model()
    opt = _offload(m, stream_slot_numel=256)
    _train(m, opt, 2)
    saved_model = {k: v.clone() for k, v in m.state_dict().items()}
    saved = opt.state_dict()
    assert sorted(saved["state"]) == list(range(6)) and float(saved["state"][2]["step"]) == 2.0
    opt.close()

    m2 = _model()
    m2.load_state_dict(saved_model)
    opt2 = _offload(m2, stream_slot_numel=256)
    opt2.load_state_dict(saved)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # the data the first two steps used
        torch.randn(16, 64, generator=g)
    rest = []
    for _ in range(3):
        x = torch.randn(16, 64, generator=g)
        loss = sum(m2(x[8 * i : 8 * (i + 1)]).pow(2).mean() / 2 for i in range(2))
        loss.backward()
        opt2.step()
        opt2.zero_grad()
        rest.append(loss.item())
    assert rest == pytest.approx(whole[2:], rel=1e-6, abs=0)
    opt2.close()

    plain = torch.optim.AdamW(_model().parameters(), lr=LR, weight_decay=WD, fused=True)
    plain.load_state_dict(saved)  # torch's layout: loads into torch's own optimizer
    assert float(plain.state_dict()["state"][2]["step"]) == 2.0


def test_stream_params_errors() -> None:
    m = _model()
    ps = list(m.parameters())
    with pytest.raises(ValueError, match="not offloaded"):
        CPUOffloadOptimizer(m.parameters(), torch.optim.AdamW, offload_params=ps[4:], stream_params=ps[2:4])
    with pytest.raises(ValueError, match="fused Adam/AdamW"):
        CPUOffloadOptimizer(m.parameters(), torch.optim.SGD, lr=0.1, offload_params=ps[2:], stream_params=ps[2:4])
    with pytest.raises(ValueError, match="fused Adam/AdamW"):
        CPUOffloadOptimizer(m.parameters(), torch.optim.AdamW, amsgrad=True, offload_params=ps[2:],
                            stream_params=ps[2:4])
    with pytest.raises(ValueError, match="not parameters of this optimizer"):
        CPUOffloadOptimizer(ps[:2], torch.optim.AdamW, offload_fraction=1.0, stream_params=ps[2:4])
    with pytest.raises(ValueError, match="stream_slot_numel"):
        CPUOffloadConfig(stream_slot_numel=100)
    opt = _offload(_model())
    with pytest.raises(ValueError, match="not supported under DDP"):
        opt.after_reduction()
    opt.close()


def test_a_streamed_job_does_not_wait_behind_host_copies_that_wait_for_staging_slots(monkeypatch) -> None:
    """Without offload_gradients a host-stepped bucket's copy waits for a staging slot, which only the host's step
    of an earlier bucket frees. A streamed bucket has nothing to copy: its device step must start while the host
    still steps, not after every host-stepped bucket whose gradients became final before its own (the backward's
    late blocks first). Two slow host steps and one slot make the order observable."""
    from elbowroom.optim.engine import Engine

    order: list[str] = []
    host_step, streamed_step = Engine._step_bucket, Engine._step_streamed

    def slow_host(self, job, plan):
        order.append(f"host {job.params[0].index}")
        import time

        time.sleep(0.15)
        return host_step(self, job, plan)

    def streamed(self, job, plan):
        order.append(f"stream {job.params[0].index}")
        return streamed_step(self, job, plan)

    monkeypatch.setattr(Engine, "_step_bucket", slow_host)
    monkeypatch.setattr(Engine, "_step_streamed", streamed)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32, bias=False) for _ in range(5)))
    ps = list(model.parameters())
    # the first two stream; the last three step on the host, one bucket each, through one staging slot
    opt = CPUOffloadOptimizer(ps, torch.optim.AdamW, lr=LR, offload_params=ps, stream_params=ps[:2],
                              config=CPUOffloadConfig(num_staging_slots=1, bucket_bytes=32 * 32 * 4))
    x = torch.randn(4, 32)
    for _ in range(2):  # the first step learns that the host steps may start during the backward
        order.clear()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.step_in_backward is True
    assert sorted(order) == ["host 2", "host 3", "host 4", "stream 0", "stream 1"]
    # the backward hands over 4, 3, 2 (host) and then 1, 0 (streamed): the streamed ones go ahead of the host's last
    assert order.index("stream 1") < order.index("host 2"), order


def test_a_finished_streamed_step_keeps_no_gradient_alive() -> None:
    """The streamed parameters' gradients, edited after their hand-over (torch's clip_grad_norm_), are read from the
    step's plan; once the step's updates have landed the plan holds none of them (see the same check for host-stepped
    parameters in test_optim_offload)."""
    import gc
    import weakref

    m = _model()
    opt = _offload(m)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        m(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)  # edits every gradient in place
        grads = [weakref.ref(p.grad) for p in m.parameters()]
        opt.step()
        opt.wait_for_weights()
        opt.zero_grad(set_to_none=True)
        gc.collect()
        assert [r() is None for r in grads] == [True] * len(grads)
