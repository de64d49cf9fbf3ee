"""What every ``planner`` command shares: the option types, ``--debug`` and the one-line errors
(``user_errors``). cli.py holds the commands themselves.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from planner.errors import PlannerError, RunFailed, printable
from planner.run.signals import Terminated, raise_on_signal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (pyproject: tomli there)
    import tomli as tomllib


class CountOrAuto(click.ParamType):
    """A positive integer, or "auto" (returned as None: the search chooses)."""

    name = "N|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return None
        try:
            number = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither a whole number nor 'auto'", param, ctx)
        if number < 1:
            self.fail(f"{number} is not a positive number; give 1 or more, or 'auto'", param, ctx)
        return number


COUNT_OR_AUTO = CountOrAuto()


class ReplicasOrAuto(click.ParamType):
    """``--dp`` and ``--tp``: a whole number or "auto", passed on as given; ``PlanRequest`` checks it (so a bad
    count is one line naming the values that divide --gpus)."""

    name = "K|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        try:
            return int(text)
        except ValueError:
            return text  # "auto", or a mistake PlanRequest names


REPLICAS_OR_AUTO = ReplicasOrAuto()


class FactorOrAuto(click.ParamType):
    """A number, or "auto", passed on as given (``PlanRequest`` checks its range, naming the option)."""

    name = "X|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float | str:
        if isinstance(value, (int, float)):
            return float(value)
        text = str(value).strip()
        if text.lower() == "auto":
            return "auto"
        try:
            return float(text)
        except ValueError:
            self.fail(f"{value!r} is neither a number nor 'auto'", param, ctx)


FACTOR_OR_AUTO = FactorOrAuto()


class OneLineUsageError(click.UsageError):
    """A usage mistake (an unknown option or command, a missing or invalid value) said in one
    ``error:`` line, as every other mistake is; click's own ``show`` prints the usage, a hint and the
    error on four lines."""

    def show(self, file: Any = None) -> None:
        """Print the one line on stderr (``file`` as click's: where to write it)."""
        message = printable(" ".join(self.format_message().split()))
        # an invalid value's message names the option and what it takes; the others point at --help
        if self.ctx is not None and not self.bad_value:
            message = f"{message.rstrip('.')} (see '{self.ctx.command_path} --help')"
        click.echo(f"error: {message}", file=file, err=file is None)

    bad_value = False


def one_line(error: click.UsageError) -> click.UsageError:
    """``error`` as a ``OneLineUsageError`` with the same message and context (and exit code, 2);
    ``planner`` alone (no command: its help) is left as it is."""
    if isinstance(error, (OneLineUsageError, click.exceptions.NoArgsIsHelpError)):
        return error
    said = OneLineUsageError(error.format_message(), error.ctx)
    said.bad_value = isinstance(error, click.BadParameter) and not isinstance(error, click.MissingParameter)
    return said


class PlannerGroup(click.Group):
    """The ``planner`` group: every usage mistake, of the group's options or a command's, is one line
    (``one_line``)."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        """click's, with a usage mistake in the group's own options said in one line."""
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as e:
            raise one_line(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        """click's, with a usage mistake of the command (its options, parsed here) said in one line."""
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise one_line(e) from None


def stopped_line(error: RunFailed) -> str:
    """What a run that stopped early says: "error: ..." for a failure (exit 1, or 2: a user error on a
    rank, as one in the launcher), the plain message for Ctrl-C or SIGTERM (what the user asked for:
    "interrupted at step 6")."""
    return f"{'error: ' if error.exit_code in (1, 2) else ''}{printable(str(error))}"


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One line on stderr for every way a command can end badly, never a traceback (unless --debug).

    PlannerError (a user mistake): its message, exit 2. RunFailed (a run whose ranks started and
    stopped early): its message, exit with its code (1; 130 / 143 when interrupted). Ctrl-C:
    "interrupted", exit 130. SIGTERM: "terminated", exit 143. Anything else is a bug in the
    planner: one line naming it, exit 1. Outputs are written atomically, so none of these leaves a
    half-written file behind.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = bool((click.get_current_context().find_root().obj or {}).get("debug"))
        previous = signal.signal(signal.SIGTERM, raise_on_signal)  # SIGTERM raises Terminated
        try:
            return fn(*args, **kwargs)
        except RunFailed as e:
            if debug:
                raise
            click.echo(stopped_line(e), err=True)
            sys.exit(e.exit_code)
        except PlannerError as e:
            if debug:
                raise
            click.echo(f"error: {printable(str(e))}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Terminated:
            click.echo("terminated", err=True)
            sys.exit(143)
        except Exception as e:
            if debug:
                raise
            text = " ".join(str(e).split())[:300]
            click.echo(
                f"error: internal error ({type(e).__name__}: {text}); re-run with --debug for the traceback", err=True
            )
            sys.exit(1)
        finally:
            signal.signal(signal.SIGTERM, previous)

    return wrapper


def set_debug(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--debug`` after the subcommand does what it does before it (``planner plan ... --debug``)."""
    if value:
        root = ctx.find_root()
        root.obj = {**(root.obj or {}), "debug": True}


# every subcommand takes --debug too: it is where users put it, and the one-line errors suggest it
debug_option = click.option(
    "--debug",
    is_flag=True,
    expose_value=False,
    callback=set_debug,
    help="A full traceback instead of a one-line error.",
)


# names a --compare value takes only as a file (a split is never written with these endings)
_SPLIT_FILE_SUFFIXES = (".json", ".toml", ".py", ".yaml", ".yml", ".txt")


def split_option(value: str | None) -> str | None:
    """``--compare SPLIT``: a file holding torchtitan's module lists becomes ``fqns:`` and their JSON;
    anything else is passed on as written (``planner.core.split.given`` reads it).

    Raises:
        click.BadParameter: a file without a module_fqns_per_model_part list, or a value named as a
            file (a path, a .json/.toml/.py name) where there is no such file.
    """
    if value is None:
        return value
    path = Path(value)
    if not path.is_file():
        if path.suffix.lower() in _SPLIT_FILE_SUFFIXES or os.sep in value:  # meant as a file: say it is not there
            what = (
                "is a folder" if path.is_dir() else "does not exist" if not path.exists() else "is not a regular file"
            )
            raise click.BadParameter(
                f"{value} {what}; give a file holding torchtitan's module_fqns_per_model_part (JSON, TOML or "
                "Python), or a split written out: layer counts (3,4), Megatron (Et*3|t*4L), DeepSpeed (parts:0,3,7)"
            )
        return value
    text = path.read_text(errors="replace")
    found: object = None
    try:
        found = json.loads(text)
    except ValueError:
        try:
            table = tomllib.loads(text)
            found = table.get("parallelism", table).get("module_fqns_per_model_part")
        except tomllib.TOMLDecodeError:
            found = _python_fqns(text)
    if isinstance(found, dict):
        found = found.get("module_fqns_per_model_part")
    if not isinstance(found, list):
        raise click.BadParameter(
            f"{value} holds no module_fqns_per_model_part list (JSON, a TOML [parallelism] table, or a Python "
            "config assigning it)"
        )
    return "fqns:" + json.dumps(found)


def _python_fqns(text: str) -> object:
    """The literal given to ``module_fqns_per_model_part`` in Python source (a keyword argument or an
    assignment), read without running the file."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        value = None
        if isinstance(node, ast.keyword) and node.arg == "module_fqns_per_model_part":
            value = node.value
        elif isinstance(node, ast.Assign) and any(
            getattr(t, "id", getattr(t, "attr", None)) == "module_fqns_per_model_part" for t in node.targets
        ):
            value = node.value
        if value is not None:
            try:
                return ast.literal_eval(value)
            except ValueError:
                return None
    return None
