"""Options shown in headed groups in ``--help``: click lists every option in one flat "Options:" list, which
for ``planner plan`` was 34 paragraphs with three filling the first screen.

Each option is tagged with its group by ``option_group``; ``GroupedCommand`` writes one section per group,
in the order the groups were declared, and puts any untagged option (``--help``) in the last one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


class GroupedOption(click.Option):
    """A ``click.Option`` that knows the ``--help`` section it belongs to (set by ``option_group``)."""

    group: str | None = None


def option(*param_decls: str, **attrs: Any) -> Decorator:
    """``click.option`` making a ``GroupedOption``, for ``option_group`` to tag.

    Args:
        param_decls: the option's names, as for ``click.option``.
        attrs: the option's settings, as for ``click.option``.

    Returns:
        The decorator that adds the option to a command function.
    """
    return click.option(*param_decls, cls=GroupedOption, **attrs)


def option_group(title: str, *options: Decorator) -> Decorator:
    """One decorator adding ``options`` (made by ``option``) under the ``--help`` heading ``title``.

    Args:
        title: the section heading, e.g. "Layout".
        options: the options of the group, in the order ``--help`` lists them.

    Returns:
        The decorator that adds them to a command function.

    Raises:
        TypeError: an option not made by ``option`` (it could not carry its group).
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        before = len(getattr(fn, "__click_params__", []))
        for add in reversed(options):
            fn = add(fn)
        for param in fn.__click_params__[before:]:  # type: ignore[attr-defined]
            if not isinstance(param, GroupedOption):
                raise TypeError(f"{param.name}: make the options of a group with cli_groups.option")
            param.group = title
        return fn

    return decorate


class GroupedCommand(click.Command):
    """A command whose ``--help`` lists its options in one section per group; ``--help`` itself (and any
    option without a group) goes in the last group's section."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Write the options, one ``formatter.section`` per group, groups in the order first met.

        Args:
            ctx: the command's context.
            formatter: where the help is written.
        """
        sections: dict[str, list[tuple[str, str]]] = {}
        loose: list[tuple[str, str]] = []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None or isinstance(param, click.Argument):
                continue
            group = param.group if isinstance(param, GroupedOption) else None
            if group is None:
                loose.append(record)
            else:
                sections.setdefault(group, []).append(record)
        if loose:
            last = next(reversed(sections)) if sections else "Options"
            sections.setdefault(last, []).extend(loose)
        for title, records in sections.items():
            with formatter.section(title):
                formatter.write_dl(records)


__all__ = ["GroupedCommand", "GroupedOption", "option", "option_group"]
