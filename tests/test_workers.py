"""The search's worker processes (planner.workers, ``planner plan --jobs``): the same plans with any
number of them, results in order, a worker's error raised as it would be here, a dead worker's share
done here, and no process started by a search that ends within a second. A call in the background
(``Background``: an estimate's second microbatch size, costed while the planner traces) alike, and
the plan it helps make the same as without it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_plans_unchanged import REF, _expected, digest, problem

import planner.costs.model_costs as model_costs
from planner.api import make_plan
from planner.core.assemble import Origin, assemble_plan
from planner.core.layout.inputs import asked_of
from planner.errors import InfeasibleError
from planner.schema.request import PlanRequest
from planner.workers import PER_JOB, Background, SearchPool, default_jobs

TESTS = Path(__file__).resolve().parent
PARENT = "PLANNER_TEST_WORKERS_PARENT"


def _dies_in_a_worker(x: int) -> int:
    """Twice ``x`` in the test's own process; in a worker, the worker exits at once (as one killed)."""
    if os.environ.get(PARENT) not in (None, str(os.getpid())):
        os._exit(3)
    return 2 * x


@pytest.fixture
def importable_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers find this module (its functions travel by name) and know the test's process."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(PARENT, str(os.getpid()))


def test_random_problems_plan_the_same_with_two_workers() -> None:
    """Forty of the pinned random problems, searched with two workers from the first layout on: every
    plan (its choice, split, figures and every searched row) has the digest of the plan made without."""
    expected = _expected()["problems"]
    with SearchPool(2, after_s=0.0) as pool:
        assert pool.width() == PER_JOB * 2  # started
        for seed in range(0, 400, 10):
            request, blocks, link, profile, limit = problem(seed)
            try:
                plan = assemble_plan(asked_of(request, limit), blocks, link, Origin(REF, profile, "t"), pool=pool)
            except InfeasibleError:
                assert expected[str(seed)].startswith("error: ")
                continue
            assert digest(plan) == expected[str(seed)], seed
        assert pool.width() == PER_JOB * 2  # still running: no worker died or was given up


def test_workers_import_this_planner_wherever_it_is_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, importable_here: None
) -> None:
    """A planner started in a directory holding another ``planner`` package (a project of that name,
    another checkout) still gets workers running its own: they answer, and none gives up."""
    decoy = tmp_path / "planner"
    decoy.mkdir()
    (decoy / "__init__.py").write_text('raise ImportError("another planner")\n')
    monkeypatch.chdir(tmp_path)
    with SearchPool(2, after_s=0.0) as pool:
        assert pool.width() == PER_JOB * 2
        pids = _all(pool, _pid, [None] * 4)
        assert os.getpid() not in pids  # answered by the workers, not here after they died
        assert pool.width() == PER_JOB * 2


def _pid(_: object) -> int:
    """The process that runs the call."""
    return os.getpid()


def _all(pool: SearchPool, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """Every item submitted, then every result taken, in order."""
    tickets = [pool.submit(fn, item) for item in items]
    return [pool.take(t) for t in tickets]


def test_results_are_taken_by_ticket_whatever_order_they_come_in() -> None:
    with SearchPool(3, after_s=0.0) as pool:
        pool.width()
        assert _all(pool, abs, list(range(-10, 0))) == list(range(10, 0, -1))
        a, b, c = (pool.submit(abs, x) for x in (-1, -2, -3))
        assert [pool.take(c), pool.take(a), pool.take(b)] == [3, 1, 2]


def test_discarded_calls_leave_nothing_behind() -> None:
    """A search that ends with calls submitted ahead and ruled out discards them: the next search's
    calls are answered, none of the old ones kept."""
    with SearchPool(2, after_s=0.0) as pool:
        pool.width()
        pool.discard([pool.submit(abs, -x) for x in range(20)])
        assert _all(pool, abs, [-7, -8]) == [7, 8]
        assert not pool._answers and not pool._calls and not pool._waiting


def test_a_workers_error_is_raised_as_it_would_be_here() -> None:
    with SearchPool(2, after_s=0.0) as pool:
        pool.width()
        tickets = [pool.submit(int, x) for x in ["1", "2", "x", "4"]]
        assert [pool.take(tickets[0]), pool.take(tickets[1])] == [1, 2]
        with pytest.raises(ValueError, match="invalid literal"):
            pool.take(tickets[2])
        assert pool.take(tickets[3]) == 4  # the others' answers are still there
        assert pool.width() == PER_JOB * 2


@pytest.mark.usefixtures("importable_here")
def test_a_dead_workers_share_is_done_here() -> None:
    with SearchPool(2, after_s=0.0) as pool:
        assert pool.width() == PER_JOB * 2
        assert _all(pool, _dies_in_a_worker, [1, 2, 3, 4]) == [2, 4, 6, 8]
        assert pool.width() == 1  # given up: nothing is started again


def test_a_short_search_starts_no_process() -> None:
    with SearchPool(4, after_s=3600.0) as pool:
        assert pool.width() == 1
        assert _all(pool, abs, [-1, -2]) == [1, 2]  # (the search runs these itself; here too)
        assert not pool._workers
    with SearchPool(1, after_s=0.0) as pool:  # --jobs 1: never
        assert pool.width() == 1
        assert not pool._workers


def test_the_default_is_the_cores_this_process_may_use() -> None:
    jobs = default_jobs()
    assert jobs >= 1
    if hasattr(os, "sched_getaffinity"):
        assert jobs == len(os.sched_getaffinity(0))


def test_a_call_in_the_background_returns_or_raises_as_it_would_here() -> None:
    with Background(int, "3") as call:
        assert call.result() == 3
    with Background(int, "x") as call, pytest.raises(ValueError, match="invalid literal"):
        call.result()


@pytest.mark.usefixtures("importable_here")
def test_a_background_call_whose_worker_dies_is_made_here() -> None:
    with Background(_dies_in_a_worker, 21) as call:
        assert call.result() == 42


def test_a_background_call_not_wanted_is_stopped_at_once() -> None:
    call = Background(time.sleep, 60)
    start = time.monotonic()
    call.close()
    assert time.monotonic() - start < 5
    assert call._worker is None


@pytest.mark.slow
def test_an_estimate_costed_at_its_second_size_in_the_background_is_the_same_plan(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A model traced by torch.export and planned in bf16 is costed at the scaling fit's second size
    in a worker while it is traced (``model_costs.SIZE_AHEAD_MODULES``): the plan is the one made
    without the worker, and the worker's result is the one used."""
    pytest.importorskip("transformers")
    request = PlanRequest.build(
        model_file=TESTS.parent / "models" / "hf" / "llama.py",
        size="tiny",
        gpus=4,
        batch_size=16,
        gpu_type="h100",
        dp="auto",
        output=tmp_path / "plan.json",
        progress=False,
    )
    taken: list[object] = []

    class Spied(Background):
        def result(self) -> Any:
            taken.append(value := super().result())
            return value

    monkeypatch.setattr(model_costs, "Background", Spied)
    monkeypatch.setattr(model_costs, "SIZE_AHEAD_MODULES", 10**9)
    alone = make_plan(request)
    assert not taken
    monkeypatch.setattr(model_costs, "SIZE_AHEAD_MODULES", 0)
    ahead = make_plan(request)
    assert len(taken) == 1 and isinstance(taken[0], float)
    assert ahead.profile.fixed_fraction == alone.profile.fixed_fraction
    assert ahead.model_dump(exclude={"created"}) == alone.model_dump(exclude={"created"})

    class Failing(Background):  # a worker in trouble (its model file not found there, say): made here
        def result(self) -> Any:
            raise RuntimeError("the worker could not load the model file")

    monkeypatch.setattr(model_costs, "Background", Failing)
    made_here = make_plan(request)
    assert made_here.model_dump(exclude={"created"}) == alone.model_dump(exclude={"created"})
