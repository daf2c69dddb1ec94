"""The trainer under data parallel (2 gloo processes): the same losses as one process over the same global batch.

Every distributed run happens in one spawn (CI has two cores); the single-process references run in the test
process. fp32, no dropout, clipping on (the global norm is compared too): the ranks' losses must equal the
single process's within 1e-5 relative (only the order of the gradient sums differs); a resumed run continues
the uninterrupted curve within 1e-6.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from elbowroom.cli import main
from elbowroom.train.checkpoint import CheckpointManager
from tests.distributed_utils import TINY_RUN, assert_close_curves, run_ranks, train_losses, trainer_config

BASE = TINY_RUN  # the same tiny run whatever the layout: its single-process curve is the reference
DDP, FSDP = ["--parallel.dp_replicate", "2"], ["--parallel.dp_shard", "2"]
HSDP = ["--parallel.data_parallel", "hsdp"]  # FSDP2 on the 2-D mesh, whichever dimension is 2
ACCUM = ["--train.gradient_accumulation_steps", "2"]
RECOMPUTE = ["--activations.checkpoint", "full"]
OFFLOAD = ["--optimizer.offload_fraction", "0.5"]
FIRST_HALF = ["--steps", "3", "--scheduler.decay_steps", "6"]  # stopped at 3 on the 6-step schedule
HF_BASE = [a for i, a in enumerate(BASE) if not (a.startswith("--model.") or BASE[i - 1].startswith("--model."))]
"""BASE without its model shape: a Hugging Face model (--model.hf) brings its own."""

CASES = {
    "ddp": DDP, "fsdp": FSDP, "ddp_accum": DDP + ACCUM, "fsdp_accum": FSDP + ACCUM,
    "ddp_recompute": DDP + RECOMPUTE + ["--parallel.ddp_bucket_mb", "0.01"],  # many small buckets
    "fsdp_recompute": FSDP + RECOMPUTE + ACCUM,
    "ddp_offload": DDP + OFFLOAD + ACCUM, "fsdp_offload": FSDP + OFFLOAD,
    # FSDP2's reduced shards straight to host buffers during backward (the step, clipped, waits for the norm only)
    "fsdp_offload_gradients": FSDP + OFFLOAD + ACCUM + ["--optimizer.offload_gradients"],
    "hsdp_2x1": DDP + HSDP, "hsdp_1x2_offload": FSDP + HSDP + OFFLOAD,
    # each block unit all-gathers the next ahead (its optimizer wait covering that unit's shards)
    "fsdp_prefetch_offload": FSDP + OFFLOAD + ["--parallel.fsdp_prefetch", "1"],
    # the fused head + loss reads the head weight after DDP's forward: its gradient is all-reduced as any other
    "ddp_fused": DDP + ACCUM + ["--train.fused_loss"],
    # ... and in the head's own forward, where FSDP2 gathers its weight (and the offloading optimizer, whose late
    # half holds the head, waits for it)
    "fsdp_fused": FSDP + ACCUM + ["--train.fused_loss"], "fsdp_fused_offload": FSDP + OFFLOAD + ["--train.fused_loss"],
    # rotary tables alike on every rank: no broadcast needed; garbage collected on the trainer's schedule
    "ddp_no_broadcast_gc": DDP + ["--parallel.ddp_broadcast_buffers", "false", "--train.gc_every", "2"],
}


def _config(out: Path, *args: str):
    return trainer_config(BASE, out, *args)


def _train(out: Path, *args: str) -> dict:
    return train_losses(BASE, out, *args)


def _offload_after_reduction(rank: int) -> dict:
    """DDP + CPUOffloadOptimizer by hand: gradients reach the host once, from the comm hook after the all-reduce."""
    import torch.nn.functional as F

    from elbowroom.distributed.config import ParallelConfig
    from elbowroom.distributed.data_parallel import apply_data_parallel, init_distributed
    from elbowroom.models import ModelConfig, build_model
    from elbowroom.optim import CPUOffloadOptimizer

    topo = init_distributed(ParallelConfig(dp_replicate=2), rank=rank, world_size=2, local_rank=rank,
                            device=torch.device("cpu"))
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16))
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, offload_fraction=1.0)
    ddp, _ = apply_data_parallel(model, topo, after_reduction=opt.after_reduction())
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randint(0, 64, (2, 17), generator=g)
        F.cross_entropy(ddp(x[:, :-1]).reshape(-1, 64), x[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    out = {"step_in_backward": opt.step_in_backward, "d2h": opt.stats()["d2h_bytes"],
           "grad_bytes": 4 * sum(p.numel() for p in model.parameters()),
           "params": [p.detach().clone() for p in model.parameters()]}
    opt.close()
    return out


def _ranks(rank: int, world: int, tmp: str) -> dict:
    """Each case on 2 ranks, inside one process group (``train(cfg)`` joins it); then the resume halves."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    tmp_path = Path(tmp)
    res = {name: _train(tmp_path / name, *args) for name, args in CASES.items()}  # one run directory for all ranks
    res["ddp_fp16"] = _train(tmp_path / "ddp_fp16", *DDP, "--parallel.comm_hook", "fp16")
    res["after_reduction"] = _offload_after_reduction(rank)
    res["ddp_budget"] = _train(tmp_path / "ddp_budget", *DDP, "--budget", "64GiB")  # planned for DDP's buckets
    # each block compiled in place, inside DDP's wrapper (beside the fused loss; recomputed whole, its checkpoint
    # compiled with it) and FSDP2's units
    res["ddp_compile"] = _train(tmp_path / "ddp-compile", *DDP, *RECOMPUTE, "--train.compile", "--train.fused_loss")
    res["fsdp_compile"] = _train(tmp_path / "fsdp-compile", *FSDP, *RECOMPUTE, "--train.compile")
    res["fsdp_budget_compile"] = _train(tmp_path / "fsdp-budget-compile", *FSDP, "--budget", "64GiB",
                                        "--train.compile")  # the rank's plan priced on the compiled blocks
    # a Hugging Face model under DDP and FSDP2: checkpoints written (its wrapper's state_dict is the model's own,
    # whose keys torch.distributed.checkpoint walks) and resumed
    hf = tmp_path / "hf-llama"
    if hf.is_dir():
        res["hf_ddp"] = train_losses(HF_BASE, tmp_path / "hf-ddp", "--model.hf", str(hf), *DDP)
        train_losses(HF_BASE, tmp_path / "hf-fsdp", "--model.hf", str(hf), *FSDP, *FIRST_HALF)
        res["hf_fsdp_resumed"] = train_losses(HF_BASE, tmp_path / "hf-fsdp", "--model.hf", str(hf), *FSDP,
                                              "--resume")
        # ... with its optimizer on the host: the embedding and final norm inside its inner model are FSDP2 units
        # of their own, each waiting for its own shards' CPU steps before its all-gather
        res["hf_fsdp_offload"] = train_losses(HF_BASE, tmp_path / "hf-fsdp-offload", "--model.hf", str(hf), *FSDP,
                                              "--optimizer.offload_fraction", "1.0")
    # compression with error feedback: each rank's residuals (and int8's noise) travel with the checkpoint
    for hook in ("topk", "int8"):
        args = [*DDP, "--parallel.comm_hook", hook, "--scheduler.decay_steps", "6"]
        res[f"{hook}_whole"] = _train(tmp_path / f"{hook}-whole", *args)
        _train(tmp_path / f"{hook}-halves", *args, *FIRST_HALF)
        res[f"{hook}_resumed"] = _train(tmp_path / f"{hook}-halves", *args, "--resume")
    # ws2 -> ws1: the first half under FSDP2 with the optimizer half on the host; the parent continues it
    res["half"] = _train(tmp_path / "ws2", *FSDP, *OFFLOAD, *FIRST_HALF)
    # ws1 -> ws2: the parent's single-process first half, continued here under FSDP2
    res["resumed"] = _train(tmp_path / "ws1", *FSDP, "--resume")
    return res


_close = assert_close_curves


@pytest.mark.slow
def test_trainer_data_parallel_equals_one_process(tmp_path: Path, capsys) -> None:
    ref = {
        "plain": _train(tmp_path / "ref", ),
        "accum": _train(tmp_path / "ref-accum", *ACCUM),
        "offload": _train(tmp_path / "ref-offload", *OFFLOAD),
    }
    ws1_half = _train(tmp_path / "ws1", *FIRST_HALF)
    assert ws1_half["step"] == 3

    if importlib.util.find_spec("transformers") is not None:  # (an extra: the check below runs where it is)
        import transformers

        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(tmp_path / "hf-llama")
    r0, r1 = run_ranks(_ranks, str(tmp_path))

    if os.environ.get("DEBUG_DP"):
        for name, args in CASES.items():
            want = ref["accum" if ACCUM[0] in args else "plain"]["losses"]
            print(name, max(abs(a / b - 1) for a, b in zip(r0[name]["losses"].values(), want.values())))
    for name, args in CASES.items():
        want = ref["accum" if ACCUM[0] in args else "plain"]
        got = r0[name]
        _close(got["losses"], want["losses"], 1e-5, name)  # the global loss, logged by rank 0
        _close(got["val"], want["val"], 1e-5, name)  # validation all-reduced: the single process's
        assert r1[name]["losses"] == got["losses"], name  # every rank agrees on the loss it reports
    # a comm hook's bytes on the wire per step: fp16, 2 bytes per gradient element
    from elbowroom.models import build_model
    from elbowroom.train.trainer import resolve_model_config

    n_params = sum(p.numel() for p in build_model(resolve_model_config(_config(tmp_path / "x"), 256)).parameters())
    fp16_rows = [json.loads(line) for line in (tmp_path / "ddp_fp16" / "metrics.jsonl").read_text().splitlines()]
    assert [r["comm_bytes_per_step"] for r in fp16_rows if "loss" in r] == [2 * n_params] * 6
    _close(r0["ddp_fp16"]["losses"], ref["plain"]["losses"], 1e-3, "fp16")
    # DDP + CPUOffloadOptimizer: each step copies the reduced gradients once (no re-copy of gradients the all-reduce
    # changed after a post-accumulate hook took them), so the CPU steps may start during backward
    for r in (r0, r1):
        assert r["after_reduction"]["step_in_backward"] is True
        assert r["after_reduction"]["d2h"] == r["after_reduction"]["grad_bytes"]
    for a, b in zip(r0["after_reduction"]["params"], r1["after_reduction"]["params"]):
        assert torch.equal(a, b)  # the ranks stepped on the same (reduced) gradients

    # --budget under DDP plans for its buckets: every gradient held from the forward on, none sent to the host early
    from elbowroom.plan import Plan

    ddp_plan = Plan.load(tmp_path / "ddp_budget" / "plan.toml")
    assert ddp_plan.persistent_gradients and not ddp_plan.offload_gradients
    _close(r0["ddp_budget"]["losses"], ref["plain"]["losses"], 1e-5, "ddp_budget")
    for name in ("ddp_compile", "fsdp_compile", "fsdp_budget_compile"):  # (compiled kernels round differently)
        _close(r0[name]["losses"], ref["plain"]["losses"], 1e-4, name)
        assert r1[name]["losses"] == r0[name]["losses"], name
    from elbowroom.plan.fit import COMPILED_NOTE

    assert COMPILED_NOTE in Plan.load(tmp_path / "fsdp-budget-compile" / "plan.toml").notes

    if "hf_ddp" in r0:  # the FSDP2 run resumed at step 3 continues the DDP run's curve
        assert sorted(r0["hf_ddp"]["losses"]) == list(range(1, 7))
        assert (tmp_path / "hf-ddp" / "checkpoints" / "step_00000006" / ".metadata").is_file()
        _close({s: v for s, v in r0["hf_fsdp_resumed"]["losses"].items() if s > 3},
               {s: v for s, v in r0["hf_ddp"]["losses"].items() if s > 3}, 1e-5, "hf")
        _close(r0["hf_fsdp_offload"]["losses"], r0["hf_ddp"]["losses"], 1e-5, "hf offloaded")

    # a compressed run resumed at step 3 continues its own curve exactly: each rank's residuals and counts of draws
    # came back, and the compression does not depend on the buckets, which a new DDP makes otherwise until it
    # rebuilds them. Without the residuals the curve departs at step 4.
    for hook in ("topk", "int8"):
        whole = r0[f"{hook}_whole"]["losses"]
        assert sorted(whole) == list(range(1, 7)), hook
        assert {s: v for s, v in r0[f"{hook}_resumed"]["losses"].items() if s > 3} == {
            s: v for s, v in whole.items() if s > 3}, hook
        assert (tmp_path / f"{hook}-halves" / "checkpoints" / "step_00000003" / "rank-00001.pt").is_file()

    # rank 0 alone writes the metrics: one row per step and evaluation, not two
    assert len((tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()) == 6 + 2

    # ws2 -> ws1: continue the FSDP2 + offload checkpoint of step 3 in one process
    sharded = tmp_path / "ws2" / "checkpoints" / "step_00000003"
    assert (sharded / ".metadata").is_file() and CheckpointManager(sharded.parent).validate(sharded)["format"] == 2
    before = sorted(p.name for p in (tmp_path / "ws2").rglob("*"))
    # its data position is a count of samples of global batches of 4: at another dp size only with that batch
    assert main(["train", *BASE, "--out", str(tmp_path / "ws2"), *OFFLOAD, "--resume", "--data.batch_size", "8"]) == 2
    assert "--data.batch_size 8 (the run has 4)" in capsys.readouterr().err  # its saved config's batch
    assert sorted(p.name for p in (tmp_path / "ws2").rglob("*")) == before
    resumed = _train(tmp_path / "ws2", *OFFLOAD, "--resume")
    _close({s: v for s, v in resumed["losses"].items() if s > 3},
           {s: v for s, v in ref["offload"]["losses"].items() if s > 3}, 1e-6)
    # ws1 -> ws2: the single-process checkpoint of step 3 continued under FSDP2 on two ranks
    _close({s: v for s, v in r0["resumed"]["losses"].items() if s > 3},
           {s: v for s, v in ref["plain"]["losses"].items() if s > 3}, 1e-6)


def test_sharded_checkpoint_verification_finds_a_flipped_byte(tmp_path: Path) -> None:
    """A sharded checkpoint is verified file by file, as a single file is: a flipped byte is found."""
    from elbowroom.train.sharded_checkpoint import save_sharded

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ckpts = CheckpointManager(tmp_path / "checkpoints", keep=1)
    for step in (1, 2):
        save_sharded(ckpts, step, model, opt, {"samples_seen": step}, {}, is_main=True)
    assert [s for s, _ in ckpts.checkpoints()] == [2]  # rotation keeps the newest
    assert not list(ckpts.directory.glob(".tmp-*"))
    path = ckpts.directory / "step_00000002"
    assert ckpts.load_latest().state == {"samples_seen": 2, "sharded": True}
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        CheckpointManager(ckpts.directory).validate(path)


# ---------------------------------------------------------------- bad set-ups: exit 2, a sentence, nothing written
@pytest.mark.parametrize(
    "world, args, message",
    [
        (None, DDP, "not started by torchrun (no WORLD_SIZE); launch it with `torchrun --nproc-per-node 2"),
        ("2", ["--parallel.dp_shard", "4"], "the world size is 2; launch with `torchrun --nproc-per-node 4`"),
        ("2", [], "set --parallel.dp_replicate 2 (DDP) or --parallel.dp_shard 2 (FSDP2)"),
        ("2", [*DDP, "--data.batch_size", "3"], "must divide by the data-parallel size 2"),
        ("2", [*FSDP, "--distill.teacher", "runs/teacher"], "drop --distill.teacher under FSDP"),
        ("2", [*DDP, *OFFLOAD, "--optimizer.offload_gradients"], "DDP keeps them in its own buckets"),
        ("2", [*FSDP, "--parallel.fsdp_cpu_offload", *OFFLOAD], "choose one"),
        ("2", [*FSDP, "--parallel.fsdp_cpu_offload", "--budget", "1GiB"], "drop --parallel.fsdp_cpu_offload"),
        ("2", [*FSDP, "--parallel.comm_hook", "fp16"], "set --parallel.dp_shard 1 or --parallel.comm_hook none"),
        ("2", [*DDP, "--distill.teacher", "runs/teacher"], "drop --distill.teacher under DDP"),
        ("2", [*DDP, "--parallel.ddp_bucket_mb", "0"], "parallel.ddp_bucket_mb must be a positive number of MiB"),
        ("2", [*DDP, "--parallel.fsdp_prefetch", "1"], "or drop --parallel.fsdp_prefetch"),
    ],
)
def test_bad_setups_exit_2(tmp_path: Path, monkeypatch, capsys, world: str | None, args: list[str],
                           message: str) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
        monkeypatch.setenv("RANK", "0")
    out = tmp_path / "run"
    assert main(["train", *BASE, "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err
    assert not out.exists()


# ---------------------------------------------------------------- --budget under FSDP2: the per-rank profile
def test_per_rank_plan_counts_shards() -> None:
    """A rank of FSDP2 over 4 holds a quarter of the model states: the per-rank profile's model-state bytes shrink by
    the shard factor, whatever the layout the planner picks; its activations stay the rank's own, and FSDP2's
    gathers come on top (at shard factor 1 too: see tests/test_train_fsdp_plan.py for them against a real wrap)."""
    import dataclasses

    from test_plan_support import make_profile

    from elbowroom.plan import cost
    from elbowroom.plan.ranks import per_rank_profile

    p = make_profile(n_layers=4, dim=256, ffn=512, vocab=1024, seq_len=128)
    n = len(p.blocks)
    whole = cost.Decisions(micro_batch=4, options=(cost.Option(),) * n, offload_blocks=(False,) * n)
    rank = per_rank_profile(p, 4)
    assert cost.state_bytes(rank, whole) * 4 == cost.state_bytes(p, whole)
    assert rank.num_params * 4 == p.num_params
    assert [b.saved_bytes for b in rank.blocks] == [b.saved_bytes for b in p.blocks]  # the rank's own activations
    one = per_rank_profile(p, 1)
    assert cost.state_bytes(one, whole) == cost.state_bytes(p, whole) and one.rank_transient_bytes > 0
    half = dataclasses.replace(whole, layout="bf16")
    assert cost.state_bytes(rank, half) < cost.state_bytes(p, half) / 3


def test_the_library_reads_no_environment(tmp_path: Path, monkeypatch) -> None:
    # torchrun's variables reach the trainer through the CLI (or a Launch the caller builds), never by itself
    from elbowroom.train.distributed_run import Launch
    from elbowroom.train.trainer import train

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    out = tmp_path / "env"
    from elbowroom.config import ConfigError

    with pytest.raises(ConfigError, match="not started by torchrun"):
        train(_config(out, *DDP))
    assert not out.exists()
    from elbowroom.cli import launch_from_environment

    assert launch_from_environment(os.environ) == Launch(0, 2, 0, rendezvous=True)


def test_ranks_of_one_host_share_its_cores(monkeypatch) -> None:
    """N ranks on a host each size their host optimizer step to 1/N of its cores (torchrun's LOCAL_WORLD_SIZE), not
    all of them: on a 2-GPU host of 32 cores, 14 threads each, not 30."""
    from elbowroom.optim import config as optim_config
    from elbowroom.train.distributed_run import Launch

    monkeypatch.setattr(optim_config.os, "sched_getaffinity", lambda _: set(range(32)), raising=False)
    assert optim_config.default_step_threads() == 30
    assert optim_config.default_step_threads(2) == 14 and optim_config.default_step_threads(64) == 1
    # bound to their GPU's NUMA node (torchrun --numa-binding node): 4 ranks on 64 cores, two nodes of 32, each
    # rank sees 32 cores shared with one other rank -> 14; bound exclusively (16 cores each) -> 14 too
    cores = {0: set(range(32))}
    monkeypatch.setattr(optim_config.os, "sched_getaffinity",
                        lambda pid: cores.get(pid, set(range(64))), raising=False)
    assert optim_config.default_step_threads(4) == 14
    cores[0] = set(range(16))
    assert optim_config.default_step_threads(4) == 14
    cores[0] = set(range(64))  # unbound: a quarter of the launcher's cores
    assert optim_config.default_step_threads(4) == 14
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h"}
    from elbowroom.cli import launch_from_environment

    assert launch_from_environment(env) == Launch(3, 4, 1, rendezvous=True, local_world_size=2)
