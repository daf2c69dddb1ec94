"""The CUDA half of the report, on a CPU: a run directory holding what a CUDA recording writes.

The files follow torch's own formats (a ``torch.profiler`` Chrome trace with ``gpu_memcpy`` and ``kernel``
events, a ``torch.cuda.memory._snapshot()`` dict) and the recorder's ``memory.jsonl`` rows with
``"device": "cuda"``, built by hand so that every number the report shows is known.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from elbowroom.report import cmd_report
from elbowroom.report.categories import CATEGORIES
from elbowroom.report.snapshot import peak_allocations
from elbowroom.report.trace import link_timeline

GIB = 2**30
N_BLOCKS = 6


def _sample(
    step: int, t: float, phase: str, event: str, block: int | None, acts: float, grads: float, flight: float = 0.0
) -> dict[str, Any]:
    by = dict.fromkeys(CATEGORIES, 0)
    by.update(
        parameters=int(2 * GIB),
        gradients=int(grads * GIB),
        optimizer_state=int(4 * GIB),
        master_weights=int(0.5 * GIB),
        activations_kept=int(acts * GIB),
        activations_in_flight=int(flight * GIB),
        other=int(0.25 * GIB),
    )
    return {
        "kind": "sample",
        "step": step,
        "t": t,
        "phase": phase,
        "event": event,
        "block": block,
        "device": "cuda",
        "total_bytes": sum(by.values()),
        "bytes": by,
        "host_bytes": {"offload_pool": int(3 * GIB), "optimizer": int(6 * GIB)},
    }


def _memory_rows(step: int) -> list[dict[str, Any]]:
    rows = [_sample(step, 0.0, "step", "begin", None, 0, 0)]
    t = 0.001
    for b in range(N_BLOCKS):
        rows.append(_sample(step, t, "forward", "begin", b, 0.5 * b, 0))
        t += 0.010
        rows.append(_sample(step, t, "forward", "end", b, 0.5 * (b + 1), 0, flight=0.25))
    for b in reversed(range(N_BLOCKS)):
        done = N_BLOCKS - 1 - b
        rows.append(_sample(step, t, "backward", "begin", b, 0.5 * (b + 1), 2 * done / N_BLOCKS, flight=0.1))
        t += 0.020
        rows.append(_sample(step, t, "backward", "end", b, 0.5 * b, 2 * (done + 1) / N_BLOCKS))
    rows.append(_sample(step, t, "optimizer", "begin", None, 0, 2))
    t += 0.015
    rows.append(_sample(step, t, "optimizer", "end", None, 0, 2))
    rows.append(_sample(step, t + 0.001, "step", "end", None, 0, 0))
    rows.append({"kind": "step", "step": step, "seconds": t + 0.002, "peak_bytes": int(10.1 * GIB),
                 "reserved_peak_bytes": int(10.6 * GIB), "device": "cuda"})
    return rows


def _trace() -> dict[str, Any]:
    """One step of 200 ms (microseconds below): kernels on stream 7, copies each way on streams 20 and 21."""
    ev: list[dict[str, Any]] = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "elbowroom step 3",
            "pid": 1,
            "tid": 1,
            "ts": 1000.0,
            "dur": 200_000.0,
        },
    ]
    for k in range(100):  # kernels: busy 1.5 of every 2 ms
        ev.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": "sm90_xmma_gemm",
                "pid": 0,
                "tid": 7,
                "ts": 1000.0 + 2000 * k,
                "dur": 1500.0,
                "args": {"device": 0, "stream": 7},
            }
        )
    for k in range(10):  # a tiny kernel on another stream: not the compute stream
        ev.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": "copy_kernel",
                "pid": 0,
                "tid": 8,
                "ts": 1000.0 + 5000 * k,
                "dur": 10.0,
                "args": {"device": 0, "stream": 8},
            }
        )
    for k in range(20):  # 64 MiB device-to-host in forward at ~44.7 GB/s, then 64 MiB back in backward
        ev.append(
            {
                "ph": "X",
                "cat": "gpu_memcpy",
                "name": "Memcpy DtoH (Device -> Pinned)",
                "pid": 0,
                "tid": 20,
                "ts": 1000.0 + 4000 * k,
                "dur": 1500.0,
                "args": {"stream": 20, "bytes": 64 << 20},
            }
        )
        ev.append(
            {
                "ph": "X",
                "cat": "gpu_memcpy",
                "name": "Memcpy HtoD (Pinned -> Device)",
                "pid": 0,
                "tid": 21,
                "ts": 101_000.0 + 4000 * k,
                "dur": 1500.0,
                "args": {"stream": 21, "bytes": 64 << 20},
            }
        )
    ev.append(
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy HtoD (Pageable -> Device)",
            "pid": 0,
            "tid": 21,
            "ts": 500_000.0,
            "dur": 10.0,
            "args": {"stream": 21, "bytes": 4},
        }
    )  # after the step: left out
    return {"traceEvents": ev, "schemaVersion": 1}


def _frames(fn: str, line: int) -> list[dict[str, Any]]:
    return [
        {"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 10, "name": "linear"},
        {"filename": "/home/me/model.py", "line": line, "name": fn},
    ]


def _snapshot() -> dict[str, Any]:
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames("attention", 10), "stream": 0},
        {"action": "alloc", "addr": 2, "size": 300, "frames": _frames("mlp", 20), "stream": 0},
        {"action": "free_requested", "addr": 1, "size": 100, "frames": [], "stream": 0},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": [], "stream": 0},
        {"action": "alloc", "addr": 3, "size": 150, "frames": _frames("norm", 30), "stream": 0},  # peak: 450 > 400
        {"action": "free_completed", "addr": 3, "size": 150, "frames": [], "stream": 0},
    ]
    segments = [
        {
            "device": 0,
            "address": 0,
            "total_size": 4096,
            "allocated_size": 1300,
            "active_size": 1300,
            "stream": 0,
            "segment_type": "large",
            "blocks": [
                {"size": 1000, "requested_size": 1000, "state": "active_allocated", "frames": []},
                {"size": 300, "requested_size": 300, "state": "active_allocated", "frames": _frames("mlp", 20)},
                {"size": 2796, "requested_size": 0, "state": "inactive", "frames": []},
            ],
        }
    ]
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {}}


@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("cuda-run")
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {"step": s, "loss": 10.0 - s, "tokens_per_s": 40_000.0 + 100 * s, "peak_memory_bytes": int(10.1 * GIB)}
            )
            + "\n"
            for s in range(1, 9)
        )
    )
    plan = {
        "predicted_peak_bytes": int(9.5 * GIB),
        "budget_bytes": 12 * GIB,
        "predicted_step_seconds": 0.2,
        "tokens_per_step": 8192,
        "h2d_bandwidth": 55e9,
        "d2h_bandwidth": 55e9,
        "blocks": [
            {
                "index": i,
                "policy": "offload" if i < 4 else "keep",
                "kept_bytes": int(0.25 * GIB),
                "offloaded_bytes": int(0.25 * GIB) if i < 4 else 0,
                "recomputed_bytes": 0,
                "forward_s": 0.009,
                "backward_s": 0.018,
                "extra_s": 0.001 if i < 4 else 0.0,
            }
            for i in range(N_BLOCKS)
        ],
    }
    (run / "plan.json").write_text(json.dumps(plan))
    prof = run / "profile"
    prof.mkdir()
    (prof / "memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _memory_rows(2) + _memory_rows(3)))
    (prof / "trace.json").write_text(json.dumps(_trace()))
    with open(prof / "memory_snapshot.pickle", "wb") as f:
        pickle.dump(_snapshot(), f)
    assert cmd_report([str(run)]) == 0
    return run


def test_link_timeline_from_memcpy_and_kernel_events() -> None:
    events = [e for e in _trace()["traceEvents"] if e["ph"] == "X"]
    tl = link_timeline(events, bins=100)
    assert tl is not None and tl.step == 3
    assert tl.seconds == pytest.approx(0.2)
    assert tl.d2h_bytes == tl.h2d_bytes == 20 * (64 << 20)  # the pageable copy after the step is outside
    assert tl.best_copy_bytes_per_s == pytest.approx((64 << 20) / 1.5e-3)
    # the first half moves device-to-host only, the second host-to-device only
    assert max(tl.h2d_bytes_per_s[:40]) == 0 and max(tl.d2h_bytes_per_s[60:]) == 0
    assert sum(v * 0.002 for v in tl.d2h_bytes_per_s) == pytest.approx(tl.d2h_bytes)
    # compute stream 7 busy 75% (1.5 of every 2 ms); stream 8's tiny kernel is not counted
    assert sum(tl.compute_busy) / len(tl.compute_busy) == pytest.approx(0.75, abs=0.01)


def test_link_timeline_window_is_the_host_range_not_its_device_copy() -> None:
    # the profiler also writes the range on the device timeline, spanning only the kernels the marking thread
    # launched (the forward); backward copies after its end belong to the step
    events = [e for e in _trace()["traceEvents"] if e["ph"] == "X"]
    events.append({"ph": "X", "cat": "gpu_user_annotation", "name": "elbowroom step 3", "pid": 0, "tid": 7,
                   "ts": 1100.0, "dur": 90_000.0})
    tl = link_timeline(events, bins=100)
    assert tl is not None and tl.step == 3 and tl.seconds == pytest.approx(0.2)
    assert tl.d2h_bytes == tl.h2d_bytes == 20 * (64 << 20)


def test_link_timeline_is_none_without_device_events() -> None:
    assert link_timeline([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5.0}]) is None


def test_snapshot_peak_replays_the_history() -> None:
    peak = peak_allocations(_snapshot())
    assert peak is not None
    # live at the peak: the 300 (mlp) and the 150 (norm); before the history: 1300 active at the end - 300 live
    assert [a.size for a in peak.top] == [300, 150]
    assert peak.before_history_bytes == 1000
    assert peak.peak_bytes == 1450
    assert peak.top[0].frames == ("/home/me/model.py:20 mlp",)  # user code first, torch's frames dropped


def test_cuda_report_has_every_panel(cuda_run: Path) -> None:
    report = cuda_run / "report"
    for name in ("memory.png", "plan.png", "link.png", "metrics.png"):
        assert (report / name).read_bytes()[:4] == b"\x89PNG", name
    text = (report / "report.html").read_text()
    assert text.count("data:image/png;base64,") == 4
    assert 'id="allocations"' in text and "/home/me/model.py:20 mlp" in text
    assert "../profile/memory_snapshot.pickle" in text and "../profile/trace.json" in text
    assert "memory_allocated" in text


def test_cuda_report_compares_peak_and_time(cuda_run: Path) -> None:
    text = (cuda_run / "report" / "report.html").read_text()
    row = text[text.index('data-key="peak_bytes"') :].split("</tr>")[0]
    # the plan's peak includes the allocator's margin: it is compared with the reserved peak
    assert f'data-value="{int(9.5 * GIB)}"' in row and f'data-value="{int(10.6 * GIB)}"' in row


def test_comm_overlap_counts_nccl_time_under_compute_kernels() -> None:
    from elbowroom.report.trace import comm_overlap

    def k(name: str, ts: float, dur: float, stream: int) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                "args": {"stream": stream}}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "elbowroom step 5", "pid": 0, "tid": 1, "ts": 0.0,
         "dur": 1000.0},
        k("ampere_bf16_gemm", 0.0, 600.0, 7), k("ampere_bf16_gemm", 650.0, 100.0, 7),  # compute: 0-600, 650-750
        k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 500.0, 200.0, 20),  # 500-700: 150 hidden, 50 exposed
        k("ncclDevKernel_ReduceScatter_Sum_f32", 800.0, 100.0, 20),  # after compute: exposed
        k("ncclDevKernel_AllReduce_Sum_f32", 1500.0, 100.0, 20),  # outside the step
    ]
    ov = comm_overlap(events)
    assert ov is not None and ov.step == 5
    assert ov.window_s == pytest.approx(1e-3)
    assert ov.comm_s == pytest.approx(300e-6) and ov.overlapped_s == pytest.approx(150e-6)
    assert ov.compute_s == pytest.approx(700e-6) and ov.hidden == pytest.approx(0.5)
    assert comm_overlap([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5.0}]) is None



def test_report_shows_communication_of_a_data_parallel_step(tmp_path: Path, cuda_run: Path) -> None:
    # the same run with NCCL kernels at the step's end: 2 ms from 197 ms (under the gemms of 196-197.5 and
    # 198-199.5 ms: 1.5 ms hidden) and 1 ms from 199 ms (0.5 ms under the last gemm), step-relative
    import shutil

    run = tmp_path / "ddp-run"
    shutil.copytree(cuda_run, run)
    shutil.rmtree(run / "report")
    trace = _trace()
    for ts, dur in ((1000.0 + 198_000 - 1000, 2000.0), (1000.0 + 199_000, 1000.0)):
        trace["traceEvents"].append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                                     "pid": 0, "tid": 30, "ts": ts, "dur": dur, "args": {"device": 0, "stream": 30}})
    (run / "profile" / "trace.json").write_text(json.dumps(trace))
    assert cmd_report([str(run)]) == 0
    page = (run / "report" / "report.html").read_text()
    assert "Communication and compute" in page
    assert "NCCL kernels running</td><td>3.0 ms" in page
    assert "NCCL time under compute kernels</td><td>2.0 ms (67%)" in page
    # without collectives (the single-GPU run) the section is left out
    assert "Communication and compute" not in (cuda_run / "report" / "report.html").read_text()
