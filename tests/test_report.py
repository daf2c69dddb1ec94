"""elbowroom.report on a CPU run: record steps of a real loop, then report on the run directory.

The trainer is not involved: the test drives a small loop itself and writes ``metrics.jsonl`` and ``plan.json``
the way the trainer and the planner would.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch

from elbowroom.models import ModelConfig, build_model
from elbowroom.report import RecordConfig, cmd_report, record, write_oom_report
from elbowroom.report.categories import CATEGORIES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _loop(model: torch.nn.Module, opt: torch.optim.Optimizer, rec: Any, steps: int, vocab: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (2, 32))
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        rec.step()
    return losses


def _plan(n_blocks: int) -> dict[str, Any]:
    policies = ["keep", "selective", "full", "keep"]
    return {
        "predicted_peak_bytes": 24_000_000,
        "budget_bytes": 32_000_000,
        "predicted_step_seconds": 0.05,
        "tokens_per_step": 62,
        "blocks": [
            {
                "index": i,
                "policy": policies[i % 4],
                "kept_bytes": 900_000 - 200_000 * (i % 4),
                "offloaded_bytes": 100_000 * i,
                "recomputed_bytes": 150_000 * (i % 3),
                "forward_s": 0.002,
                "backward_s": 0.004,
                "extra_s": 0.001 * (i % 3) - 0.0005,
            }
            for i in range(n_blocks)
        ],
    }


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 4 steps of the tiny model with steps 1-2 recorded, its metrics and a hand-written plan."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("run")
    cfg = ModelConfig.from_preset("tiny")
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with record(out, steps=range(1, 3), model=model, optimizer=opt) as rec:
        losses = _loop(model, opt, rec, 4, cfg.vocab_size)
    with open(out / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, 1):
            row = {
                "step": step,
                "loss": loss,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "tokens_per_s": 900.0 + 25 * step,
                "peak_memory_bytes": 20_000_000 + 1000 * step,
            }
            f.write(json.dumps(row) + "\n")
        f.write(json.dumps({"step": 4, "val_loss": losses[-1] + 0.1}) + "\n")
    (out / "plan.json").write_text(json.dumps(_plan(cfg.n_layers)))
    assert cmd_report([str(out)]) == 0
    return out


class _Tables(HTMLParser):
    """Tables of the page by id: rows of (text, data-value) cells."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[tuple[str, str | None]]]] = {}
        self.headers: dict[str, list[str]] = {}
        self.images = 0
        self._table: str | None = None
        self._cell: list[str] | None = None
        self._value: str | None = None
        self._th = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id") or f"table{len(self.tables)}"
            self.tables[self._table] = []
            self.headers[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        elif tag in ("td", "th") and self._table:
            self._cell, self._value, self._th = [], a.get("data-value"), tag == "th"
        elif tag == "img" and (a.get("src") or "").startswith("data:image/png;base64,"):
            self.images += 1

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table:
            text = "".join(self._cell).strip()
            if self._th and len(self.tables[self._table]) == 1:
                self.headers[self._table].append(text)
            else:
                self.tables[self._table][-1].append((text, self._value))
            self._cell = None
        elif tag == "table":
            self._table = None


def _page(run_dir: Path) -> _Tables:
    p = _Tables()
    p.feed((run_dir / "report" / "report.html").read_text())
    return p


def _memory_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "profile" / "memory.jsonl").read_text().splitlines()]


def test_report_writes_pictures_and_page(run_dir: Path) -> None:
    report = run_dir / "report"
    for name in ("memory.png", "plan.png", "metrics.png"):
        data = (report / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
    assert not (report / "link.png").exists(), "a CPU run has no device copies: no link panel"
    page = _page(run_dir)
    assert page.images == 3  # memory, plan, metrics, inlined
    html_text = (report / "report.html").read_text()
    assert "../profile/trace.json" in html_text
    assert "memory_snapshot" not in html_text  # CUDA only


def test_plan_table_matches_plan_json(run_dir: Path) -> None:
    plan = json.loads((run_dir / "plan.json").read_text())
    page = _page(run_dir)
    cols = page.headers["plan-table"]
    rows = [r for r in page.tables["plan-table"] if r]
    assert len(rows) == len(plan["blocks"])
    for row, block in zip(rows, plan["blocks"]):
        assert set(cols) == set(block)
        for col, (_, value) in zip(cols, row):
            expected = block[col]
            assert (value == expected) if isinstance(expected, str) else float(value) == pytest.approx(expected)
    summary = {r[0][0]: r[1][1] for r in page.tables["plan-summary"] if r}
    assert int(summary["predicted_peak_bytes"]) == plan["predicted_peak_bytes"]
    assert int(summary["budget_bytes"]) == plan["budget_bytes"]


def test_metrics_and_comparison_match_the_run(run_dir: Path) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    page = _page(run_dir)
    metrics = {r[0][0]: r[1][1] for r in page.tables["metrics"] if r}
    assert int(metrics["last step"]) == train[-1]["step"]
    assert float(metrics["last loss"]) == pytest.approx(train[-1]["loss"])
    assert float(metrics["min loss"]) == pytest.approx(min(r["loss"] for r in train))
    assert float(metrics["last val loss"]) == pytest.approx(rows[-1]["val_loss"])
    assert float(metrics["median tokens per s"]) == pytest.approx(statistics.median(r["tokens_per_s"] for r in train))
    assert float(metrics["max peak memory bytes"]) == max(r["peak_memory_bytes"] for r in train)
    compare = {r[0][0]: (r[1][1], r[2][1]) for r in page.tables["compare"] if r}
    steps = [r for r in _memory_rows(run_dir) if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    assert float(compare["peak memory"][0]) == 24_000_000
    samples = [r for r in _memory_rows(run_dir) if r["kind"] == "sample"]
    tensor_peak = max(s["total_bytes"] - s["bytes"]["other"] for s in samples)  # a CPU plan predicts tensor bytes
    assert float(compare["peak memory"][1]) == tensor_peak
    assert float(compare["step time"][0]) == pytest.approx(0.05)
    assert float(compare["tokens/s"][0]) == pytest.approx(62 / 0.05)


def test_categories_add_up_at_every_sample(run_dir: Path) -> None:
    samples = [r for r in _memory_rows(run_dir) if r["kind"] == "sample"]
    assert {s["step"] for s in samples} == {1, 2}
    assert {s["phase"] for s in samples} >= {"step", "forward", "backward", "optimizer"}
    n_blocks = ModelConfig.from_preset("tiny").n_layers
    for step in (1, 2):
        fwd = [s for s in samples if s["step"] == step and s["phase"] == "forward"]
        bwd = [s for s in samples if s["step"] == step and s["phase"] == "backward"]
        assert sorted({s["block"] for s in fwd}) == list(range(n_blocks))
        assert sorted({s["block"] for s in bwd}) == list(range(n_blocks))
    param_bytes = sum(p.numel() * 4 for p in build_model(ModelConfig.from_preset("tiny")).parameters())
    for s in samples:
        assert set(s["bytes"]) == set(CATEGORIES)
        assert all(v >= 0 for v in s["bytes"].values()), s
        assert sum(s["bytes"].values()) == s["total_bytes"], s
        assert s["bytes"]["parameters"] == param_bytes
    # what each phase should hold: no gradients before backward, all of them at the optimizer step,
    # activations growing through forward
    first = [s for s in samples if s["step"] == 2]
    assert first[0]["bytes"]["gradients"] == 0
    opt_begin = next(s for s in first if s["phase"] == "optimizer" and s["event"] == "begin")
    assert opt_begin["bytes"]["gradients"] == param_bytes
    assert opt_begin["bytes"]["optimizer_state"] >= 2 * param_bytes  # AdamW's two moments
    ends = [s["bytes"]["activations_kept"] for s in first if s["phase"] == "forward" and s["event"] == "end"]
    assert ends == sorted(ends) and ends[-1] > ends[0] > 0


def test_missing_or_partial_run_dir_exits_2_writing_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cases = {
        "missing": None,
        "empty": {},
        "no-training-rows": {"metrics.jsonl": json.dumps({"step": 1, "val_loss": 3.0}) + "\n"},
        "bad-json": {"metrics.jsonl": '{"step": 1, "loss": 3.0}\n{oops\n{"step": 2, "loss": 2.0}\n'},
        "bad-plan": {"metrics.jsonl": json.dumps({"step": 1, "loss": 3.0}) + "\n", "plan.json": "[1, 2"},
    }
    for name, files in cases.items():
        d = tmp_path / name
        if files is not None:
            d.mkdir()
            for fname, text in files.items():
                (d / fname).write_text(text)
        before = sorted(p.name for p in d.iterdir()) if d.exists() else None
        assert cmd_report([str(d)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("elbowroom report: error:"), (name, err)
        assert (sorted(p.name for p in d.iterdir()) if d.exists() else None) == before, name


def test_missing_matplotlib_exits_2_naming_the_extra(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import importlib.util

    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cmd_report([str(d)]) == 2
    assert "pip install 'elbowroom[plots]'" in capsys.readouterr().err
    assert not (d / "report").exists()


def test_metrics_only_run_gets_metrics_and_no_empty_panels(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 4.0 / s, "tokens_per_s": 100.0}) + "\n" for s in range(1, 6))
    )
    assert cmd_report([str(tmp_path)]) == 0
    names = sorted(p.name for p in (tmp_path / "report").iterdir())
    assert names == ["metrics.png", "report.html"]
    text = (tmp_path / "report" / "report.html").read_text()
    assert "No plan.json" in text and "--profile.steps" in text


def test_recording_off_installs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for cls, names in (
        (torch.nn.Module, ("register_forward_pre_hook", "register_forward_hook")),
        (torch.optim.Optimizer, ("register_step_pre_hook", "register_step_post_hook")),
        (torch.Tensor, ("register_hook",)),
    ):
        for name in names:
            real = getattr(cls, name)
            monkeypatch.setattr(cls, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
    monkeypatch.setattr(
        torch.autograd.graph, "saved_tensors_hooks", lambda *a, **k: calls.append("saved_tensors_hooks")
    )
    monkeypatch.setattr(torch.profiler, "profile", lambda *a, **k: calls.append("profiler"))
    cfg = ModelConfig.from_preset("tiny")
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with record(tmp_path, config=RecordConfig(), model=model, optimizer=opt) as rec:
        _loop(model, opt, rec, 2, cfg.vocab_size)
    with record(tmp_path, steps="5-6", model=model, optimizer=opt) as rec:  # steps the loop never reaches
        _loop(model, opt, rec, 2, cfg.vocab_size)
    assert calls == []
    assert list(tmp_path.iterdir()) == []


def test_hooks_are_removed_when_recording_ends(tmp_path: Path) -> None:
    cfg = ModelConfig.from_preset("tiny")
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg_rec = RecordConfig(steps="2", trace=False)
    with record(tmp_path, config=cfg_rec, model=model, optimizer=opt) as rec:
        _loop(model, opt, rec, 2, cfg.vocab_size)
        lines = (tmp_path / "profile" / "memory.jsonl").read_text()
        _loop(model, opt, rec, 2, cfg.vocab_size)  # steps 3-4: nothing recorded, no hook fires
    assert (tmp_path / "profile" / "memory.jsonl").read_text() == lines
    assert not (tmp_path / "profile" / "trace.json").exists()
    assert {json.loads(x)["step"] for x in lines.splitlines()} == {2}


def test_step_begin_end_with_checkpointed_blocks(tmp_path: Path) -> None:
    """The trainer's form, on blocks under full recompute: samples still add up; recompute is labelled."""
    from elbowroom.activations import apply_activation_policy

    cfg = ModelConfig.from_preset("tiny")
    model = apply_activation_policy(build_model(cfg), checkpoint="full")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = record(tmp_path, config=RecordConfig(steps="1", trace=False), model=model, optimizer=opt)
    for step in (1, 2):
        rec.step_begin(step)
        x = torch.randint(0, cfg.vocab_size, (2, 16))
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        rec.step_end(step)
    rec.close()
    samples = [r for r in _memory_rows(tmp_path) if r["kind"] == "sample"]
    assert all(sum(s["bytes"].values()) == s["total_bytes"] for s in samples)
    assert {s["phase"] for s in samples} >= {"forward", "backward", "optimizer"}


def test_record_config_validates_with_fixes() -> None:
    assert RecordConfig(steps="3-4").step_set == {3, 4}
    assert RecordConfig(steps="3,5").step_set == {3, 5}
    assert RecordConfig(steps="2,4-6").step_set == {2, 4, 5, 6}
    assert not RecordConfig().enabled
    for bad in ("3-", "a", "4-3", "-1"):
        with pytest.raises(ValueError, match="3-4"):
            RecordConfig(steps=bad)
    with pytest.raises(ValueError, match="max_entries must be a positive int"):
        RecordConfig(steps="1", max_entries=0)
    with pytest.raises(ValueError, match="turn one on"):
        RecordConfig(steps="1", snapshot=False, trace=False, timeline=False)


def test_oom_report_on_cpu(tmp_path: Path) -> None:
    cfg = ModelConfig.from_preset("tiny")
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, cfg.vocab_size, (2, 16))).float().mean().backward()
    opt.step()
    path = write_oom_report(tmp_path, model, opt, plan=_plan(cfg.n_layers), error=RuntimeError("out of memory\nmore"))
    text = path.read_text()
    assert path == tmp_path / "oom_report.txt"
    for needle in (
        "error: out of memory",
        "parameters",
        "gradients",
        "optimizer state",
        "activations and other",
        "plan: predicted peak",
        "plan: budget",
    ):
        assert needle in text, needle


def test_import_pulls_in_neither_matplotlib_nor_cuda() -> None:
    code = """
import sys, torch, torch.cuda
calls = []
torch.cuda._lazy_init = lambda *a, **k: calls.append(1)
import elbowroom.report
from elbowroom.report import RecordConfig, Recorder, record, write_oom_report, cmd_report, write_report
import elbowroom.report.html, elbowroom.report.trace, elbowroom.report.snapshot
assert "matplotlib" not in sys.modules, "matplotlib imported"
assert not calls, calls
print("clean")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr


def test_gradient_accumulation_is_forward_then_backward_twice(tmp_path: Path) -> None:
    """Two micro-batches in one step: the second forward is a forward, not a recompute."""
    cfg = ModelConfig.from_preset("tiny")
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = record(tmp_path, config=RecordConfig(steps="1", trace=False), model=model, optimizer=opt)
    rec.step_begin(1)
    for _ in range(2):
        model(torch.randint(0, cfg.vocab_size, (2, 16))).float().logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad()
    rec.step_end(1)
    phases = [s["phase"] for s in _memory_rows(tmp_path) if s["kind"] == "sample" and s["block"] == 0]
    assert phases == ["forward", "forward", "backward", "backward"] * 2


def test_categories_count_fsdp2_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2's parameters are DTensors, whose own storage cannot be read: the categories count the shards they
    wrap (the recorder crashed at its first sample of an FSDP2 run)."""
    from torch.distributed.fsdp import fully_shard

    from elbowroom.report.categories import sum_storages
    from tests.distributed_utils import one_process_group

    model = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16))
    expected = sum(p.numel() * p.element_size() for p in model.parameters())
    with one_process_group(monkeypatch):
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        params = list(model.parameters())
        assert all(type(p).__name__ == "DTensor" for p in params)
        seen: set = set()
        assert sum_storages(params, "cpu", seen) == expected
        assert sum_storages(params, "cpu", seen) == 0  # each shard counted once


def test_samples_reuse_what_changes_only_when_the_optimizer_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within a step the recorder counts the parameters and the optimizer's tensors once (walking every tensor at
    each block's sample doubled a profiled W1 step's time on an H100); gradients are counted at every sample, and
    the totals are those of an uncached count."""
    from elbowroom.report import categories

    model = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=16))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # state exists
    for p in params:
        p.grad = None
    walks = []
    real = categories.optimizer_tensors
    monkeypatch.setattr(categories, "optimizer_tensors", lambda o: walks.append(1) or real(o))
    cpu = torch.device("cpu")
    cache: dict = {}
    before = categories.categorise(cpu, params, opt, static=cache)
    for p in params[: len(params) // 2]:
        p.grad = torch.ones_like(p)  # half the gradients arrive, as in a backward
    during = categories.categorise(cpu, params, opt, static=cache)
    assert len(walks) == 1  # the optimizer's tensors were walked once
    uncached = categories.categorise(cpu, params, opt)
    assert during[1] == {**uncached[1], "other": during[1]["other"]}  # every category but the RSS remainder
    half = sum(p.numel() * 4 for p in params[: len(params) // 2])
    assert before[1]["gradients"] == 0 and during[1]["gradients"] == half
    assert during[1]["optimizer_state"] >= 2 * during[1]["parameters"] > 0
