"""A split the user already runs (``--compare SPLIT``), turned into the plan's stage starts, so it can
be costed beside the plan (and trained: ``--method given``).

Pure. SPLIT is written as the trainers write it:

* layer counts per stage, ``3,4`` (torchtitan's and Megatron's unit): the blocks before the first
  layer join stage 0, those after the last layer the last stage, a block between layers its layer;
* a Megatron ``--pipeline-model-parallel-layout`` string, ``Et*3|t*4L`` (``E`` embedding, ``t``
  a decoder layer, ``L`` the loss, ``|`` between stages, in Megatron's vpp x pp order, which is
  the plan's global stage order);
* DeepSpeed's ``parts``, ``parts:0,3,7`` (block indices: each stage's first block, then the count);
* torchtitan's ``module_fqns_per_model_part`` (``fqns:`` and a JSON list of lists; the command line
  reads it from a file), each stage's blocks by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from planner.core.split.solve_engine import legal_starts
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost

_COUNTS = re.compile(r"^\s*\d+(\s*,\s*\d+)+\s*$")
_MEGATRON = re.compile(r"^[EtLm|(),*\d\s]+$")
_MAX_UNROLLED = 1_000_000  # symbols of an unrolled Megatron layout


def split_kind(spec: str) -> str:
    """Which notation ``spec`` is written in: "counts", "megatron", "parts" or "fqns".

    Raises:
        InfeasibleError: none of them (one line listing the forms).
    """
    if spec.startswith("parts:"):
        return "parts"
    if spec.startswith("fqns:"):
        return "fqns"
    if _COUNTS.match(spec):
        return "counts"
    if _MEGATRON.match(spec) and ("E" in spec or "t" in spec):
        return "megatron"
    raise InfeasibleError(
        f"--compare {spec!r}: give layer counts per stage (3,4), a Megatron layout (Et*3|t*4L), DeepSpeed parts "
        "(parts:0,3,7) or a file holding torchtitan's module_fqns_per_model_part (JSON, TOML or Python)"
    )


def check_notation(spec: str) -> None:
    """Refuse a split that is not written in any of the notations, before the model is profiled
    (what depends on the model's blocks is checked by ``given_starts``).

    Raises:
        InfeasibleError: an unknown notation, a Megatron string that does not unroll, or parts that
            are not block indices, named in one line.
    """
    kind = split_kind(spec)
    if kind == "megatron":
        _megatron_stages(spec)
    elif kind == "parts":
        _parts(spec.removeprefix("parts:"), None)


def given_starts(spec: str, blocks: Sequence[BlockCost]) -> list[int]:
    """The first block of every stage of the split ``spec`` (see the module docstring).

    Args:
        spec: the split, in one of the notations ``split_kind`` names.
        blocks: the model's blocks, in order.

    Returns:
        Stage starts, increasing from 0, each a legal cut.

    Raises:
        InfeasibleError: a split that does not fit the model (too many or few layers, an unknown or
            misplaced block, an empty stage, a cut the model cannot make), named in one line.
    """
    kind = split_kind(spec)
    if kind == "parts":
        starts = _parts(spec.removeprefix("parts:"), len(blocks))
    elif kind == "fqns":
        starts = _fqn_starts(json.loads(spec.removeprefix("fqns:")), blocks)
    elif kind == "counts":
        starts = _count_starts([int(x) for x in spec.split(",")], blocks)
    else:
        starts = _megatron_starts(_megatron_stages(spec), blocks)
    _check_cuts(spec, starts, blocks)
    return starts


def _parts(text: str, n: int | None) -> list[int]:
    """The stage starts of DeepSpeed's ``parts`` (``n``: the block count they end at; None: not known
    yet, before profiling, so only their form is checked)."""
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        raise InfeasibleError(f"--compare parts:{text}: give block indices, e.g. parts:0,3,{n or 7}") from None
    ends = n is None or parts[-1] == n
    if len(parts) < 2 or parts[0] != 0 or not ends or any(b <= a for a, b in zip(parts, parts[1:])):
        count = "" if n is None else f" ({n})"
        raise InfeasibleError(
            f"--compare parts:{text}: DeepSpeed's parts start at 0, increase and end at the block count{count}"
        )
    return parts[:-1]


def _layers(blocks: Sequence[BlockCost]) -> list[int]:
    layers = [k for k, b in enumerate(blocks) if b.is_layer]
    if not layers:
        raise InfeasibleError("--compare: the model has no repeated layers to count; give parts:... or a module list")
    return layers


def _count_starts(counts: list[int], blocks: Sequence[BlockCost]) -> list[int]:
    """Stage starts of a split given as layers per stage (stage k > 0 starts at its first layer)."""
    layers = _layers(blocks)
    if sum(counts) != len(layers):
        raise InfeasibleError(
            f"--compare {','.join(map(str, counts))}: {sum(counts)} layers in all, but the model has {len(layers)}"
        )
    if any(c == 0 for c in counts[1:]):
        raise InfeasibleError(
            f"--compare {','.join(map(str, counts))}: a stage after the first holds no layer (it would be empty)"
        )
    starts, done = [0], counts[0]
    for c in counts[1:]:
        starts.append(layers[done])
        done += c
    return starts


def _megatron_stages(spec: str) -> list[str]:
    """Megatron's layout string unrolled (its own rules: ``(..)*n``, ``x*n``, cosmetic commas) and split by stage."""
    text = spec.replace(",", "").replace(" ", "")
    if "m" in text:
        raise InfeasibleError(f"--compare {spec!r}: multi-token prediction layers (m) are not supported")
    for pattern in (r"\(([^()]+)\)\*(\d+)", r"([EtL|])\*(\d+)"):
        while found := re.search(pattern, text):  # innermost groups first, so groups may nest
            repeat, digits = found.group(1), found.group(2)
            count = int(digits) if len(digits) < 8 else _MAX_UNROLLED + 1  # int() refuses 4,301 digits
            if len(text) + len(repeat) * count > _MAX_UNROLLED:  # t*10**12 would fill the memory
                raise InfeasibleError(
                    f"--compare {spec[:60]!r}: unrolls to over {_MAX_UNROLLED:,} symbols; no model has that many layers"
                )
            text = text[: found.start()] + repeat * count + text[found.end() :]
    left = re.search(r"[()*\d]+", text)
    if left:
        # what no rule unrolled: a repeat without a count or symbol (t**2, *3), a count without *
        # (t3), or a bracket without its partner
        raise InfeasibleError(
            f"--compare {spec!r}: cannot read {left.group()!r} (after unrolling: {text[:40]!r}); a repeat is a symbol "
            "(E, t, L, |) or a (group) followed by *N, as in Et*3|t*4L or E(tt|)*2L"
        )
    return text.split("|")


def _megatron_starts(stages: list[str], blocks: Sequence[BlockCost]) -> list[int]:
    """Stage starts of a Megatron layout: E opens stage 0, each stage starts at its first t, a stage of
    L alone at the first block after the last layer."""
    flat = "".join(stages)
    if flat.count("E") != 1 or not stages[0].startswith("E") or flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise InfeasibleError(
            f"--compare {'|'.join(stages)}: a Megatron layout has one E, at the start of the first stage, and one L, "
            "at the end of the last"
        )
    layers = _layers(blocks)
    counts = [s.count("t") for s in stages]
    if sum(counts) != len(layers):
        raise InfeasibleError(
            f"--compare {'|'.join(stages)}: {sum(counts)} layers (t), but the model has {len(layers)}"
        )
    starts, done = [0], counts[0]
    for stage, c in zip(stages[1:], counts[1:]):
        if c:
            starts.append(layers[done])
        elif stage == "L":
            starts.append(layers[-1] + 1)
        else:
            raise InfeasibleError(f"--compare {'|'.join(stages)}: stage {len(starts)} holds no layer and no L")
        done += c
    return starts


def _fqn_starts(parts: object, blocks: Sequence[BlockCost]) -> list[int]:
    """Stage starts of torchtitan's module lists: every block once, in order, by name."""
    if not isinstance(parts, list) or not all(isinstance(p, list) and p for p in parts):
        raise InfeasibleError("--compare: module_fqns_per_model_part must be a list of non-empty lists of names")
    index = {b.name: k for k, b in enumerate(blocks)}
    starts, expected = [], 0
    for stage, names in enumerate(parts):
        for name in names:
            if name not in index:
                near = ", ".join(b.name for b in blocks[:4])
                raise InfeasibleError(
                    f"--compare: stage {stage} names {name!r}, which is no block of the model (its blocks: {near}, ...); "
                    "name the model's own modules, as the plan's blocks are"
                )
        got = [index[n] for n in names]
        if got != list(range(expected, expected + len(got))):
            raise InfeasibleError(
                f"--compare: stage {stage} holds {', '.join(names)}; expected the blocks that follow the previous "
                f"stage, in order, from {blocks[expected].name if expected < len(blocks) else 'none'}"
            )
        starts.append(expected)
        expected += len(got)
    if expected != len(blocks):
        raise InfeasibleError(
            f"--compare: the stages hold {expected} of the model's {len(blocks)} blocks; list them all"
        )
    return starts


def _check_cuts(spec: str, starts: list[int], blocks: Sequence[BlockCost]) -> None:
    if any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= len(blocks):
        raise InfeasibleError(f"--compare {spec[:60]!r}: a stage of this split holds no block of the model")
    legal = legal_starts(blocks)
    for s in starts[1:]:
        if not legal[s]:
            raise InfeasibleError(
                f"--compare {spec[:60]!r}: the split cuts between {blocks[s - 1].name} and {blocks[s].name}, where the "
                "model cannot be cut (a value other than the hidden state crosses there)"
            )
