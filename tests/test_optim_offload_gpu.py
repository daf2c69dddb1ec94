"""CPUOffloadOptimizer on a GPU: the checks of Megatron-LM's HybridDeviceOptimizer tests, in our own code.

Run on the lent GPU with ``pytest -m gpu tests/test_optim_offload_gpu.py``. Reference: the plain torch
optimizer on the GPU. Tolerance: ``allclose(atol=1e-3)`` with equal NaN positions (as Megatron's tests): the
CPU and CUDA kernels round differently.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elbowroom.optim import CPUOffloadConfig, CPUOffloadOptimizer, last_fraction

pytestmark = pytest.mark.gpu

_KNOBS: dict[str, object] = {}  # the CPUOffloadConfig fields of the optimizers the current test builds


@pytest.fixture(autouse=True)
def default_knobs() -> Iterator[None]:
    yield
    _KNOBS.clear()


def knobs(**fields: object) -> None:
    """Set CPUOffloadConfig fields for the optimizers this test builds next with ``make_opt``."""
    _KNOBS.update(fields)


def make_opt(params, *args, **kwargs) -> CPUOffloadOptimizer:
    """A CPUOffloadOptimizer with this test's settings (``knobs``)."""
    return CPUOffloadOptimizer(params, *args, config=CPUOffloadConfig(**_KNOBS), **kwargs)


class LeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class BigNet(nn.Module):
    """The same convolutions and a ~34M-parameter MLP head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 2048)
        self.fc2 = nn.Linear(2048, 8192)
        self.fc3 = nn.Linear(8192, 2048)
        self.fc4 = nn.Linear(2048, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc4(F.relu(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))))


def seeded(cls: type[nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(42)
    torch.cuda.manual_seed_all(42)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    a, b = cls().cuda(), cls().cuda()
    b.load_state_dict(a.state_dict())
    return a, b


def groups(params: list[torch.Tensor], with_groups: bool) -> list:
    if not with_groups:
        return params
    h = len(params) // 2
    return [
        {"params": params[:h], "wd_mult": 1.0, "lr_mult": 1e-4},
        {"params": params[h:], "wd_mult": 0.0, "lr_mult": 2e-4},
    ]


def device_state_bytes(opt: CPUOffloadOptimizer) -> int:
    """Bytes of the device optimizer's state (its Adam moments exist from construction: ``early_state``)."""
    inner = opt._placement.dev_opt
    states = inner.state.values() if inner is not None else ()
    return sum(t.nbytes for st in states for t in st.values() if torch.is_tensor(t) and t.is_cuda)


def assert_state_before_first_step(opt: CPUOffloadOptimizer) -> None:
    """Before the first step only the device part's Adam moments exist, zero at step 0 (``early_state``)."""
    sd = opt.state_dict()["state"]
    inner = opt._placement.dev_opt
    adam = type(inner) in (torch.optim.Adam, torch.optim.AdamW)
    on_device = sum(len(g["params"]) for g in inner.param_groups) if adam else 0
    assert len(sd) == on_device
    for st in sd.values():
        assert st["exp_avg"].is_cuda and st["step"].item() == 0
        assert not st["exp_avg"].any() and not st["exp_avg_sq"].any()


CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


def assert_weights_close(net: nn.Module, ref: nn.Module) -> None:
    ours, theirs = net.state_dict(), ref.state_dict()
    for k, v in ours.items():
        r = theirs[k]
        assert (v.isnan() == r.isnan()).all(), k
        v, r = torch.nan_to_num(v, 0), torch.nan_to_num(r, 0)
        assert torch.allclose(v, r, atol=1e-3), f"{k}: max error {(v - r).abs().max()}"


def check_first_step(opt: CPUOffloadOptimizer, name: str, fraction: float) -> None:
    sd = opt.state_dict()
    if name != "sgd":  # torch SGD without momentum keeps no state
        assert len(sd["state"]) != 0
    if name == "adam":
        first = sd["param_groups"][0]["params"][0]
        last = sd["param_groups"][-1]["params"][-1]
        if fraction > 0:
            assert not sd["state"][first]["exp_avg"].is_cuda
        if fraction < 1:
            assert sd["state"][last]["exp_avg"].is_cuda


@pytest.mark.parametrize("n_steps", [1, 10])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("fraction", [0, 0.5, 1.0])
@pytest.mark.parametrize("name", ["sgd", "adam"])
@pytest.mark.parametrize("with_groups", [False, True])
def test_hybrid_matches_gpu_optimizer(with_groups: bool, name: str, fraction: float, overlap: bool, n_steps: int):
    net, ref_net = seeded(LeNet)
    opt = make_opt(
        groups(list(net.parameters()), with_groups), CLASSES[name], offload_fraction=fraction, overlap=overlap, lr=1e-3
    )
    ref = CLASSES[name](groups(list(ref_net.parameters()), with_groups), lr=1e-3)
    assert_state_before_first_step(opt)
    for step in range(n_steps):
        x = torch.randn(1, 3, 32, 32, device="cuda")
        net(x).sum().backward()
        opt.step()
        opt.zero_grad()
        ref_net(x).sum().backward()
        ref.step()
        ref.zero_grad()
        if step == 0:
            check_first_step(opt, name, fraction)
    assert_weights_close(net, ref_net)
    opt.close()


@pytest.mark.parametrize("n_steps", [1, 10])
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0])
@pytest.mark.parametrize("name", ["adam", "sgd"])
@pytest.mark.parametrize("with_groups", [False, True])
def test_race_detector(with_groups: bool, name: str, fraction: float, n_steps: int) -> None:
    # all offloaded steps back to back, no host sync in between: a missing stream wait (forward reading a
    # weight before its H2D copy landed, a D2H copy reading a grad before backward wrote it) shows up here
    net, ref_net = seeded(BigNet)
    opt = make_opt(
        groups(list(net.parameters()), with_groups), CLASSES[name], offload_fraction=fraction, overlap=True, lr=1e-3
    )
    ref = CLASSES[name](groups(list(ref_net.parameters()), with_groups), lr=1e-3)
    assert_state_before_first_step(opt)
    x0 = torch.randn(1, 3, 32, 32, device="cuda")
    net(x0).sum().backward()
    opt.step()
    opt.zero_grad()
    ref_net(x0).sum().backward()
    ref.step()
    ref.zero_grad()
    check_first_step(opt, name, fraction)
    inputs = [torch.randn(1, 3, 32, 32, device="cuda") for _ in range(1, n_steps)]
    for x in inputs:
        net(x).sum().backward()
        opt.step()
        opt.zero_grad()
    for x in inputs:
        ref_net(x).sum().backward()
        ref.step()
        ref.zero_grad()
    assert_weights_close(net, ref_net)
    opt.close()


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_late_blocks_accumulation_and_clipping(offload_gradients: bool, clip: float | None) -> None:
    net, ref_net = seeded(BigNet)
    late = last_fraction(net.parameters(), 0.6)
    opt = make_opt(
        net.parameters(), torch.optim.AdamW, offload_params=late, offload_gradients=offload_gradients, lr=1e-4
    )
    ref = torch.optim.AdamW(ref_net.parameters(), lr=1e-4, fused=True)
    for _ in range(4):
        xs = [torch.randn(4, 3, 32, 32, device="cuda") for _ in range(3)]
        for i, x in enumerate(xs):
            with opt.accumulating(i < 2):
                net(x).pow(2).mean().backward()
            ref_net(x).pow(2).mean().backward()
        if offload_gradients:
            assert all(p.grad is None for p in late)  # freed once copied to the host
        if clip is not None:
            n1 = opt.clip_grad_norm_(clip)
            n2 = torch.nn.utils.clip_grad_norm_(ref_net.parameters(), clip)
            torch.testing.assert_close(n1, n2, rtol=1e-4, atol=1e-5)
        opt.step()
        opt.zero_grad()
        ref.step()
        ref.zero_grad()
    assert_weights_close(net, ref_net)
    assert opt.step_in_backward is (clip is None)


def test_host_buffers_are_pinned_and_bounded() -> None:
    net, _ = seeded(BigNet)
    opt = make_opt(net.parameters(), torch.optim.AdamW, lr=1e-4)
    for hp in opt._placement.hps:
        assert hp.master.is_pinned() and hp.master.device.type == "cpu"
    net(torch.randn(2, 3, 32, 32, device="cuda")).sum().backward()
    opt.step()
    s = opt.stats()
    n = s["offloaded_numel"]
    # masters + moments = 12 B/param; the staging pool holds 3 slots of the largest gradient (fc2/fc3: 64 MiB)
    assert s["host_bytes"] <= 12 * n + s["staging_bytes"] + (1 << 20), s
    assert s["pinned_bytes"] <= 4 * n + s["staging_bytes"] + (1 << 20), s


def test_offload_gradients_saves_device_memory() -> None:
    # measured from what is allocated once both nets and optimizers exist (the two nets' weights): earlier
    # tests' nets can still be on the device until the garbage collector runs (a parameter and its grad
    # hook form a cycle), and a failed test's traceback keeps its frames alive
    gc.collect()
    net, ref_net = seeded(BigNet)
    grads = sum(p.numel() * 4 for p in net.parameters())
    opt = make_opt(net.parameters(), torch.optim.AdamW, offload_gradients=True, lr=1e-4)
    ref = torch.optim.AdamW(ref_net.parameters(), lr=1e-4, fused=True)
    torch.cuda.synchronize()
    both = torch.cuda.memory_allocated()  # the two nets' weights (and anything older), always resident
    assert both >= 2 * grads
    x = torch.randn(2, 3, 32, 32, device="cuda")
    peaks = []
    for n, o in ((net, opt), (ref_net, ref)):
        for it in range(2):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            n(x).sum().backward()
            if o is opt and it == 1:
                opt._engine.wait_pre()  # every gradient copied (the copy thread dropped its references)
                torch.cuda.synchronize()
                assert torch.cuda.memory_allocated() - both < (8 << 20)  # no offloaded grad left on the GPU
            o.step()
            o.zero_grad()
            torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - both)
    # plain: grads and two moments on the device; ours: at most the grads not yet copied, no moments
    assert peaks[0] <= grads + (32 << 20), peaks
    assert peaks[1] >= 3 * grads, peaks


def test_no_implicit_sync_in_overlapped_steps() -> None:
    net, _ = seeded(BigNet)
    opt = make_opt(net.parameters(), torch.optim.AdamW, offload_fraction=0.5, lr=1e-4)
    x = torch.randn(2, 3, 32, 32, device="cuda")
    net(x).sum().backward()
    opt.step()  # the first step learns that CPU steps may start during backward
    opt.zero_grad()
    assert opt.step_in_backward is True
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(net.fc2.weight).all()


def _bf16_with_masters(fraction: float, lr: float, steps: int):
    """A bf16 BigNet trained by CPUOffloadOptimizer with fp32 masters, and its reference: fused AdamW on fp32
    copies of the same bf16 weights, cast back after each step. Returns (net, ref_net, opt, masters)."""
    net, ref_net = seeded(BigNet)
    net.bfloat16()
    ref_net.bfloat16()
    masters = [p.detach().float() for p in ref_net.parameters()]
    opt = make_opt(
        net.parameters(), torch.optim.AdamW, offload_fraction=fraction, master_weights=True, lr=lr
    )
    ref = torch.optim.AdamW(masters, lr=lr, fused=True)
    for _ in range(steps):
        x = torch.randn(2, 3, 32, 32, device="cuda", dtype=torch.bfloat16)
        net(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
        ref_net(x).float().sum().backward()
        for w, p in zip(masters, ref_net.parameters()):
            w.grad = p.grad.float()
            p.grad = None
        ref.step()
        with torch.no_grad():
            for w, p in zip(masters, ref_net.parameters()):
                p.copy_(w)
    return net, ref_net, opt, masters


@pytest.mark.parametrize("device_chunk", [None, 1 << 20])
def test_master_weights_bf16(device_chunk: int | None) -> None:
    if device_chunk:  # the device masters' step in chunks: fc2's 16.8M elements span 16 of them
        knobs(device_chunk_numel=device_chunk)
    net, ref_net, opt, masters = _bf16_with_masters(0.5, 1e-4, 5)
    sd = opt.state_dict()
    for i, w in enumerate(masters):
        torch.testing.assert_close(sd["state"][i]["master_weight"].float().cuda(), w, atol=1e-4, rtol=1e-3)
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())
    assert_weights_close(net, ref_net)


def test_device_masters_step_in_chunks_bitwise() -> None:
    # nothing offloaded: every bf16 weight's fp32 master on the GPU, stepped chunk by chunk (fc2's 16.8M
    # elements in 16 chunks) with the CUDA kernel the reference runs on whole upcast gradients: bitwise
    knobs(device_chunk_numel=1 << 20)
    net, ref_net, opt, masters = _bf16_with_masters(0, 1e-3, 3)
    assert len(opt._placement.dev_masters) == len(masters)
    for p, w in zip(net.parameters(), masters):
        torch.testing.assert_close(opt._placement.dev_masters[p], w, atol=0, rtol=0)
        assert opt._placement.dev_masters[p].grad is None
    for a, b in zip(net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("cast_on_device", [True, False])
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_param_dtype_bf16_hybrid(offload_gradients: bool, cast_on_device: bool) -> None:
    # an fp32 net; param_dtype=bf16 casts the offloaded (late) parameters on the device and keeps their fp32
    # values as host masters. Reference: the same cast by hand, fp32 masters stepped by the GPU's fused AdamW.
    # The casts of each step run on the GPU (gradients upcast there, masters cast there) or on the host.
    knobs(cast_on_device=cast_on_device)
    gc.collect()
    net, ref_net = seeded(BigNet)
    late = last_fraction(list(net.parameters()), 0.6)
    late_ids = {id(p) for p in late}
    before = torch.cuda.memory_allocated()
    opt = make_opt(
        net.parameters(), offload_params=late, param_dtype=torch.bfloat16, offload_gradients=offload_gradients, lr=1e-4
    )
    torch.cuda.synchronize()
    # the late parameters now take 2 bytes each on the device instead of 4 (beside the early parts' moments,
    # made with the optimizer)
    saved = sum(p.numel() * 2 for p in late if p.dim() >= 2)
    assert before - torch.cuda.memory_allocated() + device_state_bytes(opt) >= 0.95 * saved
    assert all((p.dtype == torch.bfloat16) == (id(p) in late_ids and p.dim() >= 2) for p in net.parameters())
    ref_late = last_fraction(list(ref_net.parameters()), 0.6)
    ref_ids = {id(p) for p in ref_late}
    masters = {}
    for p in ref_net.parameters():
        if id(p) in ref_ids and p.dim() >= 2:
            masters[p] = p.detach().clone()
            p.data = p.data.bfloat16()
    ref_early = torch.optim.AdamW([p for p in ref_net.parameters() if p not in masters], lr=1e-4, fused=True)
    ref_masters = torch.optim.AdamW(list(masters.values()), lr=1e-4, fused=True)
    for _ in range(5):
        x = torch.randn(2, 3, 32, 32, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(x).float().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref_loss = ref_net(x).float().sum()
        ref_loss.backward()
        for p, w in masters.items():
            w.grad = p.grad.float()
        ref_early.step()
        ref_masters.step()
        with torch.no_grad():
            for p, w in masters.items():
                p.copy_(w)
        ref_net.zero_grad(set_to_none=True)
    assert_weights_close(net, ref_net)
    sd = opt.state_dict()
    for i, w in enumerate(ref_net.parameters()):
        if w in masters:
            torch.testing.assert_close(sd["state"][i]["master_weight"].cuda(), masters[w], atol=1e-4, rtol=1e-3)


def test_state_dict_round_trip_across_fractions() -> None:
    net, ref_net = seeded(LeNet)
    a = make_opt(net.parameters(), torch.optim.AdamW, offload_fraction=1.0, lr=1e-3)
    for _ in range(3):
        net(torch.randn(2, 3, 32, 32, device="cuda")).sum().backward()
        a.step()
        a.zero_grad()
    ref_net.load_state_dict(net.state_dict())
    b = make_opt(ref_net.parameters(), torch.optim.AdamW, offload_fraction=0.5, lr=1e-3)
    b.load_state_dict(a.state_dict())
    sd = b.state_dict()
    assert not sd["state"][0]["exp_avg"].is_cuda and sd["state"][len(sd["state"]) - 1]["exp_avg"].is_cuda
    for _ in range(3):
        x = torch.randn(2, 3, 32, 32, device="cuda")
        for n, o in ((net, a), (ref_net, b)):
            n(x).sum().backward()
            o.step()
            o.zero_grad()
    assert_weights_close(net, ref_net)


def lazy_steps_against_torch(net: nn.Module, opt: CPUOffloadOptimizer, ref_net: nn.Module, clip: float | None) -> None:
    """Ten steps back to back in the lazy mode, then the same ten with torch's fused AdamW on ``ref_net``: close."""
    ref = torch.optim.AdamW(ref_net.parameters(), lr=1e-4, fused=True)
    inputs = [torch.randn(8, 3, 32, 32, device="cuda") for _ in range(10)]
    for x in inputs:
        net(x).pow(2).mean().backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    opt.wait_for_weights()
    for x in inputs:
        ref_net(x).pow(2).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref_net.parameters(), clip)
        ref.step()
        ref.zero_grad()
    assert_weights_close(net, ref_net)


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_overlap_with_forward_race_detector(clip: float | None, offload_gradients: bool) -> None:
    # step() returns before the CPU updates land; each module's forward pre-hook waits for its weights.
    # Steps back to back with no host sync: a missing wait would feed stale weights to the next forward.
    net, ref_net = seeded(BigNet)
    opt = make_opt(
        net.parameters(),
        torch.optim.AdamW,
        offload_params=last_fraction(net.parameters(), 0.6),
        offload_gradients=offload_gradients,
        lr=1e-4,
    )
    opt.overlap_with_forward(net)
    lazy_steps_against_torch(net, opt, ref_net, clip)


def bf16_steps(net: nn.Module, opt: CPUOffloadOptimizer, inputs: list[torch.Tensor], sync: bool = False) -> None:
    """One step per input under bf16 autocast (a device sync after each with ``sync``), then wait for the weights."""
    for x in inputs:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sync:
            torch.cuda.synchronize()
    opt.wait_for_weights()


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("cast_on_device", [True, False])
def test_bf16_overlap_with_forward_race_detector(cast_on_device: bool, offload_gradients: bool) -> None:
    # bf16 device weights, step() returning at once, steps back to back with no host sync: bitwise the same
    # weights as the same optimizer stepping synchronously (a missing stream or host wait on the casts' copies
    # or on the device scratch they use would feed the next forward stale or torn weights)
    knobs(cast_on_device=cast_on_device)
    inputs = [torch.randn(8, 3, 32, 32, device="cuda") for _ in range(10)]
    nets = []
    for lazy in (True, False):
        net, _ = seeded(BigNet)
        opt = make_opt(
            net.parameters(),
            offload_params=last_fraction(net.parameters(), 0.6),
            param_dtype=torch.bfloat16,
            offload_gradients=offload_gradients,
            overlap=lazy,
            lr=1e-3,
        )
        if lazy:
            opt.overlap_with_forward(net)
        bf16_steps(net, opt, inputs, sync=not lazy)
        nets.append(net)
    for a, b in zip(*(n.parameters() for n in nets)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_streamed_race_detector(clip: float | None, offload_gradients: bool, mixed: bool) -> None:
    # host state stepped on the device (stream_params) through a ring of two small slots, steps back to back in the
    # lazy mode with no host sync. With every offloaded parameter streamed and no clipping the run is bitwise torch's
    # fused AdamW on the GPU (the same kernel), so a missing wait on a slot, the state's copy back, the gradient or
    # the weights shows up as a difference; mixed with host-stepped ones (the CPU kernel rounds otherwise), close.
    knobs(stream_slot_numel=1 << 16, offload_gradients=offload_gradients)
    net, ref_net = seeded(BigNet)
    late = last_fraction(net.parameters(), 0.6)
    streamed = [p for p in late if p.dim() == 2][:2] if mixed else late
    opt = make_opt(net.parameters(), torch.optim.AdamW, offload_params=late, stream_params=streamed, lr=1e-4)
    opt.overlap_with_forward(net)
    lazy_steps_against_torch(net, opt, ref_net, clip)
    if not mixed and clip is None:
        for a, b in zip(net.parameters(), ref_net.parameters()):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    ids = {id(p) for p in streamed}
    sd = opt.state_dict()
    for i, p in enumerate(net.parameters()):
        if id(p) in ids:
            assert float(sd["state"][i]["step"]) == 10  # (the steps lazy_steps_against_torch runs)
            assert sd["state"][i]["exp_avg"].is_pinned()
    opt.close()


def test_streamed_bf16_matches_device_masters() -> None:
    # bf16 device weights with fp32 masters (master_weights=True): streamed from host masters, or stepped on fp32
    # masters kept on the device, both run torch's fused kernel on the GPU over the upcast gradients and cast the
    # master into the weight: bitwise the same weights, step after step in the lazy mode
    inputs = [torch.randn(8, 3, 32, 32, device="cuda") for _ in range(6)]
    nets = []
    for stream in (False, True):
        net, _ = seeded(BigNet)
        for p in net.parameters():
            if p.dim() > 1:
                p.data = p.data.to(torch.bfloat16)  # the same Parameter objects, now bf16
        late = last_fraction(net.parameters(), 0.6) if stream else []
        opt = make_opt(net.parameters(), offload_params=late, stream_params=late, master_weights=True, lr=1e-3)
        opt.overlap_with_forward(net)
        bf16_steps(net, opt, inputs)
        assert (opt.stats()["h2d_bytes"] > 0) == stream
        nets.append(net)
        opt.close()
    for a, b in zip(*(n.parameters() for n in nets)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_device_moments_exist_before_the_first_step() -> None:
    # elbowroom.optim.early_state: the device optimizer's AdamW moments are made with the optimizer (before the
    # first forward), in torch's layout; the steps are then bitwise those of torch's AdamW on the GPU
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).cuda()
    ref = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).cuda()
    ref.load_state_dict(net.state_dict())
    opt = make_opt(net.parameters(), torch.optim.AdamW, offload_fraction=0.0, lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    early = opt.state_dict()["state"]
    assert sorted(early) == list(range(4))
    assert all(st["exp_avg"].is_cuda and st["step"].item() == 0 and not st["exp_avg_sq"].any() for st in early.values())
    for _ in range(3):
        x = torch.randn(16, 64, device="cuda")
        for m, o in ((net, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    torch.cuda.synchronize()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for i in want:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            a, b = got[i][k], want[i][k]
            assert (a.dtype, a.device) == (b.dtype, b.device), (i, k)
            torch.testing.assert_close(a, b, atol=0, rtol=0)
