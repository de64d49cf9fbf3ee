"""A plan trained by the user's own script through the library API (``planner.pipeline``): the
example script under torchrun, a tied model and replicas, equals unsplit training; the mistakes
a script can make are one clear error."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

import planner
from planner.errors import ModelFileError, PlannerError
from tests.run_factory import REL, ROOT, plan_with_starts

EXAMPLE = ROOT / "examples" / "train_with_plan.py"
STEPS, LR, SEED = 4, 3e-3, 0


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_with_plan", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _unsplit(plan: planner.Plan, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The example's training without a pipeline: the whole batch, one model, one optimizer."""
    ex = _example()
    torch.manual_seed(SEED)
    model = ex.build_model(**plan.model.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = ex.batches(plan.batch_size, seed=SEED)
    losses = []
    for _ in range(steps):
        tokens, target = next(data)
        loss = ex.loss_fn(model(tokens), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _torchrun(tmp_path: Path, plan: planner.Plan, *args: str) -> list[float]:
    """The example script under plain torchrun with the plan's number of processes; its losses."""
    plan_file, out = tmp_path / "plan.json", tmp_path / "losses.json"
    plan.save(plan_file)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={plan.world_size}"]
    cmd += [str(EXAMPLE), str(plan_file), "--steps", str(STEPS), "--lr", str(LR), "--losses", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1: loss" in proc.stdout  # the script's own log line, from the rank computing the loss
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_tied_model_trains_as_unsplit_under_torchrun(tmp_path: Path) -> None:
    # four stages over two ranks (interleaved): the embedding (stage 0, rank 0) and the tied output
    # layer (stage 3, rank 1) hold one weight
    plan = plan_with_starts(EXAMPLE, [0, 2, 4, 6], schedule="interleaved-1f1b", stages_per_rank=2, batch_size=8)
    assert plan.ties, "the example's output layer is tied to its embedding"
    losses = _torchrun(tmp_path, plan, "--save", str(tmp_path / "ckpt"))
    expected, weights = _unsplit(plan)
    assert losses == pytest.approx(expected, rel=REL)
    # the script's checkpoint (every rank's Pipeline.state_dict) loads into the unsplit model
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(SEED)
    fresh = _example().build_model(**plan.model.config)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    for name, t in weights.items():
        torch.testing.assert_close(state[name], t, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_replicas_train_as_unsplit_under_torchrun(tmp_path: Path) -> None:
    plan = plan_with_starts(EXAMPLE, [0, 4], schedule="1f1b", dp=2, batch_size=8, n_microbatches=2)
    assert plan.world_size == 4
    assert _torchrun(tmp_path, plan) == pytest.approx(_unsplit(plan)[0], rel=REL)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ranks_that_built_different_weights_are_named(tmp_path: Path) -> None:
    plan = plan_with_starts(EXAMPLE, [0, 4], schedule="gpipe", batch_size=8)
    plan.save(tmp_path / "plan.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    script = ROOT / "tests" / "fixtures" / "seed_per_rank.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    proc = subprocess.run([*cmd, str(tmp_path / "plan.json")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "the model's weights differ between ranks" in proc.stderr


@pytest.fixture
def no_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No torchrun environment; whatever group a test joins is left afterwards."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_one_rank_plan_trains_in_this_process_as_unsplit(no_group: None) -> None:
    """No torchrun needed for one rank: the API joins a group of one; the batch is given by name."""
    plan = plan_with_starts(EXAMPLE, [0], schedule="gpipe", batch_size=8, n_microbatches=4)
    ex = _example()
    torch.manual_seed(SEED)
    model = ex.build_model(**plan.model.config)
    data = ex.batches(plan.batch_size, seed=SEED)
    pipe = planner.pipeline(plan, model, {"tokens": next(ex.batches(8, seed=1))[0]}, loss_fn=ex.loss_fn)
    assert (pipe.is_first, pipe.is_last, pipe.batch_size) == (True, True, 8)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        tokens, target = next(data)
        loss = pipe.step({"tokens": tokens}, target)
        pipe.finish_grads()
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        assert loss is not None
        losses.append(float(loss))
    assert losses == pytest.approx(_unsplit(plan)[0], rel=REL)
    tokens, target = next(data)
    before = [p.detach().clone() for p in pipe.parameters()]
    assert float(pipe.evaluate(tokens, target)) == pytest.approx(
        float(ex.loss_fn(_model_of(pipe, plan)(tokens), target)), rel=REL
    )
    assert all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))  # evaluation trains nothing
    with pytest.raises(PlannerError, match="reads 8 per step"):
        pipe.step(tokens[:4], target[:4])


def _model_of(pipe: planner.Pipeline, plan: planner.Plan) -> torch.nn.Module:
    """The unsplit model with the pipeline's current weights."""
    torch.manual_seed(SEED)
    model = _example().build_model(**plan.model.config)
    model.load_state_dict(pipe.state_dict(), strict=False)
    return model


def test_a_script_without_torchrun_is_told_how_to_start(no_group: None) -> None:
    plan = plan_with_starts(EXAMPLE, [0, 4], schedule="gpipe", batch_size=8)
    torch.manual_seed(SEED)
    with pytest.raises(PlannerError, match="torchrun --nproc-per-node 2"):
        planner.pipeline(plan, _example().build_model(**plan.model.config), torch.zeros(2, 32, dtype=torch.long))


def test_too_few_processes_are_named(no_group: None) -> None:
    plan = plan_with_starts(EXAMPLE, [0, 4], schedule="gpipe", batch_size=8)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(SEED)
    with pytest.raises(PlannerError, match="1 processes joined but the plan has 2 ranks"):
        planner.pipeline(plan, _example().build_model(**plan.model.config), torch.zeros(2, 32, dtype=torch.long))


def test_an_example_smaller_than_a_microbatch_or_wrongly_named_is_refused(no_group: None) -> None:
    plan = plan_with_starts(EXAMPLE, [0], schedule="gpipe", batch_size=8, n_microbatches=2)  # microbatches of 4
    torch.manual_seed(SEED)
    model = _example().build_model(**plan.model.config)
    with pytest.raises(PlannerError, match="has 2 row.*microbatch is 4 sample"):
        planner.pipeline(plan, model, torch.zeros(2, 32, dtype=torch.long))
    with pytest.raises(ModelFileError, match="'ids'.*its parameters: tokens"):
        planner.pipeline(plan, model, {"ids": torch.zeros(4, 32, dtype=torch.long)})


def test_another_model_is_refused_by_its_fingerprint(no_group: None) -> None:
    plan = plan_with_starts(EXAMPLE, [0], schedule="gpipe", batch_size=8)
    with pytest.raises(planner.errors.PlanFileError, match="different model structure"):
        planner.pipeline(plan, _example().build_model(layers=3), torch.zeros(8, 32, dtype=torch.long))
