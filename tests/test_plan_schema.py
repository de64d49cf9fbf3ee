"""Tier 1 (pure): plan.json round-trips, and bad plans give one clear error each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_factory import big_head_blocks, plan_of_blocks

from planner.errors import PlanFileError
from planner.schema.plan import PLAN_VERSION, Plan

ROOT = Path(__file__).resolve().parents[1]


def test_round_trip_text_and_file(tmp_path: Path) -> None:
    plan = plan_of_blocks(big_head_blocks())
    assert Plan.from_json(plan.to_json()) == plan
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    assert not (tmp_path / "plan.json.tmp").exists()


def test_plan_records_what_the_issue_asks_for() -> None:
    plan = plan_of_blocks(big_head_blocks())
    raw = json.loads(plan.to_json())
    assert raw["version"] == PLAN_VERSION
    assert raw["model"]["fingerprint"] and raw["model"]["config"] == {"n_layers": 4}
    assert raw["profile"]["device"] == "cpu" and raw["profile"]["backend"] == "gloo"
    assert [s["split_node"] for s in raw["stages"]] == ["layers.2_last", None]
    assert [(s["first_block"], s["last_block"]) for s in raw["stages"]] == [
        ("embed", "layers.2"),
        ("layers.3", "output"),
    ]
    assert set(raw["baselines"]) == {"uniform", "params"}
    assert raw["prediction"]["step_time_s"] == pytest.approx(0.522)


def test_not_json(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text("{not json")
    with pytest.raises(PlanFileError, match="is not JSON"):
        Plan.load(tmp_path / "p.json")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PlanFileError, match="cannot read plan .*planner plan"):
        Plan.load(tmp_path / "nope.json")


def test_other_version() -> None:
    raw = json.loads(plan_of_blocks(big_head_blocks()).to_json())
    raw["version"] = 99
    with pytest.raises(PlanFileError, match="version 99.*reads version 1"):
        Plan.from_json(json.dumps(raw))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.pop("stages"), "stages: Field required"),
        (lambda r: r.update(n_microbatches=3), "not divisible"),
        (lambda r: r["stages"][1].update(start=5), "contiguous"),
        (lambda r: r.update(schedule="zigzag"), "schedule"),
        (lambda r: r.update(extra_field=1), "extra_field"),
        (lambda r: r["model"].update(seed=-1), "seed: Input should be greater than or equal to 0"),
        (lambda r: r["stages"][0].update(first_block="layers.9"), "block names"),
        (  # four blocks, each its own checkpoint region: at most full:4
            lambda r: r["stages"][0].update(recompute="full:99"),
            r"recompute 'full:99' names 99 checkpoint regions, but the stage has 4 \(embed to layers.2\); give full:K",
        ),
    ],
)
def test_invalid_plans(edit, message: str) -> None:  # type: ignore[no-untyped-def]
    raw = json.loads(plan_of_blocks(big_head_blocks()).to_json())
    edit(raw)
    with pytest.raises(PlanFileError, match=message):
        Plan.from_json(json.dumps(raw))


def test_a_partial_recompute_up_to_the_stages_regions_loads() -> None:
    raw = json.loads(plan_of_blocks(big_head_blocks()).to_json())
    for value in ("full:4", "selective:1"):
        raw["stages"][0]["recompute"] = value
        assert Plan.from_json(json.dumps(raw)).stages[0].recompute == value


def test_plans_written_before_stages_could_share_a_rank_still_load() -> None:
    plan = plan_of_blocks(big_head_blocks())
    raw = json.loads(plan.to_json())
    for key in ("n_ranks", "memory_limit_bytes", "search", "choice"):
        del raw[key]
    for stage in raw["stages"]:
        del stage["rank"], stage["bwd_input_s"], stage["bwd_weight_s"]
    old = Plan.from_json(json.dumps(raw))
    assert old.n_ranks == old.n_stages == 2 and [s.rank for s in old.stages] == [0, 1]
    assert old.stages_per_rank == 1 and old.search == [] and old.memory_limit_bytes is None


def test_stage_placement_is_checked() -> None:
    raw = json.loads(plan_of_blocks(big_head_blocks()).to_json())
    raw["stages"][1]["rank"] = 0  # both stages on rank 0 of 2: rank 1 would have nothing to run
    with pytest.raises(PlanFileError, match="every one of the 2 ranks must run 1 stage\\(s\\)"):
        Plan.from_json(json.dumps(raw))
    raw["n_ranks"] = 3
    with pytest.raises(PlanFileError, match="do not spread evenly over 3 ranks"):
        Plan.from_json(json.dumps(raw))


@pytest.mark.parametrize(
    "profile, expected",
    [
        ({}, None),  # measured in fp32
        ({"autocast": "bf16"}, "bf16"),  # measured under autocast
        ({"source": "estimated", "hardware": "h100", "dtype": "bf16"}, "bf16"),  # a plan made for GPUs
        ({"source": "estimated", "hardware": "h100", "dtype": "fp16"}, "fp16"),
        ({"source": "estimated", "hardware": "cpu", "dtype": "fp32"}, None),
        ({"source": "estimated", "hardware": "a100", "dtype": "tf32"}, None),  # fp32 storage: no autocast
    ],
)
def test_the_run_computes_in_the_dtype_the_costs_are_for(profile: dict, expected: str | None) -> None:
    plan = plan_of_blocks(big_head_blocks())
    got = plan.model_copy(update={"profile": plan.profile.model_copy(update=profile)})
    assert got.profile.run_autocast == expected
