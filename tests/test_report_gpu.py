"""elbowroom.report on CUDA (run on the lent GPU): a real recording, its snapshot and trace, and the report.

Run: ``python -m pytest -m gpu tests/test_report_gpu.py -q``. Skipped without CUDA.

The model offloads the inputs of its checkpointed blocks and the late half of its optimizer to the host, so
that the trace has copies both ways and the timeline has every category the mechanisms expose.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from elbowroom.activations import apply_activation_policy
from elbowroom.models import ModelConfig, build_model
from elbowroom.report import RecordConfig, cmd_report, record, write_oom_report
from elbowroom.report.snapshot import load_snapshot, peak_allocations
from elbowroom.report.trace import link_timeline, read_trace

pytestmark = pytest.mark.gpu


def _model_and_optimizer(offload: bool) -> tuple[torch.nn.Module, Any, ModelConfig]:
    cfg = ModelConfig(vocab_size=4096, dim=512, n_layers=6, n_heads=8, ffn_dim=1536, max_seq_len=1024)
    model = build_model(cfg).cuda()
    if offload:
        from elbowroom.optim import CPUOffloadOptimizer

        apply_activation_policy(model, checkpoint="full", offload_checkpoint_inputs=True, min_offload_bytes=0)
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, offload_fraction=0.5)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, opt, cfg


def _train(out: Path, offload: bool, steps: str = "2-3", n: int = 4) -> None:
    torch.manual_seed(0)
    model, opt, cfg = _model_and_optimizer(offload)
    with record(out, config=RecordConfig(steps=steps), model=model, optimizer=opt) as rec:
        for _ in range(n):
            x = torch.randint(0, cfg.vocab_size, (4, 1024), device="cuda")
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(x).float().logsumexp(-1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    with open(out / "metrics.jsonl", "w") as f:
        for s in range(1, n + 1):
            f.write(json.dumps({"step": s, "loss": 8.0 - s, "tokens_per_s": 1e5, "peak_memory_bytes": 2**30}) + "\n")


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
def test_cuda_recording_and_report(tmp_path: Path, offload: bool) -> None:
    _train(tmp_path, offload)
    prof = tmp_path / "profile"
    rows = [json.loads(x) for x in (prof / "memory.jsonl").read_text().splitlines()]
    samples = [r for r in rows if r["kind"] == "sample"]
    assert {r["step"] for r in rows if r["kind"] == "step"} == {2, 3}
    for s in samples:
        assert s["device"] == "cuda"
        assert all(v >= 0 for v in s["bytes"].values()), s
        assert sum(s["bytes"].values()) == s["total_bytes"], s
    fwd_end = [
        s["bytes"]["activations_kept"]
        for s in samples
        if s["step"] == 3 and s["phase"] == "forward" and s["event"] == "end"
    ]
    if not offload:  # kept activations grow block by block (offloaded ones leave as they grow)
        assert fwd_end[-1] > fwd_end[0]
    if offload:
        assert any(s["host_bytes"].get("offload_pool") for s in samples)
        assert any(s["host_bytes"].get("optimizer") for s in samples)

    peak = peak_allocations(load_snapshot(prof / "memory_snapshot.pickle"))
    assert peak is not None and peak.top and peak.top[0].size > 0
    tl = link_timeline(read_trace(prof / "trace.json"))
    assert tl is not None and tl.step == 3 and max(tl.compute_busy) > 0
    if offload:
        assert tl.d2h_bytes > 0 and tl.h2d_bytes > 0

    assert cmd_report([str(tmp_path)]) == 0
    for name in ("memory.png", "link.png", "metrics.png", "report.html"):
        assert (tmp_path / "report" / name).stat().st_size > 0, name
    assert 'id="allocations"' in (tmp_path / "report" / "report.html").read_text()


def test_oom_report_dumps_the_snapshot(tmp_path: Path) -> None:
    model, opt, cfg = _model_and_optimizer(False)
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    try:
        total = torch.cuda.mem_get_info()[1]  # more than the device has: the allocator's cache cannot cover it
        with pytest.raises(torch.OutOfMemoryError) as e:
            torch.empty(total + (1 << 30), dtype=torch.uint8, device="cuda")
        path = write_oom_report(tmp_path, model, opt, plan={"predicted_peak_bytes": 1 << 30}, error=e.value)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    text = path.read_text()
    assert "parameters" in text and "plan: predicted peak" in text and "reserved by the allocator" in text
    assert (tmp_path / "profile" / "oom_snapshot.pickle").stat().st_size > 0


def test_recording_off_on_cuda_leaves_no_history(tmp_path: Path) -> None:
    _train(tmp_path, False, steps="", n=2)
    assert not (tmp_path / "profile").exists()
    assert not torch.cuda.memory._snapshot()["device_traces"][0]
