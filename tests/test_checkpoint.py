"""Checkpoints, resume, final weights, the learning-rate schedule and data x pipeline parallel runs.

Tier 2 (one process) for the checkpoint folder rules and the schedule; tier 3 (gloo processes) for
resuming after a killed rank, the exported weights in the unsplit model, and dp x pp against one
process on the full batch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from run_factory import MODELS, assert_close, assert_resumes_under, plan_with_starts, saved  # noqa: E402

from planner.capture.load import load_model_file  # noqa: E402
from planner.errors import DataError, PlannerError  # noqa: E402
from planner.run import run_plan, train_reference  # noqa: E402
from planner.run.checkpoint import (  # noqa: E402
    RankState,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_weights,
    step_dir,
)
from planner.run.optim import make_scheduler  # noqa: E402
from planner.schema.run_request import RunRequest  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"


class _Counter:
    """A data stream position, as a StatefulDataLoader keeps one."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


def _trained_state(seed: int) -> tuple[torch.nn.Module, RankState]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = make_scheduler(opt, steps=10, warmup=2, decay="cosine")
    data = _Counter()
    tensors = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    return model, RankState(rank=0, tensors=tensors, optimizer=opt, scheduler=sched, data=data)


def _step(model: torch.nn.Module, state: RankState) -> float:
    assert state.optimizer is not None and state.data is not None
    x = torch.randn(8, 4)
    loss = model(x).pow(2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.scheduler.step()
    state.data.pos += 1  # type: ignore[attr-defined]
    return float(loss.detach())


def test_a_checkpoint_restores_weights_optimizer_schedule_data_and_rng(tmp_path: Path) -> None:
    model, state = _trained_state(0)
    for _ in range(3):
        _step(model, state)
    save_checkpoint(tmp_path, 3, state, {"plan_fingerprint": "x"})
    want = [_step(model, state) for _ in range(3)]

    fresh, other = _trained_state(1)  # other weights, an empty optimizer, another RNG position
    torch.manual_seed(123)
    assert load_checkpoint(step_dir(tmp_path, 3), other) == 3
    assert other.data.pos == 3  # type: ignore[union-attr]
    assert other.scheduler.last_epoch == 3
    got = [_step(fresh, other) for _ in range(3)]
    assert got == want  # bit for bit: weights, AdamW moments, lr schedule and the RNG stream all came back


def test_a_crash_mid_save_leaves_the_last_good_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    model, state = _trained_state(0)
    save_checkpoint(tmp_path, 2, state, {})
    real_save = dcp.save

    def crash(state_dict: dict, **kwargs: Any) -> None:
        real_save(state_dict, **kwargs)  # every file written ...
        raise OSError(28, "No space left on device")  # ... then the save dies before it is published

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(PlannerError, match="cannot write checkpoint .*step_00000004: No space left"):
        save_checkpoint(tmp_path, 4, state, {})
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 2)
    assert (tmp_path / ".step_00000004.partial").is_dir()  # left for the next save to clear, never resumed
    (tmp_path / "step_00000009").mkdir()  # a folder without DCP's metadata: not a checkpoint
    assert complete_checkpoints(tmp_path) == [step_dir(tmp_path, 2)]
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"


def test_learning_rate_schedule_factors() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert make_scheduler(opt, steps=10, warmup=0, decay="constant") is None
    sched = make_scheduler(opt, steps=6, warmup=2, decay="linear")
    rates = []
    for _ in range(6):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert rates == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    cos = make_scheduler(opt2, steps=4, warmup=0, decay="cosine")
    got = []
    for _ in range(4):
        got.append(opt2.param_groups[0]["lr"])
        opt2.step()
        cos.step()
    assert got == pytest.approx([2.0 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)])


def test_resume_without_a_checkpoint_is_one_line(tmp_path: Path) -> None:
    plan = plan_with_starts(FIXTURES / "dies_at.py", [0, 3], schedule="1f1b", n_microbatches=2)
    path = saved(plan, tmp_path)
    with pytest.raises(PlannerError, match="--resume: no complete checkpoint in .*plan.ckpt"):
        run_plan(plan, RunRequest(plan_file=path, steps=2, resume=True, echo=False))


@pytest.mark.multiprocess
def test_a_run_resumed_after_a_killed_rank_gives_the_uninterrupted_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = plan_with_starts(FIXTURES / "dies_at.py", [0, 3], schedule="1f1b", n_microbatches=2)
    path = saved(plan, tmp_path)
    whole = run_plan(plan, RunRequest(plan_file=path, steps=6, checkpoint_dir=tmp_path / "whole", echo=False))

    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("PLANNER_TEST_DIE_AT", "5")  # rank 1 is killed drawing step 5's batch
    monkeypatch.setenv("PLANNER_TEST_DIE_RANK", "1")
    with pytest.raises(PlannerError):
        run_plan(plan, RunRequest(plan_file=path, steps=6, checkpoint_dir=ckpt, checkpoint_every=2, echo=False))
    assert [p.name for p in complete_checkpoints(ckpt)] == ["step_00000002", "step_00000004"]
    monkeypatch.delenv("PLANNER_TEST_DIE_AT")

    resumed = run_plan(plan, RunRequest(plan_file=path, steps=6, checkpoint_dir=ckpt, resume=True, echo=False))
    assert resumed.first_step == 5 and len(resumed.losses) == 2
    assert resumed.losses == whole.losses[4:]  # bit for bit
    assert resumed.grad_norms == whole.grad_norms[4:]
    assert resumed.checkpoints == [str(step_dir(ckpt, 6))]


@pytest.mark.multiprocess
def test_final_weights_load_into_the_unsplit_model(tmp_path: Path) -> None:
    plan = plan_with_starts(FIXTURES / "dies_at.py", [0, 3], schedule="gpipe", n_microbatches=2)
    path = saved(plan, tmp_path)
    run = run_plan(plan, RunRequest(plan_file=path, steps=4, checkpoint_every=3, echo=False))
    out = tmp_path / "model.pt"
    used, step, untrained = save_weights(path, step_dir(path.with_suffix(".ckpt"), 3), out)
    assert untrained == []
    assert step == 3 and used.name == "step_00000003"

    mf = load_model_file(FIXTURES / "dies_at.py", "tiny")
    model = mf.build(plan.model.seed)
    state = torch.load(out)
    assert set(state) == set(model.state_dict())  # both names of the tied weight
    model.load_state_dict(state)
    batches = mf.train_batches(plan.batch_size, seed=plan.model.seed)
    inputs, target = [next(batches) for _ in range(4)][-1]
    loss = float(mf.loss_fn(model(*inputs), target).detach())
    assert loss == pytest.approx(run.losses[3], rel=1e-4)  # the unsplit model takes step 4 from there


UNUSED_MODULE = """
import torch
import torch.nn.functional as F


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.spare = torch.nn.Linear(8, 8)  # forward never calls it: no stage holds it
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def build_model(**config):
    return Net()


def make_batch(batch_size, **config):
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 2)


def loss_fn(output, target):
    return F.mse_loss(output, target)
"""


@pytest.mark.multiprocess
def test_weights_of_a_module_forward_never_calls_are_exported_at_their_initial_values(tmp_path: Path) -> None:
    model_file = tmp_path / "unused.py"
    model_file.write_text(UNUSED_MODULE)
    plan = plan_with_starts(model_file, [0, 2], size=None, n_microbatches=2)
    path = saved(plan, tmp_path)
    run = run_plan(plan, RunRequest(plan_file=path, steps=3, checkpoint_every=2, echo=False))
    used, step, untrained = save_weights(path, step_dir(path.with_suffix(".ckpt"), 2), tmp_path / "model.pt")
    assert step == 2 and untrained == ["spare.weight", "spare.bias"]

    mf = load_model_file(model_file, None)
    model = mf.build(plan.model.seed)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.load(tmp_path / "model.pt")
    assert set(state) == set(initial)
    assert all(torch.equal(state[k], initial[k]) for k in untrained)
    assert not torch.equal(state["head.weight"], initial["head.weight"])  # trained, loaded from the checkpoint
    model.load_state_dict(state)
    batches = mf.train_batches(plan.batch_size, seed=plan.model.seed)
    inputs, target = [next(batches) for _ in range(3)][-1]
    loss = float(mf.loss_fn(model(*inputs), target).detach())
    assert loss == pytest.approx(run.losses[2], rel=1e-4)  # the unsplit model takes step 3 from there


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("model", "starts", "schedule", "dp_mode"),
    [
        (MODELS / "gpt.py", [0, 4], "1f1b", "ddp"),
        (MODELS / "gpt.py", [0, 4], "1f1b", "fsdp"),
        # tied embedding and head on two ranks: the copies' shards are summed across the pipeline
        (FIXTURES / "dies_at.py", [0, 2], "gpipe", "fsdp"),
        # ZB-V holds both tied readers on rank 0, and its two-part backward goes past DDP's hooks
        (FIXTURES / "dies_at.py", [0, 1, 2, 4], "zbv", "ddp"),
        # four stage units on the one pipeline rank, all gathered at the step's start (torch's own
        # lowering would keep three: torch_compat.gather_each_stage_once)
        (MODELS / "gpt.py", [0, 2, 4, 6], "interleaved-1f1b", "fsdp"),
    ],
    ids=["gpt-1f1b-ddp", "gpt-1f1b-fsdp", "tied-gpipe-fsdp", "tied-zbv-ddp", "gpt-interleaved-v4-fsdp"],
)
def test_two_replicas_match_one_process_on_the_full_batch(
    tmp_path: Path, model: Path, starts: list[int], schedule: str, dp_mode: str
) -> None:
    v = 2 if schedule == "zbv" else len(starts) if schedule == "interleaved-1f1b" else 1
    plan = plan_with_starts(
        model, starts, schedule=schedule, batch_size=8, n_microbatches=2, dp=2, dp_mode=dp_mode, stages_per_rank=v
    )
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=3, save_checkpoints=False, echo=False))
    want = train_reference(plan, path, 3)
    assert got.replicas == 2 and len(got.rank_step_times_s) == 2 * plan.n_ranks
    assert [s.stage for s in got.stages] == list(range(len(starts)))
    assert_close(got.losses, want.losses, "loss")
    assert_close(got.grad_norms, want.grad_norms, "grad norm")


@pytest.mark.multiprocess
def test_data_run_evaluates_and_resumes_where_it_stopped(tmp_path: Path) -> None:
    plan = plan_with_starts(MODELS / "shakespeare.py", [0, 3], schedule="1f1b", batch_size=4, n_microbatches=2)
    path = saved(plan, tmp_path)
    common = dict(plan_file=path, tokenizer="char", eval_every=2, eval_batches=2, eval_fraction=0.2, echo=False)
    data = MODELS / "data" / "shakespeare.txt"
    whole = run_plan(plan, RunRequest(**{**common, "data": data, "steps": 4, "checkpoint_dir": tmp_path / "a"}))
    assert [(e.step, e.batches) for e in whole.evals] == [(2, 2), (4, 2)]
    assert all(e.perplexity == pytest.approx(math.exp(e.loss)) for e in whole.evals)
    assert (tmp_path / "a" / "vocab.json").is_file()

    part = tmp_path / "b"
    run_plan(plan, RunRequest(**{**common, "data": data, "steps": 2, "checkpoint_dir": part}))
    resumed = run_plan(plan, RunRequest(**{**common, "data": data, "steps": 4, "checkpoint_dir": part, "resume": True}))
    assert resumed.losses == whole.losses[2:]
    assert resumed.evals[-1].loss == whole.evals[-1].loss


def test_a_data_run_its_checks_refuse_leaves_nothing_behind(tmp_path: Path) -> None:
    # One stage, so the run that passes its checks trains in this process.
    plan = plan_with_starts(MODELS / "shakespeare.py", [0], batch_size=4, n_microbatches=2)
    path = saved(plan, tmp_path)
    folder = tmp_path / "ckpt"
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be, that is the question. " * 5)  # no eval split of a whole batch
    request = dict(plan_file=path, steps=1, checkpoint_dir=folder, echo=False)
    with pytest.raises(DataError, match="corpus too short"):
        run_plan(plan, RunRequest(**request, data=short, tokenizer="char"))
    assert sorted(folder.rglob("*")) == [] and not folder.exists()
    # A fresh run with another tokenizer is not refused by a vocabulary the refused run left.
    data = MODELS / "data" / "shakespeare.txt"
    done = run_plan(plan, RunRequest(**request, data=data, tokenizer="word"))
    assert len(done.losses) == 1
    assert json.loads((folder / "vocab.json").read_text())["tokenizer"] == "word"


def test_a_fresh_data_run_builds_its_own_vocabulary_over_an_earlier_runs(tmp_path: Path) -> None:
    # was: a fresh run read the vocab.json an earlier run of another text kept in the folder, so its
    # words got that text's ids (or none) without a word; only --resume continues the kept ids
    plan = plan_with_starts(MODELS / "shakespeare.py", [0], batch_size=4, n_microbatches=2)
    path = saved(plan, tmp_path)
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text("alpha beta gamma delta. " * 400)
    second.write_text((MODELS / "data" / "shakespeare.txt").read_text()[:20_000])
    request = dict(plan_file=path, steps=2, tokenizer="word", echo=False)
    run_plan(plan, RunRequest(**request, data=first, checkpoint_dir=tmp_path / "shared"))
    again = run_plan(plan, RunRequest(**request, data=second, checkpoint_dir=tmp_path / "shared"))
    alone = run_plan(plan, RunRequest(**request, data=second, checkpoint_dir=tmp_path / "alone"))
    assert again.losses == alone.losses
    kept = json.loads((tmp_path / "shared" / "vocab.json").read_text())
    assert kept == json.loads((tmp_path / "alone" / "vocab.json").read_text())
    resumed = run_plan(
        plan, RunRequest(**{**request, "steps": 3}, data=second, checkpoint_dir=tmp_path / "shared", resume=True)
    )
    assert resumed.first_step == 3 and json.loads((tmp_path / "shared" / "vocab.json").read_text()) == kept
    # resumed on another stream: refused before anything runs, rather than trained on silently
    without = RunRequest(plan_file=path, steps=4, checkpoint_dir=tmp_path / "shared", resume=True, echo=False)
    with pytest.raises(PlannerError, match=r"run on --data \(its vocab.json is there\); give the same --data and"):
        run_plan(plan, without)
    run_plan(plan, RunRequest(plan_file=path, steps=1, checkpoint_dir=tmp_path / "own", echo=False))
    with pytest.raises(PlannerError, match="a run on the model file's own data; leave out --data to continue it"):
        run_plan(plan, RunRequest(**{**request, "steps": 2}, data=second, checkpoint_dir=tmp_path / "own", resume=True))


def test_fsdp_under_a_split_backward_schedule_is_refused_before_launch(tmp_path: Path) -> None:
    plan = plan_with_starts(
        MODELS / "gpt.py", [0, 2, 4, 5], schedule="zbv", n_microbatches=2, dp=2, dp_mode="fsdp", stages_per_rank=2
    )
    with pytest.raises(PlannerError, match="FSDP under --schedule zbv"):
        run_plan(plan, RunRequest(plan_file=saved(plan, tmp_path), steps=1, echo=False))


@pytest.mark.multiprocess
def test_autocast_and_compiled_stages_match_the_unsplit_model_under_the_same_levers(tmp_path: Path) -> None:
    plan = plan_with_starts(FIXTURES / "dies_at.py", [0, 3], schedule="1f1b", n_microbatches=2)
    plan = plan.model_copy(update={"profile": plan.profile.model_copy(update={"autocast": "bf16"}), "compile": True})
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=3, save_checkpoints=False, echo=False))
    want = train_reference(plan, path, 3)  # the unsplit model under the same autocast, eager
    fp32 = train_reference(
        plan.model_copy(update={"profile": plan.profile.model_copy(update={"autocast": None})}), path, 3
    )
    assert got.losses == pytest.approx(want.losses, rel=1e-2)  # bf16 rounding differs between compiled and eager
    assert want.losses != pytest.approx(fp32.losses, rel=1e-6)  # autocast really ran


@pytest.mark.multiprocess
def test_a_checkpointing_plan_resumes_under_another_recompute_mode(tmp_path: Path) -> None:
    # Checkpoint regions change how a stage runs, not its state: the checkpoint of a run whose stages
    # recompute (full, selective) resumes under a plan that recomputes nothing, to the losses of an
    # uninterrupted run of that plan.
    plain = plan_with_starts(MODELS / "gpt.py", [0, 3], schedule="1f1b", n_microbatches=2, optimizer="sgd", lr=0.5)
    modes = {0: "full", 1: "selective"}
    stages = [s.model_copy(update={"recompute": modes[s.index]}) for s in plain.stages]
    recomputing = plain.model_copy(update={"stages": stages})
    assert_resumes_under(recomputing, plain, tmp_path)
