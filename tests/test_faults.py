"""A `planner run` that stops early says what happened in one line, loses no completed step, and
leaves no process behind.

Pure tests (no processes) pin ``planner.run.faults.diagnose``'s rules and messages on synthetic
failure records, the CLI's handling of ``RunFailed`` and the rendezvous settings. The real runs
(``multiprocess``) start the CLI on a 2-rank plan of tests/fixtures/faulty.py, whose data stream
strikes one rank at a given step (SIGKILL, SIGSTOP, Ctrl-C to the process group), and check the
exit code, the line, run.json, how long the processes took to go and that none is left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from planner.errors import PlannerError, RunFailed
from planner.run.faults import RankRecord, diagnose, fault_site, read_faults, read_records, signal_name

ROOT = Path(__file__).resolve().parents[1]
FAULTY = Path(__file__).resolve().parent / "fixtures" / "faulty.py"


def record(rank: int, time: float, message: str, **fields: object) -> RankRecord:
    """A failure record as a worker writes it (``step`` 5 and ``done`` 4 unless given)."""
    values: dict = {"type": "RuntimeError", "planner_error": False, "step": 5, "done": 4, "traceback": "tb"}
    values.update(fields)
    return RankRecord(rank=rank, time=time, message=message, **values)


RESET = (
    "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4: Connection reset by peer"
)
TIMEOUT = "[/__w/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation to complete"


# --- the diagnosis, pure ---------------------------------------------------------------------------


def test_a_killed_rank_is_the_cause_not_the_rank_that_lost_its_connection() -> None:
    records = {0: record(0, 1.0, RESET)}
    got = diagnose(records, {0: 1, 1: -9}, timeout_s=300)
    assert (got.message, got.status, got.exit_code) == ("rank 1 was killed by SIGKILL at step 5", "failed", 1)
    assert got.traceback is None  # a killed rank leaves none
    segv = diagnose(records, {0: 1, 1: -int(signal.SIGSEGV)}, timeout_s=300)
    assert segv.message == "rank 1 was killed by SIGSEGV at step 5"
    assert diagnose(records, {0: 1, 1: 3}, timeout_s=300).message == "rank 1 exited with code 3 at step 5"
    assert diagnose(records, {0: 1, 1: None}, timeout_s=300).message == (
        "rank 1 ended without reporting an error at step 5"
    )


def test_a_user_error_is_the_cause_over_the_ranks_that_failed_because_it_left() -> None:
    records = {
        0: record(0, 2.0, RESET),
        1: record(
            1, 1.0, "model.py: train_batches() raised ValueError: no data", type="ModelFileError", planner_error=True
        ),
    }
    got = diagnose(records, {0: 1, 1: 1}, timeout_s=300)
    assert got.message == "rank 1 failed: model.py: train_batches() raised ValueError: no data (at step 5)"
    assert got.exit_code == 2 and got.traceback == "tb"  # a user error, as in one process


def test_a_nan_stop_is_reported_as_its_message() -> None:
    nan = "step 3: the loss is nan; training stopped (lower the plan's learning rate (--lr))"
    norm = "step 3: the gradient norm is nan; training stopped (lower the plan's learning rate (--lr))"
    records = {
        0: record(0, 1.0, norm, type="PlannerError", planner_error=True, step=3, done=2),
        1: record(1, 2.0, nan, type="PlannerError", planner_error=True, step=3, done=2),
    }
    assert diagnose(records, {0: 1, 1: 1}, timeout_s=300).message == f"rank 0 failed: {norm}"  # no "(at step 3)"


def test_a_stopped_rank_is_named_with_the_timeout() -> None:
    records = {0: record(0, 1.0, TIMEOUT)}
    got = diagnose(records, {0: 1, 1: -9}, timeout_s=20, hung={1})
    assert got.message == "rank 1 stopped responding: no progress for 20 s at step 5 (--timeout 20)"
    assert got.status == "failed" and got.exit_code == 1


def test_a_rank_that_raised_is_named_not_the_one_waiting_for_it() -> None:
    """Rank 1 failed building its stages; rank 0 waited for it in dist.new_group (no timeout of its
    own) until the launcher killed it: the cause is rank 1's error, not rank 0 "stopped responding"."""
    records = {1: record(1, 1.0, "_apply(): Couldn't swap Linear.weight", step=None, done=0)}
    got = diagnose(records, {0: -9, 1: 1}, timeout_s=20, hung={0})
    assert got.message == "rank 1 failed before the first step: RuntimeError: _apply(): Couldn't swap Linear.weight"
    assert got.traceback == "tb" and got.exit_code == 1


def test_a_rank_hung_in_python_is_named_when_it_answers_the_launchers_sigterm() -> None:
    records = {
        0: record(0, 1.0, TIMEOUT),
        1: record(1, 2.0, "Terminated", type="Terminated", signal="SIGTERM"),
    }
    got = diagnose(records, {0: 1, 1: 1}, timeout_s=7.5)
    assert got.message == "rank 1 stopped responding: no progress for 7.5 s at step 5 (--timeout 7.5)"


def test_a_rank_slow_to_exit_after_its_record_is_not_called_hung() -> None:
    records = {0: record(0, 1.0, RESET)}
    got = diagnose(records, {0: -9, 1: -9}, timeout_s=300, hung={0})
    assert got.message == "rank 1 was killed by SIGKILL at step 5"


def test_a_signal_to_one_rank_is_named() -> None:
    records = {
        0: record(0, 2.0, RESET),
        1: record(1, 1.0, "Terminated", type="Terminated", signal="SIGTERM", step=6, done=6),
    }
    assert diagnose(records, {0: 1, 1: 1}, timeout_s=300).message == "rank 1 was terminated by SIGTERM after step 6"
    records[1] = record(1, 1.0, "KeyboardInterrupt", type="KeyboardInterrupt", signal="SIGINT")
    assert diagnose(records, {0: 1, 1: 1}, timeout_s=300).message == "rank 1 was interrupted by SIGINT at step 5"


def test_ctrl_c_and_sigterm_to_the_launcher() -> None:
    records = {
        0: record(0, 1.0, "KeyboardInterrupt", type="KeyboardInterrupt", signal="SIGINT", step=7, done=6),
        1: record(1, 1.0, "KeyboardInterrupt", type="KeyboardInterrupt", signal="SIGINT", step=7, done=6),
    }
    got = diagnose(records, {0: 1, 1: 1}, timeout_s=300, parent_signal="SIGINT")
    assert (got.message, got.status, got.exit_code) == ("interrupted at step 7", "interrupted", 130)
    got = diagnose(records, {0: 1, 1: 1}, timeout_s=300, parent_signal="SIGTERM")
    assert (got.message, got.status, got.exit_code) == ("terminated at step 7", "interrupted", 143)
    # the rank that got least far sets the step: one had finished step 6 and not begun step 7
    records[1] = record(1, 1.0, "KeyboardInterrupt", type="KeyboardInterrupt", signal="SIGINT", step=6, done=6)
    assert diagnose(records, {}, timeout_s=300, parent_signal="SIGINT").message == "interrupted after step 6"
    assert diagnose({}, {0: 1}, timeout_s=300, parent_signal="SIGINT").message == "interrupted before the first step"
    assert diagnose({}, {}, timeout_s=300, parent_signal="SIGHUP").exit_code == 128 + signal.SIGHUP


def test_a_failure_on_another_node_is_pointed_at() -> None:
    lost = diagnose({0: record(0, 1.0, RESET)}, {0: 1}, timeout_s=300, nnodes=2)
    assert lost.message == (
        "rank 0 lost its connection to another rank at step 5 (Read error [127.0.0.1]:4: Connection reset by "
        "peer): a rank on another node failed or stopped responding first; see that node's output"
    )
    silent = diagnose({0: record(0, 1.0, TIMEOUT)}, {0: 1}, timeout_s=20, nnodes=2)
    assert silent.message.startswith("rank 0 got no answer from another rank at step 5 (Timed out waiting 20000ms")


def test_on_one_node_a_timeout_no_rank_caused_blames_no_other_node() -> None:
    # every rank was here and none failed or was stopped: the step was slower than --timeout
    got = diagnose({0: record(0, 1.0, TIMEOUT), 1: record(1, 1.5, TIMEOUT)}, {0: 1, 1: 1}, timeout_s=20)
    assert got.message.startswith("rank 0 got no answer from another rank at step 5 (Timed out waiting 20000ms")
    assert got.message.endswith(
        "no rank failed, so a step or a save took longer than --timeout; give a larger --timeout"
    )
    assert "another node" not in got.message and got.exit_code == 1


def test_any_other_failure_is_the_earliest_record() -> None:
    records = {0: record(0, 2.0, RESET), 1: record(1, 1.0, "CUDA error: an illegal memory access", step=None)}
    got = diagnose(records, {0: 1, 1: 1}, timeout_s=300)
    assert got.message == "rank 1 failed before the first step: RuntimeError: CUDA error: an illegal memory access"
    assert diagnose({}, {0: 1}, timeout_s=300).message == "rank 0 exited with code 1"
    assert diagnose({}, {}, timeout_s=300).message == "the run stopped and no rank reported why"


DUMP = """Fatal Python error: Segmentation fault

Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/home/u/model.py", line 12 in helper

Current thread 0x00007f9a8d1fcb80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/nn/functional.py", line 2410 in layer_norm
  File "/home/u/my model.py", line 39 in forward
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1775 in _call_impl
  File "<string>", line 1 in <module>

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
"""


def test_a_crashed_rank_is_named_with_its_frame_and_its_dump_is_the_traceback() -> None:
    # the crashing thread's innermost frame outside installed packages: the user's, not torch's
    assert fault_site(DUMP) == "in forward (/home/u/my model.py:39)"
    installed_only = DUMP.replace("/home/u/my model.py", "/venv/lib/python3.11/site-packages/x.py")
    assert fault_site(installed_only) == (
        "in layer_norm (/venv/lib/python3.11/site-packages/torch/nn/functional.py:2410)"
    )
    assert fault_site("Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n") is None
    assert fault_site("garbage") is None
    records = {0: record(0, 1.0, RESET)}
    got = diagnose(records, {0: 1, 1: -int(signal.SIGSEGV)}, timeout_s=300, faults={1: DUMP})
    assert got.message == "rank 1 was killed by SIGSEGV at step 5 in forward (/home/u/my model.py:39)"
    assert got.traceback == DUMP
    # another rank's dump does not speak for the dead one
    assert diagnose(records, {0: 1, 1: -9}, timeout_s=300, faults={0: DUMP}).message == (
        "rank 1 was killed by SIGKILL at step 5"
    )


def test_fault_files_are_read_and_empty_ones_skipped(tmp_path: Path) -> None:
    (tmp_path / "rank0.fault").write_text("")
    (tmp_path / "rank1.fault").write_text(DUMP)
    assert read_faults(tmp_path) == {1: DUMP}


def test_records_are_read_and_a_broken_one_is_skipped(tmp_path: Path) -> None:
    good = {"rank": 1, "time": 1.5, "type": "ValueError", "planner_error": False, "message": "m", "signal": None}
    (tmp_path / "rank1.json").write_text(json.dumps({**good, "step": 2, "done": 1, "traceback": "t", "extra": 0}))
    (tmp_path / "rank0.json").write_text("{not json")
    (tmp_path / "rank2.json").write_text(json.dumps({"rank": 2}))
    (tmp_path / "rank1.partial.pkl").write_bytes(b"\x80")
    assert read_records(tmp_path) == {1: RankRecord(**good, step=2, done=1, traceback="t")}


def test_signal_names() -> None:
    assert signal_name(-9) == "SIGKILL" and signal_name(-int(signal.SIGBUS)) == "SIGBUS"
    assert signal_name(-1000) == "signal 1000"


# --- the CLI and the launcher's settings, without processes ----------------------------------------


@pytest.fixture
def saved_plan(tmp_path: Path) -> Path:
    from plan_factory import big_head_blocks, plan_of_blocks

    path = tmp_path / "plan.json"
    plan_of_blocks(big_head_blocks()).save(path)
    return path


def test_a_failed_run_keeps_its_steps_and_exits_with_the_failures_code(
    saved_plan: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from run_factory import run_report

    import planner.run.launch
    from planner.schema.result import RunResult

    partial = run_report(
        step_times_s=[0.1] * 4,
        losses=[4.0, 3.0, 2.0, 1.0],
        timed_steps=[],
        batch_size=16,
        status="interrupted",
        stopped="interrupted at step 5",
    )
    out = saved_plan.with_name("out.run.json")

    def interrupted(plan: object, request: object) -> None:
        raise RunFailed("interrupted at step 5", result=partial, exit_code=130)

    monkeypatch.setattr(planner.run.launch, "run_plan", interrupted)
    result = CliRunner().invoke(main, ["run", str(saved_plan), "-o", str(out)])
    assert result.exit_code == 130
    assert result.stderr.splitlines() == ["interrupted at step 5", f"wrote {out} (4 step(s) completed)"]
    assert RunResult.load(out) == partial

    def killed(plan: object, request: object) -> None:
        raise RunFailed("rank 1 was killed by SIGKILL")  # no step completed: nothing to write

    out.unlink()
    monkeypatch.setattr(planner.run.launch, "run_plan", killed)
    result = CliRunner().invoke(main, ["run", str(saved_plan), "-o", str(out)])
    assert result.exit_code == 1 and not out.exists()
    assert result.stderr.strip() == "error: rank 1 was killed by SIGKILL"
    assert "Traceback" not in result.output


def test_a_signal_after_every_worker_returned_keeps_the_finished_run() -> None:
    """Ctrl-C between the last worker's return and the agent reading the values: elastic stops the
    waiting workers with the signal, but what they returned is kept and the run stands."""
    import multiprocessing
    from types import SimpleNamespace

    from torch.distributed.elastic.multiprocessing import SignalException

    from planner.run.launch import _run_agent
    from planner.torch_compat import _returned

    queues = {
        0: multiprocessing.get_context("spawn").SimpleQueue(),
        1: multiprocessing.get_context("spawn").SimpleQueue(),
    }
    queues[1].put("rank 3's result")  # put, not yet read by the agent
    context = SimpleNamespace(_return_values={0: "rank 2's result"}, _ret_vals=queues)
    workers = [SimpleNamespace(local_rank=0, global_rank=2), SimpleNamespace(local_rank=1, global_rank=3)]
    assert _returned(context, workers) == {2: "rank 2's result", 3: "rank 3's result"}
    assert _returned(None, workers) == {}  # stopped before any worker started

    class Agent:
        def __init__(self, returned: dict) -> None:
            self.returned = returned

        def run(self) -> None:
            raise SignalException("got SIGINT", sigval=signal.SIGINT)

    watch = SimpleNamespace(pids={2: 100, 3: 101})
    done = _run_agent(Agent({2: "a", 3: "b"}), None, watch, None, None)  # type: ignore[arg-type]
    assert done == ({2: "a", 3: "b"}, "SIGINT")
    assert _run_agent(Agent({2: "a"}), None, watch, None, None) == (None, "SIGINT")  # type: ignore[arg-type]


def test_run_help_documents_the_timeout_and_the_node_rank() -> None:
    text = " ".join(CliRunner().invoke(main, ["run", "--help"]).output.split())
    assert "--timeout SECONDS" in text and "[default: 300" in text
    assert "--node-rank K" in text and "static rendezvous" in text


def test_the_rendezvous_is_torchruns() -> None:
    from plan_factory import big_head_blocks, plan_of_blocks

    from planner.run.launch import _rendezvous_parameters
    from planner.schema.run_request import RunRequest

    plan = plan_of_blocks(big_head_blocks())
    # no endpoint: c10d on port 0, as torchrun --standalone (the store binds a free port itself)
    params, addr, port = _rendezvous_parameters(plan, RunRequest(plan_file=Path("p.json"), timeout_s=12.5))
    assert (params.backend, params.endpoint, addr, port) == ("c10d", "localhost:0", None, None)
    assert params.config == {"join_timeout": 13, "read_timeout": 13} and params.run_id == "planner-" + "f" * 16
    request = RunRequest(plan_file=Path("p.json"), nnodes=2, rdzv_endpoint="node0:29500", node_rank=1, rdzv_id="x")
    params, addr, port = _rendezvous_parameters(plan, request)
    assert (params.backend, params.endpoint, params.run_id, addr, port) == (
        "static",
        "node0:29500",
        "x",
        "node0",
        29500,
    )
    assert params.config == {"rank": 1, "timeout": 300} and params.min_nodes == params.max_nodes == 2


def test_an_endpoint_port_held_on_this_machine_is_refused_at_once() -> None:
    from planner.run.launch import _check_endpoint
    from planner.schema.run_request import RunRequest

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        request = RunRequest(plan_file=Path("p.json"), rdzv_endpoint=f"localhost:{port}")
        with pytest.raises(PlannerError, match=f"port {port} on this machine is in use"):
            _check_endpoint(request)
    request = RunRequest(plan_file=Path("p.json"), rdzv_endpoint="localhost:0", nnodes=2)
    with pytest.raises(PlannerError, match="port 0 lets the store pick any free port"):
        _check_endpoint(request)


# --- real runs ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def faulty_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank GPipe plan of tests/fixtures/faulty.py (one toy layer per rank)."""
    d = tmp_path_factory.mktemp("faults")
    plan = d / "plan.json"
    result = CliRunner().invoke(
        main,
        ["plan", str(FAULTY), "--gpus", "2", "-b", "8", "-m", "2", "--schedule", "gpipe", "--method", "uniform",
         "--repeats", "1", "--warmup", "0", "-q", "-o", str(plan)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return plan


class Ended:
    """How a `planner run` subprocess ended."""

    def __init__(self, code: int, stdout: str, stderr: str, gone_s: float) -> None:
        self.code, self.stdout, self.stderr, self.gone_s = code, stdout, stderr, gone_s

    @property
    def lines(self) -> list[str]:
        """stderr's lines, the resource tracker's warnings about a killed worker's lock left out."""
        return [
            line
            for line in self.stderr.splitlines()
            if line.strip() and "resource_tracker" not in line and "warnings.warn(" not in line
        ]


def _group(pgid: int) -> list[int]:
    """The live processes of a process group (zombies are already gone, only not yet reaped)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(stat[2]) == pgid and stat[0] != "Z":
                pids.append(int(entry))
    return pids


def run_cli(*args: str, fault: str = "", mark: Path | None = None, timeout: float = 120) -> Ended:
    """Run `planner run ARGS` in its own process group (so a Ctrl-C to the group stays in it); wait
    until every process of the group is gone and time that from the fault (from the start without one)."""
    env = {**os.environ, "PLANNER_FAULT": fault, "PLANNER_FAULT_MARK": str(mark or "")}
    start = time.time()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "cli.py"), "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    stdout, stderr = proc.communicate(timeout=timeout)
    while _group(proc.pid) and time.time() - start < timeout:
        time.sleep(0.1)
    left = _group(proc.pid)
    for pid in left:  # not to leave them to the next test; the assertion below fails the test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"
    began = float(mark.read_text()) if mark is not None and mark.exists() else start
    return Ended(proc.returncode, stdout, stderr, time.time() - began)


def _run_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.multiprocess
def test_a_killed_rank_is_named_and_the_completed_steps_are_kept(faulty_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    mark = tmp_path / "fault"
    ended = run_cli(str(faulty_plan), "--steps", "8", "-o", str(out), "--no-checkpoint", fault="SIGKILL:0:5", mark=mark)
    assert ended.code == 1 and ended.gone_s < 60, ended.stderr
    assert ended.lines == ["error: rank 0 was killed by SIGKILL at step 5", f"wrote {out} (4 step(s) completed)"]
    run = _run_json(out)
    assert (run["status"], run["stopped"], run["steps"]) == ("failed", "rank 0 was killed by SIGKILL at step 5", 4)
    assert len(run["losses"]) == 4  # rank 1, the last stage, reported its steps


@pytest.mark.multiprocess
def test_a_crashed_rank_is_one_line_naming_its_frame(faulty_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    ended = run_cli(str(faulty_plan), "--steps", "5", "-o", str(out), "--no-checkpoint", fault="SIGSEGV:1:3")
    assert ended.code == 1, ended.stderr
    # the fault handler's page of every thread's frames stays off the console
    assert "Fatal Python error" not in ended.stderr and "most recent call first" not in ended.stderr
    site = f"in _strike ({FAULTY}:"
    assert ended.lines[0].startswith(f"error: rank 1 was killed by SIGSEGV at step 3 {site}"), ended.stderr
    assert ended.lines[1:] == [f"wrote {out} (2 step(s) completed)"]


@pytest.mark.multiprocess
def test_a_stopped_rank_is_named_within_the_timeout(faulty_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    mark = tmp_path / "fault"
    ended = run_cli(
        str(faulty_plan), "--steps", "8", "-o", str(out), "--timeout", "10", "--no-checkpoint",
        fault="SIGSTOP:1:5", mark=mark,
    )  # fmt: skip
    assert ended.code == 1 and ended.gone_s < 60, ended.stderr
    message = "rank 1 stopped responding: no progress for 10 s at step 5 (--timeout 10)"
    assert ended.lines == [f"error: {message}", f"wrote {out} (4 step(s) completed)"]
    assert (_run_json(out)["status"], _run_json(out)["stopped"]) == ("failed", message)


@pytest.mark.multiprocess
def test_ctrl_c_stops_every_rank_and_exits_130(faulty_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    mark = tmp_path / "fault"
    ckpt = tmp_path / "ckpt"
    every = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    ended = run_cli(str(faulty_plan), "--steps", "8", "-o", str(out), *every, fault="SIGINT@group:0:5", mark=mark)
    assert ended.code == 130 and ended.gone_s < 60, ended.stderr
    run = _run_json(out)
    # Rank 0 strikes as it begins step 5; rank 1 may not have finished step 4 yet.
    done = run["steps"]
    assert done in (3, 4) and (run["status"], run["stopped"]) == ("interrupted", ended.lines[0])
    assert ended.lines[0] in (f"interrupted at step {done + 1}", f"interrupted after step {done}")
    assert ended.lines[1:] == [f"wrote {out} ({done} step(s) completed)"]
    # The last checkpoint is intact: it loads into the unsplit model.
    weights = tmp_path / "w.pt"
    exported = CliRunner().invoke(
        main, ["export-weights", str(faulty_plan), "--checkpoint", str(ckpt), "-o", str(weights)]
    )
    assert exported.exit_code == 0, exported.output
    assert f"the weights after step {2 * (done // 2)}" in exported.output and weights.is_file()


@pytest.mark.multiprocess
@pytest.mark.parametrize("nnodes", [1, 2])
def test_a_port_in_use_is_one_line_within_the_timeout(faulty_plan: Path, nnodes: int) -> None:
    with socket.socket() as held:  # a program that accepts connections and never answers
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        endpoint = f"localhost:{port}"
        ended = run_cli(str(faulty_plan), "--rdzv-endpoint", endpoint, "--nnodes", str(nnodes), "--timeout", "5")
    assert ended.code == 2 and ended.gone_s < 5 + 15  # --timeout + the command's own start (imports, on a busy machine)
    if nnodes == 1:  # this node would host the store: the port must be free
        why = f"port {port} on this machine is in use (by another program, or another planner run); choose a free port, or leave --rdzv-endpoint out to get one"
    else:  # what holds it may be another node of the run: it must answer as a store
        why = "the program listening there is not a rendezvous store (another program holds the port); choose a free port, the same on every node"
    assert ended.lines == [f"error: --rdzv-endpoint {endpoint}: {why}"]


@pytest.fixture(scope="module")
def single_node_losses(faulty_plan: Path) -> list[float]:
    """The losses of 4 steps of the plan on one node."""
    out = faulty_plan.with_name("single.run.json")
    ended = run_cli(str(faulty_plan), "--steps", "4", "-o", str(out), "--no-checkpoint")
    assert ended.code == 0, ended.stderr
    losses: list[float] = _run_json(out)["losses"]
    assert len(losses) == 4
    return losses


@pytest.mark.multiprocess
@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_nodes_on_loopback_train_as_one(
    faulty_plan: Path, single_node_losses: list[float], tmp_path: Path, rendezvous: str
) -> None:
    from run_factory import free_port

    port = free_port()
    outs = [tmp_path / f"node{k}.run.json" for k in range(2)]
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "cli.py"),
                "run",
                str(faulty_plan),
                "--steps",
                "4",
                "-o",
                str(out),
                "--nnodes",
                "2",
                "--rdzv-endpoint",
                f"localhost:{port}",
                "--rdzv-id",
                "two-nodes",
                "--timeout",
                "60",
                "--no-checkpoint",
                *(["--node-rank", str(k)] if rendezvous == "static" else []),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for k, out in enumerate(outs)
    ]
    for node in nodes:
        _, stderr = node.communicate(timeout=180)
        assert node.returncode == 0, stderr
    runs = [_run_json(out) for out in outs]
    # each node records its own rank; the node holding the last stage has the losses
    assert sorted(len(run["losses"]) for run in runs) == [0, 4]
    losses = next(run["losses"] for run in runs if run["losses"])
    assert losses == pytest.approx(single_node_losses, rel=1e-6)
