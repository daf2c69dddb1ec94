"""The benchmark harness stays runnable: the smoke workload through our modes and a peer mode, on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_smoke_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    modes = ["plain", "torch_ckpt", "ours_offload_ckpt_inputs", "ours_selective_offload", "er_optim_late0.4"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--workload", "smoke", "--modes", ",".join(modes),
           "--steps", "2", "--warmup", "1", "--in-process", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mode"] for r in rows] == modes
    for r in rows:
        assert "error" not in r, r
        assert r["tok_per_s"] > 0 and r["loss_last"] < r["loss_first"] + 1.0
    assert "| smoke | plain |" in proc.stdout  # the table
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--modes", "bogus_mode"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "unknown mode 'bogus_mode'" in bad.stderr
