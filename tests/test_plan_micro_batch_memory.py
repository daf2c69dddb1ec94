"""Memory against the tokens of a micro-batch, on W1's analytic profile for the H100 of the device table: fewer tokens
never need a larger budget where nothing but the tokens changes, and the head's terms grow with the tokens as the
head itself does (the fused one only up to one chunk of ``linear_cross_entropy``)."""

from __future__ import annotations

import functools

import pytest
import torch

from elbowroom.plan import BudgetError, cost, plan_for
from elbowroom.plan.cost import Decisions, Option
from elbowroom.plan.devices import get_device

GiB = 1 << 30
SHAPES = [(1, 2048), (1, 4096), (2, 4096), (1, 8192)]
"""Micro-batches as (samples, tokens each), in order of their tokens."""
AUDIT_HOST = int(23.5 * GiB)
"""The host memory of the machine the audit ran on: the optimizer state (16.3 GB) and the pinned activations of
W1's deepest offload levels do not fit it together."""


@functools.cache
def _w1(samples: int, seq_len: int, host: int):
    from elbowroom.models import ModelConfig, build_model
    from elbowroom.models.decoder import PRESETS
    from elbowroom.plan.profiler import profile

    cfg = ModelConfig.from_preset("w1", max_seq_len=max(PRESETS["w1"].max_seq_len, seq_len))
    model = build_model(cfg, device="meta")
    sample = torch.zeros((samples, seq_len), dtype=torch.long, device="meta")
    return profile(model, sample, source="analytic", machine=get_device("h100-80gb", host_memory=host))


def _minimum(p, **kw) -> BudgetError:
    with pytest.raises(BudgetError) as e:
        plan_for(p, 1 << 20, **kw)
    return e.value


@pytest.mark.parametrize("host", [AUDIT_HOST, 1 << 40], ids=["23.5GiB-host", "1TiB-host"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_fewer_tokens_never_need_a_larger_budget(host: int, fused: bool) -> None:
    """With the gradients on the device until the step (the setting where only the tokens change what is held), the
    minimum budget is non-decreasing in the tokens of a micro-batch. (Offloaded gradients are the exception the
    next test states: they wait for the link longer when the backward is shorter.)"""
    lows = [_minimum(_w1(b, t, host), fused_loss_allowed=fused, gradient_offload_allowed=False).minimum_bytes
            for b, t in SHAPES]
    assert lows == sorted(lows), [f"{x / GiB:.2f}" for x in lows]


def test_a_full_host_leaves_the_recompute_only_plans_open() -> None:
    """On the audit's host the optimizer state and the deepest offload levels' pinned pool do not fit together:
    the levels then stay open without activation offload. Before, they did only where the pool alone exceeded half
    the host, so 1x4096 (pool 7.9 GiB) lost them while 1x2048 and 1x8192 kept theirs: 12.1 GiB against 10.3."""
    low = {bt: _minimum(_w1(*bt, AUDIT_HOST), fused_loss_allowed=True, gradient_offload_allowed=True)
           for bt in SHAPES}
    assert low[(1, 4096)].minimum_bytes <= low[(1, 2048)].minimum_bytes
    assert low[(1, 4096)].minimum_bytes < 10 * GiB
    # more host memory lowers it, and the refusal says so, with how much
    roomy = _minimum(_w1(1, 4096, 1 << 40), fused_loss_allowed=True, gradient_offload_allowed=True)
    assert roomy.minimum_bytes < low[(1, 4096)].minimum_bytes
    assert "(elbowroom plan --host-memory) lowers the minimum to" in str(low[(1, 4096)])


def test_gradients_waiting_for_the_link_are_named_and_shrink_with_the_tokens() -> None:
    """With offloaded gradients a shorter backward hides less of their copy: the device holds more of them at once.
    That is what the engine does (no throttle), so the minimum may fall with the tokens there; the refusal names
    that part instead of hiding it in the head's (4.3 GiB "head, loss and working memory" at 1x2048)."""
    waiting = []
    for bt in SHAPES:
        text = str(_minimum(_w1(*bt, 1 << 40), fused_loss_allowed=True, gradient_offload_allowed=True))
        assert "offloaded gradients waiting for their copy" in text
        waiting.append(cost.gradient_backlog_bytes(_w1(*bt, 1 << 40), _all_offloaded(_w1(*bt, 1 << 40))))
    assert waiting == sorted(waiting, reverse=True)


def _all_offloaded(p, **kw) -> Decisions:
    n = len(p.blocks)
    return Decisions(options=(Option(),) * n, offload_blocks=(True,) * n, offload_other=True, offload_gradients=True,
                     micro_batch=p.micro_batch, **kw)


def test_the_head_and_loss_grow_with_the_tokens_and_the_fused_one_stays_smaller() -> None:
    heads = []
    for bt in SHAPES:
        p = _w1(*bt, 1 << 40)
        n = len(p.blocks)
        d = Decisions(options=(Option(),) * n, offload_blocks=(False,) * n, micro_batch=p.micro_batch)
        plain = cost.globals_for(p, d).head
        fused = cost.globals_for(p, Decisions(**{**d.__dict__, "fused_loss": True})).head
        assert fused < plain
        heads.append((fused, plain))
    assert heads == sorted(heads)


def test_the_fused_transient_is_one_chunk_at_most_at_any_micro_batch() -> None:
    """Profiled at 1x2048, planned at 1, 2 and 4 samples: one chunk's logits (4096 tokens x vocab x 4 B) at most, not
    the profile's bytes times the samples."""
    p = _w1(1, 2048, 1 << 40)
    vocab = 32000
    got = [cost.fused_transient_bytes(p, s) for s in (0.5, 1.0, 2.0, 4.0)]
    assert got == [1024 * vocab * 4, 2048 * vocab * 4, 4096 * vocab * 4, 4096 * vocab * 4]
    # and a profile taken above one chunk gives the same bytes when planned below it
    big = _w1(2, 4096, 1 << 40)
    assert cost.fused_transient_bytes(big, 0.5) == 4096 * vocab * 4
    assert cost.fused_transient_bytes(big, 0.25) == 2048 * vocab * 4
    # the head's term at the forward's end counts it so: 4 samples of 2048 tokens hold one 4096-token chunk
    n = len(p.blocks)
    d = Decisions(options=(Option(),) * n, offload_blocks=(False,) * n, micro_batch=4, fused_loss=True)
    in_last = p.blocks[-1].input_bytes
    assert cost.globals_for(p, d).head == 4 * 2 * in_last + 4096 * vocab * 4 + 4 * p.head.num_params


@pytest.mark.parametrize("overhead", [0, 3 * GiB], ids=["share-of-budget", "measured"])
def test_the_refusal_names_parts_that_add_up_to_its_minimum(overhead: int) -> None:
    """The BudgetError's parts add up to the minimum it names, the allocator's margin among them: a Hugging Face Llama
    refused at 16 GiB named 6.2 GiB of parts for a minimum of 19.2, the other 13 GiB a margin measured over cached
    segments and named nowhere."""
    import dataclasses
    import re

    p = dataclasses.replace(_w1(1, 4096, 1 << 40), allocator_overhead_bytes=overhead,
                            allocator_overhead_expandable_bytes=overhead)
    err = _minimum(p, fused_loss_allowed=True, gradient_offload_allowed=True)
    text = str(err)
    parts = text.split("the smallest plan: ", 1)[1].split(" (micro-batch", 1)[0]
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": GiB, "TiB": 1 << 40}
    named = {m[1]: float(m[2]) * units[m[3]] for m in re.finditer(r"(?:^|, )([a-z][^,]*?) ([\d.]+) (B|KiB|MiB|GiB|TiB)",
                                                                    parts)}
    margin = [k for k in named if k.startswith("allocator margin")]
    assert margin == ["allocator margin (measured: reserved beyond allocated over the profile's steps)" if overhead
                      else "allocator margin (a share of the budget)"], named
    if overhead:
        assert named[margin[0]] == pytest.approx(overhead, rel=0.01)
    # each part is printed to two decimals of its unit
    assert sum(named.values()) == pytest.approx(err.minimum_bytes, rel=0.01), (named, err.minimum_bytes)
