"""Fuzzing the loaders and parsers (issue 10): any input gives a valid result or a PlannerError.

Every reader of user input — plan.json, run.json, a calibration, ``--set`` pairs, model files and the
request options — is fed arbitrary and mutated input by hypothesis (the ``planner`` command line
itself: tests/test_cli_property.py). The outcome must be the result or the domain error (``PlannerError`` or a subclass)
with a one-line message; any other exception is a bug. Each bug the fuzzing found also has a
deterministic regression test below (``test_regression_*``), so it stays fixed without luck.

Examples are bounded (``max_examples``) so the file runs in seconds on two cores.
"""

from __future__ import annotations

import copy
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plan_factory import big_head_blocks, plan_of_blocks
from run_factory import plan_stage_reports, run_report

from planner.core.step.calibrate import Calibration, StageCalibration
from planner.errors import ModelFileError, PlanFileError, PlannerError
from planner.schema.jsonfile import parse_versioned, read_text
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest
from planner.schema.result import RUN_VERSION, RunResult
from planner.schema.run_request import RunRequest

# Bounded runs: hypothesis explores, the regression tests pin what it found.
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- JSON documents --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """JSON text inserted verbatim: what ``json.dumps`` cannot produce but a file can hold."""

    text: str


DEEP_LIST = Raw("[" * 10_000 + "]" * 10_000)  # json.loads recurses per level: RecursionError
DEEP_OBJECT = Raw('{"a":' * 5_000 + "0" + "}" * 5_000)
HUGE_INT = Raw("1" * 5_000)  # past sys.get_int_max_str_digits(): int() raises ValueError
HUGE_NEG_INT = Raw("-" + "9" * 4_301)
RAW_VALUES = [
    DEEP_LIST,
    DEEP_OBJECT,
    HUGE_INT,
    HUGE_NEG_INT,
    Raw("1e999"),
    Raw("-1e999"),
    Raw("NaN"),
    Raw("Infinity"),
    Raw(str(2**64)),
    Raw('"\\ud800"'),
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**62, max_value=2**200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
# JSON values plus the raw texts above, anywhere in the tree.
fuzz_values = st.recursive(
    scalars | st.sampled_from(RAW_VALUES),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


# Object keys; line breaks included, as an error message may name the key.
keys = st.text(max_size=6) | st.sampled_from(["a\nb", "\r", "x\u2028y", "version"])


def one_line(message: str) -> bool:
    """The CLI prints a PlannerError as one line: no line break of any kind inside."""
    return len(message.splitlines()) <= 1


def dump(value: Any) -> str:
    """JSON text of ``value``, with ``Raw`` leaves written verbatim (NaN and Infinity as Python writes them)."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)


def paths_of(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and indices) into a JSON tree, the root's children first."""
    out: list[tuple[Any, ...]] = []
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    for key, child in children:
        out.append((*prefix, key))
        out.extend(paths_of(child, (*prefix, key)))
    return out


def mutate(doc: Any, data: st.DataObject) -> Any:
    """One to three random edits of a JSON tree: delete, replace, wrap, duplicate, nudge or add a value."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        paths = paths_of(doc)
        if not paths:
            break
        path = data.draw(st.sampled_from(paths), label="path")
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key, old = path[-1], parent[path[-1]]
        op = data.draw(st.sampled_from(["delete", "replace", "wrap", "duplicate", "nudge", "add"]), label="op")
        if op == "delete":
            del parent[key]
        elif op == "add" and isinstance(old, dict):  # an unknown key (names with newlines included)
            old[data.draw(keys, label="key")] = data.draw(fuzz_values, label="value")
        elif op == "replace":
            parent[key] = data.draw(fuzz_values, label="value")
        elif op == "wrap":
            parent[key] = [old]
        elif op == "duplicate" and isinstance(old, list) and old:
            old.append(copy.deepcopy(old[-1]))
        elif op == "nudge" and isinstance(old, (int, float)) and not isinstance(old, bool):
            parent[key] = data.draw(st.sampled_from([old + 1, old - 1, -old, 0, old * 10**30, float("nan")]))
    return doc


def check_parse(parse: Callable[[str], Any], kind: type, text: str) -> None:
    """``parse(text)`` is a ``kind`` or a one-line PlanFileError; anything else fails the test."""
    try:
        result = parse(text)
    except PlanFileError as e:
        assert one_line(str(e)), str(e)
        return
    assert isinstance(result, kind)


PLAN = plan_of_blocks(big_head_blocks())
PLAN_DOC = json.loads(PLAN.to_json())


def a_run(plan: Plan) -> RunResult:
    """A minimal valid run.json of ``plan`` (two steps, per-stage figures equal to the plan's)."""
    stages = plan_stage_reports(plan, step_s=0.1)
    return run_report(plan, stages=stages, step_times_s=[0.1, 0.1], ranks=plan.n_stages, losses=[1.0, 0.9])


RUN_DOC = json.loads(a_run(PLAN).to_json())
CALIBRATION_DOC = json.loads(
    Calibration(
        plan_fingerprint="f" * 16,
        microbatch_size=4,
        starts=(0, 3),
        stages=[
            StageCalibration(
                stage=0, first_block="embed", last_block="layers.1", fwd_factor=1.0, bwd_factor=1.0, opt_factor=1.0
            ),
            StageCalibration(
                stage=1, first_block="layers.2", last_block="output", fwd_factor=1.0, bwd_factor=1.0, opt_factor=1.0
            ),
        ],
        latency_s=0.0,
        bandwidth_Bps=1e9,
        global_factor=1.0,
        measured_step_s=0.1,
        predicted_step_s=0.1,
        calibrated_step_s=0.1,
    ).to_json()
)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder shared by a module's hypothesis examples (function-scoped tmp_path is not per example)."""
    return tmp_path_factory.mktemp("fuzz")


def test_seeds_are_valid() -> None:
    """The mutation seeds parse as they are, so a failure below is caused by the mutation."""
    assert Plan.from_json(json.dumps(PLAN_DOC)) == PLAN
    assert RunResult.model_validate(RUN_DOC).n_stages == PLAN.n_stages
    assert Calibration.from_json(json.dumps(CALIBRATION_DOC)).starts == (0, 3)


@pytest.mark.slow
@FAST
@given(st.text() | st.binary().map(lambda b: b.decode("utf-8", errors="replace")))
def test_plan_from_arbitrary_text(text: str) -> None:
    check_parse(Plan.from_json, Plan, text)


@FAST
@given(fuzz_values)
def test_plan_from_arbitrary_json(value: Any) -> None:
    check_parse(Plan.from_json, Plan, dump(value))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_plan_from_mutated_plan(data: st.DataObject) -> None:
    check_parse(Plan.from_json, Plan, dump(mutate(PLAN_DOC, data)))


@pytest.mark.slow
@FAST
@given(st.data())
def test_run_result_from_mutated_run(data: st.DataObject) -> None:
    def parse(text: str) -> RunResult:  # what RunResult.load does after reading the file
        return parse_versioned(text, RunResult, RUN_VERSION, "run.json", "run result", "run it again")

    check_parse(parse, RunResult, dump(mutate(RUN_DOC, data)))
    check_parse(parse, RunResult, dump(data.draw(fuzz_values, label="json")))


@FAST
@given(st.data())
def test_calibration_from_mutated_calibration(data: st.DataObject) -> None:
    check_parse(Calibration.from_json, Calibration, dump(mutate(CALIBRATION_DOC, data)))
    check_parse(Calibration.from_json, Calibration, dump(data.draw(fuzz_values, label="json")))


@FEW
@given(st.data())
def test_run_result_load_arbitrary_bytes(scratch: Path, data: st.DataObject) -> None:
    content = data.draw(
        st.binary(max_size=64)
        | st.sampled_from([b"\xff\xfe{}", json.dumps(RUN_DOC).encode(), b"{\x00}"])
        | st.binary(max_size=2).map(lambda junk: dump(RUN_DOC).encode() + junk)  # a valid run, then junk
    )
    if data.draw(st.booleans()):
        content = dump(mutate(RUN_DOC, data)).encode()
    path = scratch / "run.json"
    path.write_bytes(content)
    try:
        assert isinstance(RunResult.load(path), RunResult)
    except PlanFileError as e:
        assert one_line(str(e)), str(e)


# --- read_text on odd paths -----------------------------------------------------------------------


def test_read_text_on_a_directory_or_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PlanFileError, match="Is a directory; make one"):
        read_text(tmp_path, "plan", "make one")
    with pytest.raises(PlanFileError, match="No such file or directory; make one"):
        Plan.load(tmp_path / "missing.json")
    with pytest.raises(PlanFileError, match="No such file"):
        RunResult.load(tmp_path / "missing.run.json")


def test_regression_read_text_invalid_utf8(tmp_path: Path) -> None:
    # Was: UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 1.
    path = tmp_path / "plan.json"
    path.write_bytes(b"{\xff}")
    with pytest.raises(PlanFileError, match=r"is not a plan: byte 1 is not UTF-8 text \(b'\\xff'\); make one"):
        read_text(path, "plan", "make one")
    with pytest.raises(PlanFileError, match="is not a run result: byte 1 is not UTF-8"):
        RunResult.load(path)


def test_regression_read_text_nul_in_path(tmp_path: Path) -> None:
    # Was: ValueError: embedded null byte.
    with pytest.raises(PlanFileError, match="cannot read plan .*embedded null byte; make one"):
        read_text(str(tmp_path / "a\x00b.json"), "plan", "make one")


# --- regressions: JSON too deep or with too long an integer ---------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        DEEP_LIST.text,
        '{"version": 1, "blocks": ' + DEEP_LIST.text + "}",
        DEEP_OBJECT.text,
    ],
)
def test_regression_deeply_nested_json(text: str) -> None:
    # Was: RecursionError: maximum recursion depth exceeded while decoding a JSON array.
    with pytest.raises(PlanFileError, match="plan is not a plan: its JSON is nested too deeply to read; re-run"):
        Plan.from_json(text)
    with pytest.raises(PlanFileError, match="nested too deeply"):
        Calibration.from_json(text)


@pytest.mark.parametrize("text", [HUGE_INT.text, '{"version": ' + HUGE_NEG_INT.text + "}"])
def test_regression_integer_too_long(text: str, tmp_path: Path) -> None:
    # Was: ValueError: Exceeds the limit (4300 digits) for integer string conversion.
    digits = sys.get_int_max_str_digits()
    with pytest.raises(PlanFileError, match=f"is not a plan: it holds an integer of more than {digits} digits"):
        Plan.from_json(text)
    path = tmp_path / "x.run.json"
    path.write_text(text)
    with pytest.raises(PlanFileError, match="is not a run result: it holds an integer"):
        RunResult.load(path)


def test_regression_line_break_in_a_key() -> None:
    # Was a two-line message: "...: baselines.a<newline>b: Input should be a valid dictionary ...".
    doc = copy.deepcopy(PLAN_DOC)
    doc["baselines"]["a\nb"] = 1
    with pytest.raises(PlanFileError, match=r"^plan is not a valid plan: baselines\.'a\\nb': Input should be") as e:
        Plan.from_json(json.dumps(doc))
    assert one_line(str(e.value))


# --- --set pairs ----------------------------------------------------------------------------------


override_pairs = st.lists(
    st.text(max_size=12)
    | st.builds(lambda k, v: f"{k}={dump(v)}", keys, fuzz_values)
    | st.builds(lambda k, v: f"{k}={v}", keys, st.text(max_size=12)),
    max_size=4,
)


@FAST
@given(override_pairs)
def test_parse_overrides_arbitrary(pairs: list[str]) -> None:
    from planner.capture.load import parse_overrides

    try:
        out = parse_overrides(pairs)
    except ModelFileError as e:
        assert one_line(str(e)), str(e)
        return
    assert all(key and key == key.strip() for key in out)


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ("n=" + DEEP_LIST.text, "--set n: the value is nested too deeply to read; give a flatter value"),
        ("n=" + "[" * 10_000, "--set n: the value is nested too deeply"),  # unterminated: recursion comes first
        ("n=" + HUGE_INT.text, "--set n: the value has an integer of more than 4300 digits; give a smaller number"),
        # Was a two-line message: the key's line break printed as is.
        ("a\rb=" + DEEP_LIST.text, r"^--set 'a\\rb': the value is nested too deeply"),
    ],
)
def test_regression_parse_overrides_unreadable_json(pair: str, message: str) -> None:
    # Was: RecursionError / ValueError (integer string conversion) out of parse_overrides.
    from planner.capture.load import parse_overrides

    with pytest.raises(ModelFileError, match=message.replace("4300", str(sys.get_int_max_str_digits()))):
        parse_overrides([pair])


# --- model files ----------------------------------------------------------------------------------

BUILD = "def build_model(d=1, **_):\n    return None\n"
BATCH = "def make_batch(batch_size, d=1, **_):\n    return None\n"
TRAIN = "def train_batches(batch_size, d=1, **_):\n    yield None\n"
_names = itertools.count()


@st.composite
def model_sources(draw: st.DrawFn) -> bytes:
    """A small model file from a grammar of mistakes: missing or odd contract names, SIZES of every
    shape, a module that fails at import, a syntax error, bytes that are not UTF-8."""
    parts = ["import sys\n"]
    parts.append(
        draw(st.sampled_from([BUILD, "", "build_model = 3\n", "build_model = print\n", "build_model = None\n"]))
    )
    parts.append(draw(st.sampled_from([BATCH, "", "make_batch = 'x'\n", "make_batch = len\n"])))
    parts.append(draw(st.sampled_from(["", TRAIN, "train_batches = 5\n", "train_batches = max\n"])))
    sizes = [
        "",
        "SIZES = None\n",
        "SIZES = {}\n",
        "SIZES = []\n",
        "SIZES = ['tiny']\n",
        "SIZES = {'tiny': 3}\n",
        "SIZES = {'tiny': None}\n",
        "SIZES = {'tiny': {'d': 2}, 'big': {'d': 4}}\n",
        "SIZES = {1: {'d': 2}}\n",
        "SIZES = {'tiny': {1: 2}}\n",
        "SIZES = {'tiny': [('d', 2)]}\n",
        "SIZES = 5\n",
        "SIZES = 'tiny'\n",
    ]
    parts.append(draw(st.sampled_from(sizes)))
    failures = [
        "",
        "raise ValueError('boom')\n",
        "sys.exit(3)\n",
        "raise SystemExit\n",
        "raise SystemExit('bye')\n",
        "1 / 0\n",
        "import planner_no_such_module_xyz\n",
        "def broken(:\n",
        "x = (\n",
        "raise RecursionError\n",
    ]
    parts.append(draw(st.sampled_from(failures)))
    order = draw(st.permutations(parts[1:]))
    text = (parts[0] + "".join(order)).encode()
    return draw(st.sampled_from([text, b"\xff\xfe" + text, text + b"# caf\xe9\n", text.replace(b"\n", b"\r\n")]))


@FEW
@given(
    model_sources(),
    st.none() | st.sampled_from(["tiny", "big"]) | st.text(max_size=4),
    st.none()
    | st.dictionaries(st.sampled_from(["d", "unknown", "batch_size", ""]), json_values, max_size=2)
    | st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
def test_load_model_file_grammar_of_mistakes(
    scratch: Path, source: bytes, size: str | None, overrides: dict[str, Any] | None
) -> None:
    from planner.capture.load import ModelFile, load_model_file

    path = scratch / f"model_{next(_names)}.py"  # a fresh name: no stale bytecode from an earlier example
    path.write_bytes(source)
    before = set(sys.modules)
    try:
        assert isinstance(load_model_file(path, size, overrides), ModelFile)
    except ModelFileError as e:
        assert one_line(str(e)), str(e)
    finally:  # the examples' modules would pile up in sys.modules
        for name in set(sys.modules) - before:
            del sys.modules[name]


def write(tmp_path: Path, text: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_regression_sys_exit_at_import(tmp_path: Path) -> None:
    # Was: SystemExit(3) out of load_model_file: `planner plan` ended silently with status 3.
    from planner.capture.load import load_model_file

    path = write(tmp_path, "import sys\n" + BUILD + BATCH + "sys.exit(3)\n")
    before = set(sys.modules)
    with pytest.raises(
        ModelFileError, match=r"model.py failed: it called sys.exit\(3\) \(at model.py:6\); a model file"
    ):
        load_model_file(path)
    assert set(sys.modules) == before


@pytest.mark.parametrize(
    ("sizes", "size", "overrides", "message"),
    [
        # Was: TypeError: list indices must be integers or slices, not str
        ("['tiny']", "tiny", None, "SIZES has type list; it must be a dict of named configs, e.g. SIZES = "),
        # Was: AttributeError: 'list' object has no attribute 'values'
        ("['tiny']", None, {"d": 2}, "SIZES has type list"),
        # Was: TypeError: argument of type 'int' is not iterable
        ("5", "tiny", None, "SIZES has type int"),
        # Was: TypeError: string indices must be integers
        ("'tiny'", "t", None, "SIZES has type str"),
        # Was: TypeError: 'int' object is not iterable
        ("{'tiny': 3}", "tiny", None, r"SIZES\['tiny'\] has type int, not a dict of config entries"),
        ("{'tiny': 3}", None, {"d": 2}, r"SIZES\['tiny'\] has type int"),
        # Was: TypeError: sequence item 0: expected str instance, int found (listing the known sizes)
        ("{1: {'d': 2}}", "x", None, "SIZES has the name 1, which is not a string"),
        ("{'tiny': {1: 2}}", None, {"d": 2}, r"SIZES\['tiny'\] has a config key that is not a string"),
    ],
)
def test_regression_sizes_of_the_wrong_shape(
    tmp_path: Path, sizes: str, size: str | None, overrides: dict[str, Any] | None, message: str
) -> None:
    from planner.capture.load import load_model_file

    path = write(tmp_path, BUILD + BATCH + f"SIZES = {sizes}\n")
    with pytest.raises(ModelFileError, match=f"^model.py: {message}"):
        load_model_file(path, size, overrides)


def test_sizes_none_or_empty_still_means_no_sizes(tmp_path: Path) -> None:
    from planner.capture.load import load_model_file

    for sizes in ("None", "{}"):
        assert load_model_file(write(tmp_path, BUILD + BATCH + f"SIZES = {sizes}\n", f"s{len(sizes)}.py")).config == {}


def test_regression_line_break_in_an_unknown_override_key(tmp_path: Path) -> None:
    # Was a two-line message: "--set a<newline>b: model.py has no config key 'a\\nb'; ...".
    from planner.capture.load import load_model_file

    path = write(tmp_path, BUILD + BATCH)
    with pytest.raises(ModelFileError, match=r"^--set 'a\\nb': model.py has no config key 'a\\nb'") as e:
        load_model_file(path, None, {"a\nb": 1})
    assert one_line(str(e.value))


def test_regression_contract_names_without_a_signature(tmp_path: Path) -> None:
    # Was: TypeError: 5 is not a callable object (inspect.signature of train_batches = 5, under --set).
    from planner.capture.load import load_model_file

    path = write(tmp_path, BUILD + BATCH + "train_batches = 5\n")
    with pytest.raises(ModelFileError, match="--set x: model.py has no config key 'x'; known keys: d"):
        load_model_file(path, None, {"x": 1})
    assert load_model_file(path, None, {"d": 3}).config == {"d": 3}


@pytest.mark.parametrize(
    ("make_path", "message"),
    [
        # Was: RuntimeError: Could not determine home directory.
        (lambda tmp: "~planner_no_such_user_xyz/model.py", "cannot be found .*home directory"),
        # Was: ValueError: embedded null byte
        (lambda tmp: str(tmp / "a\x00b.py"), "cannot be found .*embedded null byte"),
        # Was: RuntimeError: Symlink loop from '.../loop1'
        (lambda tmp: str(tmp / "loop1"), "cannot be found .*[Ss]ymlink loop"),
    ],
)
def test_regression_unresolvable_model_path(tmp_path: Path, make_path: Callable[[Path], str], message: str) -> None:
    from planner.capture.load import load_model_file

    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    with pytest.raises(ModelFileError, match=f"^model file .*{message}.*; give the path of a .py file"):
        load_model_file(make_path(tmp_path))


# --- requests -------------------------------------------------------------------------------------

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**62, max_value=2**80),
    st.sampled_from([10**5000, -(10**5000), 2**63, 2**63 - 1, -1, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["a\nb", "1f1b\r", "gpipe"]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=4), st.integers() | st.floats() | st.sampled_from([10**5000]), max_size=2),
)
PLAN_FIELDS = list(PlanRequest.model_fields)
RUN_FIELDS = list(RunRequest.model_fields)


def check_build(build: Callable[..., Any], kind: type, values: dict[str, Any]) -> None:
    """``build(**values)`` is a ``kind`` or a one-line PlannerError."""
    try:
        request = build(**values)
    except PlannerError as e:
        assert one_line(str(e)), str(e)
        return
    assert isinstance(request, kind)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_plan_request_arbitrary_values(data: st.DataObject) -> None:
    values = {"model_file": "m.py", "gpus": 2}
    for name in data.draw(st.lists(st.sampled_from(PLAN_FIELDS + ["bogus"]), max_size=4, unique=True)):
        values[name] = data.draw(anything, label=name)
    check_build(PlanRequest.build, PlanRequest, values)


def test_regression_default_microbatches_of_a_huge_batch_is_fast() -> None:
    # Was: default_microbatches tried every number up to the batch size (minutes at 10**12).
    import time

    t0 = time.perf_counter()
    request = PlanRequest.build(model_file="m.py", gpus=4, batch_size=10**9)
    assert request.n_microbatches == 8 and time.perf_counter() - t0 < 1.0
    with pytest.raises(PlannerError, match="^--batch-size"):
        PlanRequest.build(model_file="m.py", gpus=4, batch_size=10**12)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(RUN_FIELDS + ["bogus"]), anything, max_size=5))
def test_run_request_arbitrary_values(values: dict[str, Any]) -> None:
    check_build(RunRequest.build, RunRequest, values)


@pytest.mark.parametrize(
    ("cls", "values", "message"),
    [
        # Was: ValueError: Exceeds the limit (4300 digits) for integer string conversion.
        (PlanRequest, {"model_file": "m.py", "gpus": -(10**5000)}, "^--gpus: a number of over 1000 digits is out"),
        (RunRequest, {"plan_file": "p.json", "steps": -(10**5000)}, "^--steps: a number of over 1000 digits"),
        # Was a PlannerError whose whole message was "Exceeds the limit ...; use sys.set_int_max_str_digits()".
        (PlanRequest, {"model_file": "m.py", "gpus": 10**5000}, "^--gpus: a number of over 1000 digits"),
        (
            PlanRequest,
            {"model_file": "m.py", "gpus": 1, "optimizer": {"lr": 10**5000}},
            r"^--lr \(a number too long to show\): ",
        ),
        # Was accepted, then torch.manual_seed raised RuntimeError: Overflow when unpacking long.
        (PlanRequest, {"model_file": "m.py", "gpus": 1, "seed": 10**23}, "^--seed 10{23}: Input should be less than"),
        (PlanRequest, {"model_file": "m.py", "gpus": 1, "seed": -1}, "^--seed -1: Input should be greater than"),
        # Was a message broken over two lines by the value.
        (
            PlanRequest,
            {"model_file": "m.py", "gpus": 1, "schedule": "a\nb"},
            r"^--schedule a\\nb: not a pipeline schedule",
        ),
        # Was "MODEL_FILE {'gpus': 1}: Field required": the other values shown as the missing one's.
        (PlanRequest, {"gpus": 1}, "^MODEL_FILE: Field required$"),
    ],
)
def test_regression_request_values(cls: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(PlannerError, match=message):
        cls.build(**values)


def test_regression_memory_limit_overflow() -> None:
    # Was OverflowError (int(1e308 * 2**30)) after profiling; now a bounded option.
    try:
        limit = PlanRequest.build(model_file="m.py", gpus=1, memory_limit_gib=1e308).memory_limit_bytes
    except PlannerError:
        return
    assert isinstance(limit, int)


def test_regression_line_break_quoted_by_a_validator() -> None:
    # Was "--rdzv-endpoint a<newline>b: expected HOST:PORT ...": a validator's message quoting the value.
    check_build(RunRequest.build, RunRequest, {"plan_file": "p.json", "rdzv_endpoint": "a\nb"})
    check_build(RunRequest.build, RunRequest, {"plan_file": "p.json", "rdzv_endpoint": "a\r\nb:1", "nnodes": 0})


def test_largest_seed_is_accepted() -> None:
    assert PlanRequest.build(model_file="m.py", gpus=1, seed=2**63 - 1).seed == 2**63 - 1
