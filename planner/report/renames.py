"""``planner export --rename OLD=NEW``: block-name prefixes replaced in the formats that name modules,
and the renames refused that would be ignored or break an export (``ExportError``, one line each).

Pure: it reads the plan only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from planner.errors import PlannerError
from planner.schema.plan import Plan


class ExportError(PlannerError):
    """The plan's split cannot be written in the target's terms (one line: why, and what to do)."""


def parse_renames(pairs: Iterable[str]) -> dict[str, str]:
    """``--rename OLD=NEW`` pairs as a mapping.

    Args:
        pairs: the option's values.

    Returns:
        OLD -> NEW, in the order given.

    Raises:
        ExportError: a pair without ``=`` or with an empty side, or one OLD given twice.
    """
    out: dict[str, str] = {}
    for pair in pairs:
        old, sep, new = pair.partition("=")
        if not sep or not old.strip() or not new.strip():
            raise ExportError(f"--rename {pair!r}: give OLD=NEW, e.g. --rename model.layers=layers")
        if old.strip() in out:
            raise ExportError(
                f"--rename {old.strip()} is given twice (={out[old.strip()]} and ={new.strip()}); give it once"
            )
        out[old.strip()] = new.strip()
    return out


def renamed(name: str, renames: Mapping[str, str]) -> str:
    """A block name with the longest matching ``--rename`` prefix replaced (a whole dotted prefix:
    ``model.layers=layers`` turns ``model.layers.3`` into ``layers.3``, not ``model.layers_x``)."""
    for old in sorted(renames, key=len, reverse=True):
        if name == old or name.startswith(old + "."):
            return renames[old] + name[len(old) :]
    return name


# a module path: names (or ModuleList indices) joined by dots
_MODULE_PATH = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
_NAMES_MODULES = ("torchtitan", "torchtitan-toml", "deepspeed")  # the formats --rename applies to


def check_renames(plan: Plan, renames: Mapping[str, str], fmt: str) -> None:
    """Refuse a ``--rename`` that would be ignored or would break the export, each in one line.

    A rename that matched nothing, or one given to a format that names no modules, was silently
    dropped; ``a=b=c`` renamed ``a`` to ``b=c``; ``layers.0=norm`` exported "norm" in two stages.

    Args:
        plan: the plan exported.
        renames: OLD -> NEW (``parse_renames``).
        fmt: the export format.

    Raises:
        ExportError: renames for a format without module names, a side that is not a module path,
            an OLD no block name starts with, two blocks renamed to one name, or one renamed inside
            another (a name both a module and the parent of another).
    """
    if not renames:
        return
    if fmt not in _NAMES_MODULES:
        raise ExportError(
            f"--to {fmt} names no modules, so --rename would change nothing; leave it out (it applies to "
            f"{', '.join(_NAMES_MODULES)})"
        )
    names = [b.name for b in plan.blocks]
    for old, new in renames.items():
        for side in (old, new):
            if not _MODULE_PATH.match(side):
                raise ExportError(f"--rename {old}={new}: {side!r} is not a module path (names joined by dots)")
        if not any(renamed(n, {old: new}) != n for n in names):
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ExportError(f"--rename {old}={new}: no block is {old!r} or inside it (the blocks: {shown})")
    seen: dict[str, str] = {}
    for name in names:
        out = renamed(name, renames)
        if out in seen:
            raise ExportError(f"--rename gives blocks {seen[out]!r} and {name!r} one name, {out!r}; rename them apart")
        seen[out] = name
    for out, name in seen.items():  # "norm" beside "norm.0": one name both a module and its parent
        parents = [".".join(out.split(".")[:k]) for k in range(1, out.count(".") + 1)]
        clash = next((p for p in parents if p in seen), None)
        if clash is not None and (renamed(name, renames) != name or renamed(seen[clash], renames) != seen[clash]):
            raise ExportError(
                f"--rename makes {clash!r} (block {seen[clash]!r}) the parent of {out!r} (block {name!r}): one name "
                "would be a module and hold another; rename them apart"
            )
