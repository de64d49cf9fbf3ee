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
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from planner.errors import PlannerError

if TYPE_CHECKING:
    from planner.data.text import Vocab

_STEP_DIR = re.compile(r"^step_(\d{8})$")
META_FILE = "planner.json"
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


def keep_vocab(root: Path, vocab: Vocab) -> None:
    """Keep a ``--data`` run's vocabulary beside its checkpoints, unless one is kept already.

    Written with the run's first checkpoint, not when the stream is made: a run that stops (or is
    refused) before it saves anything leaves no vocabulary behind to refuse the next run's
    ``--tokenizer``, and no checkpoint is ever published without the ids it was trained on.

    Args:
        root: the checkpoint folder (created if missing).
        vocab: the stream's vocabulary.

    Raises:
        DataError: the file cannot be written.
    """
    if kept_vocab(root) is None:
        vocab.save(root / VOCAB_FILE)


def step_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives under ``root``."""
    return root / f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first (a partial or foreign folder is skipped)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (None: there is none)."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


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
    """

    rank: int
    tensors: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any | None = None
    data: Stateful | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

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
                    out[f"optim.{names[id(p)]}.{key}"] = value
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
        state: dict[str, Any] = {f"model.{k}": v for k, v in self.tensors.items()}
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


def save_checkpoint(root: Path, step: int, state: RankState, meta: dict[str, Any]) -> Path:
    """Write the checkpoint of ``step`` (every rank calls this at the same step).

    Args:
        root: the checkpoint folder (created if missing; shared by all nodes).
        step: the last completed step.
        state: this rank's state.
        meta: what rank 0 records beside it (plan fingerprint, layout), as JSON.

    Returns:
        The checkpoint's folder.

    Raises:
        PlannerError: the folder cannot be written.
    """
    import torch.distributed.checkpoint as dcp

    final = step_dir(root, step)
    partial = root / f".{final.name}.partial"
    lead = not _dist_ready() or torch.distributed.get_rank() == 0
    try:
        if lead:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that crashed
        if _dist_ready():
            torch.distributed.barrier()
        dcp.save(state.state_dict(step), checkpoint_id=partial)
        if _dist_ready():
            torch.distributed.barrier()  # every rank's files are written
        if lead:
            (partial / META_FILE).write_text(json.dumps({**meta, "step": step}, indent=2) + "\n")
            if final.exists():  # a resumed run saving the same step again
                shutil.rmtree(final)
            os.replace(partial, final)
            tmp = root / ".latest.tmp"
            tmp.write_text(final.name + "\n")
            os.replace(tmp, root / "latest")
    except OSError as e:
        raise PlannerError(
            f"cannot write checkpoint {final}: {e.strerror or e}; free space or pick another --checkpoint-dir"
        ) from None
    return final


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
    have = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    full = state.state_dict(0)
    missing = [k for k in full if (k.startswith(("model.", "optim.")) or k in ("sched", "step")) and k not in have]
    if missing:
        raise PlannerError(
            f"checkpoint {path} has no {missing[0]!r} ({len(missing)} missing), which this run needs; it was written "
            "for another model or optimizer: resume with the plan it was written under, or start without --resume"
        )
    wanted = {k: v for k, v in full.items() if k in have}
    try:
        dcp.load(wanted, checkpoint_id=path)
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


def export_weights(path: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """Load a checkpoint's weights into the unsplit model, in this process.

    Args:
        path: a checkpoint folder.
        model: the unsplit model, built as the plan builds it.

    Returns:
        The model's state dict after loading (every parameter and persistent buffer).

    Raises:
        PlannerError: the checkpoint lacks one of the model's tensors or has another shape.
    """
    import torch.distributed.checkpoint as dcp

    have = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    sd = model.state_dict()
    missing = [k for k in sd if f"model.{k}" not in have]
    if missing:
        raise PlannerError(
            f"checkpoint {path} has no weights for {missing[0]!r} ({len(missing)} of {len(sd)} missing); "
            "it was written for another model"
        )
    wanted = {f"model.{k}": v for k, v in sd.items()}
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is meant
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(wanted, checkpoint_id=path, no_dist=True)
    except Exception as e:  # shapes that differ, a damaged file
        raise PlannerError(f"cannot load checkpoint {path}: {' '.join(str(e).split())[:300]}") from None
    model.load_state_dict({k: wanted[f"model.{k}"] for k in sd})
    return model.state_dict()


def save_weights(plan_file: Path, checkpoint: Path | None, out: Path) -> tuple[Path, int]:
    """Write the unsplit model's state dict from a checkpoint of a plan's run, as ``torch.save`` does.

    Args:
        plan_file: the plan that was run (its model file builds the unsplit model).
        checkpoint: a checkpoint folder, or the folder of a run's checkpoints (its newest is
            taken); None: the plan's default, PLAN's name with .ckpt.
        out: where the state dict goes (written through a temporary file).

    Returns:
        (the checkpoint used, its step).

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
    state = export_weights(path, model)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PlannerError(f"cannot write {out}: {e.strerror or e}") from None
    return path, step
