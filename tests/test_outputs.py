"""Tier 1 (pure): outputs never destroy anything (issue 10, part 2).

``check_output`` refuses, before any work, a destination whose content would be lost; ``write_atomic``
refuses links and non-regular files on its own and never leaves a temporary file behind. Every
refusal is checked byte for byte: the file, link or device is exactly as it was.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from plan_factory import big_head_blocks, plan_of_blocks

from planner.errors import PlanFileError
from planner.schema.jsonfile import write_atomic
from planner.schema.outputs import OutputKind, check_output, document_kind
from planner.schema.plan import Plan

MODEL_SOURCE = "import torch\n\n\ndef build_model(**config):\n    return torch.nn.Linear(2, 2)\n"
RUN_DOC = {"version": 1, "plan_fingerprint": "abc", "stages": [], "step_times_s": [0.1], "median_step_s": 0.1}
CALIBRATION_DOC = {"version": 1, "plan_fingerprint": "abc", "stages": [], "latency_s": 0.0, "global_factor": 1.0}


@pytest.fixture(scope="module")
def plan_text() -> str:
    return plan_of_blocks(big_head_blocks()).to_json()


Entry = tuple[str, bytes]


def snapshot(folder: Path) -> dict[str, Entry]:
    """Every entry of ``folder`` (not following links): its type and its bytes / link target / device."""
    out: dict[str, Entry] = {}
    for p in folder.iterdir():
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            out[p.name] = ("link", os.readlink(p).encode())
        elif stat.S_ISREG(st.st_mode):
            out[p.name] = ("file", p.read_bytes())
        elif stat.S_ISDIR(st.st_mode):
            out[p.name] = ("dir", json.dumps(snapshot(p), default=repr).encode())
        else:
            out[p.name] = (stat.filemode(st.st_mode)[0], str(st.st_rdev).encode())
    return out


def no_temporary_files(folder: Path) -> None:
    left = [p.name for p in folder.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp")]
    assert not left, f"temporary files left behind: {left}"


def refuses(path: str | Path, kind: OutputKind, match: str) -> str:
    with pytest.raises(PlanFileError, match=match) as info:
        check_output(path, kind)
    message = str(info.value)
    assert "\n" not in message and message.startswith("--output ")
    return message


def refuses_write(path: Path, match: str) -> None:
    with pytest.raises(PlanFileError, match=match) as info:
        write_atomic(path, "{}\n")
    assert "\n" not in str(info.value) and str(info.value).startswith(f"cannot write {path}: ")


# --- files whose content is not a document of the kind about to be written --------------------------


def test_model_file_survives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model.py"
    model.write_text(MODEL_SOURCE)
    before = snapshot(tmp_path)
    message = refuses(
        model,
        "plan",
        r"^--output \S+model\.py holds something that is not a plan \(a Python file\?\); "
        r"choose another file name, e.g\. -o plan\.json$",
    )
    assert snapshot(tmp_path) == before
    # the fix works: the suggested name, in the model's folder, is accepted
    monkeypatch.chdir(tmp_path)
    suggested = message.rsplit("-o ", 1)[1]
    assert check_output(suggested, "plan") == Path("plan.json")


def test_plan_given_as_run_report_target_survives(tmp_path: Path, plan_text: str) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(plan_text)
    before = snapshot(tmp_path)
    refuses(plan, "run result", r"holds a plan, not a run result; choose another file name, e.g\. -o run\.json$")
    assert snapshot(tmp_path) == before
    assert Plan.load(plan).to_json() == plan_text


@pytest.mark.parametrize(
    ("name", "content", "kind", "match"),
    [
        ("notes.txt", b"hello\n", "plan", r"not a plan \(text that is not JSON\)"),
        ("model.bin", b"\x80\x00\xff", "plan", r"not a plan \(binary data\)"),
        ("nul.txt", b"a\x00b", "plan", r"not a plan \(binary data\)"),
        (
            "other.json",
            b'{"name": "x", "deps": []}',
            "plan",
            r"not a plan \(JSON of another kind, with keys deps, name\)",
        ),
        ("list.json", b"[1, 2]", "run result", r"not a run result \(JSON that is not an object\)"),
        ("script", b"#!/bin/sh\necho hi\n", "plan", r"not a plan \(a Python file\?\)"),
        ("cal.json", json.dumps(CALIBRATION_DOC).encode(), "plan", r"holds a calibration, not a plan"),
        ("run.json", json.dumps(RUN_DOC).encode(), "calibration", r"holds a run result, not a calibration"),
        ("deep.json", b"[" * 100_000, "plan", r"not a plan \(text that is not JSON\)"),
    ],
)
def test_other_content_survives(tmp_path: Path, name: str, content: bytes, kind: OutputKind, match: str) -> None:
    target = tmp_path / name
    target.write_bytes(content)
    refuses(target, kind, match)
    assert target.read_bytes() == content


# --- things that are not regular files: check_output and write_atomic both refuse -------------------


def test_symlink_and_its_target_survive(tmp_path: Path, plan_text: str) -> None:
    real = tmp_path / "real.json"
    real.write_text(plan_text)  # even a link to a plan of the right kind is never replaced
    link = tmp_path / "plan.json"
    link.symlink_to(real.name)
    before = snapshot(tmp_path)
    message = refuses(link, "plan", r"is a symbolic link to real\.json; the planner never replaces a link")
    assert f"-o {real.resolve()}" in message
    refuses_write(link, r"it is a symbolic link to real\.json")
    with pytest.raises(PlanFileError, match="symbolic link"):
        plan_of_blocks(big_head_blocks()).save(link)
    assert link.is_symlink() and snapshot(tmp_path) == before
    assert check_output(real.resolve(), "plan") == real.resolve()  # the suggested fix works


def test_link_to_a_model_file_suggests_no_write_over_it(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text(MODEL_SOURCE)
    link = tmp_path / "plan.json"
    link.symlink_to("model.py")
    message = refuses(
        link, "plan", r"is a symbolic link to model\.py; the planner never replaces a link: choose another"
    )
    assert "model.py (" not in message and "-o " + str(tmp_path) not in message
    loop = tmp_path / "loop.json"
    loop.symlink_to("loop.json")
    refuses(loop, "plan", r"is a symbolic link to loop\.json; the planner never replaces a link: choose another")
    assert (tmp_path / "model.py").read_text() == MODEL_SOURCE and link.is_symlink() and loop.is_symlink()


def test_dangling_symlink_survives(tmp_path: Path) -> None:
    link = tmp_path / "plan.json"
    link.symlink_to(tmp_path / "nowhere.json")
    refuses(link, "plan", "is a symbolic link")
    refuses_write(link, "symbolic link")
    assert link.is_symlink() and not (tmp_path / "nowhere.json").exists()
    no_temporary_files(tmp_path)


def test_directory_survives(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    before = snapshot(tmp_path)
    message = refuses(out, "plan", r"is a folder; name a file inside it, e.g\. -o \S+/out/plan\.json$")
    refuses_write(out, r"it is a folder, not a regular file")
    assert snapshot(tmp_path) == before
    assert check_output(message.rsplit("-o ", 1)[1], "plan")  # the fix works


@pytest.mark.parametrize("device", ["/dev/null", "/dev/full"])
def test_device_node_survives(device: str) -> None:
    if not os.path.exists(device):
        pytest.skip(f"{device} is missing here")
    before = os.lstat(device)
    refuses(device, "plan", rf"^--output {device} is a character device, not a regular file; choose another file name")
    if device == "/dev/null":  # /dev/full only through check_output: never risk writing at it
        refuses_write(Path(device), "it is a character device, not a regular file")
    after = os.lstat(device)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_fifo_survives(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # never opened: opening a fifo for writing would block
    refuses(fifo, "run result", r"is a named pipe \(fifo\), not a regular file")
    refuses_write(fifo, "named pipe")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    no_temporary_files(tmp_path)


# --- folders and files that cannot be written ---------------------------------------------------------


@contextlib.contextmanager
def read_only(path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """Make ``path`` unwritable; yields True when writes really fail, False when only os.access says so.

    Root ignores permission bits, so as root the folder or file is made immutable (``chattr +i``,
    which binds root too). Where that is not possible, os.access is monkeypatched for ``path``.
    """
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield True
        finally:
            path.chmod(mode)
        return
    chattr = shutil.which("chattr")
    if chattr and subprocess.run([chattr, "+i", str(path)], capture_output=True).returncode == 0:
        try:
            yield True
        finally:
            subprocess.run([chattr, "-i", str(path)], check=True)
        return
    real_access = os.access

    def access(p: str | os.PathLike[str], mode: int, **kwargs: object) -> bool:
        if Path(p).resolve() == path.resolve() and mode & os.W_OK:
            return False
        return real_access(p, mode)

    monkeypatch.setattr(os, "access", access)
    yield False


def test_read_only_folder(tmp_path: Path, plan_text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    plan = folder / "plan.json"
    plan.write_text(plan_text)
    before = snapshot(folder)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with read_only(folder, monkeypatch) as really:
        for target in (plan, folder / "new.json"):
            message = refuses(
                target, "plan", r"folder \S+/ro is not writable; choose a path in a folder you can write to"
            )
            assert check_output(message.rsplit("-o ", 1)[1], "plan")  # the suggested path is fine
        if really:  # the write itself fails too, and cleans up
            for target in (plan, folder / "new.json"):
                refuses_write(target, r"(Operation not permitted|Permission denied|Read-only file system)")
            assert snapshot(folder) == before
    assert snapshot(folder) == before


def test_read_only_file(tmp_path: Path, plan_text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(plan_text)
    with read_only(plan, monkeypatch):
        refuses(plan, "plan", r"is read-only; make it writable \(chmod u\+w \S+\) or choose another file name")
    assert plan.read_text() == plan_text


def test_missing_folder(tmp_path: Path) -> None:
    target = tmp_path / "no" / "such" / "plan.json"
    refuses(target, "plan", r"folder \S+/no/such does not exist; create it \(mkdir -p \S+/no/such\)")
    refuses_write(target, "No such file or directory")
    assert not (tmp_path / "no").exists()


def test_folder_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    refuses(tmp_path / "file" / "plan.json", "plan", r"\S+/file is not a folder; choose another path")
    assert (tmp_path / "file").read_text() == "x"


def test_nul_in_the_name() -> None:
    refuses("plan\0.json", "plan", "is not a valid path")


# --- good destinations are accepted and written atomically -------------------------------------------


def test_missing_file_is_accepted_and_written(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    assert check_output(target, "plan") == target
    assert check_output(str(target), "plan") == target
    plan = plan_of_blocks(big_head_blocks())
    plan.save(target)
    assert Plan.load(target) == plan
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # as a plain open would make it, not 0600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_relative_name_in_the_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert check_output("plan.json", "plan") == Path("plan.json")
    write_atomic("plan.json", "{}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


@pytest.mark.parametrize(
    ("kind", "old"),
    [("run result", json.dumps(RUN_DOC)), ("calibration", json.dumps(CALIBRATION_DOC)), ("plan", ""), ("plan", " \n")],
)
def test_same_kind_or_empty_is_accepted(tmp_path: Path, kind: OutputKind, old: str) -> None:
    target = tmp_path / "out.json"
    target.write_text(old)
    assert check_output(target, kind) == target


def test_existing_plan_is_replaced_atomically(tmp_path: Path, plan_text: str) -> None:
    target = tmp_path / "plan.json"
    target.write_text(plan_text)
    target.chmod(0o640)
    inode = target.stat().st_ino
    assert check_output(target, "plan") == target
    write_atomic(target, plan_text.replace('"version"', '"version" ', 1))
    assert target.stat().st_ino != inode  # a new file renamed over the old one, not rewritten in place
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # the old file's permissions are kept
    assert target.read_text() == plan_text.replace('"version"', '"version" ', 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_document_kind_reads_the_top_level_keys(plan_text: str) -> None:
    assert document_kind(json.loads(plan_text)) == "plan"
    assert document_kind(RUN_DOC) == "run result"
    assert document_kind(CALIBRATION_DOC) == "calibration"
    assert document_kind({"version": 1}) is None and document_kind([1]) is None


# --- a write that fails midway leaves the old file and no temporary file --------------------------------


def _fail(exc: BaseException) -> Callable[..., None]:
    def raiser(*args: object, **kwargs: object) -> None:
        raise exc

    return raiser


@pytest.mark.parametrize("step", ["fsync", "replace", "fchmod"])
def test_failed_write_keeps_the_old_file(
    tmp_path: Path, plan_text: str, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    target = tmp_path / "plan.json"
    target.write_text(plan_text)
    before = snapshot(tmp_path)
    monkeypatch.setattr(os, step, _fail(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    with pytest.raises(
        PlanFileError, match=r"^cannot write \S+plan\.json: No space left on device; choose a writable path with -o$"
    ):
        write_atomic(target, "{}\n")
    monkeypatch.undo()
    assert snapshot(tmp_path) == before
    no_temporary_files(tmp_path)


def test_interrupted_write_leaves_no_temporary_file(
    tmp_path: Path, plan_text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "plan.json"
    target.write_text(plan_text)
    monkeypatch.setattr(os, "fsync", _fail(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, "{}\n")
    monkeypatch.undo()
    assert target.read_text() == plan_text
    no_temporary_files(tmp_path)


def test_message_without_strerror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "replace", _fail(OSError("boom")))
    with pytest.raises(PlanFileError, match=r"cannot write \S+: boom; choose a writable path with -o"):
        write_atomic(tmp_path / "plan.json", "{}\n")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
