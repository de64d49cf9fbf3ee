"""The seed pages' commands: each run as typed, in a workspace of its own, and what it did.

``bench.seed_systems`` writes one docs page per seed system; this module runs a page's commands
(`planner plan`, `planner run`, ...) as subprocesses in a temporary folder holding a copy of
`models/`, keeps each one's outcome for the page's renderer, and reads the machine's facts.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import MODELS, PLANNER, copy_models, cpu_model, execute

SEED = "0"  # passed as --seed to every plan: same weights and data on every rerun

# The executables a page's commands start with, as the user types them -> what runs here. The venv
# that runs the bench is the one whose `planner` we measure.
EXECUTABLES = {"planner": PLANNER, "python": sys.executable}


@dataclass(frozen=True)
class Cmd:
    """One command of a page, as the user types it from the repository root.

    Attributes:
        key: the name the page's renderer looks the outcome up by.
        argv: the words, starting with `planner` or `python`.
        needs: keys of earlier commands whose output this one reads; if one failed, this one is
            skipped (and named as skipped) instead of failing for a reason that is not its own.
        expect_fail: the page shows this command failing on purpose (a limit worth knowing).
        timeout_s: wall-clock limit; a command past it is stopped and reported as timed out.
    """

    key: str
    argv: tuple[str, ...]
    needs: tuple[str, ...] = ()
    expect_fail: bool = False
    timeout_s: float = 420.0

    @property
    def text(self) -> str:
        """The command line as a shell would show it."""
        return shlex.join(self.argv)


@dataclass
class Outcome:
    """What one command did."""

    cmd: Cmd
    returncode: int | None  # None: not run to completion (skipped or timed out)
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    note: str = ""  # why there is no return code: "skipped: ..." or "timed out after N s"

    @property
    def ok(self) -> bool:
        """Whether the command did what the page expected of it."""
        if self.cmd.expect_fail:
            return self.returncode not in (None, 0)
        return self.returncode == 0

    def error_line(self) -> str:
        """The line that says what went wrong: the last non-empty line of stderr, else of stdout."""
        if self.note:
            return self.note
        for text in (self.stderr, self.stdout):
            lines = [line for line in text.splitlines() if line.strip()]
            if lines:
                return lines[-1].strip()
        return f"exit code {self.returncode}, nothing printed"


class Workspace:
    """A temporary folder where a page's commands run exactly as typed.

    `models/` is copied in so that `models/gpt.py` and `models/data/shakespeare.txt` resolve as they
    do from the repository root, while plans, runs and checkpoints never land in the repository.
    """

    def __init__(self, folder: Path, label: str) -> None:
        self.folder = folder
        self.label = label
        self.outcomes: dict[str, Outcome] = {}
        copy_models(MODELS, folder / "models")

    def run(self, cmd: Cmd) -> Outcome:
        """Run one command (or skip it when a command it needs failed) and keep its outcome."""
        failed = [key for key in cmd.needs if not self.ok(key)]
        if failed:
            outcome = Outcome(cmd, None, note=f"skipped: it reads the output of `{self.outcomes[failed[0]].cmd.text}`")
        else:
            print(f"[{self.label}] $ {cmd.text}", flush=True)
            outcome = _execute(cmd, self.folder)
            status = "ok" if outcome.ok else f"FAILED: {outcome.error_line()}"
            print(f"[{self.label}]   {outcome.seconds:.1f} s, {status}", flush=True)
        self.outcomes[cmd.key] = outcome
        return outcome

    def ok(self, key: str) -> bool:
        """Whether the command with this key ran and succeeded."""
        outcome = self.outcomes.get(key)
        return outcome is not None and outcome.ok

    def stdout(self, key: str) -> str:
        """What the command with this key printed on stdout."""
        return self.outcomes[key].stdout

    def json(self, name: str) -> dict[str, Any]:
        """A JSON file a command wrote in the workspace."""
        data = json.loads((self.folder / name).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{name} holds {type(data).__name__}, expected an object")
        return data


def _execute(cmd: Cmd, cwd: Path) -> Outcome:
    """Run `cmd` in `cwd` (``bench.common.execute``: a timeout stops its whole process group)."""
    done = execute([EXECUTABLES.get(cmd.argv[0], cmd.argv[0]), *cmd.argv[1:]], cwd, cmd.timeout_s)
    return Outcome(cmd, done.returncode, done.stdout, done.stderr, done.seconds, note=done.note)


def planner(key: str, *words: str, needs: tuple[str, ...] = (), expect_fail: bool = False) -> Cmd:
    """A `planner ...` command."""
    return Cmd(key, ("planner", *words), needs=needs, expect_fail=expect_fail)


# --------------------------------------------------------------------------------------------------
# the machine
# --------------------------------------------------------------------------------------------------
def machine_facts() -> dict[str, str]:
    """CPU model, cores, torch and Python versions, read the way a user would check them."""
    cpu = cpu_model() or "unknown"
    probe = (
        "import platform, torch; print(torch.__version__); print(platform.python_version()); print(platform.platform())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    torch_version, python_version, system = out.splitlines()[:3]
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "torch": torch_version,
        "python": python_version,
        "system": system,
        "probe": f"python -c '{probe}'",
    }
