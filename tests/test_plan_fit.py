"""fit() on Hugging Face models built from configs (no download): GPT-2 with dropout and a small Llama train as
their plain runs do, under a plan that fits a tight budget. These need the profiler
(``elbowroom.plan.profiler``, written in another worktree) and skip until it is there; the budget parsing tests
run without it."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import pytest
import torch

from elbowroom.activations import _wrap
from elbowroom.activations.recompute import find_blocks
from elbowroom.optim import CPUOffloadConfig, CPUOffloadOptimizer
from elbowroom.plan import BudgetError, fit, parse_budget, plan_for
from elbowroom.plan.types import profile_from_dict

DEVICE = "h100-80gb"  # a device of the table: analytic profiles plan for it; the run itself is on the CPU


@pytest.mark.parametrize(
    "text, want",
    [("24GiB", 24 << 30), ("24GB", 24 * 10**9), ("512MiB", 512 << 20), ("1.5 GiB", 3 << 29), ("100", 100),
     ("2tib", 2 << 40), (4096, 4096)],
)
def test_parse_budget(text: str | int, want: int) -> None:
    assert parse_budget(text) == want


@pytest.mark.parametrize("bad", ["24 parsecs", "GiB", "-1GiB", "", 0, -5, 2.5, True, None])
def test_bad_budgets_name_the_accepted_forms(bad: object) -> None:
    with pytest.raises(ValueError, match="accepted: a number with GiB"):
        parse_budget(bad)  # type: ignore[arg-type]


def test_fit_rejects_a_bad_budget_before_profiling() -> None:
    with pytest.raises(ValueError, match="cannot read budget"):
        fit(torch.nn.Linear(2, 2), torch.zeros(1, 2), budget="lots")


def test_a_budget_above_the_process_memory_cap_is_refused_with_the_cap() -> None:
    """A budget above ``torch.cuda.set_per_process_memory_fraction``'s cap (one an earlier capped run left) is refused
    before profiling, naming the cap and how to lift it; within the cap, or uncapped, nothing is said."""
    from elbowroom.plan.fit import memory_cap_error

    total = 141 * 2**30
    err = memory_cap_error(16 * 2**30, 10 / 141, total)
    assert err is not None and "above this process's CUDA memory cap of 10.0 GiB" in err
    assert "set_per_process_memory_fraction(1.0)" in err
    assert memory_cap_error(10 * 2**30, 10 / 141, total) is None
    assert memory_cap_error(140 * 2**30, 1.0, total) is None


# ------------------------------------------------------------------ with the profiler
# small staging (so that the planner finds offloading worth its buffers on these tiny models) and one thread
KNOBS = CPUOffloadConfig(bucket_bytes=1 << 14, num_staging_slots=2, cpu_threads=1)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def hf_gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=4, n_head=4,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


def hf_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


IDS = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """The plain torch loop, as a user writes it: nothing elbowroom-specific."""
    losses = []
    for step in range(steps):
        torch.manual_seed(1000 + step)  # the same dropout masks in both runs
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def budgets(model: torch.nn.Module) -> tuple[int, int]:
    """(the minimum, the plain peak) of the analytic profile on DEVICE."""
    profile = pytest.importorskip("elbowroom.plan.profiler").profile
    prof = profile(copy.deepcopy(model), IDS, source="analytic", machine=DEVICE)
    high = plan_for(prof, 80 << 30, offload_config=KNOBS).predicted_peak_bytes
    with pytest.raises(BudgetError) as e:
        plan_for(prof, 1, offload_config=KNOBS)
    return e.value.minimum_bytes, high


@pytest.mark.parametrize("make", [hf_gpt2, hf_llama], ids=["gpt2-dropout", "llama"])
@pytest.mark.parametrize("where", ["minimum", "between"])
def test_fit_trains_like_plain(make, where: str) -> None:
    pytest.importorskip("elbowroom.plan.profiler")
    ref = make()
    model = copy.deepcopy(ref)
    low, high = budgets(ref)
    budget = low if where == "minimum" else (low + high) // 2
    model, opt, plan = fit(model, IDS, budget=budget, source="analytic", machine=DEVICE, lr=1e-2,
                           weight_decay=0.1, fused=True, offload_config=KNOBS)
    assert plan.predicted_peak_bytes <= budget and len(plan.blocks) == 4
    if where == "minimum":  # the tightest plan uses the mechanisms
        assert any(b.checkpoint != "none" or b.offload_ratio or b.offload_input for b in plan.blocks) or \
            plan.offloads_optimizer
    # one process: the blocks recomputed whole use torch's reentrant checkpoint, the selective ones cannot
    for blk, decided in zip(find_blocks(model), plan.blocks):
        rc = _wrap.get_policy(blk).recompute if _wrap.get_policy(blk) is not None else None
        assert (rc is None) == (decided.checkpoint == "none")
        assert rc is None or rc.use_reentrant == (decided.checkpoint == "full")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    got = train(model, opt, 3)
    want = train(ref, ref_opt, 3)
    assert got == pytest.approx(want, rel=1e-5)
    if isinstance(opt, CPUOffloadOptimizer):
        opt.wait_for_weights()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        err = ((a.detach() - b.detach()).norm() / b.detach().norm().clamp_min(1e-30)).item()
        assert err <= 1e-5, f"{name}: relative error {err:.3e}"


def test_fit_keeps_the_non_reentrant_checkpoint_when_asked() -> None:
    # a loop that calls torch.autograd.grad through the model (torch refuses it under the reentrant checkpoint)
    pytest.importorskip("elbowroom.plan.profiler")
    model = hf_llama()
    low, _ = budgets(model)
    model, opt, plan = fit(model, IDS, budget=low, source="analytic", machine=DEVICE, lr=1e-2, offload_config=KNOBS,
                           reentrant=False)
    full = [b for b, d in zip(find_blocks(model), plan.blocks) if d.checkpoint == "full"]
    assert full and all(not _wrap.get_policy(b).recompute.use_reentrant for b in full)
    loss = model(input_ids=IDS, labels=IDS).loss
    grads = torch.autograd.grad(loss, [p for p in full[0].parameters()])
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_fit_with_a_loss_fn_that_leaves_the_kv_cache_on() -> None:
    # a caller's loss_fn calls the Hugging Face model as it is (use_cache on by default): the profile recomputes
    # every block once, which refuses a cache written twice, so profiling turns it off and gives it back; the
    # plan's apply turns it off for training where blocks are recomputed
    from elbowroom.plan import profile

    def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        ids, _ = batch
        logits = model(input_ids=ids).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    ids = torch.randint(0, 128, (2, 32))
    model = hf_gpt2()
    assert model.config.use_cache
    profile(model, (ids, ids), loss_fn=loss_fn, machine=DEVICE, source="measured")
    assert model.config.use_cache  # the profile leaves the model as it found it
    with pytest.raises(BudgetError) as e:
        plan_for(profile(hf_gpt2(), (ids, ids), loss_fn=loss_fn, machine=DEVICE, source="measured"), 1,
                 offload_config=KNOBS)
    model, opt, plan = fit(model, (ids, ids), budget=e.value.minimum_bytes, loss_fn=loss_fn, machine=DEVICE,
                           source="measured", lr=1e-3, offload_config=KNOBS)
    recomputes = any(b.checkpoint != "none" for b in plan.blocks)
    assert recomputes and not model.config.use_cache  # the minimum recomputes: the cache is off for training
    loss_fn(model, (ids, ids)).backward()  # trains under the plan
    opt.step()
    if hasattr(opt, "close"):
        opt.close()


def test_a_model_without_found_blocks_is_told_how_to_name_them() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10))
    with pytest.raises(ValueError, match="has no repeated blocks.*blocks='path.to.list'"):
        fit(model, torch.randint(0, 10, (2, 5)), budget="1GiB")
    from elbowroom.plan import profile

    with pytest.raises(ValueError, match="has no repeated blocks.*blocks='path.to.list'"):  # the profile alone too
        profile(model, torch.randint(0, 10, (2, 5)))


def test_the_plan_names_a_small_model_s_parameter_count_readably() -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(x)) + x

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.layers, self.head = torch.nn.Embedding(10, 8), torch.nn.ModuleList(
                [Block() for _ in range(3)]), torch.nn.Linear(8, 10)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            for b in self.layers:
                x = b(x)
            return self.head(x)

    _, _, plan = fit(Tiny(), torch.randint(0, 10, (2, 5)), budget="1GiB", lr=1e-3)
    n = sum(p.numel() for p in Tiny().parameters())
    assert plan.table().splitlines()[0].endswith(f"profile, {n} parameters)")


def test_fit_compiled_prices_and_runs_the_compiled_blocks() -> None:
    # fit(compile=True) on a measured profile: the plan is priced on the blocks compiled (its note says so), the
    # blocks run compiled inside the plan's policies, and the loop trains as the plain one does. At the minimum of
    # that profile the plan uses the mechanisms. An analytic profile cannot price compiled blocks: refused.
    from elbowroom.activations import CompiledBlocks, compile_blocks
    from elbowroom.plan.fit import COMPILED_NOTE
    from elbowroom.plan.profiler import profile

    ref = hf_llama()
    prof = profile(copy.deepcopy(ref), IDS, machine="cpu", compiled=True, warmup=1, iters=1)
    with pytest.raises(BudgetError) as e:
        plan_for(prof, 1, offload_config=KNOBS)
    model, opt, plan = fit(copy.deepcopy(ref), IDS, budget=e.value.minimum_bytes, machine="cpu", compile=True,
                           lr=1e-2, offload_config=KNOBS)
    assert COMPILED_NOTE in plan.notes
    # planned blocks compile recomputing pointwise results (PLANNED_COMPILE), unless told otherwise or compiled by
    # another backend than inductor (which the option needs)
    from elbowroom.plan.fit import planned_compile_options

    assert "the blocks compiled with compile_blocks(recompute_pointwise=True)" in plan.notes
    assert planned_compile_options() == {"recompute_pointwise": True}
    assert planned_compile_options({"recompute_pointwise": False, "mode": "max-autotune"}) == {
        "recompute_pointwise": False, "mode": "max-autotune"}
    assert planned_compile_options({"backend": "aot_eager"}) == {"backend": "aot_eager"}
    # the note comes from the profile, so a plan made from a saved one (elbowroom plan --profile) carries it too,
    # and one whose profile ran eager does not
    big = e.value.minimum_bytes * 4
    assert COMPILED_NOTE in plan_for(profile_from_dict(prof.to_dict()), big, offload_config=KNOBS).notes
    eager = dataclasses.replace(prof, extra={**prof.extra, "compiled_blocks": False})
    assert COMPILED_NOTE not in plan_for(eager, big, offload_config=KNOBS).notes
    assert any(b.checkpoint != "none" or b.offload_ratio or b.offload_input for b in plan.blocks) or \
        plan.offloads_optimizer
    assert compile_blocks(model) == CompiledBlocks(compiled=4, eager=0)  # compiled already: nothing new
    got = train(model, opt, 3)
    want = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 3)
    assert got == pytest.approx(want, rel=1e-4)
    # an analytic profile prices blocks compiled as planned runs compile them (pointwise recomputed), not the
    # partitioner's defaults, which only a measurement tells
    _, _, analytic = fit(hf_llama(), IDS, budget="1GiB", source="analytic", machine=DEVICE, compile=True,
                         offload_config=KNOBS)
    assert COMPILED_NOTE in analytic.notes and any(n.startswith("analytic: a compiled block") for n in analytic.notes)
    with pytest.raises(ValueError, match="needs a measured profile"):
        fit(hf_llama(), IDS, budget="1GiB", source="analytic", machine=DEVICE,
            compile={"recompute_pointwise": False})


def test_fit_compiled_leaves_the_planned_run_its_own_graphs() -> None:
    # a compiled profile leaves no compiled code behind: the planned run compiles as many graphs as the same plan
    # applied and compiled in a fresh compiler state (one that reused the profile's graphs died with an illegal
    # memory access on CUDA, a Hugging Face Llama; fresh, it trained), and trains as the plain loop does
    from torch._dynamo.utils import counters

    from elbowroom.activations import compile_blocks
    from elbowroom.plan import apply

    ref = hf_llama()
    with pytest.raises(BudgetError) as e:
        fit(copy.deepcopy(ref), IDS, budget=1, machine="cpu", compile=True, offload_config=KNOBS)
    # at the minimum, where the profile's last compiled graphs (every block recomputed) are the plan's: reused
    # whole, the planned run would compile none
    model, opt, plan = fit(copy.deepcopy(ref), IDS, budget=e.value.minimum_bytes, machine="cpu", compile=True,
                           lr=1e-2, offload_config=KNOBS)
    counters.clear()
    got = train(model, opt, 2)
    after_fit = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    fresh, fresh_opt = apply(copy.deepcopy(ref), plan, torch.optim.AdamW, lr=1e-2, offload_config=KNOBS)
    compile_blocks(fresh)
    counters.clear()
    assert train(fresh, fresh_opt, 2) == pytest.approx(got, rel=1e-5)
    assert after_fit == counters["stats"]["unique_graphs"] > 0
    assert got == pytest.approx(train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 2), rel=1e-4)


def test_fit_compiled_with_compile_blocks_options() -> None:
    # fit(compile={...}): compile_blocks' keyword arguments, the profile compiled so too (its extra says how) and the
    # plan priced on what those blocks save; the loop trains as the plain one does. An unknown key is refused
    # before any profiling
    from elbowroom.plan.profiler import profile

    ref = hf_llama()
    opts = {"recompute_pointwise": True}
    prof = profile(copy.deepcopy(ref), IDS, machine="cpu", compiled=opts, warmup=1, iters=1)
    assert prof.extra["compile_options"] == opts and prof.extra["compiled_blocks"] is True
    big = 4 * plan_for(prof, 1 << 40, offload_config=KNOBS).predicted_peak_bytes
    model, opt, plan = fit(copy.deepcopy(ref), IDS, budget=big, machine="cpu", compile=opts, lr=1e-2,
                           offload_config=KNOBS)
    assert "the blocks compiled with compile_blocks(recompute_pointwise=True)" in plan.notes
    got = train(model, opt, 3)
    want = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 3)
    assert got == pytest.approx(want, rel=1e-4)
    with pytest.raises(ValueError, match=r"not \['recompute'\]"):
        fit(hf_llama(), IDS, budget=big, machine="cpu", compile={"recompute": True})


def test_fit_s_optimizer_warns_when_the_allocator_keeps_retrying(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A loop of fit's (CUDA counters simulated on a CPU optimizer): the step post-hook reads the allocator after
    each step, warns once when it keeps retrying (naming a budget 5% lower, as fit takes it) and once when it holds
    more than the budget, then removes itself; after the first 50 steps it reads every 50th."""
    from elbowroom.plan.fit import BudgetHook
    from elbowroom.plan.plan import BlockPlan, Plan

    plan = Plan(blocks=(BlockPlan(0),), budget_bytes=20 << 30, predicted_peak_bytes=19 << 30,
                predicted_step_seconds=0.5, predicted_tokens_per_s=1.0)
    counters = {"num_alloc_retries": 3, "reserved_bytes.all.current": 19 << 30, "allocated_bytes.all.current": 1}
    reads: list[int] = []

    def memory_stats(device: torch.device) -> dict[str, int]:
        reads.append(hook.steps)
        return dict(counters)

    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hook = BudgetHook(plan, torch.device("cuda", 0))
    hook.register(opt)

    def steps(n: int) -> None:
        for _ in range(n):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

    with caplog.at_level("WARNING"):
        steps(2)  # the first row is the baseline (the profile's retries); no new ones: nothing said
        assert caplog.text == ""
        counters["num_alloc_retries"] = 5
        steps(1)
        assert caplog.text.count("the allocator found no room 2 times since step 1") == 1
        assert "fit(budget='19.0GiB')" in caplog.text
        counters["reserved_bytes.all.current"] = 21 << 30  # more than the budget: said once
        steps(2)
        assert caplog.text.count("above the budget of 20.00 GiB") == 1
    assert reads == [1, 2, 3, 4]  # both said: the hook removed itself
    # another hook, quiet: every step to the 50th, then every 50th
    hook = BudgetHook(plan, torch.device("cuda", 0))
    hook.register(opt)
    reads.clear()
    counters.update({"num_alloc_retries": 0, "reserved_bytes.all.current": 1})
    steps(120)
    assert reads == [*range(1, 51), 100]


@pytest.mark.gpu
def test_fit_s_optimizer_on_cuda_carries_the_budget_hook() -> None:
    """On CUDA fit's optimizer carries the hook (and counts the loop's steps reading the real counters); with
    watch=False it carries none."""
    from elbowroom.plan.fit import BudgetHook

    def hooks(opt: torch.optim.Optimizer) -> list[BudgetHook]:
        return [h for h in opt._optimizer_step_post_hooks.values() if isinstance(h, BudgetHook)]

    ids = IDS.cuda()
    model, opt, plan = fit(hf_llama().cuda(), ids, budget="4GiB", lr=1e-3)
    assert len(hooks(opt)) == 1 and plan.expandable_segments is not None  # the plan says which setting it priced
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert hooks(opt)[0].steps == 3 and hooks(opt)[0].watch.retries is not None
    _, opt, _ = fit(hf_llama().cuda(), ids, budget="4GiB", lr=1e-3, watch=False)
    assert hooks(opt) == []


def test_fit_s_before_apply_sees_the_plan_and_may_refuse_it() -> None:
    """before_apply gets the plan before anything is applied; raising refuses it and leaves the model as it was
    (the trainer refuses a re-plan that would not be faster so, before its pinned memory is allocated)."""
    model = hf_llama()
    low, _ = budgets(model)  # at the minimum blocks recompute: applied, they carry a policy
    seen = []

    def refuse(plan) -> None:
        seen.append(plan)
        raise RuntimeError("refused")

    kw = dict(source="analytic", machine=DEVICE, lr=1e-3, offload_config=KNOBS)
    with pytest.raises(RuntimeError, match="refused"):
        fit(model, IDS, budget=low, before_apply=refuse, **kw)
    assert len(seen) == 1 and seen[0].budget_bytes == low
    assert any(b.checkpoint != "none" for b in seen[0].blocks)
    assert all(_wrap.get_policy(m) is None for m in model.modules())  # nothing applied
    model, _, plan = fit(model, IDS, budget=low, before_apply=seen.append, **kw)
    assert seen[-1] is plan and any(_wrap.get_policy(m) is not None for m in model.modules())


def test_fit_plans_again_from_the_profiles_it_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """fit(profiles=d) keeps what it measured (the model and its bf16 copy) in d; a later fit of the model built
    again, given d, plans from them without profiling, to the plan a fresh profile gives; another batch shape or
    precision is measured anew (the trainer's re-plans: elbowroom.train.planning.Try.profiles)."""
    from elbowroom.plan import profiler

    shapes = []
    measure = profiler.profile

    def counted(model, batch, **kw):
        shapes.append(tuple(batch.shape))
        return measure(model, batch, **kw)

    monkeypatch.setattr(profiler, "profile", counted)
    kept: dict = {}
    kw = dict(source="analytic", machine=DEVICE, lr=1e-3, offload_config=KNOBS, precision="bf16")
    low, high = budgets(hf_llama())
    shapes.clear()
    _, _, first = fit(hf_llama(), IDS, budget=high, profiles=kept, **kw)
    assert shapes == [(4, 64), (4, 64)] and len(kept) == 1  # the model and its bf16 copy, kept as one entry
    _, _, again = fit(hf_llama(), IDS, budget=high, profiles=kept, **kw)
    _, _, lower = fit(hf_llama(), IDS, budget=(low + high) // 2, profiles=kept, **kw)
    assert len(shapes) == 2 and again == first  # planned from the kept profiles
    _, _, fresh = fit(hf_llama(), IDS, budget=(low + high) // 2, **kw)
    assert len(shapes) == 4 and lower == fresh  # (the analytic profile is exact: a fresh one plans alike)
    fit(hf_llama(), IDS[:2], budget=high, profiles=kept, **kw)
    fit(hf_llama(), IDS, budget=high, profiles=kept, **{**kw, "precision": "fp32"})
    assert shapes[4:] == [(2, 64), (2, 64), (4, 64)] and len(kept) == 3
