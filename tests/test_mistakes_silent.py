"""What was dropped or made up without a word (issue 66, items 7, 8 and 10): every option a layout
ignores is said, an error where the user asked for it explicitly and it cannot apply, a note in the
plan's choice line where the search chose a layout it does not apply to; a ``--set`` key a Hugging
Face config does not know is refused; a run that timed no step claims no median step time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from run_factory import plan_with_starts, saved, stage_report

from cli import main
from planner.errors import ModelFileError, PlanFileError, PlannerError
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest
from planner.schema.result import RunResult, timed_steps

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
GPT = str(MODELS / "gpt.py")
LLAMA_70B = MODELS / "hf" / "configs" / "llama-3-70b"


def _invoke(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_error_line(result: Result, *parts: str) -> str:
    """The one ``error:`` line of a refused command (exit 2), holding every one of ``parts``."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def _planned(tmp_path: Path, *args: str | Path) -> tuple[Plan, str]:
    """A plan made with ``args`` (not quiet: the report the user sees) and that report."""
    out = tmp_path / "plan.json"
    result = _invoke("plan", *args, "-o", out)
    assert result.exit_code == 0, result.output
    return Plan.load(out), result.output


# ------------------------------------------------------------------------------------------------
# 7: --sequence-parallel and --fsdp-units where the layout has nothing for them to split
# ------------------------------------------------------------------------------------------------


def test_sequence_parallel_at_tp_1_is_refused(tmp_path: Path) -> None:
    # was: planned without it, exit 0, not a word
    result = _invoke(
        "plan", GPT, "--gpus", "2", "--size", "tiny", "--tp", "1", "--sequence-parallel", "--gpu-type", "cpu"
    )
    _one_error_line(result, "--sequence-parallel", "--tp is 1", "give --tp 2 or more (or auto)")
    with pytest.raises(PlannerError, match="--sequence-parallel splits along the sequence"):
        PlanRequest.build(model_file="m.py", gpus=2, tp=1, sequence_parallel=True)
    # off, or searched, it stays a valid request
    PlanRequest.build(model_file="m.py", gpus=2, tp=1, sequence_parallel=False)
    PlanRequest.build(model_file="m.py", gpus=2, tp=1)


@pytest.mark.parametrize(
    ("model", "gpu_type", "said"),
    [
        (GPT, "cpu", "sequence parallelism: none, --tp auto keeps tp 1 on a plan measured here or for --gpu-type cpu"),
        (str(MODELS / "llama.py"), "h100", "sequence parallelism: none, the chosen layout has tp 1"),
        (
            str(MODELS / "toy.py"),
            "h100",
            "tensor parallelism: none, the model declares no tp_plan (nor a Hugging Face base_model_tp_plan); "
            "sequence parallelism: none, it needs tensor parallelism",
        ),
    ],
    ids=["tp auto keeps 1", "the search chose tp 1", "no tp plan"],
)
def test_sequence_parallel_a_tp_auto_plan_leaves_out_is_said(
    tmp_path: Path, model: str, gpu_type: str, said: str
) -> None:
    size = [] if model.endswith("toy.py") else ["--size", "tiny"]
    plan, output = _planned(tmp_path, model, *size, "--gpus", "2", "--sequence-parallel", "--gpu-type", gpu_type)
    assert plan.tp == 1 and not plan.sequence_parallel
    assert said in plan.choice
    chosen = [line for line in output.splitlines() if line.startswith("chosen: ")]
    assert len(chosen) == 1 and said in chosen[0]  # in the report the user reads, not only in plan.json


def test_fsdp_units_with_one_replica_are_refused(tmp_path: Path) -> None:
    # was: planned as one DDP replica, exit 0, while --dp-mode ddp with them is refused
    for units in ("block", "stage"):
        result = _invoke(
            "plan", GPT, "--gpus", "2", "--size", "tiny", "--dp", "1", "--fsdp-units", units, "--gpu-type", "cpu"
        )
        _one_error_line(result, f"--fsdp-units {units}", "--dp is 1", "give --dp 2 or more (or auto)")
    with pytest.raises(PlannerError, match="--fsdp-units block shards with FSDP over replicas, but --dp is 1"):
        PlanRequest.build(model_file="m.py", gpus=2, fsdp_units="block")  # --dp defaults to 1
    # with ddp and --dp 1 together, the ddp message as before
    with pytest.raises(PlannerError, match="but --dp-mode is ddp"):
        PlanRequest.build(model_file="m.py", gpus=2, dp=1, dp_mode="ddp", fsdp_units="block")


@pytest.mark.parametrize(
    ("gpus", "said"),
    [
        ("1", "--fsdp-units block: not used, the chosen layout has one replica (dp 1), so nothing is sharded"),
        ("2", "--fsdp-units block: not used, the chosen layout has 2 DDP replicas (--dp-mode auto takes DDP"),
    ],
    ids=["one replica", "ddp replicas"],
)
def test_fsdp_units_a_searched_layout_leaves_out_are_said(tmp_path: Path, gpus: str, said: str) -> None:
    # --dp auto: the search chose one replica, or DDP replicas (--dp-mode auto, DDP fits): nothing sharded
    plan, output = _planned(
        tmp_path, GPT, "--size", "tiny", "--gpus", gpus, "--dp", "auto", "--fsdp-units", "block", "--gpu-type", "cpu"
    )
    assert not plan.sharded and plan.dp == int(gpus)
    assert said in plan.choice and said in output


@pytest.mark.parametrize("mode", ["fsdp", "hsdp"])
def test_a_sharding_dp_mode_with_one_replica_is_refused(mode: str) -> None:
    # was: planned as one DDP replica, exit 0, not a word (as --fsdp-units was)
    result = _invoke("plan", GPT, "--gpus", "2", "--size", "tiny", "--dp", "1", "--dp-mode", mode, "--gpu-type", "cpu")
    _one_error_line(result, f"--dp-mode {mode} shards over replicas, but --dp is 1", "give --dp 2 or more (or auto)")
    with pytest.raises(PlannerError, match=f"--dp-mode {mode} shards over replicas, but --dp is 1"):
        PlanRequest.build(model_file="m.py", gpus=2, dp_mode=mode)  # --dp defaults to 1
    PlanRequest.build(model_file="m.py", gpus=2, dp=2, dp_mode="fsdp")  # with replicas it stays a valid request
    PlanRequest.build(model_file="m.py", gpus=2, dp="auto", dp_mode=mode)


@pytest.mark.parametrize("mode", ["fsdp", "hsdp"])
def test_a_sharding_dp_mode_a_searched_layout_of_one_replica_leaves_out_is_said(tmp_path: Path, mode: str) -> None:
    # --dp auto on one GPU can only choose one replica: the mode shards nothing, and the choice line says so
    plan, output = _planned(
        tmp_path, GPT, "--size", "tiny", "--gpus", "1", "--dp", "auto", "--dp-mode", mode, "--gpu-type", "cpu"
    )
    said = f"--dp-mode {mode}: not used, the chosen layout has one replica (dp 1), so nothing is sharded"
    assert plan.dp == 1 and plan.dp_mode == "ddp"
    assert said in plan.choice and said in output


# ------------------------------------------------------------------------------------------------
# 8: a --set key a Hugging Face config does not know
# ------------------------------------------------------------------------------------------------


def test_set_hf_config_cannot_swap_the_config_planned(tmp_path: Path) -> None:
    # was: --set hf_config=OTHER planned OTHER while the plan recorded the file given
    other = tmp_path / "other.json"
    other.write_text((LLAMA_70B / "config.json").read_text())
    result = _invoke("plan", LLAMA_70B, "--gpus", "2", "--set", f"hf_config={other}", "--gpu-type", "h100")
    _one_error_line(result, "--set hf_config: that key is the path of the config the planner reads")


def test_a_set_key_a_hugging_face_config_does_not_know_is_refused(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from planner.capture.load import load_model_file

    # was: accepted, recorded in the plan, the model unchanged
    result = _invoke("plan", LLAMA_70B, "--gpus", "2", "--gpu-type", "cpu", "--set", "hidden_sise=128")
    _one_error_line(result, "--set hidden_sise:", "LlamaConfig", "no field 'hidden_sise'", "did you mean hidden_size")
    with pytest.raises(ModelFileError, match="no field 'n_layers'") as e:
        load_model_file(LLAMA_70B, overrides={"n_layers": 2})  # the model file's name, not the config's
    assert "num_hidden_layers" in str(e.value)
    with pytest.raises(ModelFileError) as e:
        load_model_file(LLAMA_70B, overrides={"a\nb": 1})
    assert "\n" not in str(e.value)  # one line, whatever the key holds
    # what the config knows still goes through: its fields, seq_len (ours), a settable property
    mf = load_model_file(LLAMA_70B, overrides={"num_hidden_layers": 1, "seq_len": 16, "num_labels": 3})
    assert mf.config["num_hidden_layers"] == 1
    # and a class's aliases (GPT-2's hidden_size is n_embd); its misspelt own name suggests it
    gpt2 = tmp_path / "config.json"
    transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, vocab_size=64, architectures=["GPT2LMHeadModel"]
    ).to_json_file(str(gpt2))
    assert load_model_file(gpt2, overrides={"hidden_size": 64}).config["hidden_size"] == 64
    with pytest.raises(ModelFileError, match="did you mean n_embd"):
        load_model_file(gpt2, overrides={"n_embed": 64})


# ------------------------------------------------------------------------------------------------
# 10: a run of 1 or 2 steps timed none of them
# ------------------------------------------------------------------------------------------------


def test_untimed_steps_give_no_median() -> None:
    from planner.run.loop import RankResult, run_result

    # was: step 1 (set-up) counted when nothing else remained, so 1- and 2-step runs had a "median"
    assert timed_steps(1, None) == [] and timed_steps(2, 2) == []
    assert timed_steps(3, 3) == [2] and timed_steps(5, 5) == [2, 3, 4]
    plan = plan_with_starts(MODELS / "gpt.py", [0, 3])
    for times, memory_step in (((0.5,), None), ((0.5, 2.0), 2)):
        ranks = [
            RankResult(
                rank=r,
                losses=(1.0,) * len(times),
                grad_norms=(1.0,) * len(times),
                times=times,
                threads=1,
                peak_rss_bytes=1,
                memory_step=memory_step,
                measures=(stage_report(r, fwd_s=0.0, bwd_s=0.0, step_s=0.0),),
            )
            for r in (0, 1)
        ]
        run = run_result(plan, ranks, mode="pipeline")
        assert run.timed_steps == [] and run.median_step_s is None
        assert run.samples_per_s is None and run.tokens_per_s is None
        assert RunResult.model_validate_json(run.to_json()) == run
    # a run.json with a median, as every earlier run wrote, still reads
    old = json.loads(run.to_json())
    old.update(median_step_s=0.5, timed_steps=[1])
    assert RunResult.model_validate(old).median_step_s == 0.5


@pytest.mark.multiprocess
def test_a_run_of_two_steps_says_it_timed_none(tmp_path: Path) -> None:
    from planner.core.step.calibrate import calibrate

    plan = plan_with_starts(MODELS / "gpt.py", [0, 3])
    path = saved(plan, tmp_path)
    result = _invoke("run", path, "--steps", "2", "--no-checkpoint")
    assert result.exit_code == 0, result.output
    # was: "median step 183.3 ms measured vs ..." and a throughput, both from the set-up step
    assert "no timed step: run --steps 3 or more to measure the step time" in result.output
    assert "median step" not in result.output and "throughput" not in result.output
    run = RunResult.load(tmp_path / "plan.run.json")
    assert run.timed_steps == [] and run.median_step_s is None and run.samples_per_s is None
    # the report compares what was measured (memory, tracked at step 2) and shows no time
    report = _invoke("report", path, "--measured", tmp_path / "plan.run.json")
    assert report.exit_code == 0, report.output
    step = next(line for line in report.output.splitlines() if line.startswith("step "))
    assert step.split()[2:] == ["-", "-"], step
    assert report.output.splitlines()[-1] == (
        "note: the run timed no step (--steps 3 or more times some); its columns show what it measured before, "
        "'-' where nothing"
    )
    with pytest.raises(PlanFileError, match="the run timed no step.*--steps 3 or more"):
        calibrate(plan, run)
    # one that stopped: more steps would not have helped, and the report says why it has no time
    failed = run.model_copy(update={"status": "failed", "stopped": "rank 0 failed: step 2: the loss is nan"})
    with pytest.raises(PlanFileError, match=r"the run failed before it timed a step \(rank 0 failed: step 2: the loss"):
        calibrate(plan, failed)
    (tmp_path / "failed.run.json").write_text(failed.model_dump_json())
    report = _invoke("report", path, "--measured", tmp_path / "failed.run.json")
    assert report.exit_code == 0 and report.output.splitlines()[-1].startswith(
        "note: the run failed: rank 0 failed: step 2: the loss is nan; its columns"
    )
    # resumed at step 3 (the checkpoint of step 2) for two more steps: those two are set-up and tracked too
    result = _invoke("run", path, "--steps", "2")
    resumed = _invoke("run", path, "--steps", "4", "--resume", "--no-checkpoint")
    assert result.exit_code == 0 and resumed.exit_code == 0, resumed.output
    assert "no timed step: run --steps 5 or more to measure the step time (step 3 sets" in resumed.output
