"""The benchmark harness stays runnable: the smoke workload through our modes and a peer mode, on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elbowroom.plan import Plan

ROOT = Path(__file__).resolve().parent.parent


def test_bench_smoke_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    modes = ["plain", "torch_ckpt", "fsdp2", "ours_offload_ckpt_inputs", "ours_selective_offload", "fit@1GiB+cap",
             "fit@1GiB+compile", "fit@1GiB+compile+norpw", "plain_compiled", "plain_compiled_rpw",
             "er_optim_late0.4"]
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
    capped = next(r for r in rows if r["mode"] == "fit@1GiB+cap")
    assert capped["notes"]["capped_GiB"] is None and "pred_step_s" in capped  # +cap: no cap without CUDA
    compiled = next(r for r in rows if r["mode"] == "fit@1GiB+compile")  # the plan priced on compiled blocks
    notes = compiled["settings"]["mechanism"]["plan"]["notes"]
    assert "priced on the blocks compiled, as they run (compile_blocks)" in notes
    rpw = "the blocks compiled with compile_blocks(recompute_pointwise=True)"  # fit's planned default
    assert rpw in notes
    norpw = next(r for r in rows if r["mode"] == "fit@1GiB+compile+norpw")["settings"]["mechanism"]["plan"]["notes"]
    assert "the blocks compiled with compile_blocks(recompute_pointwise=False)" in norpw and rpw not in norpw
    # the planned rows repriced on the analytic profile, eager and compiled (analytic_replay.py): one line each
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "analytic_replay.py"), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    planned = [r for r in rows if r.get("settings", {}).get("mechanism", {}).get("plan")]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| smoke |")]
    assert len(lines) == len(planned) >= 3 and all(line.count("x,") == 2 for line in lines)
    # every row carries what produced it, and can be measured again from that alone
    recorded = rows[-1]["settings"]
    assert recorded["mode"] == modes[-1] and recorded["workload"]["seq_len"] == 128
    assert recorded["args"]["steps"] == 2 and recorded["torch"] == __import__("torch").__version__
    again = tmp_path / "again.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--reproduce", str(out),
                           "--json", str(again)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = [json.loads(line) for line in again.read_text().splitlines()]
    assert row["settings"] == recorded and "error" not in row
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--modes", "bogus_mode"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "unknown mode 'bogus_mode'" in bad.stderr


def test_hugging_face_harnesses_compiled(tmp_path: Path) -> None:
    # hf_fit.py --compile: the plain row compiled as the fit rows are, each fit row priced on compiled blocks; and
    # hf_compiled_policies.py, a planner's mix compiled and eager in its own process, on the tiny shape on CPU
    pytest.importorskip("transformers")
    out = tmp_path / "hf.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_fit.py"), "--arch", "llama", "--tiny",
                           "--budgets", "1GiB", "--compile", "--steps", "3", "--warmup", "1", "--json", str(out),
                           "--save-plans", str(tmp_path / "plans")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain, fitted = [json.loads(line) for line in out.read_text().splitlines()]
    saved = tmp_path / "plans" / "hf-llama-tiny-1GiB-compile.toml"  # written before the first step
    assert Plan.load(saved).to_dict() == fitted["settings"]["mechanism"]["plan"]
    assert plain["mode"] == "plain+compile" and fitted["mode"] == "1GiB+compile"
    assert plain["loss_last"] < plain["loss_first"] and fitted["loss_last"] < fitted["loss_first"]
    # the window of timed steps (back to back), and the loop's own pace beside it
    assert fitted["step_s"] > 0 and fitted["loop_step_s"] > 0 and "gpu_ms" not in fitted  # (CUDA events only)
    assert "priced on the blocks compiled, as they run (compile_blocks)" in fitted["settings"]["mechanism"]["plan"][
        "notes"]
    rows = {}
    for extra in ([], ["--eager"]):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_compiled_policies.py"), "--tiny",
                               "--cases", "mix", "--weights", "bf16", "--host", *extra],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("| mix |")]
        rows[bool(extra)] = json.loads(line.split("|")[4].strip())  # the three losses, or the fault's line
    assert len(rows[False]) == 3 and rows[False] == pytest.approx(rows[True], rel=1e-2)
    # fit's saved plan applied in a fresh process, after fit's own profiles, with a variant of it: each trains
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_compiled_policies.py"), "--tiny", "--plan",
                           str(saved), "--cases", "as-is,recompute-all", "--profile-first", "fit"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = {ln.split("|")[1].strip(): json.loads(ln.split("|")[4].strip()) for ln in proc.stdout.splitlines()
           if ln.startswith(("| as-is |", "| recompute-all |"))}
    assert len(got["as-is"]) == 3 and got["as-is"] == pytest.approx(got["recompute-all"], rel=1e-2)


def test_bf16_model_mode_and_microbatch_harness(tmp_path: Path) -> None:
    # the 7B accumulation-8 configuration's mode on the smoke shape (bf16 model, fp32 masters on both sides,
    # recompute of the first blocks, fused loss), and the micro-batch timer in its CPU variants
    out = tmp_path / "rows.jsonl"
    mode = "er_optim_bf16all_late0.5_fwd+eckpt+fl"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--workload", "smoke", "--modes", mode,
           "--accum", "2", "--steps", "3", "--warmup", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert "error" not in row, row
    assert row["accum"] == 2 and row["notes"]["param_dtype"] == "bf16 (all)" and row["offloaded_share"] == 0.5
    assert row["loss_last"] < row["loss_first"]
    mb = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "microbatch.py"), "--preset", "tiny", "--seq",
                         "64", "--variants", "bf16,amp+ckpt2,bf16+unfused+sel", "--warmup", "1", "--iters", "1"],
                        capture_output=True, text=True, timeout=300)
    assert mb.returncode == 0, mb.stderr[-2000:]
    rows = [json.loads(line) for line in mb.stdout.splitlines() if line.startswith("{")]
    assert [r["variant"] for r in rows] == ["bf16", "amp+ckpt2", "bf16+unfused+sel"]
    assert all(r["ms"] > 0 and r["layers"] == 4 for r in rows)


def test_prediction_plot_counts_the_points_in_each_band(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    planned = [("w1", 0.35, 0.34, 23.1, 23.7), ("w1", 0.54, 0.81, 9.85, 7.94), ("w3", 0.86, 1.05, 74.3, 76.0)]
    lines = [json.dumps({"workload": "w1", "mode": "plain", "step_s": 0.34, "reserved_peak_GiB": 55.6})]  # no plan
    lines += [json.dumps({"workload": w, "mode": "fit@x", "step_s": s, "pred_step_s": ps, "reserved_peak_GiB": r,
                          "pred_peak_GiB": pr}) for w, s, ps, r, pr in planned]
    rows.write_text("\n".join(lines) + "\n")
    png = tmp_path / "pred.png"
    script = str(ROOT / "benchmarks" / "plot_predictions.py")
    proc = subprocess.run([sys.executable, script, str(png), str(rows)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert png.read_bytes()[:4] == b"\x89PNG"
    table = [line for line in proc.stdout.splitlines() if line.startswith("| w") and "fit@x" in line]
    assert len(table) == 3 and "(0.67)" in table[1] and "(1.24)" in table[1]  # measured / predicted
    empty = tmp_path / "none.jsonl"
    empty.write_text(lines[0] + "\n")
    proc = subprocess.run([sys.executable, script, str(tmp_path / "x.png"), str(empty)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "no planned rows" in proc.stderr and not (tmp_path / "x.png").exists()


def test_memory_peak_names_what_was_alive_at_the_peak() -> None:
    # a synthetic allocator history: 100 bytes before the recording, then two allocations from two places; one is
    # freed before a third makes the peak, and a set-up allocation is freed at the end
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import memory_peak

    own = {"filename": "/x/elbowroom/optim/engine.py", "line": 7, "name": "_copy"}
    op = {"filename": "/x/torch/_tensor.py", "line": 1, "name": "to"}
    M = 1 << 20
    trace = [
        {"action": "alloc", "addr": 1, "size": 40 * M, "frames": [op, own]},
        {"action": "segment_alloc", "addr": 9, "size": 1000},
        {"action": "alloc", "addr": 2, "size": 30 * M, "frames": [own]},
        {"action": "free_completed", "addr": 2, "size": 30},
        {"action": "alloc", "addr": 3, "size": 50 * M, "frames": [op, own]},
        {"action": "free_completed", "addr": 77, "size": 100 * M},  # made before the recording
    ]
    peak, at, live = memory_peak.peak_allocations(trace, baseline=100 * M)
    assert (peak, at) == (190 * M, 4)
    assert sorted(n for n, _ in live.values()) == [40 * M, 50 * M]
    assert {site for _, site in live.values()} == {"elbowroom/optim/engine.py:7 _copy <- _tensor.py:1 to"}
    text = memory_peak.summarize({"device_traces": [trace]}, baseline=100 * M)
    assert "made since and alive at the peak: 0.088 GiB in 2 allocations" in text
    assert "| 0.088 | 2 | 40.0 x 1, 50.0 x 1 | elbowroom/optim/engine.py:7 _copy <- _tensor.py:1 to |" in text


def test_idle_gaps_put_a_steps_idle_down_to_phases_and_host_ranges(tmp_path: Path) -> None:
    # a synthetic trace of one step: forward kernels with a 3 us gap under FSDP2's pre-forward hook, backward
    # kernels with a 5 us gap under an autograd function, then 7 us idle at the end under the optimizer's step
    def x(name: str, cat: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}

    events = [
        x("elbowroom step 1", "user_annotation", 0, 100),
        x("fwd_a", "kernel", 0, 20), x("fwd_b", "kernel", 23, 27),
        x("FSDP::pre_forward (blocks.1)", "cpu_op", 19, 5),
        x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 50, 30),
        x("bwd_a", "kernel", 50, 20), x("bwd_b", "kernel", 75, 18),
        x("Optimizer.step#AdamW.step", "cpu_op", 90, 10),
        x("ncclKernel_AllReduce", "kernel", 60, 30),  # communication: not compute
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "idle_gaps.py"), str(trace), "--min-ms", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "compute idle 0.0 ms in 3 gaps" in out  # 15 us
    assert "idle by phase: forward 0.0 ms, backward 0.0 ms, optimizer step 0.0 ms" in out  # (ms, rounded)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from idle_gaps import attribute
    finally:
        sys.path.pop(0)
    host = [e for e in events if e["cat"] == "cpu_op"]
    phases, ranges = attribute([(3, 20), (5, 70), (7, 93)], host, (0, 100))
    assert phases == {"forward": 3, "backward": 5, "optimizer step": 7}
    assert ranges == {"FSDP::pre_forward": 3, "MmBackward0": 5, "Optimizer.step": 7}
