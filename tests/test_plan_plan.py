"""The Plan as data: TOML and JSON round trips, validation with fix-it messages, hand edits, the table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import tomllib
from test_plan_support import GiB, make_profile

from elbowroom.activations import BlockPolicy
from elbowroom.plan import Plan, plan_for
from elbowroom.plan.plan import BlockPlan


@pytest.fixture(scope="module")
def plan() -> Plan:
    p = make_profile(n_layers=8)
    return plan_for(p, 16 * GiB, precision="bf16", fused_loss_allowed=True)


def test_round_trips_toml_and_json_exactly(plan: Plan, tmp_path: Path) -> None:
    assert Plan.from_toml(plan.to_toml()) == plan
    assert Plan.from_json(plan.to_json()) == plan
    for name in ("p.toml", "p.json"):
        path = plan.save(tmp_path / name)
        assert Plan.load(path) == plan
    # floats survive bit for bit
    again = Plan.load(tmp_path / "p.toml")
    assert again.predicted_step_seconds.hex() == plan.predicted_step_seconds.hex()
    assert [b.seconds.hex() for b in again.blocks] == [b.seconds.hex() for b in plan.blocks]


def test_toml_has_no_null_and_one_table_per_block(plan: Plan) -> None:
    text = plan.to_toml()
    data = tomllib.loads(text)
    assert len(data["blocks"]) == len(plan.blocks) and text.count("[[blocks]]") == len(plan.blocks)
    assert "null" not in text and "None" not in text
    assert json.loads(plan.to_json())["budget_bytes"] == plan.budget_bytes


def test_block_policies(plan: Plan) -> None:
    pol = plan.to_block_policies()
    assert len(pol) == len(plan.blocks) and all(isinstance(p, BlockPolicy) for p in pol)
    for p, b in zip(pol, plan.blocks):
        assert (p.checkpoint, p.offload_ratio, p.offload_input) == (b.checkpoint, b.offload_ratio, b.offload_input)


def test_table_shows_every_block_and_the_predictions(plan: Plan) -> None:
    text = str(plan)
    assert text == plan.table()
    assert "predicted peak" in text and "tokens/s" in text
    assert "weights:" in text and "optimizer on the host:" in text
    rows = [line for line in text.splitlines() if line[:5].strip().isdigit()]
    assert len(rows) == len(plan.blocks)


def _edit(plan: Plan, path: Path, old: str, new: str) -> Path:
    text = plan.to_toml()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize(
    "old, new, match",
    [
        ('checkpoint = "', 'checkpoint = "ful', r"blocks\[0\]\.checkpoint must be one of none, selective, full"),
        ("micro_batch = ", "micro_batch = -", "micro_batch must be a positive int"),
        ("fused_loss = ", "fuse_loss = ", "unknown key.*fuse_loss.*known:"),
        ("index = 1\n", "index = 5\n", r"blocks\[1\] has index 5; rows must be numbered"),
        ('weight_dtype = "', 'weight_dtype = "half', "weight_dtype must be one of float32, bfloat16"),
        ("budget_bytes = ", "budget_bytes = 1.5 #", "budget_bytes must be an integer"),
        ("offload_ratio = ", "offload_ratio = 2 #", r"offload_ratio must be in \[0, 1\]"),
        ("version = 1", "version = 7", "format version 7"),
    ],
)
def test_load_validates_with_fix_it_messages(plan: Plan, tmp_path: Path, old: str, new: str, match: str) -> None:
    path = _edit(plan, tmp_path / "bad.toml", old, new)
    with pytest.raises((ValueError, TypeError), match=match) as e:
        Plan.load(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("cut.json", b'{"version": 1', r"cut\.json: Expecting .* line 1 column"),
        ("cut.toml", b"version = ", r"cut\.toml: Invalid value"),
        ("bin.json", b"\xff\xfe\x00\x81", r"bin\.json: not a text file"),
    ],
)
def test_corrupt_plan_files_name_the_file_and_the_fault(tmp_path: Path, name: str, content: bytes, match: str) -> None:
    # a truncated or binary file is a ValueError with the file and the parser's place in it, not a rebuilt
    # JSONDecodeError's TypeError
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=match):
        Plan.load(tmp_path / name)


def test_missing_keys_and_wrong_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing key"):
        Plan.from_dict({"blocks": [{"index": 0}]})
    with pytest.raises(ValueError, match=r"end in \.toml or \.json"):
        Plan.load(tmp_path / "plan.yaml")


def test_hand_edit_applies_and_repredicts(plan: Plan, tmp_path: Path) -> None:
    p = make_profile(n_layers=8)
    rows = list(plan.blocks)
    rows[-1] = dataclasses.replace(rows[-1], checkpoint="full", offload_ratio=0.0, offload_input=False)
    edited = dataclasses.replace(plan, blocks=tuple(rows))
    edited.save(tmp_path / "e.toml")
    loaded = Plan.load(tmp_path / "e.toml")
    assert loaded.blocks[-1].checkpoint == "full"
    fresh = loaded.repredicted(p)
    assert fresh.blocks[-1].kept_bytes == p.blocks[-1].input_bytes
    assert fresh.predicted_step_seconds > 0 and fresh.budget_bytes == plan.budget_bytes


def test_block_rows_validate() -> None:
    with pytest.raises(ValueError, match="offload_input needs checkpoint"):
        BlockPlan(index=0, offload_input=True)
    with pytest.raises(ValueError, match="at least one block"):
        Plan(blocks=(), budget_bytes=1, predicted_peak_bytes=0, predicted_step_seconds=0.0, predicted_tokens_per_s=0.0)


def test_importing_the_planner_is_cheap() -> None:
    # no CUDA initialisation and none of the mechanisms' engines until a plan is applied
    import subprocess
    import sys

    code = (
        "import sys, torch, elbowroom.plan as p\n"
        "assert p.Plan and p.fit and p.apply and p.plan_for and p.parse_budget and p.BudgetError\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert 'elbowroom.optim.offload' not in sys.modules and 'elbowroom.activations.offload' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


def test_the_table_says_autocast_only_where_the_step_computes_below_fp32() -> None:
    # a CPU profile of an fp32 model computes in fp32: its plan's table said "fp32 weights under autocast"
    for compute, says in (("bfloat16", "weights: fp32 weights under autocast"),
                          ("float32", "weights: fp32 weights, computed in fp32")):
        plan = plan_for(make_profile(n_layers=4, compute_dtype=compute), 80 * GiB)
        assert plan.weight_dtype == "float32" and says in plan.table()
