"""The tutorials' speed levers in the cost model: ``--dtype bf16|fp16`` (autocast) and ``--compile``.

Bytes under autocast are checked exactly against hand computation on a Linear stack; plans record
the levers, old plans without them load, and bad combinations are one-line errors. Compiling costs
seconds per distinct block (tens of seconds with a cold inductor cache), so only one test compiles,
a model of small Linear layers; the fallback to eager is tested with a compile that fails at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from cli import main
from planner.api import make_plan
from planner.capture.load import load_model_file
from planner.capture.trace import trace_model
from planner.core.step.calibrate import check_levers
from planner.costs import measure, measure_modules
from planner.costs.levers import check_autocast, tensor_bytes
from planner.costs.measure import profile_model
from planner.costs.settings import ProfileSettings, Sample
from planner.errors import PlanFileError, PlannerError
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
DELAY = ROOT / "tests" / "fixtures" / "delay.py"  # blocks with data-dependent control flow: a module trace
FAST = {"repeats": 1, "warmup": 0, "progress": False}

# A Linear stack as a model file: four identical 16 -> 16 layers, so blocks 1 and 2 are the same
# computation on the same shapes (block 0 takes the data, block 3 the loss).
MLP = """
import torch
from torch import nn

def build_model(**config):
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])

def make_batch(batch_size, **config):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 16, generator=g),), torch.randn(batch_size, 16, generator=g)

def loss_fn(output, target):
    return ((output.float() - target) ** 2).mean()
"""


def _stack(b: int, d: int, h: int, o: int) -> tuple[Any, tuple[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, o))
    x = torch.randn(b, d)
    return trace_model(model, (x,)), (x,), torch.zeros(b, o)


def _mean_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.float().mean()  # saves nothing for backward: the bytes are the blocks' own


# --- autocast: exact bytes --------------------------------------------------------------------


def test_autocast_bytes_of_a_linear_stack_by_hand() -> None:
    b, d, h, o = 4, 8, 32, 8
    traced, inputs, target = _stack(b, d, h, o)
    assert [blk.name for blk in traced.blocks] == ["0", "1", "2"]
    fp32 = profile_model(traced, Sample(inputs, target, _mean_loss), ProfileSettings(**FAST)).costs
    bf16 = profile_model(traced, Sample(inputs, target, _mean_loss), ProfileSettings(autocast="bf16", **FAST)).costs
    # fp32: Linear 0 saves its input for the weight gradient (the data needs no gradient, so not
    # the weight for an input gradient); ReLU saves its output; Linear 2 its input (for W's
    # gradient) and its weight (for the input's), but the weight is a parameter, counted elsewhere.
    assert [c.activation_bytes for c in fp32] == [b * d * 4, b * h * 4, b * h * 4]
    # bf16 autocast: the same tensors in 2 bytes, and autocast's bf16 copy of Linear 2's weight (not a
    # parameter: a cast, saved for the input gradient), also told apart (a stage may share it). Linear
    # 0's weight copy is not saved: its input needs no gradient.
    assert [c.activation_bytes for c in bf16] == [b * d * 2, b * h * 2, b * h * 2 + h * o * 2]
    assert [c.weight_cast_bytes for c in bf16] == [0, 0, h * o * 2]
    assert [c.weight_cast_bytes for c in fp32] == [0, 0, 0]
    # what crosses each cut: bf16 out of the Linear and out of the ReLU
    assert [c.cut_bytes for c in fp32[:-1]] == [b * h * 4, b * h * 4]
    assert [c.cut_bytes for c in bf16[:-1]] == [b * h * 2, b * h * 2]
    assert bf16[-1].output_bytes == b * o * 2  # the logits the last stage keeps: bf16
    # parameters stay fp32 (autocast's master weights)
    assert [c.param_bytes for c in bf16] == [c.param_bytes for c in fp32] == [(d * h + h) * 4, 0, (h * o + o) * 4]


def test_autocast_on_a_module_boundary_trace_measures_the_bytes_it_makes() -> None:
    mf = load_model_file(DELAY, "tiny", {"modules": True, "d": 16, "fwd_ms": [1] * 3, "bwd_ms": [1] * 3})
    model = mf.build()
    inputs, target = mf.batch(4)
    traced = trace_model(model, inputs)
    assert traced.method == "modules"
    costs = profile_model(traced, Sample(inputs, target, mf.loss_fn), ProfileSettings(autocast="bf16", **FAST)).costs
    # x * w is not an autocast op: it stays fp32, and so does everything it saves and sends
    assert [c.activation_bytes for c in costs] == [4 * 16 * 4] * 3
    assert [c.weight_cast_bytes for c in costs] == [0] * 3  # nothing cast
    assert [c.cut_bytes for c in costs] == [4 * 16 * 4, 4 * 16 * 4, 0]
    assert costs[-1].output_bytes == 4 * 16 * 4


def test_tensor_bytes_counts_each_tensor_once_in_its_dtype() -> None:
    x = torch.zeros(3, 4, dtype=torch.bfloat16)
    assert tensor_bytes((x, {"y": torch.zeros(2)}, None, 7)) == 3 * 4 * 2 + 2 * 4
    assert tensor_bytes((x, x)) == 3 * 4 * 2


@pytest.mark.slow
def test_a_bf16_plan_records_autocast_and_saves_fewer_bytes(tmp_path: Path) -> None:
    def plan(dtype: str | None) -> Plan:
        request = PlanRequest.build(
            model_file=MODELS / "gpt.py",
            gpus=2,
            size="tiny",
            batch_size=8,
            microbatches=2,
            schedule="1f1b",
            dtype=dtype,
            output=tmp_path / f"{dtype}.json",
            **FAST,
        )
        return make_plan(request)

    fp32, bf16 = plan(None), plan("bf16")
    assert (fp32.profile.autocast, bf16.profile.autocast) == (None, "bf16")
    assert bf16.profile.dtype == "fp32" and bf16.profile.source == "measured"  # parameters stay fp32
    assert [b.param_bytes for b in bf16.blocks] == [b.param_bytes for b in fp32.blocks]
    layers = [(a, b) for a, b in zip(fp32.blocks, bf16.blocks) if a.is_layer]
    assert layers and all(b.activation_bytes < a.activation_bytes for a, b in layers)
    # summed over the stages, as the splits may differ (the two plans are timed apart)
    assert sum(s.activation_bytes for s in bf16.stages) < sum(s.activation_bytes for s in fp32.stages)
    assert not bf16.compile and bf16.profile.compile_s is None
    bf16.save(tmp_path / "bf16.json")
    assert Plan.load(tmp_path / "bf16.json") == bf16


def test_fp16_autocast_runs_on_this_cpu_and_meta_has_none() -> None:
    check_autocast(torch.device("cpu"), "bf16")
    check_autocast(torch.device("cpu"), "fp16")  # torch 2.13's CPU autocast has fp16 too
    with pytest.raises(PlannerError, match="no autocast for meta") as e:
        check_autocast(torch.device("meta"), "bf16")
    assert "\n" not in str(e.value)


# --- compile ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_compile_profiles_once_per_distinct_block_and_the_plan_records_it(tmp_path: Path) -> None:
    model_file = tmp_path / "mlp.py"
    model_file.write_text(MLP)
    mf = load_model_file(model_file, None, {})
    inputs, target = mf.batch(4)
    traced = trace_model(mf.build(), inputs)
    profile = profile_model(traced, Sample(inputs, target, mf.loss_fn), ProfileSettings(compile=True, **FAST))
    assert profile.compile_failures == [] and profile.compile_s > 0
    assert profile.shared == 1  # block 2 took block 1's measurement
    assert profile.costs[1].fwd_s == profile.costs[2].fwd_s
    assert all(c.fwd_s > 0 and c.bwd_s > 0 for c in profile.costs)

    out = tmp_path / "plan.json"
    args = ["plan", str(model_file), "--gpus", "2", "-b", "8", "-m", "2", "--schedule", "1f1b", "--repeats", "1"]
    result = CliRunner().invoke(main, [*args, "--warmup", "0", "--compile", "--dtype", "bf16", "-o", str(out)])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.endswith("per rank, autocast bf16, compiled"), first
    assert "compiling the blocks took" in result.output
    plan = Plan.load(out)
    assert plan.compile and plan.profile.autocast == "bf16" and plan.profile.compile_failures == []
    assert plan.profile.compile_s is not None


def test_a_block_compile_fails_on_is_profiled_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("inductor says no\nsecond line")

        return call

    monkeypatch.setattr(measure, "compile_module", broken)
    traced, inputs, target = _stack(4, 8, 16, 8)
    profile = profile_model(traced, Sample(inputs, target, _mean_loss), ProfileSettings(compile=True, **FAST))
    assert profile.compile_failures == [(name, "RuntimeError: inductor says no") for name in ("0", "1", "2")]
    assert all(c.fwd_s > 0 for c in profile.costs) and profile.compile_s == 0.0


def test_a_module_trace_block_compile_fails_on_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    mf = load_model_file(DELAY, "tiny", {"modules": True, "d": 16, "fwd_ms": [1] * 3, "bwd_ms": [1] * 3})
    model = mf.build()
    inputs, target = mf.batch(4)
    traced = trace_model(model, inputs)

    def second_breaks(fn: Any) -> Any:  # layers.1's forward fails; the others run as they are
        if fn.__self__ is traced.model.get_submodule("layers.1"):

            def call(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("cannot compile this")

            return call
        return fn

    monkeypatch.setattr(measure_modules, "compile_module", second_breaks)
    profile = profile_model(traced, Sample(inputs, target, mf.loss_fn), ProfileSettings(compile=True, **FAST))
    assert profile.compile_failures == [("layers.1", "RuntimeError: cannot compile this")]
    assert all(c.fwd_s > 0 for c in profile.costs)
    assert not any("forward" in vars(m) for m in traced.model.modules())  # their own forwards are back


@pytest.mark.slow
def test_compile_with_an_estimate_fuses_element_wise_operators_and_recomputes_their_outputs(tmp_path: Path) -> None:
    base = ["plan", str(MODELS / "gpt.py"), "--gpus", "2", "--size", "tiny", "-b", "8", "--gpu-type", "h100"]
    args = [*base, "-m", "2", "--schedule", "1f1b"]  # the same layout: per-microbatch costs compare
    plain = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "a.json"), "-q"])
    compiled = CliRunner().invoke(main, [*args, "--compile", "-o", str(tmp_path / "b.json")])
    assert plain.exit_code == 0 and compiled.exit_code == 0, compiled.output
    assert "--compile estimated, not measured: element-wise operators fused" in compiled.output
    assert compiled.output.splitlines()[0].endswith(", compiled")
    a, b = Plan.load(tmp_path / "a.json"), Plan.load(tmp_path / "b.json")
    assert b.compile and not a.compile and b.profile.autocast is None
    assert b.prediction.step_time_s < a.prediction.step_time_s  # fused norms, activations, residual adds
    # the partitioner's saves: never more than the eager block's
    assert all(x.activation_bytes <= y.activation_bytes for x, y in zip(b.blocks, a.blocks))
    assert sum(x.activation_bytes for x in b.blocks) < sum(x.activation_bytes for x in a.blocks)


# --- plan files and requests ------------------------------------------------------------------


def test_plans_written_before_the_levers_load_with_their_defaults(tmp_path: Path) -> None:
    request = PlanRequest.build(model_file=MODELS / "toy.py", gpus=2, batch_size=8, output=tmp_path / "p.json", **FAST)
    raw = json.loads(make_plan(request).to_json())
    assert raw["compile"] is False and raw["profile"]["autocast"] is None
    del raw["compile"]
    for key in ("autocast", "compile_failures", "compile_s"):
        del raw["profile"][key]
    old = Plan.from_json(json.dumps(raw))
    assert not old.compile and old.profile.autocast is None
    assert old.profile.compile_failures == [] and old.profile.compile_s is None


@pytest.mark.parametrize(
    "dtype, gpu_type, autocast",
    [(None, None, None), ("fp32", None, None), ("bf16", None, "bf16"), ("fp16", None, "fp16"), ("bf16", "h100", None)],
)
def test_the_request_autocasts_measured_costs_only(
    dtype: str | None, gpu_type: str | None, autocast: str | None
) -> None:
    request = PlanRequest.build(model_file=MODELS / "toy.py", gpus=2, dtype=dtype, gpu_type=gpu_type)
    assert request.autocast == autocast
    assert PlanRequest.build(model_file=MODELS / "toy.py", gpus=2, compile=True).compile


def test_a_calibration_under_other_levers_is_refused_in_one_line(tmp_path: Path) -> None:
    request = PlanRequest.build(model_file=MODELS / "toy.py", gpus=2, batch_size=8, output=tmp_path / "p.json", **FAST)
    run_plan = make_plan(request)
    check_levers(run_plan, request)  # the same levers: fine
    for asked in (request.model_copy(update={"dtype": "bf16"}), request.model_copy(update={"compile": True})):
        with pytest.raises(PlanFileError, match="--calibrate: the run trained a plan made fp32, eager") as e:
            check_levers(run_plan, asked)
        assert "\n" not in str(e.value)
