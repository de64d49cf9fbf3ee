"""Hardware files: a ``HardwareSpec`` as JSON, with what `planner probe` measured to make it.

``planner probe -o FILE.json`` writes one for the machine it runs on, ``planner probe
--write-shipped DIR`` writes the shipped table (``GPUS``) in the same format, and ``planner plan
--gpu-type FILE.json`` estimates for it. A file is::

    {"format": 2, "spec": {...HardwareSpec...}, "derived": {field: how}, "measured": {...} | null}

``spec`` is all the planner reads. ``measured`` holds the raw sweep points (GEMM shapes and
seconds, copies, attention, every collective's size and seconds inside a node and across nodes)
and ``derived`` says, field by field, how the spec's constants came from them
(``planner.core.levers.probe_fit``), so a reader can check a figure or refit it. A shipped GPU's
file has no ``measured`` section: its figures come from datasheets (``spec.source``).

Pure module: pydantic and the standard library only.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.core.levers.hardware import GPUS, KERNEL_FLOOR_S, HardwareError, HardwareSpec, get_hardware
from planner.schema.jsonfile import write_atomic

# 2: a GPU's per-operator host time is ``spec.dispatch_s``; format 1 had none, and a GPU probe put that
# measurement in ``op_overhead_s`` (read as format 2 by ``_upgraded``)
FORMAT_VERSION = 2
"""The hardware file format this planner writes and reads (a newer one is refused by name)."""


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GemmPoint(_Record):
    """One timed GEMM: ``(m x k) @ (k x n)``, median seconds per call."""

    m: int = Field(gt=0)
    n: int = Field(gt=0)
    k: int = Field(gt=0)
    seconds: float = Field(gt=0, allow_inf_nan=False)

    @property
    def flops(self) -> float:
        """Multiply-adds counted as two FLOPs, as ``planner.costs.roofline`` counts them."""
        return 2.0 * self.m * self.n * self.k


class CopyPoint(_Record):
    """One timed copy of ``nbytes`` (read once, written once), median seconds."""

    nbytes: int = Field(gt=0)
    seconds: float = Field(gt=0, allow_inf_nan=False)


class AttentionPoint(_Record):
    """``scaled_dot_product_attention`` at one shape (not causal), forward and backward.

    The FLOPs are torch's own count (``torch.utils.flop_counter``), the one the roofline charges.
    """

    batch: int = Field(gt=0)
    heads: int = Field(gt=0)
    seq: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    fwd_flops: float = Field(gt=0)
    bwd_flops: float = Field(gt=0)
    fwd_s: float = Field(gt=0, allow_inf_nan=False)
    bwd_s: float = Field(gt=0, allow_inf_nan=False)


class CollectivePoint(_Record):
    """One collective at one size: ``nbytes`` as ``planner.core.levers.probe_fit.COST_TERMS`` defines
    it per operation, median seconds on rank 0 (send_recv: one way, half a ping-pong)."""

    nbytes: int = Field(gt=0)
    seconds: float = Field(gt=0, allow_inf_nan=False)


class CollectiveSweep(_Record):
    """Every collective measured over one group of ranks (inside a node, or one rank per node)."""

    ranks: int = Field(ge=2, description="Ranks in the group (send_recv: always two of them).")
    ops: dict[str, list[CollectivePoint]] = Field(
        description="all_reduce, all_gather, reduce_scatter, all_to_all, send_recv -> points by size."
    )


class Measured(_Record):
    """What `planner probe` measured: the raw points every constant of the spec is fitted from."""

    device: str = Field(description="'cpu' or 'cuda'.")
    device_name: str = Field(description="The processor or GPU as torch names it.")
    backend: str = Field(description="The collectives' backend: gloo or nccl.")
    dtype: str = Field(description="The dtype GEMMs and attention ran in.")
    world_size: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    threads: int = Field(ge=1, description="Intra-op threads of each rank.")
    host: str
    torch_version: str
    date: str = Field(description="When it was measured (UTC, ISO 8601).")
    quick: bool = Field(description="--quick: a shorter sweep.")
    memory_bytes: int = Field(gt=0, description="Device memory (a CPU: the machine's).")
    gemms: list[GemmPoint]
    copies: list[CopyPoint]
    attention: list[AttentionPoint]
    op_overhead_s: float = Field(ge=0, description="Seconds per operator of a tiny model's training step.")
    intra_node: CollectiveSweep | None = Field(default=None, description="Ranks of one node (None: one rank).")
    inter_node: CollectiveSweep | None = Field(default=None, description="One rank per node (None: one node).")


class HardwareFile(_Record):
    """The document of a hardware file (see the module docstring)."""

    format: int = Field(default=FORMAT_VERSION, ge=1)
    spec: HardwareSpec
    derived: dict[str, str] = Field(default_factory=dict, description="Spec field -> how it was derived.")
    measured: Measured | None = None


def looks_like_file(name: str) -> bool:
    """Whether ``--gpu-type NAME`` names a hardware file rather than a table entry.

    Args:
        name: what the user gave.

    Returns:
        True for a path ending ``.json`` or an existing file.
    """
    return name.strip().lower().endswith(".json") or Path(name).is_file()


def read_hardware_file(path: str | Path) -> HardwareFile:
    """Read and validate a hardware file.

    Args:
        path: the file.

    Returns:
        The document.

    Raises:
        HardwareError: the file is missing, unreadable, not JSON, of a newer format, or not a hardware
            file (one line naming the first thing wrong).
    """
    where = f"--gpu-type {path}"
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise HardwareError(
            f"{where}: no such file; give a hardware file written by `planner probe -o FILE.json` "
            f"or one of {', '.join(GPUS)}, cpu"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise HardwareError(f"{where}: cannot be read ({type(e).__name__}: {e})") from None
    try:
        doc = HardwareFile.model_validate_json(text)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        what = f"{loc}: {first['msg']}" if loc else first["msg"]
        raise HardwareError(f"{where}: not a hardware file ({what}); write one with `planner probe`") from None
    if doc.format > FORMAT_VERSION:
        raise HardwareError(
            f"{where}: format {doc.format} is newer than this planner reads ({FORMAT_VERSION}); upgrade the planner"
        )
    return _upgraded(doc)


def _upgraded(doc: HardwareFile) -> HardwareFile:
    """A format-1 file as format 2: a GPU probe's tiny-model measure moves from ``op_overhead_s`` (which on
    a GPU is now the least a kernel takes) to ``dispatch_s``; a file without a probe's measurements (the
    shipped GPUs, edited) keeps its figures, ``dispatch_s`` at its default."""
    if doc.format >= 2 or doc.measured is None or doc.spec.kind != "gpu" or "dispatch_s" in doc.spec.model_fields_set:
        return doc
    spec = doc.spec.model_copy(update={"dispatch_s": doc.spec.op_overhead_s, "op_overhead_s": KERNEL_FLOOR_S})
    return doc.model_copy(update={"format": 2, "spec": spec})


def write_hardware_file(path: str | Path, doc: HardwareFile) -> None:
    """Write ``doc`` to ``path`` atomically (indented JSON, the spec first).

    Args:
        path: the file to write.
        doc: the document.
    """
    write_atomic(Path(path), doc.model_dump_json(indent=1) + "\n")


def shipped_file(name: str) -> HardwareFile:
    """A shipped GPU of the table as a hardware file (no ``measured`` section: datasheet figures).

    Args:
        name: a key of ``GPUS``.

    Returns:
        The document.
    """
    spec = get_hardware(name)
    return HardwareFile(spec=spec, derived={"*": f"shipped table (planner.core.levers.hardware): {spec.source}"})


def hardware_named(name: str) -> HardwareSpec:
    """``--gpu-type NAME``: a hardware file when NAME looks like one, else the shipped table's entry.

    Args:
        name: a path ending ``.json`` (or any existing file), or a key of ``GPUS``.

    Returns:
        The spec.

    Raises:
        HardwareError: a bad file (``read_hardware_file``) or an unknown name (``get_hardware``).
    """
    if looks_like_file(name):
        return read_hardware_file(name).spec
    return get_hardware(name)
