"""Outputs never destroy anything: check an output path before any work is done. Pure: no torch.

``planner plan -o``, ``planner run -o`` and the calibration write JSON documents, ``planner
export-weights -o`` a state dict (``torch.save``'s zip archive, identified here without torch). Before profiling
or training starts, ``check_output`` refuses a destination whose old content would be lost and is
not an older copy of the same document: a model file, a plan given as a run report's target, a
symbolic link, a folder, a device node, a fifo. It also refuses a destination that cannot be
written (no folder, read-only folder or file), so no run's figures are lost at the very end.
``jsonfile.write_atomic`` repeats the link / non-regular-file refusal (``unsafe_target``) for every
write, whoever calls it.
"""

from __future__ import annotations

import json
import os
import pickletools
import re
import stat
import tempfile
import zipfile
from pathlib import Path
from typing import IO, Literal

from planner.errors import PlanFileError

OutputKind = Literal["plan", "run result", "calibration", "trace", "timeline", "weights", "export", "hardware file"]

# The top-level keys that identify each document the planner writes (all must be present). They
# are disjoint enough that no document matches two kinds: a plan has no plan_fingerprint, a run
# report and a calibration differ in step_times_s / latency_s.
SIGNATURES: dict[str, frozenset[str]] = {
    "plan": frozenset({"version", "model", "stages", "blocks"}),
    "run result": frozenset({"plan_fingerprint", "stages", "step_times_s"}),
    "calibration": frozenset({"plan_fingerprint", "latency_s", "global_factor"}),
    "trace": frozenset({"traceEvents"}),
    "hardware file": frozenset({"format", "spec"}),  # planner probe -o (planner.core.levers.hardware_file)
}
EXAMPLE_NAMES: dict[OutputKind, str] = {
    "plan": "plan.json",
    "run result": "run.json",
    "calibration": "calibration.json",
    "trace": "trace.json",
    "timeline": "timeline.png",
    "export": "plan_export.txt",
    "hardware file": "hardware.json",
    "weights": "model.pt",
}

# What ``planner export`` writes begins with this line (report/export.HEADER), except its CSV: a file
# of pipeline actions ("0F0,1B2,...") only.
EXPORT_HEADER = b"# planner export"
_ACTIONS_CSV = re.compile(rb"^(\d+[A-Z_]+\d*(,\d+[A-Z_]+\d*)*)?$")

# The first bytes of the pictures ``planner report --timeline`` writes (PNG, PDF, SVG): an earlier
# picture may be replaced, any other file may not.
IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"%PDF", b"<?xml", b"<svg")

# What ``planner export-weights`` writes: ``torch.save`` of a model's state dict, a zip archive whose
# records lie in one folder, its pickle (FOLDER/data.pkl) an OrderedDict. An earlier state dict may be
# replaced; any other file (a plan, a model file, a training checkpoint of several dicts) may not.
ZIP_MAGIC = b"PK\x03\x04"
_STATE_DICT_GLOBAL = "collections OrderedDict"
# the opcodes a pickle may begin with before it names its first class (protocol 2: GLOBAL; 4 and
# later: the two names as strings, then STACK_GLOBAL)
_PICKLE_PREAMBLE = frozenset({"PROTO", "FRAME", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"})
_PICKLE_STRINGS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "UNICODE"})

# A destination larger than this is not read to identify it: no planner document comes near it.
MAX_SNIFF_BYTES = 64 * 2**20

_FILE_TYPES = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe (fifo)"),
    (stat.S_ISSOCK, "a socket"),
)


def file_type_name(mode: int) -> str:
    """What kind of file system entry ``mode`` (an ``st_mode``) is, for messages.

    Args:
        mode: ``os.lstat(path).st_mode``.

    Returns:
        "a symbolic link", "a folder", "a character device", ..., "a regular file".
    """
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    for test, name in _FILE_TYPES:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def unsafe_target(path: str | Path) -> str | None:
    """Why writing a file over ``path`` would destroy something that is not a regular file.

    A link is never replaced (``os.replace`` would swap the link for a file) nor followed (its
    target may be anything, anywhere). A folder, device node, fifo or socket is not ours to replace:
    ``os.replace`` onto ``/dev/null`` as root swaps the device node for a file.

    Args:
        path: the destination.

    Returns:
        The reason ("is a symbolic link to X", "is a character device, not a regular file"), or
        None when the path is missing, a regular file, or cannot be looked at (the write itself
        then fails with the system's reason).
    """
    try:
        mode = os.lstat(path).st_mode
    except (OSError, ValueError):  # missing, a path component that is a file, a NUL in the name
        return None
    if stat.S_ISLNK(mode):
        try:
            return f"is a symbolic link to {os.readlink(path)}"
        except OSError:
            return "is a symbolic link"
    if not stat.S_ISREG(mode):
        return f"is {file_type_name(mode)}, not a regular file"
    return None


def document_kind(raw: object) -> OutputKind | None:
    """Which planner document a parsed JSON value is, by its top-level keys.

    Args:
        raw: the value of ``json.loads``.

    Returns:
        "plan", "run result" or "calibration", or None when it is none of them.
    """
    if not isinstance(raw, dict):
        return None
    keys = set(raw)
    for kind, signature in SIGNATURES.items():
        if signature <= keys:
            return kind  # type: ignore[return-value]  # SIGNATURES' keys are OutputKinds
    return None


def looks_like_python(name: str, text: str) -> bool:
    """Whether a file named ``name`` holding ``text`` is Python source (by its suffix or first line)."""
    if name.endswith((".py", ".pyw", ".pyi")):
        return True
    first = text.lstrip().split("\n", 1)[0]
    return first.startswith(("#!", "import ", "from ", "def ", "class ", '"""', "'''", "# "))


def _what_it_holds(path: Path, size: int) -> tuple[OutputKind | None, str]:
    """The planner document kind found in ``path`` (None: not one) and a hint of what it is.

    Raises:
        OSError: the file cannot be read.
    """
    if size > MAX_SNIFF_BYTES:
        return None, f"a file of {size / 2**20:.0f} MiB"
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "binary data"
    if "\0" in text:
        return None, "binary data"
    if not text.strip():
        return None, ""  # empty: nothing to lose
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, an integer too long, nesting too deep
        return None, "a Python file?" if looks_like_python(path.name, text) else "text that is not JSON"
    kind = document_kind(raw)
    if kind is not None:
        return kind, kind
    if isinstance(raw, dict):
        keys = ", ".join(sorted(map(str, raw))[:4])
        return None, f"JSON of another kind, with keys {keys}" if keys else "an empty JSON object"
    return None, "JSON that is not an object"


def _elsewhere(kind: OutputKind, folder: Path) -> str:
    """An example path in a writable folder other than ``folder``: the current folder or the temp folder."""
    name = EXAMPLE_NAMES[kind]
    try:
        cwd = Path.cwd()
        if os.access(cwd, os.W_OK | os.X_OK) and cwd.resolve() != folder.resolve():
            return name
    except OSError:  # the current folder was removed
        pass
    return str(Path(tempfile.gettempdir()) / name)


def _short(option: str) -> str:
    return "-o" if option == "--output" else option


def _link_fix(link: Path, kind: OutputKind, option: str, fix_name: str) -> str:
    """The fix for a link: name the file it points to when that file would be accepted, else another name."""
    real = os.path.realpath(link)
    if not os.path.islink(real):  # a link loop resolves to a link: checking it would recurse forever
        try:
            check_output(real, kind, option)
        except PlanFileError:
            return fix_name
        return f"name the file itself ({_short(option)} {real}) or {fix_name}"
    return fix_name


def _check_existing(path: str | Path, p: Path, st: os.stat_result, kind: OutputKind, option: str) -> None:
    """Refuse an existing destination that is not a regular file holding a document of ``kind``."""
    where = f"{option} {path}"
    fix_name = f"choose another file name, e.g. {_short(option)} {EXAMPLE_NAMES[kind]}"
    if stat.S_ISLNK(st.st_mode):
        raise PlanFileError(
            f"{where} {unsafe_target(p)}; the planner never replaces a link: {_link_fix(p, kind, option, fix_name)}"
        )
    if stat.S_ISDIR(st.st_mode):
        raise PlanFileError(
            f"{where} is a folder; name a file inside it, e.g. {_short(option)} {p / EXAMPLE_NAMES[kind]}"
        )
    if not stat.S_ISREG(st.st_mode):
        raise PlanFileError(f"{where} is {file_type_name(st.st_mode)}, not a regular file; {fix_name}")
    if kind == "export":
        _check_export(path, p, fix_name, option)
        return
    if kind == "weights":
        _check_weights(path, p, st.st_size, fix_name, option)
        return
    if kind == "timeline":
        try:
            with open(p, "rb") as f:
                head = f.read(16)
        except OSError as e:
            raise PlanFileError(f"{where} cannot be read to check it holds a picture ({e.strerror}); {fix_name}") from e
        if head and not head.startswith(IMAGE_MAGIC):
            raise PlanFileError(f"{where} holds something that is not a picture; {fix_name}")
        if not os.access(p, os.W_OK):
            raise PlanFileError(f"{where} is read-only; make it writable (chmod u+w {path}) or {fix_name}")
        return
    try:
        found, hint = _what_it_holds(p, st.st_size)
    except OSError as e:
        raise PlanFileError(f"{where} cannot be read to check it holds a {kind} ({e.strerror}); {fix_name}") from e
    if found is not None and found != kind:
        raise PlanFileError(f"{where} holds a {found}, not a {kind}; {fix_name}")
    if found is None and hint:  # a non-empty file that is no planner document
        raise PlanFileError(f"{where} holds something that is not a {kind} ({hint}); {fix_name}")
    if not os.access(p, os.W_OK):
        raise PlanFileError(f"{where} is read-only; make it writable (chmod u+w {path}) or {fix_name}")


def _check_export(path: str | Path, p: Path, fix_name: str, option: str) -> None:
    """Refuse replacing a file that is not an earlier export (or empty), or is read-only."""
    where = f"{option} {path}"
    try:
        with open(p, "rb") as f:
            head = f.read(MAX_SNIFF_BYTES + 1)
    except OSError as e:
        raise PlanFileError(f"{where} cannot be read to check it holds an export ({e.strerror}); {fix_name}") from e
    ours = head.startswith(EXPORT_HEADER) or (
        len(head) <= MAX_SNIFF_BYTES and all(_ACTIONS_CSV.match(line.strip()) for line in head.splitlines())
    )
    if not ours:
        raise PlanFileError(f"{where} holds something that is not a `planner export` output; {fix_name}")
    if not os.access(p, os.W_OK):
        raise PlanFileError(f"{where} is read-only; make it writable (chmod u+w {path}) or {fix_name}")


def _pickles_a_state_dict(stream: IO[bytes]) -> bool:
    """Whether a pickle's first object is an OrderedDict (what ``state_dict()`` returns), read
    opcode by opcode: nothing is unpickled, so no code in the file runs."""
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(stream):
        if op.name == "GLOBAL":
            return arg == _STATE_DICT_GLOBAL
        if op.name == "STACK_GLOBAL":
            return " ".join(strings[-2:]) == _STATE_DICT_GLOBAL
        if op.name in _PICKLE_STRINGS:
            strings.append(str(arg))
        elif op.name not in _PICKLE_PREAMBLE or len(strings) > 2:
            return False  # a dict, a list, a tensor: not a state dict
    return False


def _not_a_state_dict(p: Path, size: int) -> str | None:
    """None when ``p`` holds a state dict ``torch.save`` wrote, else what it holds (for the message).

    Raises:
        OSError: the file cannot be read.
    """
    with open(p, "rb") as f:
        zipped = f.read(len(ZIP_MAGIC)) == ZIP_MAGIC
    if not zipped:
        found, hint = _what_it_holds(p, size)
        if found is None and not hint:
            return None  # blank: nothing to lose, as for the other kinds
        return f"a {found}" if found is not None else hint.rstrip("?")
    try:
        with zipfile.ZipFile(p) as archive:
            pickles = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
            if len(pickles) != 1:
                return "a zip archive that torch.save did not write"
            with archive.open(pickles[0]) as stream:
                if _pickles_a_state_dict(stream):
                    return None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError, ValueError):
        return "a damaged zip archive"  # a truncated file, an unknown compression, a broken pickle
    return "a PyTorch file of another object (a whole checkpoint or module?)"


def _check_weights(path: str | Path, p: Path, size: int, fix_name: str, option: str) -> None:
    """Refuse replacing a file that is not an earlier state dict (or empty), or is read-only."""
    where = f"{option} {path}"
    try:
        held = _not_a_state_dict(p, size) if size else None
    except OSError as e:
        raise PlanFileError(f"{where} cannot be read to check it holds weights ({e.strerror}); {fix_name}") from e
    if held is not None:
        raise PlanFileError(f"{where} holds {held}, not a state dict; {fix_name}")
    if not os.access(p, os.W_OK):
        raise PlanFileError(f"{where} is read-only; make it writable (chmod u+w {path}) or {fix_name}")


def check_output(path: str | Path, kind: OutputKind, option: str = "--output") -> Path:
    """Check, before any work, that writing a ``kind`` document to ``path`` destroys nothing and can succeed.

    Call it before profiling or training, so a refused path costs nothing. Accepted: a missing file
    in a writable folder, an empty file, or an earlier document of the same kind (a plan over a
    plan). Refused: a symbolic link, a folder, a device node, fifo or socket, a file holding
    anything else (a model file, a plan given as a run report's target, text that is not JSON), a
    read-only file, and a folder that is missing, not a folder, or not writable.

    Args:
        path: the destination as the user gave it.
        kind: the document that will be written there.
        option: the command-line option that named it, for messages (its short form ``-o`` for
            ``--output`` is used in the suggested fix).

    Returns:
        ``Path(path)``, unchanged.

    Raises:
        PlanFileError: one line naming the option, what is wrong and a fix that works.
    """
    p = Path(path)
    where = f"{option} {path}"
    try:
        st: os.stat_result | None = os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):  # missing, or a path component is a file
        st = None
    except ValueError as e:  # a NUL character: the system cannot look the name up
        raise PlanFileError(f"{option} {path!r} is not a valid path ({e}); choose another file name") from e
    except OSError as e:  # no permission on a component, a link loop, a name too long
        raise PlanFileError(f"{where} cannot be checked ({e.strerror}); choose another path") from e
    if st is not None:
        _check_existing(path, p, st, kind, option)
    folder = p.parent
    shown = str(folder) if str(folder) != "." else "the current folder"
    if not folder.exists():
        raise PlanFileError(
            f"{where}: folder {shown} does not exist; create it (mkdir -p {folder}) or choose another path"
        )
    if not folder.is_dir():
        raise PlanFileError(
            f"{where}: {folder} is not a folder; choose another path, e.g. {_short(option)} {_elsewhere(kind, folder)}"
        )
    # The write goes to a temporary file in the same folder, then renames it: the folder must take
    # new entries even when the file exists. os.access asks the kernel, so a read-only file system
    # or an immutable folder is refused for root too.
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PlanFileError(
            f"{where}: folder {shown} is not writable; choose a path in a folder you can write to, "
            f"e.g. {_short(option)} {_elsewhere(kind, folder)}"
        )
    return p
