"""apply(): a hand-made plan on the tiny reference model (fp32, CPU) trains as the plain run does.

Tolerances are the mechanisms' own: recompute gives the plain gradients to fp32 rounding (1e-6 relative,
tests/test_activations_policy.py) and the offloaded optimizer runs torch's fused CPU AdamW (bitwise on the same
gradients, tests/test_optim_offload.py), so parameters after a few steps agree to ~1e-6.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import replace as dataclasses_replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from elbowroom.activations.policy import get_block_policies
from elbowroom.models import ModelConfig, build_model
from elbowroom.optim import CPUOffloadConfig, CPUOffloadOptimizer
from elbowroom.plan import Plan, apply
from elbowroom.plan.plan import BlockPlan

TOL = 1e-6


# several buckets even for the tiny model, and one CPU thread (two cores shared with other tests)
KNOBS = CPUOffloadConfig(bucket_bytes=1 << 16, num_staging_slots=2, cpu_threads=1)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(dropout: float = 0.0, arch: str = "llama") -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny", dropout=dropout, arch=arch)
    return build_model(cfg).train()


def hand_plan(n: int, **kw) -> Plan:
    rows = [
        BlockPlan(index=0, checkpoint="full"),
        BlockPlan(index=1, checkpoint="selective"),
        BlockPlan(index=2, optimizer_on_host=True),
        BlockPlan(index=3, checkpoint="full", optimizer_on_host=True),
    ][:n]
    return Plan(blocks=tuple(rows), budget_bytes=1 << 30, predicted_peak_bytes=0, predicted_step_seconds=1.0,
                predicted_tokens_per_s=1.0, **kw)


IDX = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))


def run(
    model: nn.Module, opt: torch.optim.Optimizer, steps: int, clip: float | None = None, grads: dict | None = None
) -> list[float]:
    """Losses of ``steps`` steps; the first step's gradients into ``grads`` (before clipping)."""
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)  # the same dropout masks in both runs
        loss = F.cross_entropy(model(IDX).flatten(0, 1).float(), IDX.flatten())
        loss.backward()
        if step == 0 and grads is not None:
            grads.update({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        if clip is not None:  # the CPU-offloaded optimizer's own: it also sees gradients already on the host
            if hasattr(opt, "clip_grad_norm_"):
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_params_close(a: nn.Module, b: nn.Module, tol: float) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        err = ((x.detach().float() - y.detach().float()).norm() / y.detach().float().norm().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: relative error {err:.3e}"


@pytest.mark.parametrize("arch, dropout", [("llama", 0.0), ("gpt2", 0.1)])
@pytest.mark.parametrize("other", [False, True, "head"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_plan_trains_like_plain(arch: str, dropout: float, other: bool | str, clip: float | None) -> None:
    ref = tiny(dropout, arch)
    model = copy.deepcopy(ref)
    # other: the parameters outside the blocks on the host, all of them or ("head") those after the blocks alone
    plan = hand_plan(4, offload_other_params=other is True, offload_head_params=other == "head")
    model, opt = apply(model, plan, torch.optim.AdamW, offload_config=KNOBS, lr=1e-2, weight_decay=0.1, fused=True)
    assert isinstance(opt, CPUOffloadOptimizer)
    assert [p.checkpoint for p in get_block_policies(model)] == ["full", "selective", "none", "full"]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    g_got, g_want = {}, {}
    got = run(model, opt, 3, clip, g_got)
    want = run(ref, ref_opt, 3, clip, g_want)
    for name, q in g_want.items():  # the first step's gradients: equal to fp32 rounding
        err = ((g_got[name] - q).norm() / q.norm().clamp_min(1e-30)).item()
        assert err <= TOL, f"{name}: gradient relative error {err:.3e}"
    assert got == pytest.approx(want, rel=1e-5)
    opt.wait_for_weights()
    assert_params_close(model, ref, 1e-5)
    n_off = sum(p.numel() for blk in list(model.blocks)[2:] for p in blk.parameters())
    names = [n for n, _ in model.named_parameters()]
    last = max(i for i, n in enumerate(names) if n.startswith("blocks."))
    if other is True:
        n_off += sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    elif other == "head":  # the final norm and the output head; the embeddings stay on the device
        after = names[last + 1:]
        assert after and all(n.startswith(("norm.", "output.")) for n in after), after
        n_off += sum(p.numel() for n, p in model.named_parameters() if n in after)
    assert opt.stats()["offloaded_numel"] == n_off


def test_nothing_offloaded_gives_torchs_optimizer() -> None:
    model = tiny()
    plan = hand_plan(4)
    rows = tuple(BlockPlan(index=b.index, checkpoint=b.checkpoint) for b in plan.blocks)
    plain = Plan(blocks=rows, budget_bytes=1, predicted_peak_bytes=0, predicted_step_seconds=1.0,
                 predicted_tokens_per_s=1.0)
    _, opt = apply(model, plain, torch.optim.AdamW, offload_config=KNOBS, lr=1e-3)
    assert type(opt) is torch.optim.AdamW


def test_bf16_plan_casts_weights_and_keeps_fp32_masters() -> None:
    ref = tiny()
    model = copy.deepcopy(ref)
    plan = hand_plan(4, weight_dtype="bfloat16", offload_param_dtype="bfloat16")
    model, opt = apply(model, plan, torch.optim.AdamW, offload_config=KNOBS, lr=1e-2)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.rope.cos.dtype == torch.float32  # buffers keep their precision
    assert isinstance(opt, CPUOffloadOptimizer) and opt.config.master_weights
    losses = run(model, opt, 3)
    # the same arithmetic in plain torch: bf16 weights (fp32 buffers), AdamW on fp32 copies of them, cast back
    bf16 = copy.deepcopy(ref)
    for q in bf16.parameters():
        q.data = q.data.to(torch.bfloat16)
    masters = [q.detach().float() for q in bf16.parameters()]
    want, inner = [], torch.optim.AdamW(masters, lr=1e-2)
    for step in range(3):
        torch.manual_seed(100 + step)
        loss = F.cross_entropy(bf16(IDX).flatten(0, 1).float(), IDX.flatten())
        loss.backward()
        for m, q in zip(masters, bf16.parameters()):
            m.grad, q.grad = q.grad.float(), None
        inner.step()
        with torch.no_grad():
            for m, q in zip(masters, bf16.parameters()):
                q.copy_(m)
        want.append(loss.item())
    assert losses == pytest.approx(want, rel=1e-3)
    # and near fp32's (bf16 rounding apart; the margin depends on the CPU's bf16 kernels)
    assert losses == pytest.approx(run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 3), rel=5e-2)


def test_bf16_offloaded_copies_leave_the_embedding_and_the_residual_stream_in_fp32() -> None:
    # fp32 weights under autocast with bf16 device copies of the offloaded matrices: the embedding table is offloaded
    # too but keeps its fp32 copy, so the residual stream stays fp32 as profiled (a bf16 table made it bf16, and
    # each block's norms then saved fp32 upcasts of it: 128 MiB a block more than profiled on the 7B shape)
    model = tiny()
    plan = hand_plan(4, offload_param_dtype="bfloat16", offload_other_params=True)
    model, opt = apply(model, plan, torch.optim.AdamW, offload_config=KNOBS, lr=1e-2)
    assert model.tok_emb.weight.dtype == torch.float32
    assert model.blocks[2].w13.weight.dtype == torch.bfloat16 and model.blocks[1].w13.weight.dtype == torch.float32
    assert model.output.weight.dtype == torch.bfloat16  # a matrix after the blocks: its output is the logits
    seen = []
    hook = model.blocks[3].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(IDX).float().sum().backward()
    hook.remove()
    assert seen == [torch.float32]
    before = model.tok_emb.weight.detach().clone()
    opt.step()  # and it steps, the table in fp32 from its host master
    opt.zero_grad()
    opt.wait_for_weights()  # step() returns before the host's update lands (the plan overlaps it with the forward)
    assert model.tok_emb.weight.dtype == torch.float32 and not torch.equal(model.tok_emb.weight, before)


def test_state_dict_right_after_step_has_the_updated_weights() -> None:
    # step() returns before the host's updates land; a checkpoint saved right after it must not hold the weights of
    # the step before (or half of them): model.state_dict() waits for each offloaded module's update
    for _ in range(3):
        model = tiny()
        model, opt = apply(model, hand_plan(4), torch.optim.AdamW, offload_config=KNOBS, lr=1e-2)
        assert isinstance(opt, CPUOffloadOptimizer)
        for _ in range(2):
            F.cross_entropy(model(IDX).flatten(0, 1), IDX.flatten()).backward()
            opt.step()
            opt.zero_grad()
            saved = {k: v.clone() for k, v in model.state_dict().items()}
            block = {k: v.clone() for k, v in model.blocks[3].state_dict().items()}
            opt.wait_for_weights()
            for k, v in model.state_dict().items():
                assert torch.equal(saved[k], v), k
            for k, v in model.blocks[3].state_dict().items():
                assert torch.equal(block[k], v), k
        opt.close()


def test_a_plan_applied_again_while_the_first_optimizer_is_open_is_refused_until_it_is_closed() -> None:
    """A second apply to the same model, the first optimizer kept open, is refused and says why (it built, then
    failed in the second step with "became final twice before step()", pointing at gradient accumulation); once the
    first is closed, the plan applies again and trains like plain."""
    model, ref = tiny(), tiny()
    model, first = apply(model, hand_plan(4), torch.optim.AdamW, offload_config=KNOBS, lr=1e-2)
    with pytest.raises(ValueError, match=r"already belongs to an open CPUOffloadOptimizer.*call that optimizer's "
                                         r"close\(\).*elbowroom.apply of another plan"):
        apply(model, hand_plan(4), torch.optim.AdamW, offload_config=KNOBS, lr=1e-2)
    first.close()
    model, again = apply(model, hand_plan(4), torch.optim.AdamW, offload_config=KNOBS, lr=1e-2)
    assert run(model, again, 3) == pytest.approx(run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 3), rel=1e-5)
    again.close()


def test_bf16_offloaded_copies_in_a_plan_profiled_in_fp32_are_refused() -> None:
    """A hand edit the planner never makes (it keeps offloaded weights fp32 where the step computes in fp32): bf16
    device copies without autocast failed in the first matmul with a dtype mismatch; apply now says why first, the
    model untouched."""
    from elbowroom.plan.plan import ProfileSummary

    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    edited = hand_plan(4, offload_param_dtype="bfloat16", profile=ProfileSummary(compute_dtype="float32"))
    with pytest.raises(ValueError, match=r"offloaded weights in bf16 .* profiled computing in float32: set "
                                         r'offload_param_dtype = "float32"'):
        apply(model, edited, torch.optim.AdamW, offload_config=KNOBS, lr=1e-2)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # profiled under bf16 compute, the same plan applies
    model, opt = apply(model, dataclasses_replace(edited, profile=ProfileSummary(compute_dtype="bfloat16")),
                       torch.optim.AdamW, offload_config=KNOBS, lr=1e-2)
    opt.close()


def test_block_count_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="the plan has 3 blocks but the model has 4: plan again"):
        apply(tiny(), hand_plan(3), offload_config=KNOBS, lr=1e-3)


class Wrapped(nn.Module):
    """Blocks under another name, next to a longer list of another kind (so finding them by size fails)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny()
        self.heads = nn.ModuleList(nn.Identity() for _ in range(6))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(idx)


def test_blocks_named_by_path() -> None:
    ref = Wrapped()
    model = copy.deepcopy(ref)
    with pytest.raises(ValueError, match="the plan has 4 blocks but the model has 6"):
        apply(model, hand_plan(4), offload_config=KNOBS, lr=1e-2)
    model, opt = apply(model, hand_plan(4), torch.optim.AdamW, blocks="inner.blocks", offload_config=KNOBS, lr=1e-2,
                       fused=True)
    got = run(model, opt, 2)
    want = run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), 2)
    assert got == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="has no submodule 'inner.layers'"):
        apply(Wrapped(), hand_plan(4), blocks="inner.layers", offload_config=KNOBS, lr=1e-2)


@pytest.mark.parametrize("where", ["minimum", "between"])
def test_searched_plan_applies_and_trains_like_plain(where: str) -> None:
    # search -> apply without the profiler: a hand-made profile of the tiny model's shape
    from test_plan_support import make_profile

    from elbowroom.plan import BudgetError, plan_for

    p = make_profile(dim=128, n_layers=4, ffn=384, vocab=256, micro_batch=2, seq_len=64)
    with pytest.raises(BudgetError) as e:
        plan_for(p, 1, fused_loss_allowed=False, offload_config=KNOBS)
    low = e.value.minimum_bytes
    high = plan_for(p, 80 << 30, offload_config=KNOBS).predicted_peak_bytes
    budget = low if where == "minimum" else (low + high) // 2
    plan = plan_for(p, budget, offload_config=KNOBS)
    if where == "minimum":
        assert plan.offloads_optimizer and any(b.checkpoint != "none" for b in plan.blocks)
    ref = tiny(0.1, "gpt2")
    model = copy.deepcopy(ref)
    model, opt = apply(model, plan, torch.optim.AdamW, offload_config=KNOBS, lr=1e-2, fused=True)
    got = run(model, opt, 3, clip=1.0)
    want = run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), 3, clip=1.0)
    assert got == pytest.approx(want, rel=1e-5)
    if isinstance(opt, CPUOffloadOptimizer):
        opt.wait_for_weights()
    assert_params_close(model, ref, 1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hugging_face_models_train_like_plain(arch: str) -> None:
    # every mechanism on HF blocks (keyword arguments, tied embeddings, dropout): bitwise the plain run on CPU
    import test_plan_fit as hf

    ref = hf.hf_gpt2() if arch == "gpt2" else hf.hf_llama()
    model = copy.deepcopy(ref)
    rows = (
        BlockPlan(index=0, checkpoint="full", offload_input=True),
        BlockPlan(index=1, checkpoint="selective", offload_ratio=0.5),
        BlockPlan(index=2, offload_ratio=0.5, optimizer_on_host=True),
        BlockPlan(index=3, checkpoint="selective", optimizer_on_host=True),
    )
    plan = Plan(blocks=rows, budget_bytes=1 << 30, predicted_peak_bytes=0, predicted_step_seconds=1.0,
                predicted_tokens_per_s=1.0, offload_other_params=True)
    model, opt = apply(model, plan, torch.optim.AdamW, offload_config=KNOBS, lr=1e-2, weight_decay=0.1, fused=True)
    assert model.config.use_cache is False
    got = hf.train(model, opt, 3)
    want = hf.train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True), 3)
    assert got == pytest.approx(want, rel=1e-6)
    opt.wait_for_weights()
    assert_params_close(model, ref, 1e-6)


def test_apply_builds_the_callers_parameter_groups() -> None:
    # the trainer's AdamW groups (no decay on norms and embeddings) survive a plan, offloaded or not
    from elbowroom.train.trainer import param_groups

    on_device = Plan(blocks=tuple(BlockPlan(index=i) for i in range(4)), budget_bytes=1 << 30,
                     predicted_peak_bytes=0, predicted_step_seconds=1.0, predicted_tokens_per_s=1.0)
    for plan in (hand_plan(4), on_device):
        model = tiny()
        _, opt = apply(model, plan, torch.optim.AdamW, offload_config=KNOBS, lr=1e-2, weight_decay=0.1,
                       param_groups=lambda m: param_groups(m, 0.1))
        decays = sorted(g["weight_decay"] for g in opt.param_groups)
        assert decays == [0.0, 0.1], decays
        assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
        if isinstance(opt, CPUOffloadOptimizer):
            opt.close()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_plan_with_gradients_offloaded_trains_like_plain(clip: float | None) -> None:
    """A plan whose offloaded gradients leave in the backward (a loop that does not clip, or clips with the
    optimizer's ``clip_grad_norm_``) builds that optimizer, frees those gradients and steps as plain AdamW."""
    from test_plan_support import make_profile

    from elbowroom.plan import BudgetError, plan_for

    p = make_profile(dim=128, n_layers=4, ffn=384, vocab=256, micro_batch=2, seq_len=64)
    with pytest.raises(BudgetError) as e:
        plan_for(p, 1, grad_clipping=clip is not None, gradient_offload_allowed=True, offload_config=KNOBS)
    plan = plan_for(p, e.value.minimum_bytes, grad_clipping=clip is not None, gradient_offload_allowed=True,
                    offload_config=KNOBS)
    assert plan.offload_gradients and Plan.from_toml(plan.to_toml()) == plan
    ref = tiny(0.1, "gpt2")
    model, opt = apply(copy.deepcopy(ref), plan, torch.optim.AdamW, offload_config=KNOBS, lr=1e-2, fused=True)
    assert isinstance(opt, CPUOffloadOptimizer) and opt.config.offload_gradients
    got = run(model, opt, 3, clip=clip)
    want = run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True), 3, clip=clip)
    assert got == pytest.approx(want, rel=1e-5)
    opt.wait_for_weights()
    assert_params_close(model, ref, 1e-5)
