"""Tensor and pipeline parallel on 2 gloo processes: a single process's losses, resumable across layouts.

Each spawn groups every check of one kind (CI has two cores); the single-process references run in the test
process. fp32, no dropout: the ranks' losses must equal the single process's within 1e-5 relative over 10 steps
(tensor parallel changes the order of the matmuls' sums, the pipeline the order of micro-batch gradients).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from elbowroom.config import ConfigError
from elbowroom.distributed.config import ParallelConfig
from elbowroom.models import ModelConfig, build_model, count_params
from tests.distributed_utils import run_ranks

LLAMA = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_dim=64, max_seq_len=16)
GPT2 = replace(LLAMA, arch="gpt2")
BATCH, SEQ, STEPS, TOKENS = 4, 16, 10, 4 * 16


def _batch(step: int, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable sequences (each counts up from a random start by a stride of 1-3), so losses fall."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    data = (start + stride * torch.arange(SEQ + 1)) % vocab
    return data[:, :-1], data[:, 1:]


def _loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the step's tokens (a micro-batch's share of the step's mean)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / TOKENS


def _value(loss: torch.Tensor) -> float:
    return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()


def _train(step_fn, optimizer, steps: int, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        losses.append(step_fn(*_batch(step)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def _plain(model):
    def step(x, y):
        loss = _loss_fn(model(x), y)
        loss.backward()
        return loss.item()

    return step


def _parallel(mp, topo):
    """One step of a model-parallel model on this rank's slice of the batch: through the pipeline, or forward and
    backward in the loss context. Losses are scaled for data parallel's gradient average and summed back."""
    from elbowroom.distributed.data_parallel import all_reduce_sum, loss_scale
    from elbowroom.distributed.pipeline import pipeline_step

    n = BATCH // topo.dp_size
    rows = slice(topo.dp_rank * n, (topo.dp_rank + 1) * n)
    scale = loss_scale(topo)

    def step(x, y):
        x, y = x[rows], y[rows]
        if mp.pipeline is not None:
            loss = pipeline_step(mp.pipeline, x, y).item()
        else:
            with mp.loss_context():
                out = _loss_fn(mp.modules[0](x), y) * scale
                out.backward()
            loss = _value(out)
        return all_reduce_sum(loss / scale, topo, torch.device("cpu"))

    return step


def _fresh(cfg: ModelConfig):
    torch.manual_seed(0)
    model = build_model(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _reference(cfg: ModelConfig) -> list[float]:
    model, opt = _fresh(cfg)
    _plain(model)(*_batch(0))
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    opt.zero_grad(set_to_none=True)
    return [norm, *_train(_plain(model), opt, STEPS)]


def _build(rank: int, world: int, cfg: ModelConfig, parallel: ParallelConfig,
           recompute: str | tuple[str, ...] | None = None):
    """The model split for ``parallel`` on this rank, its optimizer, and its step function. ``recompute``: one
    policy for every block, or one per block of the whole model (a plan's, installed on this rank's blocks)."""
    from elbowroom.activations import ActivationConfig, BlockPolicy
    from elbowroom.distributed.data_parallel import init_distributed, loss_scale
    from elbowroom.distributed.model_parallel import apply_model_parallel
    from elbowroom.distributed.pipeline import stage_blocks, stage_ids

    topo = init_distributed(parallel, rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    torch.manual_seed(0)
    per_block = None
    if isinstance(recompute, tuple):
        own = ([i for s in stage_ids(parallel, topo.mesh.get_local_rank("pp"))
                for i in stage_blocks(parallel, cfg.n_layers, s)] if parallel.pp > 1 else range(cfg.n_layers))
        per_block, recompute = [BlockPolicy(recompute[i]) for i in own], None
    mp = apply_model_parallel(build_model(cfg), topo, device=torch.device("cpu"),
                              loss_fn=lambda logits, y: _loss_fn(logits, y) * loss_scale(topo),
                              activations=ActivationConfig(checkpoint=recompute) if recompute else None,
                              block_policies=per_block, seq_len=SEQ, batch_size=BATCH // parallel.dp_size)
    return mp, torch.optim.AdamW(mp.parameters(), lr=1e-2), _parallel(mp, topo)


def _ranks_train(rank: int, world: int, cases: dict, ckpt_dir: str) -> dict:
    """Every case's 10-step losses; then the checkpoint round trip of the first case's layout: continue the
    single process's step-5 checkpoint, and write this layout's own step-5 checkpoint."""
    from elbowroom.activations.policy import get_block_policies
    from elbowroom.distributed import checkpoint as C

    out = {}
    for name, (cfg, parallel, recompute) in cases.items():
        mp, opt, step = _build(rank, world, cfg, parallel, recompute)
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in mp.parameters())
        out[name, "norm"] = (step(*_batch(0)), mp.clip_grad_norm_(float("inf")).item())  # measured, not applied
        opt.zero_grad(set_to_none=True)
        out[name] = _train(step, opt, STEPS)
        out[name, "share"] = local / count_params(build_model(cfg))
        out[name, "policies"] = [None if (got := get_block_policies(m)) is None else tuple(p.checkpoint for p in got)
                                 for m in mp.modules]
    cfg, parallel, _ = next(iter(cases.values()))
    mp, opt, step = _build(rank, world, cfg, parallel)
    extra = C.load(Path(ckpt_dir, "single"), mp.checkpoint_module, opt)
    out["resumed"] = _train(step, opt, 5, first=extra["step"])
    mp, opt, step = _build(rank, world, cfg, parallel)
    _train(step, opt, 5)
    C.save(Path(ckpt_dir, "parallel"), mp.checkpoint_module, opt, extra={"step": 5})
    return out


def _check(cases: dict, tmp_path: Path, world: int = 2) -> None:
    """Run ``cases`` on ``world`` ranks against single-process references, and the checkpoint round trips."""
    from elbowroom.distributed import checkpoint as C
    from elbowroom.distributed.pipeline import stage_blocks, stage_ids

    cfg = next(iter(cases.values()))[0]
    model, opt = _fresh(cfg)
    _train(_plain(model), opt, 5)
    C.save(tmp_path / "single", model, opt, extra={"step": 5})
    refs: dict = {}
    r0, r1, *_ = run_ranks(_ranks_train, cases, str(tmp_path), world=world)
    for name, (case_cfg, _, _) in cases.items():  # with recompute too: it changes no number
        if case_cfg not in refs:
            refs[case_cfg] = _reference(case_cfg)
        norm, *losses = refs[case_cfg]
        assert r0[name] == pytest.approx(losses, rel=1e-5), name
        assert r0[name, "norm"][1] == pytest.approx(norm, rel=1e-5) == r1[name, "norm"][1], name  # the global norm
        assert r1[name] == r0[name], name  # every rank reports the same loss
        assert r0[name, "share"] < 0.6 and r1[name, "share"] < 0.6, name  # and holds about half the weights
        policies = cases[name][2]
        if isinstance(policies, tuple):  # a plan's: each rank's blocks got their own (an all-kept stage: none)
            parallel = cases[name][1]
            for rank, r in enumerate((r0, r1)):
                stages = ([stage_blocks(parallel, case_cfg.n_layers, s) for s in stage_ids(parallel, rank)]
                          if parallel.pp > 1 else [range(case_cfg.n_layers)])
                want = [tuple(policies[i] for i in ids) for ids in stages]
                assert r[name, "policies"] == [None if set(w) == {"none"} else w for w in want], name
    ref = refs[cfg][1:]
    assert r0["resumed"] == pytest.approx(ref[5:], rel=1e-5)  # single process -> 2 ranks
    model, opt = _fresh(cfg)
    assert C.load(tmp_path / "parallel", model, opt) == {"step": 5}
    assert _train(_plain(model), opt, 5, first=5) == pytest.approx(ref[5:], rel=1e-5)  # 2 ranks -> single process


@pytest.mark.slow
def test_tensor_parallel_equals_single_process(tmp_path) -> None:
    """TP 2 on both architectures, fused and separate q/k/v, with recompute (for all blocks, or a plan's per block),
    with FSDP2 on the 2-D mesh; checkpoints move between TP 2 and TP 1 both ways."""
    tp = ParallelConfig(tp=2)
    cases = {
        "llama": (LLAMA, tp, None),
        "llama_qkv_apart": (replace(LLAMA, fused_qkv=False), tp, None),
        "gpt2": (GPT2, tp, None),
        "gpt2_qkv_apart_gathered_logits": (replace(GPT2, fused_qkv=False), ParallelConfig(tp=2, tp_loss_parallel=False),
                                           None),
        "llama_recompute": (LLAMA, tp, "full"),
        "llama_per_block": (LLAMA, tp, ("none", "selective", "full", "none")),  # a plan's policies
        "llama_fsdp": (LLAMA, ParallelConfig(tp=2, data_parallel="fsdp"), "selective"),
    }
    _check(cases, tmp_path)


@pytest.mark.slow
def test_pipeline_parallel_equals_single_process(tmp_path) -> None:
    """PP 2 with GPipe and 1F1B, interleaved 1F1B and zero-bubble with 4 stages over 2 ranks, with recompute and
    FSDP2; checkpoints move between 4 stages on 2 ranks and one process both ways."""
    cases = {
        "interleaved_1f1b": (LLAMA, ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_microbatches=4), None),
        "1f1b": (LLAMA, ParallelConfig(pp=2, pp_schedule="1f1b", pp_microbatches=2), None),
        "gpipe": (LLAMA, ParallelConfig(pp=2, pp_schedule="gpipe", pp_microbatches=4), None),
        "gpt2_1f1b": (GPT2, ParallelConfig(pp=2, pp_schedule="1f1b", pp_microbatches=2), None),
        "zero_bubble": (LLAMA, ParallelConfig(pp=2, pp_schedule="zero_bubble", pp_microbatches=4), None),
        "1f1b_recompute": (LLAMA, ParallelConfig(pp=2, pp_microbatches=2), "full"),
        # a plan's policies, block by block, on the rank's stages 0 and 2 (or 1 and 3)
        "interleaved_per_block": (LLAMA, ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_microbatches=4),
                                  ("full", "none", "selective", "full")),
        "gpipe_fsdp": (LLAMA, ParallelConfig(pp=2, pp_schedule="gpipe", pp_microbatches=2, data_parallel="fsdp"),
                       None),
    }
    _check(cases, tmp_path)


@pytest.mark.slow
def test_two_dimensional_meshes_on_four_ranks(tmp_path) -> None:
    """FSDP2 x TP on a 2 x 2 mesh, checkpoints to and from one process. (PP x TP composes the same way; it is
    left out to keep CI's two cores under a minute for this file.)"""
    cases = {"fsdp_tp": (LLAMA, ParallelConfig(dp_shard=2, tp=2), None)}
    _check(cases, tmp_path, world=4)


# ---------------------------------------------------------------- bad layouts
@pytest.mark.parametrize(
    "parallel, world, cfg, message",
    [
        (ParallelConfig(tp=2), 4, LLAMA, "launch with `torchrun --nproc-per-node 2`"),
        (ParallelConfig(tp=3), 3, replace(LLAMA, n_heads=4), "model.n_heads = 4 must be divisible by parallel.tp = 3"),
        (ParallelConfig(tp=2), 2, replace(LLAMA, ffn_dim=63), "model.ffn_dim = 63 must be divisible"),
        (ParallelConfig(pp=3), 3, LLAMA, "do not split evenly into 3 pipeline stages"),
        (ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=3), 2, LLAMA,
         "do not split evenly into 6 pipeline stages"),
        (ParallelConfig(pp=2), 2, replace(LLAMA, tie_embeddings=True), "set --model.tie_embeddings false"),
        (ParallelConfig(tp=2), 2, replace(LLAMA, tie_embeddings=True), "set --model.tie_embeddings false"),
        (ParallelConfig(tp=2), 2, None, "not --model.hf models"),
    ],
)
def test_bad_layouts_are_refused(parallel, world, cfg, message) -> None:
    from elbowroom.distributed.model_parallel import validate_layout

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_layout(parallel, cfg, world)


def test_batch_and_sequence_must_split() -> None:
    from elbowroom.distributed.model_parallel import validate_layout

    with pytest.raises(ConfigError, match="data.seq_len = 15 must be divisible by parallel.tp = 2"):
        validate_layout(ParallelConfig(tp=2), LLAMA, 2, seq_len=15)
    with pytest.raises(ConfigError, match="set --parallel.pp_microbatches to a divisor of 6"):
        validate_layout(ParallelConfig(pp=2, pp_microbatches=4), LLAMA, 2, batch_size=6)
    validate_layout(ParallelConfig(pp=2, pp_microbatches=3), LLAMA, 2, batch_size=6)  # fits: no error


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pp": 2, "pp_microbatches": 1}, "fewer than the pipeline's 2 stages"),
        ({"pp": 2, "pp_schedule": "zero_bubble", "pp_microbatches": 3}, "set --parallel.pp_microbatches 4 or more"),
        ({"pp": 2, "pp_schedule": "gpipe", "pp_stages_per_rank": 2}, "runs one stage per rank"),
        ({"pp": 2, "pp_schedule": "dualpipe"}, "parallel.pp_schedule must be gpipe, 1f1b"),
        ({"tp": 2, "dp_replicate": 2}, "replicate with --parallel.data_parallel hsdp"),
    ],
)
def test_bad_pipeline_settings_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


# ---------------------------------------------------------------- expected efficiency
def test_bubble_and_tensor_parallel_traffic_arithmetic() -> None:
    from elbowroom.distributed.pipeline import bubble_fraction
    from elbowroom.distributed.tensor_parallel import tp_bytes_per_block

    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(4, 16) == pytest.approx(3 / 19)
    assert bubble_fraction(4, 16, stages_per_rank=2) == pytest.approx(3 / 35)
    assert bubble_fraction(1, 8) == 0
    # 2 tokens x 4 wide x 2 bytes = 16 B per activation; tp 2 sends half of it per reduce-scatter/all-gather:
    # forward 4 x 8 B, backward the same
    assert tp_bytes_per_block(tokens=2, dim=4, tp=2) == 64
    assert tp_bytes_per_block(tokens=2, dim=4, tp=2, sequence_parallel=False) == 64  # the same bytes
    assert tp_bytes_per_block(tokens=2, dim=4, tp=2, recompute=True) == 96
    assert tp_bytes_per_block(tokens=2, dim=4, tp=1) == 0


def test_chunked_loss_falls_back_under_tensor_parallel(caplog) -> None:
    """linear_cross_entropy needs whole vocabulary rows: under TP it is turned off with a warning."""
    from elbowroom.distributed.tensor_parallel import fused_loss_applies

    with caplog.at_level("WARNING"):
        assert fused_loss_applies(2, True) is False
    assert "loss_parallel cross-entropy on the shards instead" in caplog.text
    assert fused_loss_applies(1, True) is True and fused_loss_applies(2, False) is False
