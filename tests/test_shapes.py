"""Running modules on fake tensors for the runner's shapes (planner.capture.shapes): the same shapes,
dtypes, strides and requires_grad as a real run, weights untouched, and the real run where fake
tensors cannot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from planner.capture.graph import record_values
from planner.capture.load import load_model_file
from planner.capture.shapes import shapes_of, shapes_or_real
from planner.capture.stage import stage_inputs, stage_module
from planner.capture.trace import trace_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, size", [("gpt", "tiny"), ("llama", "tiny"), ("shakespeare", None), ("resnet50", None)])
def test_values_from_shapes_are_the_real_ones(name: str, size: str | None) -> None:
    mf = load_model_file(ROOT / "models" / f"{name}.py", size)
    inputs, _ = mf.batch(2)
    traced = trace_model(mf.build(seed=0), inputs, methods=("fx",))
    before = {k: v.clone() for k, v in traced.gm.state_dict().items()}
    real = record_values(traced.gm, inputs)
    meta = record_values(traced.gm, inputs, shapes_only=True)
    assert meta == real and len(real) == len(traced.gm.graph.nodes)
    after = traced.gm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # batch-norm statistics did not move


def test_a_stage_on_fake_tensors_gives_the_shapes_dtypes_and_grads_of_the_real_one() -> None:
    mf = load_model_file(ROOT / "models" / "llama.py", "tiny")
    inputs, _ = mf.batch(3)
    traced = trace_model(mf.build(seed=0), inputs)
    prefix, stage = stage_module(traced, 0, 2), stage_module(traced, 2, len(traced.blocks))
    with torch.enable_grad():
        x = stage_inputs(inputs)
        hidden = shapes_of(prefix, prefix, *x)
        real_hidden = prefix(*x)
        out = shapes_of(stage, stage, real_hidden)
        real_out = stage(real_hidden)
    assert hidden.device.type == "meta" and out.device.type == "meta"
    for got, want in ((hidden, real_hidden), (out, real_out)):
        assert (got.shape, got.dtype, got.stride(), got.requires_grad) == (
            want.shape,
            want.dtype,
            want.stride(),
            want.requires_grad,
        )
    assert all(p.device.type == "cpu" for p in stage.parameters())  # the weights stayed where they were


def test_tied_weights_stay_tied_shapes_of() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids))

    model = Tied()
    out = shapes_of(model, model, torch.randint(0, 16, (2, 5)))
    assert out.shape == (2, 5, 16) and out.device.type == "meta"
    assert model.head.weight is model.embed.weight and model.head.weight.device.type == "cpu"


def test_code_that_reads_data_runs_for_real() -> None:
    class ReadsData(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * x.abs().sum().item() + torch.arange(4.0)  # .item() needs data

    model = ReadsData()
    x = torch.randn(2, 4)
    with pytest.raises(Exception):  # noqa: B017 - torch's data-dependent error, whatever its class
        shapes_of(model, model, x)
    got = shapes_or_real(model, model, x)
    assert got.device.type == "cpu" and torch.equal(got, model(x))


def test_autocast_gives_the_dtypes_training_sends() -> None:
    """The examples of a plan trained under autocast carry autocast's dtypes (bf16 receive buffers for
    bf16 activations): a meta run left them fp32, and the run received garbage."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fake = shapes_of(model, model, x)
        real = model(x)
    assert fake.dtype == real.dtype == torch.bfloat16 and fake.shape == real.shape


@pytest.mark.parametrize("limit", [0, None], ids=["fake", "real-when-cheap"])
def test_the_runner_makes_its_stage_examples_without_computing_unless_that_is_cheaper(
    limit: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PipelineStage's examples (the receive buffers' shapes) come from a fake run: a real one is a
    forward of the whole prefix at full width on the CPU, in every rank. A model as small as the tiny
    Llama runs for real (cheaper than the fake run's per-operator overhead), with the same shapes."""
    import planner.capture.shapes as shapes
    from planner.run.stages import _example_io

    if limit is not None:
        monkeypatch.setattr(shapes, "REAL_RUN_LIMIT", limit)
    mf = load_model_file(ROOT / "models" / "llama.py", "tiny")
    inputs, _ = mf.batch(2)
    traced = trace_model(mf.build(seed=0), inputs, shapes_only=True)
    stage = stage_module(traced, 3, 5)
    x, y = _example_io(traced, 3, stage, inputs, torch.device("cpu"))
    real_x = stage_module(traced, 0, 3)(*stage_inputs(inputs))
    want = "meta" if limit == 0 else "cpu"
    assert [t.device.type for t in (*x, *y)] == [want] * (len(x) + len(y))
    assert x[0].shape == real_x.shape and x[0].requires_grad and y[0].shape == stage(real_x).shape


def test_a_run_is_cheap_for_real_only_when_small_and_on_one_real_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import planner.capture.shapes as shapes

    lin = nn.Linear(10, 10)  # 110 parameters
    x = torch.zeros(3, 10)  # 30 elements: 3,300
    monkeypatch.setattr(shapes, "REAL_RUN_LIMIT", 3300)
    assert shapes.cheap_to_run(lin, (x,)) and shapes.cheap_to_run(lin, (x,), torch.device("cpu"))
    assert not shapes.cheap_to_run(lin, (torch.zeros(4, 10),))  # 4,400: over the limit
    assert not shapes.cheap_to_run(lin, (x,), torch.device("meta"))  # as if on another device: fake
    assert not shapes.cheap_to_run(lin, (x.to("meta"),))  # inputs on another device than the weights
    assert not shapes.cheap_to_run(nn.Linear(10, 10, device="meta"), (x.to("meta"),))  # nothing to compute
