"""Checkpoints of ``planner run``: save, find, resume and export, with torch.distributed.checkpoint.

One checkpoint is one DCP folder, ``DIR/step_00000120``, written by every rank together. Its
state is keyed by the **unsplit model's names** (``transformer.h.3.attn.c_attn.weight``), not by
stage, so a checkpoint:

- loads into the unsplit model (``planner export-weights``, or ``load_into`` in Python), and
- resumes under another split of the same model (DCP re-shards by name), not only the one it was
  written under.

What it holds (the keys of the DCP state):

- ``model.<name>``: every parameter and persistent buffer, under each of its names (a tied
  weight's copies on several ranks are equal, and DCP writes one);
- ``optim.<name>.<key>``: the optimizer's state of each parameter (AdamW's moments and step);
- ``sched``: the learning-rate schedule's state (its step count);
- ``rng.<rank>``: each rank's torch RNG state (dropout), ``data.<rank>``: each rank's data-stream
  state, ``step``: the last completed step.

Beside them a ``--data`` run keeps its vocabulary, ``DIR/vocab.json``, written with its first
checkpoint (``keep_vocab``), so a resumed run reads the ids the model was trained on.

Written so that a crash mid-save never damages the last good checkpoint: the ranks write into
``DIR/.step_00000120.partial``; once all have written (DCP's final metadata write is collective),
rank 0 renames it to ``DIR/step_00000120`` (an atomic rename on one file system) and only then
records it in ``DIR/latest``. A folder without DCP's ``.metadata`` or with the ``.partial``
suffix is never resumed from. Several nodes must share DIR (one file system), as DCP requires.

A folder belongs to one run of one plan. Each run has an id (rank 0's, kept by a resumed run),
recorded in every step's ``planner.json`` (``run_id``, beside the plan's fingerprint) and in
``DIR/latest`` (``step_00000120 <run id>``). ``--resume`` and ``export-weights`` take the step
``latest`` names, not the highest step number, which may be an older run's. A fresh run's saves
remove the step folders of this model's earlier runs and any ``.partial`` folder (never
resumable); nothing else in DIR is removed or written over (``owned_by_planner``).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import torch
from torch import nn

from planner.errors import PlannerError

if TYPE_CHECKING:
    from planner.data.text import Vocab

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_PARTIAL_DIR = re.compile(r"^\.step_\d{8}\.partial$")
# what save_checkpoint writes to DIR/latest: the step folder, then the run's id (older versions: no id)
_RUN_ID = re.compile(r"[0-9a-f]{32}")
_LATEST_LINE = re.compile(rf"(step_\d{{8}})(?: ({_RUN_ID.pattern}))?\n?")
_LATEST_MAX = 128  # a longer DIR/latest is not a pointer planner wrote; never read a big file whole
META_FILE = "planner.json"
LATEST_FILE = "latest"
VOCAB_FILE = "vocab.json"


class Stateful(Protocol):
    """A thing with a resumable position (a data stream)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def kept_vocab(root: Path) -> Path | None:
    """The vocabulary a ``--data`` run keeps beside its checkpoints, when there is one.

    Args:
        root: the checkpoint folder.

    Returns:
        ``root / "vocab.json"`` when it exists (a resumed run reads its ids from it), else None.
    """
    path = root / VOCAB_FILE
    return path if path.exists() else None


def keep_vocab(root: Path, vocab: Vocab, fresh: bool = False) -> None:
    """Keep a ``--data`` run's vocabulary beside its checkpoints, unless one is kept already.

    Written with the run's first checkpoint, not when the stream is made: a run that stops (or is
    refused) before it saves anything leaves no vocabulary behind to refuse the next run's
    ``--tokenizer``, and no checkpoint is ever published without the ids it was trained on. A fresh
    run replaces the one an earlier run kept (that run's steps go with the same save).

    Args:
        root: the checkpoint folder (created if missing).
        vocab: the stream's vocabulary.
        fresh: the run started afresh (not ``--resume``): its own vocabulary replaces a kept one.

    Raises:
        DataError: the file cannot be written.
    """
    if fresh or kept_vocab(root) is None:
        vocab.save(root / VOCAB_FILE)


def step_of(path: Path) -> int | None:
    """The step of a folder named as ``step_dir`` names it (``step_00000120``: 120); None for any other name."""
    digits = path.name.removeprefix("step_")
    if digits == path.name or not digits.isdigit():
        return None
    step = int(digits)
    return step if step_dir(path.parent, step).name == path.name else None


def step_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives under ``root``."""
    return root / f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first (a partial or foreign folder is skipped)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: p.name)


def is_run_id(value: object) -> TypeGuard[str]:
    """A run's id as ``planner run`` makes one (``uuid4().hex``), fit to be written to ``latest``."""
    return isinstance(value, str) and _RUN_ID.fullmatch(value) is not None


def parse_latest(text: str) -> tuple[str, str | None] | None:
    """What a ``DIR/latest`` that ``planner run`` wrote says: (step folder name, run id or None).

    Args:
        text: the file's content.

    Returns:
        The pointer, or None when the text is not one ``planner run`` writes (a user's own file).
    """
    found = _LATEST_LINE.fullmatch(text)
    return (found.group(1), found.group(2)) if found else None


def read_latest(root: Path) -> tuple[str, str | None] | None:
    """``root/latest`` parsed (``parse_latest``); None when missing, unreadable or not a pointer."""
    path = root / LATEST_FILE
    if path.is_symlink() or not path.is_file():
        return None
    try:
        with path.open("rb") as f:
            raw = f.read(_LATEST_MAX + 1)
        return parse_latest(raw.decode()) if len(raw) <= _LATEST_MAX else None
    except (OSError, UnicodeDecodeError):
        return None


def foreign_latest(root: Path) -> bool:
    """``root/latest`` exists but is not a step pointer ``planner run`` wrote, so a save must not replace it."""
    path = root / LATEST_FILE
    return (path.exists() or path.is_symlink()) and read_latest(root) is None


def read_meta(path: Path) -> dict[str, Any] | None:
    """The ``planner.json`` of a step folder, or None when it has none readable (not planner's)."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("step"), int) else None


def owned_by_planner(path: Path) -> bool:
    """A folder ``planner run`` published: named ``step_NNNNNNNN``, holding its ``planner.json``.

    Only such folders (and ``.step_NNNNNNNN.partial`` ones) are ever removed or replaced: a user's
    own folder in DIR is left alone whatever its name.
    """
    return bool(_STEP_DIR.match(path.name)) and path.is_dir() and not path.is_symlink() and read_meta(path) is not None


def choose_latest(done: list[Path], pointer: tuple[str, str | None] | None) -> Path | None:
    """The checkpoint to continue from among complete ones: the one ``latest`` names, if it is there.

    ``latest`` is written last, after the rename, so it names the last step of the last run that
    saved; the highest step number may belong to an older run (a long run stopped early, then a
    short fresh one). When ``latest`` is missing or stale (its folder is gone, or belongs to another
    run than it says), the most recently published folder is taken (its ``planner.json`` is written
    just before the rename), the step breaking ties.

    Args:
        done: the complete checkpoints (``complete_checkpoints``).
        pointer: ``latest`` parsed (``read_latest``), or None.

    Returns:
        The checkpoint folder, or None when ``done`` is empty.
    """
    if pointer is not None:
        name, run_id = pointer
        for path in done:
            if path.name == name and (run_id is None or (read_meta(path) or {}).get("run_id") in (None, run_id)):
                return path
    if not done:
        return None
    return max(done, key=lambda p: (_published_at(p), p.name))


def _published_at(path: Path) -> float:
    """When a step folder was published: its ``planner.json``'s time, else the folder's."""
    for candidate in (path / META_FILE, path):
        try:
            return candidate.stat().st_mtime
        except OSError:
            continue
    return 0.0


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint a run continues from under ``root``: the one ``latest`` names (None: there is none).

    Args:
        root: the checkpoint folder.

    Returns:
        A complete checkpoint folder (``choose_latest``), or None.
    """
    return choose_latest(complete_checkpoints(root), read_latest(root))


def earlier_checkpoints(root: Path, run_id: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """The complete checkpoints ``planner run`` wrote under ``root`` and not in run ``run_id``, oldest first.

    Args:
        root: the checkpoint folder.
        run_id: a run whose own folders are left out (None: none is).

    Returns:
        (folder, its ``planner.json``) of each.
    """
    found = [(p, read_meta(p)) for p in complete_checkpoints(root)]
    return [(p, m) for p, m in found if m is not None and (run_id is None or m.get("run_id") != run_id)]


def clear_stale(root: Path, run_id: str | None, fingerprint: str | None, keep_unnamed: bool) -> list[Path]:
    """Remove what no run can continue from: ``.partial`` folders, and this model's earlier runs' steps.

    Called by rank 0 after publishing a checkpoint, so the earlier run's checkpoints are replaced only
    once this run has one. Only folders ``planner run`` wrote go: a step folder of another model
    (refused before any rank started) or without ``planner.json`` (a user's own) stays.

    Args:
        root: the checkpoint folder.
        run_id: the saving run's id (None: keep every step folder, remove only ``.partial`` ones).
        fingerprint: the plan's model fingerprint (a folder of another model is kept).
        keep_unnamed: keep folders written before runs had ids (a resumed run continued them).

    Returns:
        The folders removed.
    """
    removed: list[Path] = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if _PARTIAL_DIR.match(path.name) and path.is_dir() and not path.is_symlink():
            removed.append(path)
        elif run_id is not None and owned_by_planner(path):
            meta = read_meta(path) or {}
            other = meta.get("run_id")
            if other != run_id and not (other is None and keep_unnamed) and meta.get("plan_fingerprint") == fingerprint:
                removed.append(path)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def checkpoint_meta(path: Path) -> dict[str, Any]:
    """What ``planner run`` recorded beside a checkpoint: step, plan fingerprint, layout.

    Raises:
        PlannerError: the folder is not a checkpoint ``planner run`` wrote.
    """
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        raise PlannerError(
            f"{path} is not a checkpoint of `planner run` (no readable {META_FILE}); give a folder "
            "`planner run --checkpoint-dir` wrote, e.g. DIR/step_00000100"
        ) from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise PlannerError(f"{path / META_FILE} is damaged (no step recorded); use an older checkpoint")
    return meta


def checkpoint_step(path: Path, fingerprint: str, fix: str) -> int:
    """The step of a checkpoint, checked to be of the model with ``fingerprint``.

    Args:
        path: a checkpoint folder.
        fingerprint: the plan's ``model.fingerprint``.
        fix: what the user should do instead, ending the message.

    Raises:
        PlannerError: not a checkpoint of ``planner run``, or one of another model.
    """
    meta = checkpoint_meta(path)
    if meta.get("plan_fingerprint") not in (None, fingerprint):
        raise PlannerError(
            f"{path} was written by a run of another model (fingerprint {meta['plan_fingerprint']}, the plan's "
            f"is {fingerprint}); {fix}"
        )
    return int(meta["step"])


def model_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name the unsplit model gives each of its state tensors, by tensor identity.

    Only what ``model.state_dict()`` holds counts: parameters and persistent buffers. A tied
    parameter has several names.
    """
    keep = set(model.state_dict(keep_vars=True))
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name in keep:
            names.setdefault(id(t), []).append(name)
    return names


@dataclass
class RankState:
    """Everything one rank checkpoints, and puts back on resume.

    Attributes:
        rank: the global rank (the key of its RNG and data state).
        tensors: model name -> this rank's parameter or buffer (``stage_state``).
        optimizer: its optimizer (None: the rank holds no parameters).
        scheduler: the learning-rate schedule (None: a constant rate).
        data: the data stream, when it can say where it is (None: the step count replays it).
        device: where the RNG state of a GPU rank lives (CPU ranks: only torch's CPU generator).
        shards: id of a parameter this rank holds a share of (an expert-parallel layer's experts)
            -> what turns it, and its optimizer state of its shape, into the whole tensor's view
            that is saved and loaded (``planner.run.stages.RankStages.shards``).
    """

    rank: int
    tensors: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any | None = None
    data: Stateful | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    shards: dict[int, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)

    def _whole(self, param: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``t`` (``param`` or a state of its shape) as saved: the whole tensor's view of a share."""
        view = self.shards.get(id(param))
        return view(t) if view is not None and t.shape == param.shape else t

    def _param_names(self) -> dict[int, str]:
        """The first name of each parameter (the optimizer's state is keyed by it)."""
        out: dict[int, str] = {}
        for name, t in sorted(self.tensors.items()):
            out.setdefault(id(t), name)
        return out

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """``optim.<name>.<key>`` -> the optimizer's state tensor of that parameter."""
        if self.optimizer is None:
            return {}
        names = self._param_names()
        out: dict[str, torch.Tensor] = {}
        for p, st in self.optimizer.state.items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim.{names[id(p)]}.{key}"] = self._whole(p, value)
        return out

    def init_optimizer_state(self) -> None:
        """Create the optimizer's state tensors without moving any weight, so a checkpoint can be
        loaded into them: one step at learning rate 0 on zero gradients (AdamW's decoupled weight
        decay is lr * wd, so 0 too), as torch.distributed.checkpoint.state_dict does."""
        opt = self.optimizer
        if opt is None or opt.state:
            return
        saved = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        opt.step()
        for g, lr in zip(opt.param_groups, saved):
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)

    def state_dict(self, step: int) -> dict[str, Any]:
        """The DCP state of this rank at ``step`` (tensors are this rank's own, not copies)."""
        state: dict[str, Any] = {f"model.{k}": self._whole(v, v) for k, v in self.tensors.items()}
        state.update(self.optimizer_state())
        state[f"rng.{self.rank}"] = torch.get_rng_state()
        if self.device.type == "cuda":
            state[f"rng_cuda.{self.rank}"] = torch.cuda.get_rng_state(self.device)
        # Nested states are stored as one opaque value each: DCP would otherwise flatten them
        # into keys of their own, which a fresh skeleton must then match entry for entry.
        if self.scheduler is not None:
            state["sched"] = pickle.dumps(self.scheduler.state_dict())
        if self.data is not None:
            state[f"data.{self.rank}"] = pickle.dumps(self.data.state_dict())
        state["step"] = step
        return state


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def save_checkpoint(
    root: Path, step: int, state: RankState, meta: dict[str, Any], *, keep_unnamed: bool = False
) -> Path:
    """Write the checkpoint of ``step`` (every rank calls this at the same step).

    Rank 0 then records it in ``DIR/latest`` with the run's id and clears what no run can continue
    from (``clear_stale``): the ``.partial`` folders, and the steps of this model's earlier runs.

    Args:
        root: the checkpoint folder (created if missing; shared by all nodes).
        step: the last completed step.
        state: this rank's state.
        meta: what rank 0 records beside it (plan fingerprint, layout, ``run_id``), as JSON.
        keep_unnamed: keep step folders written before runs had ids (a resumed run continues them).

    Returns:
        The checkpoint's folder.

    Raises:
        PlannerError: the folder cannot be written, or ``DIR/step_NNNNNNNN`` is a folder
            ``planner run`` did not write.
    """
    import torch.distributed.checkpoint as dcp

    final = step_dir(root, step)
    partial = root / f".{final.name}.partial"
    lead = not _dist_ready() or torch.distributed.get_rank() == 0
    try:
        if lead:
            root.mkdir(parents=True, exist_ok=True)
            _check_replaceable(root, final)
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that crashed
        if _dist_ready():
            torch.distributed.barrier()
        # the writer named: given only a path, DCP imports fsspec (and its compression codecs) to ask
        # whether it is a URL, 0.4 s of CPU in every rank at every save; these are local folders
        dcp.save(state.state_dict(step), checkpoint_id=partial, storage_writer=dcp.FileSystemWriter(partial))
        if _dist_ready():
            torch.distributed.barrier()  # every rank's files are written
        if lead:
            (partial / META_FILE).write_text(json.dumps({**meta, "step": step}, indent=2) + "\n")
            if final.exists():  # a resumed run saving the same step again, or an earlier run's (planner's)
                shutil.rmtree(final)
            os.replace(partial, final)
            run_id = meta.get("run_id") if is_run_id(meta.get("run_id")) else None
            tmp = root / ".latest.tmp"
            tmp.write_text(f"{final.name} {run_id}\n" if run_id else f"{final.name}\n")
            os.replace(tmp, root / LATEST_FILE)
            clear_stale(root, run_id, meta.get("plan_fingerprint"), keep_unnamed)
    except OSError as e:
        raise PlannerError(
            f"cannot write checkpoint {final}: {e.strerror or e}; free space or pick another --checkpoint-dir"
        ) from None
    return final


def check_latest_replaceable(root: Path, where: str) -> None:
    """Refuse a save into ``root`` whose ``latest`` is a user's own file (``foreign_latest``): the
    save would replace it. ``planner run`` asks before any rank starts, every save again.

    Args:
        root: the checkpoint folder.
        where: how the message names the folder (the option the user gave, or the folder).

    Raises:
        PlannerError: ``root/latest`` is there and names no step folder.
    """
    if foreign_latest(root):
        raise PlannerError(
            f"{where}: {root / LATEST_FILE} is not a file `planner run` wrote (it names no step folder), and a "
            "save would replace it; move it away, or give --checkpoint-dir another folder"
        )


def _check_replaceable(root: Path, final: Path) -> None:
    """A save replaces ``latest`` and an existing step folder only if ``planner run`` wrote them (a
    resumed run saving the same step again, an earlier run of this model): never a user's own file.
    ``planner run`` refuses both before any rank starts; this guards every other caller."""
    check_latest_replaceable(root, f"checkpoint folder {root}")
    if (final.exists() or final.is_symlink()) and not owned_by_planner(final):
        raise PlannerError(
            f"{final} exists and is not a checkpoint `planner run` wrote (no {META_FILE}); move it away, or "
            "give --checkpoint-dir another folder"
        )


def load_checkpoint(path: Path, state: RankState) -> int:
    """Put a checkpoint back into this rank's tensors, optimizer, schedule, RNG and data stream.

    Keys this rank needs but the checkpoint lacks are refused (another model); keys of the
    checkpoint this rank does not hold are skipped (other stages'). The RNG and data state of a
    rank the checkpoint did not have (a run resumed on more ranks) start afresh.

    Args:
        path: a checkpoint folder (``step_dir``).
        state: this rank's state, built as for training.

    Returns:
        The step the checkpoint was taken after.

    Raises:
        PlannerError: the checkpoint lacks a tensor of this rank's stages or has another shape.
    """
    import torch.distributed.checkpoint as dcp

    state.init_optimizer_state()
    reader = dcp.FileSystemReader(path)  # named, as save names its writer: no fsspec
    have = set(reader.read_metadata().state_dict_metadata)
    full = state.state_dict(0)
    missing = [k for k in full if (k.startswith(("model.", "optim.")) or k in ("sched", "step")) and k not in have]
    if missing:
        raise PlannerError(
            f"checkpoint {path} has no {missing[0]!r} ({len(missing)} missing), which this run needs; it was written "
            "for another model or optimizer: resume with the plan it was written under, or start without --resume"
        )
    wanted = {k: v for k, v in full.items() if k in have}
    try:
        dcp.load(wanted, checkpoint_id=path, storage_reader=reader)
    except Exception as e:  # DCP wraps shape and read errors in its own exception types
        raise PlannerError(f"cannot load checkpoint {path}: {' '.join(str(e).split())[:300]}") from None
    # Tensors were loaded in place (parameters, buffers, optimizer moments, RNG states); the
    # rest comes back as values.
    if f"rng.{state.rank}" in wanted:
        torch.set_rng_state(wanted[f"rng.{state.rank}"])
    if f"rng_cuda.{state.rank}" in wanted:
        torch.cuda.set_rng_state(wanted[f"rng_cuda.{state.rank}"], state.device)
    if state.scheduler is not None and "sched" in wanted:
        state.scheduler.load_state_dict(pickle.loads(wanted["sched"]))
        # The schedule's state holds its step and last rates; the optimizer's groups take the rate
        # only at the schedule's next step, so set it now for the step about to run.
        assert state.optimizer is not None
        for group, lr in zip(state.optimizer.param_groups, state.scheduler.get_last_lr()):
            group["lr"] = lr
    if state.data is not None and f"data.{state.rank}" in wanted:
        state.data.load_state_dict(pickle.loads(wanted[f"data.{state.rank}"]))
    return int(wanted["step"])


def export_weights(path: Path, model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Load a checkpoint's weights into the unsplit model, in this process.

    A tensor the checkpoint lacks, where it holds the model's other tensors, is one no stage of the
    plan uses (a module ``forward`` never calls): no rank held it, no gradient reached it, and it
    keeps the value ``model`` was built with (the plan's seed), as in unsplit training, where the
    optimizer skips a parameter without a gradient. The caller has checked that the checkpoint is of
    this model (``checkpoint_step``).

    Args:
        path: a checkpoint folder.
        model: the unsplit model, built as the plan builds it.

    Returns:
        The model's state dict after loading (every parameter and persistent buffer), and the names
        of the tensors that kept their initial values.

    Raises:
        PlannerError: the checkpoint holds none of the model's tensors, or one of another shape.
    """
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(path)  # named, as save names its writer: no fsspec
    have = set(reader.read_metadata().state_dict_metadata)
    sd = model.state_dict()
    untrained = [k for k in sd if f"model.{k}" not in have]
    if sd and len(untrained) == len(sd):
        raise PlannerError(
            f"checkpoint {path} has no weights of this model (none of its {len(sd)} tensors, e.g. {untrained[0]!r}); "
            "it was written for another model"
        )
    wanted = {f"model.{k}": v for k, v in sd.items() if f"model.{k}" in have}
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is meant
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(wanted, checkpoint_id=path, storage_reader=reader, no_dist=True)
    except Exception as e:  # shapes that differ, a damaged file
        raise PlannerError(f"cannot load checkpoint {path}: {' '.join(str(e).split())[:300]}") from None
    model.load_state_dict({k: wanted.get(f"model.{k}", v) for k, v in sd.items()})
    return model.state_dict(), untrained


def save_weights(plan_file: Path, checkpoint: Path | None, out: Path) -> tuple[Path, int, list[str]]:
    """Write the unsplit model's state dict from a checkpoint of a plan's run, as ``torch.save`` does.

    Args:
        plan_file: the plan that was run (its model file builds the unsplit model).
        checkpoint: a checkpoint folder, or the folder of a run's checkpoints (the one its
            ``latest`` names is taken: ``latest_checkpoint``); None: the plan's default, PLAN's
            name with .ckpt.
        out: where the state dict goes (written through a temporary file).

    Returns:
        (the checkpoint used, its step, the tensors no stage uses, written at their initial values:
        ``export_weights``).

    Raises:
        PlannerError: no checkpoint there, one of another model, or ``out`` cannot be written.
    """
    from planner.run.model import load_plan_model
    from planner.schema.plan import Plan

    plan = Plan.load(plan_file)
    root = checkpoint if checkpoint is not None else plan_file.with_suffix(".ckpt")
    path = root if (root / ".metadata").is_file() else latest_checkpoint(root)
    if path is None:
        raise PlannerError(
            f"no complete checkpoint in {root}; give a folder `planner run` wrote (--checkpoint-dir), "
            "or one of its step_NNNNNNNN folders"
        )
    step = checkpoint_step(path, plan.model.fingerprint, "give the plan that run used")
    model = load_plan_model(plan, plan_file).build(plan.model.seed)
    state, untrained = export_weights(path, model)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PlannerError(f"cannot write {out}: {e.strerror or e}") from None
    return path, step, untrained
