"""The offload engine's boundaries: nothing to offload on the CPU, one device per engine, one lock for threads."""

from __future__ import annotations

import logging
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import elbowroom
from elbowroom.activations import OffloadEngine, apply_activation_policy, get_offload_engine
from elbowroom.models import ModelConfig, build_model

IDX = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(arch="llama", dim=64, n_heads=4, ffn_dim=128, n_layers=4, dropout=0.1)
    return build_model(cfg).train()


def step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    loss = F.cross_entropy(model(IDX).flatten(0, 1), IDX.flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


# ------------------------------------------------------------------------------------ CPU: a no-op
@pytest.mark.parametrize("settings", [dict(offload_ratio=1.0), dict(checkpoint="full", offload_checkpoint_inputs=True)],
                         ids=["offload", "ckpt-inputs"])
def test_offload_on_a_cpu_model_allocates_nothing_and_says_so_once(
    settings: dict, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model()
    ref_loss, ref = step(model)
    apply_activation_policy(model, min_offload_bytes=0, **settings)
    with caplog.at_level(logging.WARNING, logger="elbowroom.activations"):
        for _ in range(2):
            loss, got = step(model)
            torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    s = get_offload_engine(model).stats()
    assert s.host_pool_bytes == 0 and s.host_allocations == 0  # (the old engine made a 256 MiB "host" pool)
    assert s.offloaded_tensors == 0 and s.reloaded_bytes == 0 and s.kept > 0
    said = [r for r in caplog.records if "nothing is offloaded" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    get_offload_engine(model).reserve(1 << 20)  # no pool to reserve on the CPU
    assert get_offload_engine(model).stats().host_pool_bytes == 0


def test_context_manager_on_cpu_tensors_offloads_nothing() -> None:
    eng = OffloadEngine(min_offload_bytes=0)
    lin = nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    with elbowroom.offload(1.0, engine=eng):
        loss = lin(x).tanh().sum()
    loss.backward()
    assert eng.device == torch.device("cpu")
    assert eng.stats().host_allocations == 0 and eng.stats().offloaded_tensors == 0


def test_simulate_host_keeps_the_engine_working_on_cpu() -> None:
    model = tiny_model()
    ref_loss, ref = step(model)
    apply_activation_policy(model, offload_ratio=1.0, min_offload_bytes=0, simulate_host=True)
    loss, got = step(model)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    s = get_offload_engine(model).stats()
    assert s.host_allocations >= 1 and s.offloaded_tensors > 0 and s.reloaded_bytes == s.offloaded_bytes
    with pytest.raises(ValueError, match="simulate_host has no effect without offload"):
        apply_activation_policy(model, checkpoint="full", simulate_host=True)


# --------------------------------------------------------------------------- one device per engine
# The engine decides per saved tensor through ``_admits(device)``: a seam that needs no second device, so the
# adoption rule is tested here on torch.device values (creating the CUDA streams is left to the first pack).
def test_adopted_device_refuses_a_second_accelerator() -> None:
    eng = OffloadEngine()  # no device: adopts the first tensor's
    assert eng._admits(torch.device("cuda", 0))
    assert eng.device == torch.device("cuda", 0)
    assert eng._admits(torch.device("cuda", 0))
    assert not eng._admits(torch.device("cpu"))  # host memory already: stays, no error
    with pytest.raises(ValueError, match=r"on cuda:1, but this offload engine serves cuda:0.*first saved tensor"):
        eng._admits(torch.device("cuda", 1))


def test_given_device_refuses_another_and_takes_an_index() -> None:
    eng = OffloadEngine(device="cuda")
    assert eng._admits(torch.device("cuda", 1))  # "cuda" without an index: the first tensor fixes it
    assert eng.device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="cuda:0.*was given.*OffloadEngine\\(device='cuda:0'\\)"):
        eng._admits(torch.device("cuda", 0))
    cpu = OffloadEngine(device="cpu", simulate_host=True)
    with pytest.raises(ValueError, match="serves cpu"):
        cpu._admits(torch.device("cuda", 0))  # a CUDA tensor in a CPU engine's region


def test_cpu_tensors_first_adopt_nothing_when_an_accelerator_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    offload_mod = sys.modules["elbowroom.activations.offload"]  # the package's `offload` is the verb
    monkeypatch.setattr(offload_mod, "_accelerator_available", lambda: True)
    eng = OffloadEngine()
    assert not eng._admits(torch.device("cpu")) and eng.device is None  # an RNG seed of a CUDA model
    assert eng._admits(torch.device("cuda", 0))


def test_meta_tensors_stay_and_adopt_nothing() -> None:
    eng = OffloadEngine(min_offload_bytes=0, simulate_host=True)
    lin = nn.Linear(8, 8, device="meta")
    with eng.group():
        lin(torch.randn(4, 8, device="meta", requires_grad=True)).relu()
    assert eng.device is None and eng.stats().offloaded_tensors == 0


# ------------------------------------------------------------------------------------------ threads
def test_backward_thread_entry_points_take_the_engine_lock() -> None:
    # autograd runs unpack hooks and frees saved handles on its own threads (on CUDA a device thread): while
    # the training thread holds the engine's lock, a backward on another thread must wait for it, then finish
    # with the plain run's gradients
    model = tiny_model()
    ref_loss, ref = step(model)
    apply_activation_policy(model, offload_ratio=1.0, min_offload_bytes=0, simulate_host=True)
    eng = get_offload_engine(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    loss = F.cross_entropy(model(IDX).flatten(0, 1), IDX.flatten())
    errors: list[BaseException] = []

    def backward() -> None:
        try:
            loss.backward()
        except BaseException as e:  # noqa: BLE001  (reported by the test thread)
            errors.append(e)

    worker = threading.Thread(target=backward)
    with eng._lock:
        worker.start()
        time.sleep(0.3)
        assert worker.is_alive(), "backward ran engine code without the engine's lock"
        assert all(p.grad is None for p in model.blocks[0].parameters())
    worker.join(timeout=60)
    assert not worker.is_alive() and not errors
    for a, b in zip([p.grad for p in model.parameters()], ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert eng.stats().host_pool_in_use_bytes == 0


def test_a_graph_freed_on_another_thread_returns_its_slots_under_the_lock() -> None:
    eng = OffloadEngine(min_offload_bytes=0, simulate_host=True)
    lin = nn.Linear(64, 64)
    box: list[torch.Tensor] = []
    with eng.group():
        box.append(lin(torch.randn(32, 64, requires_grad=True)).tanh().sum())
    assert eng.stats().host_pool_in_use_bytes > 0
    worker = threading.Thread(target=box.clear)  # the last reference dies there: handles dropped there
    with eng._lock:
        worker.start()
        time.sleep(0.3)
        assert worker.is_alive(), "a handle was dropped without the engine's lock"
    worker.join(timeout=60)
    assert eng.stats().host_pool_in_use_bytes == 0


def test_offload_inside_fsdp2_blocks_runs_like_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    # FSDP2 frees a block's unsharded parameters between its all-gathers: the engine's set of storages never
    # to offload skips them instead of reading a freed storage's address
    from torch.distributed.fsdp import fully_shard

    from tests.distributed_utils import one_process_group

    with one_process_group(monkeypatch):
        ref_loss, ref = step(tiny_model())
        model = tiny_model()
        apply_activation_policy(model, checkpoint="full", offload_checkpoint_inputs=True, min_offload_bytes=0,
                                simulate_host=True)
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        for _ in range(2):  # the second forward refreshes the set while the first blocks' storages are freed
            loss, got = step(model)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a.full_tensor() if hasattr(a, "full_tensor") else a, b, rtol=1e-4,
                                       atol=1e-6)
        assert get_offload_engine(model).stats().offloaded_tensors > 0
