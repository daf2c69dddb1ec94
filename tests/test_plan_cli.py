"""``elbowroom plan`` (cmd_plan): the table, the JSON schema, --out, and bad input returning 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_plan_support import make_profile

from elbowroom.plan import Plan
from elbowroom.plan.cli import cmd_plan


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("prof") / "w1.json"
    path.write_text(json.dumps(make_profile().to_dict()))
    return str(path)


def test_json_schema(profile_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_plan(["--profile", profile_file, "--budget", "24GiB", "--json", "--precision", "bf16"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("predicted_peak_bytes", "predicted_step_seconds", "predicted_tokens_per_s", "budget_bytes",
                "micro_batch", "gradient_accumulation_steps", "weight_dtype", "fused_loss", "blocks"):
        assert key in out
    assert out["budget_bytes"] == 24 << 30 and out["predicted_peak_bytes"] <= out["budget_bytes"]
    assert len(out["blocks"]) == 24
    for i, b in enumerate(out["blocks"]):
        assert b["index"] == i and b["checkpoint"] in ("none", "selective", "full")
        assert {"offload_ratio", "offload_input", "optimizer_on_host", "kept_bytes", "seconds"} <= set(b)
    assert Plan.from_dict(out).budget_bytes == 24 << 30


def test_table_and_out(profile_file: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.toml"
    assert cmd_plan(["--profile", profile_file, "--budget", "30GB", "--global-batch", "8", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted peak" in text and "block" in text
    plan = Plan.load(out)
    assert plan.budget_bytes == 30 * 10**9 and plan.global_batch == 8


@pytest.mark.parametrize(
    "args, match",
    [
        (["--budget", "24 parsecs"], "cannot read --budget '24 parsecs'; accepted: a number with GiB"),
        # the output's folder is checked before any work (it printed the plan, then a FileNotFoundError traceback)
        (["--budget", "24GiB", "--out", "missing/plan.toml"], "the folder 'missing' does not exist; create it"),
        # more than the device has: refused, naming the device's memory (it said "below the minimum" of a budget
        # it had silently lowered)
        (["--budget", "200GiB"],
         r"--budget 200\.00 GiB is above the 80\.00 GiB of h100-test; pass --budget 80GiB or less"),
        (["--budget", "24GiB", "--host-memory", "12XB"], "cannot read --host-memory '12XB'"),
        (["--budget", "-3GiB"], "--budget must be positive, got '-3GiB'"),  # (argparse: "expected one argument")
        (["--budget", "24GiB", "--host-memory", "-1TiB"], "--host-memory must be positive"),
        (["--budget", "24GiB", "--global-batch", "-2"], "--global-batch must be positive"),
        (["--budget", "1.5"], r"--budget '1\.5' is not a whole number of bytes; add a unit"),
        (["--budget", "2GiB"], "below the minimum"),
        (["--budget", "24GiB", "--out", "plan.yaml"], r"--out must end in \.toml or \.json"),
        (["--budget", "24GiB", "--frobnicate"], "unrecognized arguments"),
        (["--budget", "24GiB", "--precision", "fp8"], "invalid choice"),
        (["--budget", "24GiB", "--dp-shard", "0"], "--dp-shard must be a positive number of ranks"),
        (["--budget", "24GiB", "--dp-replicate", "0"], "--dp-replicate must be a positive number of ranks"),
        (["--budget", "24GiB", "--fsdp-prefetch", "2"], "--fsdp-prefetch 2 needs --dp-shard above 1"),
        (["--budget", "24GiB", "--shared-link", "37,32,19"], "--shared-link is the link of several ranks"),
        (["--budget", "24GiB", "--dp-shard", "4", "--shared-link", "37,32"], "--shared-link takes three positive"),
        (["--budget", "24GiB", "--dp-shard", "4", "--shared-link", "37,x,19"], "--shared-link takes three positive"),
        (["--budget", "24GiB", "--dp-replicate", "2", "--shared-link", "37,0,19"], "--shared-link takes three"),
        (["--budget", "24GiB", "--compile"], "--compile prices the model's blocks compiled, and --profile plans"),
    ],
)
def test_bad_input_returns_2_with_one_line(
    profile_file: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], match: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cmd_plan(["--profile", profile_file, *args]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elbowroom plan: error: ")  # as `elbowroom train: error: `
    import re

    assert re.search(match, lines[0]), lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_bad_profile_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    assert cmd_plan(["--profile", str(bad), "--budget", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "is not a profile: it has no 'machine' entry" in err and "Traceback" not in err


def test_a_plan_given_as_the_profile(profile_file: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plan file where the profile goes is named as a plan, with the command that takes it; nothing written."""
    plan = tmp_path / "plan.toml"
    assert cmd_plan(["--profile", profile_file, "--budget", "24GiB", "--out", str(plan)]) == 0
    capsys.readouterr()
    out = tmp_path / "again.toml"
    assert cmd_plan(["--profile", str(plan), "--budget", "24GiB", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is a plan file, not a profile" in err and f"elbowroom train --plan {plan}" in err
    assert not out.exists()


def test_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_plan(["--model", "w9", "--device", "h100-80gb", "--budget", "24GiB"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'w9'; choose one of tiny, w1, w2, 7b" in err


# ------------------------------------------------------------------ with the analytic profiler
def test_analytic_w1_on_the_device_table(capsys: pytest.CaptureFixture[str]) -> None:
    # the lent H100's host has 128 GiB; this machine's memory (the default) may be smaller
    assert cmd_plan(["--model", "w1", "--device", "h100-80gb", "--budget", "24GiB", "--batch", "4x4096",
                     "--host-memory", "128GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_peak_bytes"] <= out["budget_bytes"] == 24 << 30 and len(out["blocks"]) == 24
    assert cmd_plan(["--model", "7b", "--arch", "gpt2", "--device", "h100-80gb", "--budget", "40GiB",
                     "--precision", "bf16", "--host-memory", "128GiB"]) == 0
    # a small host limits the optimizer's offload, and the error says so
    assert cmd_plan(["--model", "7b", "--device", "h100-80gb", "--budget", "40GiB", "--host-memory", "16GiB"]) == 2
    assert "cannot hold the whole optimizer" in capsys.readouterr().err


def test_analytic_compiled_w1(capsys: pytest.CaptureFixture[str]) -> None:
    # --compile: the blocks priced as planned runs compile them, a block kept whole at what selective recompute
    # keeps; at a budget that binds, the plan keeps blocks it recomputed eager, and predicts a step no slower
    # (the twenty-second session's H200 rows: W1 0.94-1.05x the measured steps so, 1.15-1.35x eager-priced)
    args = ["--model", "w1", "--device", "h200", "--budget", "16GiB", "--batch", "4x4096", "--host-memory",
            "128GiB", "--precision", "bf16", "--no-clip", "--json"]
    assert cmd_plan(args) == 0
    eager = json.loads(capsys.readouterr().out)
    assert cmd_plan([*args, "--compile"]) == 0
    compiled = json.loads(capsys.readouterr().out)
    assert any(n.startswith("analytic: a compiled block kept whole") for n in compiled["notes"])
    assert not any(n.startswith("analytic: a compiled block") for n in eager["notes"])
    kept = [[b["kept_bytes"] for b in p["blocks"] if b["checkpoint"] == "none" and not b["offload_ratio"]]
            for p in (eager, compiled)]
    assert max(kept[1]) < min(kept[0] or [1 << 62])  # a kept block holds less compiled
    assert sum(b["checkpoint"] != "none" for b in compiled["blocks"]) < sum(
        b["checkpoint"] != "none" for b in eager["blocks"])  # fewer blocks recompute, fully or selectively
    assert compiled["predicted_step_seconds"] <= eager["predicted_step_seconds"]
    assert compiled["predicted_peak_bytes"] <= compiled["budget_bytes"] == 16 << 30


def test_unknown_device_lists_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("elbowroom.plan.profiler")
    pytest.importorskip("elbowroom.plan.devices")
    assert cmd_plan(["--model", "w1", "--device", "tpu-v9", "--budget", "24GiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tpu-v9" in err and "h100-80gb" in err
    from elbowroom.plan.devices import ALIASES

    assert all(alias in err for alias in ALIASES)  # h200-141gb included


def test_help_lists_every_model(capsys: pytest.CaptureFixture[str]) -> None:
    from elbowroom.models.decoder import PRESETS

    with pytest.raises(SystemExit):
        cmd_plan(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "gpt2-xl" in PRESETS and f"model preset: {', '.join(PRESETS)}" in out


def test_help_lists_the_devices_and_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """--device names the device table's devices and aliases and says when it is needed (it listed none, and showed
    no default though it is required without --profile); --precision shows its default."""
    from elbowroom.plan.devices import ALIASES, DEVICES

    with pytest.raises(SystemExit):
        cmd_plan(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    options = out[out.index("options:"):]
    device = options[options.index("--device DEVICE"):options.index("--host-memory HOST_MEMORY")]
    assert f"{', '.join(sorted(DEVICES))} (any case; aliases: {', '.join(ALIASES)})" in device
    assert "required unless --profile" in device
    assert "with fp32 masters (default: fp32)" in out


def test_errors_read_as_trains_do(capsys: pytest.CaptureFixture[str]) -> None:
    """`elbowroom plan: error: ...`, as `elbowroom train: error: ...` (it had no "error:"), argparse's own too."""
    from elbowroom.cli import main

    for argv in (["plan", "--model", "w9", "--device", "h100", "--budget", "24GiB"], ["plan", "--frobnicate"]):
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("elbowroom plan: error: "), lines
    assert main(["train", "--stepz", "3"]) == 2
    assert capsys.readouterr().err.startswith("elbowroom train: error: ")


def _main_not_interrupted(argv: list[str]) -> int:
    """``elbowroom.cli.main(argv)``, failing the test where a KeyboardInterrupt comes out (not stopping the suite)."""
    from elbowroom.cli import main

    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("a KeyboardInterrupt came out of main()")


def test_ctrl_c_while_planning_exits_130_writing_nothing(
    profile_file: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C during the search: one line and 128 + SIGINT (it was a KeyboardInterrupt traceback and -2), no --out."""
    import elbowroom.plan.search

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(elbowroom.plan.search, "plan_for", interrupted)
    out = tmp_path / "plan.toml"
    assert _main_not_interrupted(["plan", "--profile", profile_file, "--budget", "24GiB", "--out", str(out)]) == 130
    cap = capsys.readouterr()
    assert cap.err.strip().splitlines() == ["elbowroom plan: interrupted; nothing written"] and cap.out == ""
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_saving_leaves_the_older_plan_whole(
    profile_file: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """--out is written beside its place and renamed over it: a Ctrl-C mid-write leaves the plan that was there,
    and no partial or temporary file."""
    from elbowroom.cli import main

    out = tmp_path / "plan.toml"
    assert main(["plan", "--profile", profile_file, "--budget", "24GiB", "--out", str(out)]) == 0
    before = out.read_text()
    capsys.readouterr()
    save = Plan.save

    def cut_short(self: Plan, path: str | Path) -> Path:
        Path(path).write_text(self.to_toml()[:100])  # half of it...
        raise KeyboardInterrupt  # ...then Ctrl-C

    monkeypatch.setattr(Plan, "save", cut_short)
    assert _main_not_interrupted(["plan", "--profile", profile_file, "--budget", "30GiB", "--out", str(out)]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["elbowroom plan: interrupted; nothing written"]
    assert out.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["plan.toml"]
    monkeypatch.setattr(Plan, "save", save)
    assert main(["plan", "--profile", profile_file, "--budget", "30GiB", "--out", str(out)]) == 0
    assert Plan.load(out).budget_bytes == 30 << 30 and [p.name for p in tmp_path.iterdir()] == ["plan.toml"]


def test_a_budget_under_one_gib_is_shown_in_mib(capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_plan(["--model", "tiny", "--device", "h100", "--budget", "512MiB"]) == 0
    out = capsys.readouterr().out
    assert "budget 512.00 MiB" in out and "of 512.00 MiB" in out and "0.50 GiB" not in out


def test_a_closed_pipe_ends_quietly(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``elbowroom plan ... | head``: the reader leaves; no BrokenPipeError traceback, the status a shell reports
    for a tool a closed pipe stopped."""
    import os

    r, w = os.pipe()
    os.close(r)
    closed = os.fdopen(w, "w")
    monkeypatch.setattr("sys.stdout", closed)
    try:
        assert cmd_plan(["--model", "tiny", "--device", "h100", "--budget", "8GiB"]) == 141
    finally:
        closed.close()
    assert capsys.readouterr().err == ""


def test_device_aliases_and_case(capsys: pytest.CaptureFixture[str]) -> None:
    """The names elbowroom.plan.get_device takes are the ones the command takes: any case, and the short aliases
    (it had refused "h100", which the table's lookup accepts)."""
    pytest.importorskip("elbowroom.plan.profiler")
    outs = []
    for device in ("h100", "H100-80GB", "h100-80gb"):
        assert cmd_plan(["--model", "tiny", "--device", device, "--budget", "8GiB", "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1] == outs[2]


def test_model_path_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_plan(["--model", "w1", "--device", "tpu-v9", "--budget", "24GiB"]) == 2
    assert "unknown device 'tpu-v9'; known: a100-40gb, a100-80gb, cpu, h100-80gb" in capsys.readouterr().err
    assert cmd_plan(["--model", "tiny", "--device", "h100-80gb", "--budget", "24GiB", "--batch", "4by4096"]) == 2
    assert "--batch must read SAMPLESxTOKENS" in capsys.readouterr().err


def test_one_rank_of_fsdp2(profile_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--dp-shard N`` plans one rank as the trainer does under FSDP2: shards counted as shards, so the minimum
    per GPU falls with N, and the plan records its shard factor (the trainer refuses it at another one)."""
    def minimum(*extra: str) -> tuple[float, float]:
        """(the minimum, the fp32 AdamW model states it names) in GiB."""
        assert cmd_plan(["--profile", profile_file, "--budget", "1GiB", "--precision", "bf16", *extra]) == 2
        err = capsys.readouterr().err
        states = float(err.split("model states need ")[1].split(" GiB")[0])
        return float(err.split("below the minimum ")[1].split(" GiB")[0]), states

    # all with the plain loss
    (one, s1), (two, s2), (_, s8) = (minimum("--no-fused-loss"), minimum("--dp-shard", "2", "--no-fused-loss"),
                                     minimum("--dp-shard", "8", "--no-fused-loss"))
    assert two < one and s2 == pytest.approx(s1 / 2, rel=0.02) and s8 == pytest.approx(s1 / 8, rel=0.02)
    # (from 2 ranks on the head, loss and working memory dominate, and the 8 ranks of one host share its memory, so
    # each offloads less: 8 need not go lower than 2, nor than one process that has the whole host to offload to)
    # ... which the fused head and loss shrinks under FSDP2 too (it runs in the head's forward, where FSDP2 gathers
    # the weight): a budget between the two minimums is met, fused
    fused, _ = minimum("--dp-shard", "2")
    assert fused < 0.9 * two
    assert cmd_plan(["--profile", profile_file, "--budget", f"{(fused + two) / 2:.2f}GiB", "--precision", "bf16",
                     "--dp-shard", "2", "--json"]) == 0
    plan = Plan.from_dict(json.loads(capsys.readouterr().out))
    assert plan.profile.shard_factor == 2 and plan.fused_loss
    assert cmd_plan(["--profile", profile_file, "--budget", "24GiB", "--precision", "bf16", "--dp-shard", "8",
                     "--json"]) == 0
    plan = Plan.from_dict(json.loads(capsys.readouterr().out))
    assert plan.profile.shard_factor == 8
    assert plan.memory["FSDP2 gathered parameters and gradients"] > 0
    assert (plan.weight_dtype, plan.offload_param_dtype) != ("float32", "bfloat16")


def test_one_rank_of_ddp(profile_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--dp-replicate N`` plans one DDP rank as the trainer does: every gradient held all step (DDP's buckets),
    the host's memory and optimizer rate shared by the ranks on it."""
    def run(*extra: str) -> Plan:
        assert cmd_plan(["--profile", profile_file, "--budget", "24GiB", "--no-fused-loss", "--json", *extra]) == 0
        return Plan.from_dict(json.loads(capsys.readouterr().out))

    one, ddp = run(), run("--dp-replicate", "4")
    assert ddp.persistent_gradients and not one.persistent_gradients and not ddp.fused_loss
    assert ddp.predicted_peak_bytes <= 24 * 2**30
    # the same decisions cost a DDP rank its buckets in the forward, and its share of the host step
    from dataclasses import replace

    from elbowroom.plan import profile_from_dict
    from elbowroom.plan.cost import predict
    from elbowroom.plan.ranks import host_share

    prof = profile_from_dict(json.loads(Path(profile_file).read_text()))
    shared = replace(prof, machine=host_share(prof.machine, 4))
    again = predict(shared, ddp.decisions(), 24 * 2**30)
    assert again.peak_bytes == ddp.predicted_peak_bytes
    assert abs(again.step_seconds - ddp.predicted_step_seconds) < 1e-9
    # priced at one GPU's link alone unless told the shared one, and it says so
    assert any("--shared-link" in n for n in ddp.notes) and not any("--shared-link" in n for n in one.notes)
    linked = run("--dp-replicate", "4", "--shared-link", "37,32,19")
    assert not any("--shared-link" in n for n in linked.notes)
    link = replace(shared, machine=host_share(prof.machine, 4, (37e9, 32e9, 19e9)))
    again = predict(link, linked.decisions(), 24 * 2**30)
    assert abs(again.step_seconds - linked.predicted_step_seconds) < 1e-9


def test_budget_hints_name_this_commands_flags(profile_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_plan(["--profile", profile_file, "--budget", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "--precision bf16 allows" in err and "precision='bf16'" not in err and "global_batch=" not in err
    assert cmd_plan(["--profile", profile_file, "--budget", "1GiB", "--no-fused-loss"]) == 2
    err = capsys.readouterr().err
    assert "the fused head and loss (no --no-fused-loss) shrinks" in err and "fused_loss=" not in err
    # under data parallel too (the trainer runs the fused loss in the head's forward, which DDP and FSDP2 see)
    for extra in (["--dp-replicate", "2"], ["--dp-shard", "2"]):
        assert cmd_plan(["--profile", profile_file, "--budget", "1GiB", "--no-fused-loss", *extra]) == 2
        assert "the fused head and loss (no --no-fused-loss) shrinks" in capsys.readouterr().err


# ------------------------------------------------------------------ a local Hugging Face model (--hf DIR)
def _hf_dir(tmp_path: Path, arch: str = "llama", positions: int = 256) -> Path:
    transformers = pytest.importorskip("transformers")
    if arch == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=260,
                                       max_position_embeddings=positions)
    else:
        cfg = transformers.GPT2Config(n_embd=64, n_layer=5, n_head=4, vocab_size=260, n_positions=positions)
    d = tmp_path / arch
    cfg.save_pretrained(d)
    return d


def test_a_hugging_face_directory_is_planned_from_its_config(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # a laptop's question before any GPU: does this model fit that card. Built on meta from config.json: the
    # weights are never read (a corrupt weights file beside it changes nothing), one block row per layer
    from elbowroom.plan import get_device, plan_for, profile

    d = _hf_dir(tmp_path)
    (d / "model.safetensors").write_bytes(b"not weights")
    assert cmd_plan(["--hf", str(d), "--device", "h100", "--budget", "1GiB", "--batch", "2x128", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert len(got["blocks"]) == 3 and got["predicted_peak_bytes"] <= got["budget_bytes"] == 1 << 30
    assert any("eager layers took about 1.7x the predicted time" in n for n in got["notes"])  # the caveat, said
    # the same plan as the library's, on the same model built on meta
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d))
    model.config.use_cache = False
    ids = torch.zeros((2, 128), dtype=torch.long, device="meta")
    prof = profile(model.train(), ids, source="analytic", machine=get_device("h100"))
    want = plan_for(prof, 1 << 30, fused_loss_allowed=True, grad_clipping=True, gradient_offload_allowed=True)
    assert got["predicted_peak_bytes"] == want.predicted_peak_bytes
    assert got["predicted_step_seconds"] == pytest.approx(want.predicted_step_seconds)
    # the directory given as --model (a new user's first try), or as the trainer's --model.hf, is planned as --hf
    for flag in ("--model", "--model.hf"):
        assert cmd_plan([flag, str(d), "--device", "h100", "--budget", "1GiB", "--batch", "2x128", "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == got
    # GPT-2's blocks (model.transformer.h), the default batch one sequence of the position table
    assert cmd_plan(["--hf", str(_hf_dir(tmp_path, "gpt2")), "--device", "h100", "--budget", "1GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["blocks"]) == 5 and out["profile"]["seq_len"] == 256 and out["micro_batch"] == 1


def test_hf_bad_input_returns_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _hf_dir(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    long = _hf_dir(tmp_path / "long", positions=131072)
    cases = [
        (["--hf", str(tmp_path / "nope")], "is not a directory"),
        (["--hf", str(empty)], "has no config.json"),
        (["--hf", str(d), "--model", "w1"], "leave out --model and --arch"),
        (["--hf", str(d), "--batch", "1x512"], "position table holds 256 tokens; pass at most 1x256"),
        (["--hf", str(long)], "up to 131072 tokens; say which with --batch"),
        (["--hf", str(d), "--profile", "p.json"], "--profile plans a saved profile, --hf profiles a model"),
        (["--hf", str(d), "--budget", "1KiB"], "below the minimum"),
    ]
    out = tmp_path / "plan.toml"
    for args, match in cases:
        argv = ["--device", "h100", *args, "--out", str(out)]
        if "--budget" not in args:
            argv += ["--budget", "1GiB"]
        assert cmd_plan(argv) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and match in err[0], (args, err)
        assert not out.exists()
