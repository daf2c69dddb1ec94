"""Activation engine on CUDA (run on the lent GPU): exactness under real streams, memory, no leaks.

Run: ``python -m pytest -m gpu tests/test_activations_gpu.py -q``. Skipped without CUDA.

Tolerances: fp32 gradients within 1e-5 relative (norm-wise) of a plain run (SDPA's backward may
reorder float sums between runs); bf16 autocast: loss within 1e-3 relative, gradient norm within
1e-2 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from elbowroom.activations import (
    BlockPolicy,
    apply_activation_policy,
    apply_block_policies,
    get_offload_engine,
    remove_activation_policy,
)
from elbowroom.models import ModelConfig, build_model

pytestmark = pytest.mark.gpu

MODES = {
    "full": dict(checkpoint="full"),
    "selective": dict(checkpoint="selective"),
    "offload-1.0": dict(offload_ratio=1.0),
    "offload-0.5": dict(offload_ratio=0.5),
    "ckpt-inputs": dict(checkpoint="full", offload_checkpoint_inputs=True),
    "selective+offload-1.0": dict(checkpoint="selective", offload_ratio=1.0, offload_checkpoint_inputs=True),
    "selective+offload-0.5": dict(checkpoint="selective", offload_ratio=0.5),
    "every-2+offload": dict(checkpoint="full", every=2, offload_ratio=1.0),
}


def make(arch: str = "llama", *, dim: int = 1024, layers: int = 6, dropout: float = 0.1) -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch=arch, vocab_size=8192, dim=dim, n_layers=layers, n_heads=dim // 128, ffn_dim=int(dim * 2.75) // 64 * 64,
        max_seq_len=2048, dropout=dropout,
    )
    return build_model(cfg, device="cuda").train()


def batch(bs: int = 4, seq: int = 2048) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    return torch.randint(0, 8192, (bs, seq), device="cuda", generator=g)


def step(model: nn.Module, idx: torch.Tensor, *, bf16: bool, seed: int = 5) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        logits = model(idx)
    loss = F.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
    loss.backward()
    return loss.detach()


def grad_norm(model: nn.Module) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))


def with_offload_kwargs(kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    if kwargs.get("offload_ratio") or kwargs.get("offload_checkpoint_inputs"):
        kwargs.setdefault("min_offload_bytes", 1 << 16)
    return kwargs


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_fp32_gradients_match_plain(arch: str, mode: str) -> None:
    model = make(arch, dim=512, layers=5)
    idx = batch(2, 1024)
    ref_loss = step(model, idx, bf16=False)
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    apply_activation_policy(model, **with_offload_kwargs(MODES[mode]))
    for _ in range(3):  # step 1 measures ratios and grows the pool; 2 and 3 run the plan
        loss = step(model, idx, bf16=False)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        for k, p in model.named_parameters():
            err = ((p.grad - ref[k]).norm() / ref[k].norm()).item()
            assert err <= 1e-5, f"{k}: relative error {err:.2e}"
    eng = get_offload_engine(model)
    if eng is not None:
        assert eng.stats().offloaded_tensors > 0
        assert eng._pool.chunk.is_pinned()


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_blocks_match_compiled_plain(mode: str) -> None:
    # elbowroom.compile_blocks under each policy, with the real copy streams and pinned memory: the gradients equal
    # those of the same blocks compiled without a policy (compiled and eager kernels round differently, so the
    # reference is compiled too), and the offloading ones moved what the compiled forward saved
    from elbowroom.activations import compile_blocks

    ref_model = make("llama", dim=512, layers=5, dropout=0.0)
    compile_blocks(ref_model)
    idx = batch(2, 1024)
    ref_loss = step(ref_model, idx, bf16=False)
    ref = {k: p.grad.clone() for k, p in ref_model.named_parameters()}
    model = make("llama", dim=512, layers=5, dropout=0.0)
    apply_activation_policy(model, **with_offload_kwargs(MODES[mode]))
    compile_blocks(model)
    for _ in range(3):  # (a selective block offloading its input and half the rest runs eager: it rounds otherwise)
        loss = step(model, idx, bf16=False)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=0)
        for k, p in model.named_parameters():
            err = ((p.grad - ref[k]).norm() / ref[k].norm()).item()
            assert err <= 1e-4, f"{k}: relative error {err:.2e}"
    eng = get_offload_engine(model)
    if eng is not None:
        assert eng.stats().offloaded_tensors > 0


def test_selective_cache_is_offloaded_on_this_torch() -> None:
    # a selective block's kept outputs are packed through the offload region as they are kept and brought back
    # when the recompute reads them
    model = make("llama", dim=512, layers=4)
    idx = batch(2, 1024)
    ref_loss = step(model, idx, bf16=True)
    apply_block_policies(model, [BlockPolicy("selective", offload_ratio=1.0)] * 3 + [BlockPolicy("selective")],
                         min_offload_bytes=1 << 16)
    for _ in range(2):
        torch.testing.assert_close(step(model, idx, bf16=True), ref_loss, rtol=1e-3, atol=0)
    s = get_offload_engine(model).stats()
    assert s.offloaded_tensors > 0 and s.reloaded_bytes == s.offloaded_bytes


@pytest.mark.parametrize("mode", list(MODES))
def test_bf16_loss_and_grad_norm_agree(mode: str) -> None:
    model = make("llama")
    idx = batch()
    ref_loss = step(model, idx, bf16=True)
    ref_norm = grad_norm(model)
    apply_activation_policy(model, **with_offload_kwargs(MODES[mode]))
    for _ in range(3):
        loss = step(model, idx, bf16=True)
        norm = grad_norm(model)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=0)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-2, atol=0)


def test_training_with_offload_tracks_plain_over_steps() -> None:
    # a race between copies and compute would corrupt some step: compare 12 SGD steps one by one
    losses = {}
    for mode in ("plain", "offload"):
        model = make("llama", dim=768, layers=6)
        if mode == "offload":
            apply_activation_policy(model, offload_ratio=1.0, min_offload_bytes=1 << 16)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        idx = batch(4, 2048)
        losses[mode] = []
        for i in range(12):
            losses[mode].append(step(model, idx, bf16=True, seed=i))
            opt.step()
    torch.testing.assert_close(torch.stack(losses["offload"]), torch.stack(losses["plain"]), rtol=2e-3, atol=0)


def _saved_bytes_per_block(model: nn.Module, idx: torch.Tensor) -> int:
    """Bytes autograd saves inside one block (distinct storages), bf16 autocast."""
    blk = model.blocks[0]
    x = model.tok_emb(idx).detach().requires_grad_()
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cuda", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        blk(x)
    seen.pop(x.untyped_storage().data_ptr(), None)
    return sum(seen.values())


def _peak(model: nn.Module, idx: torch.Tensor, steps: int = 3) -> int:
    for _ in range(steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(model, idx, bf16=True)
        torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def test_peak_memory_drops_as_predicted() -> None:
    layers = 8
    model = make("llama", dim=1024, layers=layers, dropout=0.0)
    idx = batch(4, 2048)
    block_saved = _saved_bytes_per_block(model, idx)
    input_bytes = idx.numel() * model.config.dim * 4  # the fp32 residual stream
    peaks = {"plain": _peak(model, idx)}
    for name, kw in {
        "full": dict(checkpoint="full"),
        "ckpt-inputs": dict(checkpoint="full", offload_checkpoint_inputs=True),
        "offload-1.0": dict(offload_ratio=1.0),
        "selective": dict(checkpoint="selective"),
        "selective+offload-1.0": dict(checkpoint="selective", offload_ratio=1.0, offload_checkpoint_inputs=True),
    }.items():
        apply_activation_policy(model, **with_offload_kwargs(kw))
        peaks[name] = _peak(model, idx)
        remove_activation_policy(model)
    gib = {k: round(v / 2**30, 2) for k, v in peaks.items()}
    # predicted: all blocks but the last offload; about two blocks' worth is on the device at the peak
    # (the one still copying out or kept for backward, and the one prefetched), so the rest is gone.
    # 40% slack for what the prediction ignores (allocator rounding, gradients growing in backward)
    away = layers - 1 - 2
    assert peaks["offload-1.0"] <= peaks["plain"] - 0.6 * away * block_saved, gib
    assert peaks["ckpt-inputs"] <= peaks["full"] - 0.6 * away * input_bytes, gib
    assert peaks["selective+offload-1.0"] < peaks["selective"], gib
    assert peaks["full"] < peaks["selective"] < peaks["plain"], gib


def test_no_pinned_allocation_after_step_one() -> None:
    model = make("llama", dim=768, layers=6)
    idx = batch(4, 2048)
    apply_block_policies(
        model,
        [BlockPolicy(offload_ratio=0.5), BlockPolicy("selective", offload_ratio=0.5, offload_input=True),
         BlockPolicy("full", offload_input=True)] * 2,
        min_offload_bytes=1 << 16,
    )
    # the last block's policy offloads too here (apply_block_policies takes the plan as given)
    eng = get_offload_engine(model)
    step(model, idx, bf16=True)
    torch.cuda.synchronize()
    s1 = eng.stats()
    host_stats = getattr(torch.cuda, "host_memory_stats", dict)  # torch's pinned allocator, where exposed
    host1 = host_stats()
    key = "num_host_alloc" if "num_host_alloc" in host1 else "allocations.allocated"
    for i in range(10):
        step(model, idx, bf16=True, seed=i)
    torch.cuda.synchronize()
    s = eng.stats()
    assert s.host_allocations == s1.host_allocations and s.host_pool_bytes == s1.host_pool_bytes
    if key in host1:
        assert host_stats()[key] == host1[key]


@pytest.mark.parametrize(
    "kwargs",
    [dict(offload_ratio=1.0), dict(checkpoint="full", offload_checkpoint_inputs=True),
     dict(checkpoint="selective", offload_ratio=0.5)],
    ids=["offload-all", "ckpt-inputs", "selective-0.5"],
)
def test_200_steps_flat_device_and_host_memory(kwargs: dict) -> None:
    model = make("llama", dim=512, layers=4)
    idx = batch(4, 1024)
    block_bytes = _saved_bytes_per_block(model, idx)  # before wrapping: the block's own hooks would see them
    apply_activation_policy(model, **with_offload_kwargs(kwargs))
    eng = get_offload_engine(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    allocated, peaks, pools, held = [], [], [], []
    for i in range(200):
        torch.cuda.reset_peak_memory_stats()
        step(model, idx, bf16=True, seed=i)
        opt.step()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
        peaks.append(torch.cuda.max_memory_allocated())
        s = eng.stats()
        pools.append(s.host_pool_bytes)
        held.append((s.pending, len(eng._live), s.host_pool_in_use_bytes))
    # the engine holds nothing between steps: no device tensor waiting for a copy, no host slot in use
    assert set(held) == {(0, 0, 0)}, [(i, h) for i, h in enumerate(held) if h != (0, 0, 0)][:10]
    # The device memory left after a step is not bit-exact from step to step: on the H100 it moved by up
    # to 768 KiB either way at a handful of steps (never two in a row), with the engine holding nothing
    # (above). So a leak is judged by what cannot be noise: the median must not rise from the first 50
    # steps to the last 50 (a leak of one 16 KiB tensor per step would add 2.4 MiB), and no step may hold
    # a whole offloaded tensor more (4 MiB here: 4 x 1024 tokens x 512 bf16).
    def median(xs: list[int]) -> int:
        return sorted(xs)[len(xs) // 2]

    # Seen on the H100 across runs: the median rose by 768 KiB between the halves in one run; in another
    # the memory dropped by 95 MiB at step 36 and stayed there (the allocator returning a cached block).
    # Neither is a leak. A leak only grows: one 16 KiB tensor per step adds 2.4 MiB by the end, one
    # offloaded activation per step (4 MiB here) breaks the second check at once.
    first, last = median(allocated[5:55]), median(allocated[150:])
    assert last - first <= 2 << 20, (first, last)
    up = [(i, allocated[i] - first) for i in range(5, 200) if allocated[i] > first]
    assert max((d for _, d in up), default=0) < idx.numel() * model.config.dim * 2, up[:20]
    # The peak depends on timing (how many of a region's copies finished before it): on the H100 it took
    # a few discrete levels up to 27 MiB apart, and which level is the median of 50 steps is chance (seen:
    # +13 MiB with the memory left after each step flat). The leak check is the one on ``allocated`` above;
    # here the late steps' typical peak must not exceed the worst early one, and the spread stays in a block.
    assert median(peaks[150:]) <= max(peaks[5:55]), (max(peaks[5:55]), median(peaks[150:]))
    # a peak may drop for good (the one-time 95 MiB release above moves it too); it may not climb past the
    # early steps' worst by a block's saved bytes
    assert max(peaks[55:]) <= max(peaks[5:55]) + block_bytes, (max(peaks[5:55]), max(peaks[55:]), block_bytes)
    assert len(set(pools[1:])) == 1
