"""apply_activation_policy / apply_block_policies: every mode and combination equals a plain run."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from elbowroom.activations import (
    ActivationConfig,
    BlockPolicy,
    _wrap,
    apply_activation_policy,
    apply_block_policies,
    get_offload_engine,
    remove_activation_policy,
)
from elbowroom.activations.policy import get_block_policies
from elbowroom.models import ModelConfig, build_model

TOL = 1e-6  # fp32 on CPU: max relative error (norm-wise) per parameter gradient


def model_for(arch: str, n_layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, dim=64, n_heads=4, ffn_dim=128, n_layers=n_layers, dropout=0.1)
    return build_model(cfg).train()


IDX = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def step_grads(model: nn.Module, steps: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of the last of ``steps`` identical steps (RNG seeded the same each time)."""
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(42)
        loss = F.cross_entropy(model(IDX).flatten(0, 1), IDX.flatten())
        loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


MODES = {
    "full": dict(checkpoint="full"),
    "selective": dict(checkpoint="selective"),
    "every-2": dict(checkpoint="full", every=2),
    "index-list": dict(checkpoint="selective", checkpoint_blocks=(0, 2)),
    "reentrant": dict(checkpoint="full", use_reentrant=True),
    "offload-0.5": dict(offload_ratio=0.5),
    "offload-1.0": dict(offload_ratio=1.0),
    "ckpt-inputs": dict(checkpoint="full", offload_checkpoint_inputs=True),
    "ckpt-inputs-reentrant": dict(checkpoint="full", offload_checkpoint_inputs=True, use_reentrant=True),
    "selective+offload-0.5": dict(checkpoint="selective", offload_ratio=0.5),
    "selective+offload-1.0": dict(checkpoint="selective", offload_ratio=1.0, offload_checkpoint_inputs=True),
    "every-2+offload-0.5": dict(checkpoint="full", every=2, offload_ratio=0.5),
    "selective-every-2+ckpt-inputs+offload": dict(
        checkpoint="selective", every=2, offload_checkpoint_inputs=True, offload_ratio=1.0
    ),
}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_matches_plain(arch: str, mode: str) -> None:
    model = model_for(arch)
    ref_loss, ref = step_grads(model, 1)
    kwargs = dict(MODES[mode])
    if kwargs.get("offload_ratio") or kwargs.get("offload_checkpoint_inputs"):
        kwargs["min_offload_bytes"] = 0
        kwargs["simulate_host"] = True  # a CPU model: offload into a separate host buffer to test the engine
    apply_activation_policy(model, **kwargs)
    # three steps: the first measures ratios, the later ones run the plan
    loss, got = step_grads(model, 3)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for k in ref:
        err = ((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item()
        assert err <= TOL, f"{k}: relative error {err:.3e}"
    eng = get_offload_engine(model)
    if "offload" in mode or "inputs" in mode:
        s = eng.stats()
        assert s.offloaded_tensors > 0 and s.reloaded_bytes == s.offloaded_bytes
        assert s.host_pool_in_use_bytes == 0
    else:
        assert eng is None


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_mixed_per_block_plan_matches_plain(reentrant: bool) -> None:
    model = model_for("llama", n_layers=6)
    ref_loss, ref = step_grads(model, 1)
    plan = [
        BlockPolicy(offload_ratio=1.0),  # offload what the link hides
        BlockPolicy(offload_ratio=0.5),
        BlockPolicy(),  # kept whole
        BlockPolicy("full", offload_input=True),
        BlockPolicy("selective", offload_ratio=0.5, offload_input=True),
        BlockPolicy("full"),
    ]
    apply_block_policies(model, plan, min_offload_bytes=0, simulate_host=True, use_reentrant=reentrant)
    assert get_block_policies(model) == tuple(plan)
    # use_reentrant applies to the blocks recomputed whole; a selective one keeps the non-reentrant checkpoint
    impl = [None if (rc := _wrap.get_policy(b).recompute) is None else rc.use_reentrant for b in model.blocks]
    assert impl == [None, None, None, reentrant, False, reentrant]
    loss, got = step_grads(model, 3)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=0)
    # a mapping plan: unnamed blocks stay whole
    apply_block_policies(model, {1: BlockPolicy("full"), -2: BlockPolicy(offload_ratio=1.0)}, min_offload_bytes=0,
                         simulate_host=True)
    assert get_block_policies(model)[1].checkpoint == "full" and get_block_policies(model)[4].offload_ratio == 1.0
    loss, got = step_grads(model, 2)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)


def test_outer_region_around_forward_and_loss_composes_with_block_regions() -> None:
    model = model_for("gpt2")
    ref_loss, ref = step_grads(model, 1)
    apply_activation_policy(model, checkpoint="selective", every=2, offload_ratio=1.0, min_offload_bytes=0,
                            simulate_host=True)
    eng = get_offload_engine(model)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(42)
        with eng.group("outside-blocks"):  # the head, the loss and the kept last block
            loss = F.cross_entropy(model(IDX).flatten(0, 1), IDX.flatten())
        loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=0, atol=0)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[k], rtol=1e-6, atol=0)
    assert any(key[0] == "outside-blocks" for key in eng._states)
    assert eng.stats().host_pool_in_use_bytes == 0


def test_selective_cache_itself_is_offloaded() -> None:
    # only the kept matmul/attention outputs move (not the block inputs): the selective region packs them
    # through the offload region as it keeps them
    model = model_for("llama")
    ref_loss, ref = step_grads(model, 1)
    apply_block_policies(model, [BlockPolicy("selective", offload_ratio=1.0)] * 3 + [BlockPolicy()],
                         min_offload_bytes=0, simulate_host=True)
    loss, got = step_grads(model, 2)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=0)
    s = get_offload_engine(model).stats()
    assert s.offloaded_tensors > 0 and s.reloaded_bytes == s.offloaded_bytes
    kinds = {(kind, ratio) for _, kind, ratio in get_offload_engine(model)._states}
    assert ("cache", 1.0) in kinds and ("saved", 1.0) not in kinds  # the inputs stayed


def test_last_block_never_offloads_and_policy_is_removable() -> None:
    model = model_for("gpt2")
    keys = list(model.state_dict())
    apply_activation_policy(model, checkpoint="full", offload_checkpoint_inputs=True, min_offload_bytes=0)
    plan = get_block_policies(model)
    assert [p.offloads for p in plan] == [True, True, True, False]
    assert list(model.state_dict()) == keys
    plain = model_for("gpt2")
    plain.load_state_dict(model.state_dict())
    apply_activation_policy(model, ActivationConfig(offload_ratio=1.0, keep_last=2, min_offload_bytes=0))
    assert [p.offloads for p in get_block_policies(model)] == [True, True, False, False]
    remove_activation_policy(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)
    assert get_offload_engine(model) is None


def test_config_block_policies() -> None:
    cfg = ActivationConfig(checkpoint="selective", every=2, offload_ratio=0.25)
    plan = cfg.block_policies(5)
    assert [p.checkpoint for p in plan] == ["selective", "none", "selective", "none", "selective"]
    assert plan[0] == BlockPolicy("selective", 0.25, offload_input=True)
    assert plan[1] == BlockPolicy("none", 0.25)
    assert plan[4] == BlockPolicy("selective", 0.0, offload_input=False)  # the last block keeps all


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(checkpoint="sometimes"), "activations.checkpoint must be one of"),
        (dict(offload_ratio=1.5), r"offload_ratio must be in \[0, 1\], got 1.5"),
        (dict(offload_ratio=-0.1), r"must be in \[0, 1\]"),
        (dict(every=0, checkpoint="full"), "every must be a positive int"),
        (dict(every=2), "checkpoint='none'"),
        (dict(checkpoint_blocks=(1,)), "checkpoint='none'"),
        (dict(checkpoint="full", every=2, checkpoint_blocks=(1,)), "not both"),
        (dict(offload_checkpoint_inputs=True), "needs checkpointed blocks"),
        (dict(use_reentrant=True), "no effect without checkpoint"),
        (dict(checkpoint="selective", use_reentrant=True), "use_reentrant=False"),
        (dict(host_memory_limit_bytes=1 << 30), "nothing is offloaded"),
        (dict(offload_ratio=1.0, host_memory_limit_bytes=0), "must be a positive int"),
        (dict(min_offload_bytes=-1), "min_offload_bytes"),
        (dict(keep_last=0), "keep_last must be >= 1"),
        (dict(checkpoint="full", checkpoint_blocks=(1.5,)), "tuple of block indices"),
        (dict(checkpoint="full", use_reentrant=1), "use_reentrant must be a bool"),
        (dict(simulate_host=True), "simulate_host has no effect without offload"),
    ],
)
def test_bad_config_raises_value_error(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ActivationConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        apply_activation_policy(model_for("llama", n_layers=2), **kwargs)


def test_bad_apply_calls() -> None:
    model = model_for("llama", n_layers=2)
    with pytest.raises(TypeError, match="unknown activation setting"):
        apply_activation_policy(model, offload=0.5)
    with pytest.raises(ValueError, match="out of range"):
        apply_activation_policy(model, checkpoint="full", checkpoint_blocks=(5,))
    with pytest.raises(ValueError, match="nothing would be offloaded"):
        apply_activation_policy(model_for("llama", n_layers=1), offload_ratio=0.5)
    with pytest.raises(ValueError, match="2 blocks"):
        apply_block_policies(model, [BlockPolicy()])
    with pytest.raises(ValueError, match="offload_input needs a checkpointed block"):
        BlockPolicy(offload_input=True)
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        BlockPolicy("some")
    with pytest.raises(ValueError, match=r"offload_ratio must be in \[0, 1\]"):
        BlockPolicy(offload_ratio=2.0)



@pytest.mark.parametrize("lead", [1, 3, 8])
def test_an_offloaded_block_starts_back_up_to_the_lead_before_its_backward(lead: int) -> None:
    """Blocks that offload nothing lend their backward to the copy of the offloading block before them: the block
    ``lead`` after it (at most) starts it back when backward reaches it, and gradients stay exact."""
    model = model_for("llama", n_layers=6)
    ref_loss, ref = step_grads(model, 1)
    plan = [BlockPolicy(offload_ratio=1.0)] + [BlockPolicy()] * 4 + [BlockPolicy("full")]
    apply_block_policies(model, plan, min_offload_bytes=0, simulate_host=True, prefetch_lead_blocks=lead)
    eng = get_offload_engine(model)
    seen: list[tuple[int, int]] = []  # (block whose backward starts, bytes brought back by then)

    def watch(k: int):
        def fwd_hook(mod, args, out):
            if out.requires_grad:  # after the policy's own hook: fires once that one has run
                out.register_hook(lambda g: seen.append((k, eng.stats().reloaded_bytes)))
        return fwd_hook

    for k, b in enumerate(model.blocks):
        b.register_forward_hook(watch(k))
    loss, got = step_grads(model, 1)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=0)
    assert [k for k, _ in seen] == [5, 4, 3, 2, 1, 0]
    started = [k for k, nbytes in seen if nbytes > 0]
    assert started[0] == min(lead, 5)  # block 0's tensors start back when the backward reaches block `lead`
    assert eng.stats().reloaded_bytes == eng.stats().offloaded_bytes > 0


def test_a_bad_prefetch_lead_is_refused() -> None:
    model = model_for("llama", n_layers=2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch_lead_blocks"):
            apply_block_policies(model, [BlockPolicy(offload_ratio=1.0), BlockPolicy()], prefetch_lead_blocks=bad)
    assert _wrap.get_policy(model.blocks[0]) is None  # nothing applied
