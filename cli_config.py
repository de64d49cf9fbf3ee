"""``planner plan --config job.toml``: a TOML job file whose keys are the command's options.

A key is an option's long name without the dashes, as on the command line (``gpus``,
``batch-size``, ``memory-limit``; ``model-file`` for MODEL_FILE; ``set`` a table of config
entries). The file becomes click's ``default_map``, so a value given on the command line wins
over the file's and click's own conversion and checks apply to both; only ``--set`` adds to the
file's entries instead of replacing them (a key given in both: the command line's value). Every
mistake in the file is one line naming the file and the key, exit 2 (docs/options.md).
"""

from __future__ import annotations

import difflib
import json
import sys
from typing import IO, Any

import click

from cli_groups import option
from cli_support import CountOrAuto, FactorOrAuto, ReplicasOrAuto
from planner.errors import printable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (pyproject: tomli there)
    import tomli as tomllib

NOT_IN_FILE = ("config", "help")
"""Options a job file cannot give: another job file, and ``--help``."""


class ConfigError(click.ClickException):
    """A mistake in a job file: one line on stderr, exit 2 (click's usage errors print four)."""

    exit_code = 2

    def show(self, file: IO[Any] | None = None) -> None:
        """Print ``error: <message>`` on stderr.

        Args:
            file: where to print instead of stderr.
        """
        # a path may hold a line break or a NUL: escaped, so the message stays one line
        text = printable(self.format_message())
        click.echo(f"error: {text}", err=file is None, file=file)


def file_key(param: click.Parameter) -> str:
    """The job-file key of a parameter: its long option name without the dashes, ``model-file`` for
    the MODEL_FILE argument.

    Args:
        param: an option or argument of the command.

    Returns:
        The key, e.g. ``batch-size``.
    """
    if isinstance(param, click.Argument):
        return (param.name or "").replace("_", "-")
    return max(param.opts, key=len).lstrip("-")


def _read(path: str) -> dict[str, Any]:
    """The TOML table of ``path``.

    Raises:
        ConfigError: a missing or unreadable file, or one that is no TOML (its line and column).
    """
    where = f"--config {path}"
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file; give the path of a TOML job file") from None
    except IsADirectoryError:
        raise ConfigError(f"{where} is a folder; give the path of a TOML job file") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text; a TOML job file is UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: not valid TOML: {e}") from None
    except ValueError:  # a path with a NUL byte, which no file has (after UTF-8 and TOML's, both ValueErrors)
        raise ConfigError(f"{where}: no such file; give the path of a TOML job file") from None


def _unknown(key: str, keys: list[str]) -> str:
    """The message for a key no option has, naming the nearest one (and a close one as the likely meant)."""
    wanted = key.replace("_", "-")
    close = difflib.get_close_matches(wanted, keys, n=1, cutoff=0.6)
    if close:
        return f"unknown key {key!r}; did you mean {close[0]!r}?"
    nearest = difflib.get_close_matches(wanted, keys, n=1, cutoff=0)
    hint = f" (the nearest is {nearest[0]!r})" if nearest else ""
    return f"unknown key {key!r}{hint}; the keys are planner plan's options without the dashes (docs/options.md)"


def _shown(value: Any) -> str:
    return json.dumps(value, default=str)


def _set_entries(key: str, value: Any, where: str) -> list[str]:
    """``set`` in a file: a table of config entries or a list of ``KEY=VALUE`` strings, as ``--set`` takes them."""
    if isinstance(value, dict):
        try:
            return [f"{name}={json.dumps(entry)}" for name, entry in value.items()]
        except TypeError:  # a TOML date or time: JSON has none
            raise ConfigError(
                f"{where}: {key}: a config entry must be a string, number, boolean, array or table"
            ) from None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(
        f'{where}: {key} = {_shown(value)}: expected a table ({key} = {{ n_layers = 4 }}) or a list of "KEY=VALUE" strings'
    )


def _kind_error(param: click.Parameter, value: Any) -> str | None:
    """Why ``value`` (as TOML read it) is the wrong kind for ``param``, or None: click would read a float
    2.5 as the whole number 2, and any value as a string."""
    kind = param.type
    if isinstance(param, click.Option) and param.is_flag:
        return None if isinstance(value, bool) else "expected true or false"
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return "expected a single string or number"
    if isinstance(kind, (CountOrAuto, ReplicasOrAuto)):
        return None if isinstance(value, (int, str)) else 'expected a whole number or "auto"'
    if isinstance(kind, click.types.IntParamType):
        return None if isinstance(value, int) else "expected a whole number"
    if isinstance(kind, FactorOrAuto):
        return None  # a number, "auto", or a mistake the option names
    if isinstance(kind, click.types.FloatParamType):
        return None if isinstance(value, (int, float)) else "expected a number"
    return None if isinstance(value, str) else "expected a string"


def _file_value(ctx: click.Context, param: click.Parameter, key: str, value: Any, where: str) -> Any:
    """A file's value for ``param``, checked as the command line's would be.

    Raises:
        ConfigError: the wrong kind of value, or one click's type refuses (its message).
    """
    if param.multiple:
        value = _set_entries(key, value, where)
    else:
        wrong = _kind_error(param, value)
        if wrong:
            raise ConfigError(f"{where}: {key} = {_shown(value)}: {wrong}")
    try:
        param.type_cast_value(ctx, value)
    except click.BadParameter as e:
        raise ConfigError(f"{where}: {key} = {_shown(value)}: {e.message}") from None
    return value


def load_job_file(ctx: click.Context, _param: click.Parameter, path: str | None) -> None:
    """``--config``'s callback: the file's values become the command's ``default_map`` (an eager option,
    so this runs before any other option takes its value).

    Args:
        ctx: the command's context.
        _param: ``--config``.
        path: the job file, or None.

    Raises:
        ConfigError: the file is missing, no TOML, or has a key or value the command does not take.
    """
    if path is None or ctx.resilient_parsing:
        return
    where = f"--config {path}"
    params = {file_key(p): p for p in ctx.command.get_params(ctx) if file_key(p) not in NOT_IN_FILE}
    values: dict[str, Any] = {}
    for key, value in _read(path).items():
        param = params.get(key)
        if key == "config":
            raise ConfigError(f"{where}: config: a job file cannot name another; give one --config")
        if param is None or param.name is None:
            raise ConfigError(f"{where}: {_unknown(key, list(params))}")
        values[param.name] = _file_value(ctx, param, key, value, where)
    ctx.default_map = {**(ctx.default_map or {}), **values}


def merge_file_overrides(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """``--set``'s callback: entries on the command line add to the job file's (and win for a key in both)
    rather than replacing them all, as click's ``default_map`` would.

    Args:
        ctx: the command's context.
        param: ``--set``.
        value: the entries click found (the command line's, else the file's).

    Returns:
        The file's entries, then the command line's (later ones win in ``parse_overrides``).
    """
    from click.core import ParameterSource

    name = param.name or ""
    if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE and ctx.default_map:
        return tuple(ctx.default_map.get(name, ())) + tuple(value)
    return tuple(value)


config_option = option(
    "--config",
    default=None,
    metavar="JOB.toml",
    is_eager=True,
    expose_value=False,
    callback=load_job_file,
    help="Take options from a TOML job file (keys: option names); the command line wins.",
)


__all__ = ["ConfigError", "config_option", "file_key", "load_job_file", "merge_file_overrides"]
