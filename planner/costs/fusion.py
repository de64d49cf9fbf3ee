"""What ``torch.compile`` fuses: runs of memory-bound operators charged as one kernel each.

Eagerly, every elementwise operator and reduction is its own kernel: it reads its inputs from memory
and writes its output back, so a Llama layer's RMSNorm (a cast, a square, a mean, an rsqrt, two
products and a cast back) moves its hidden state through memory about a dozen times. Inductor, the
default ``torch.compile`` backend, generates one kernel for each run of such operators between the
operators it leaves to libraries (matrix products, convolutions, fused attention: "extern kernels"),
and that kernel reads each tensor it needs from outside the run once and writes only what is used
after it. ``Fusion`` charges that: a *region* is a maximal run of memory-bound operators (everything
that is not a barrier: a GEMM, a convolution, attention, a collective or a library's custom
operator), and its bytes are

* each storage the region reads that was not written inside it, once, and
* each storage it writes that is read after the region ends (by a later region or a barrier), or
  still alive when the phase ends (saved for backward, the block's output, a gradient).

Views move nothing and do not end a region. An operator is charged as it runs (its external reads and
all of its writes, the region's launch overhead with its first operator), so that a phase's running
time is at hand mid-phase (the forward up to a saved tensor: ``planner.costs.estimate``); ``settle``
then takes back the writes nothing read afterwards (``Roofline`` applies the kernel's floor).

What a compiled block saves for backward: AOTAutograd's partitioner (``min_cut_rematerialization_
partition``, torch.compile's default) recomputes cheap element-wise operators in backward instead of
saving their outputs, but never matrix products, attention, reductions (``ban_recompute_reductions``)
or random operators. ``Fusion`` follows every storage an element-wise operator writes back to its
*frontier*: the storages it is computed from that such an operator did not make (a GEMM's output,
a reduction's, the block's input). A compiled block saves, for each tensor the eager block saves, the
tensor itself where something else made it, else its frontier where that holds no more bytes
(``compiled_saves``: a greedy min cut); the forward writes what it saves and none of the tensors so
replaced (``settle``). Llama's SwiGLU then saves ``w1 x`` and ``w3 x`` instead of those, ``silu`` of the
first and the product; its RMSNorm its input and the mean of squares (a reduction's result) instead
of the fp32 copy, the normalised tensor and the output.

What it leaves out: the partitioner's min cut is global, the greedy one here tensor by tensor, so it
can save more than the partitioner (never more than the eager block); a region is
program-ordered (inductor also fuses independent operators ahead, as SwiGLU's ``silu`` before ``w3``
runs) and one kernel, although inductor splits some (a reduction whose consumers cannot join it, which
then reads a tensor twice).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from planner.torch_compat import storage_id


@dataclass
class _Write:
    """A storage a region wrote: its bytes and a weak reference that tells whether it outlives the phase."""

    region: int
    nbytes: int
    ref: StorageWeakRef
    read_after: bool = False


@dataclass
class Fusion:
    """The fused kernels of one phase (forward, backward): which storages each region reads and writes.

    Attributes:
        region: the index of the open region (-1: none open; the next memory-bound operator opens one).
        regions: how many regions the phase has opened.
        provisional: bytes charged so far per region (external reads, every write).
        writes: (region, storage id) -> the write; a storage written again in the same region counts once.
        written: storage id -> the region that last wrote it.
        reads: storage id -> bytes of it the open region has read from outside itself (charged up to
            the storage's size: two halves of one tensor are two reads, one half twice is one).
        sources: storage id -> its frontier, for each storage a recomputable operator wrote last.
        sizes: storage id -> bytes of the storage, for each storage an operator here read.
        alive: weak references to the storages in ``sizes`` and ``writes``: they keep their ids from
            being reused by a later storage while the phase runs.
    """

    region: int = -1
    regions: int = 0
    provisional: dict[int, int] = field(default_factory=dict)
    writes: dict[tuple[int, int], _Write] = field(default_factory=dict)
    written: dict[int, int] = field(default_factory=dict)
    reads: dict[int, int] = field(default_factory=dict)
    sources: dict[int, frozenset[int]] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)
    alive: dict[int, StorageWeakRef] = field(default_factory=dict)

    def operator(
        self,
        inputs: Sequence[tuple[torch.Tensor, int]],
        outputs: Sequence[tuple[torch.Tensor, int, bool]],
        storage_bytes: dict[int, int],
    ) -> tuple[int, bool]:
        """Record a memory-bound operator into the open region (opening one if none is).

        Args:
            inputs: (tensor, bytes) of each tensor the operator reads.
            outputs: (tensor, bytes, recomputable) of each tensor it writes; recomputable: the
                partitioner may recompute it in backward (not a reduction's result, not random): its
                frontier is then its inputs' (``sources``), else it is a frontier itself.
            storage_bytes: storage id -> bytes of the whole storage, of the inputs (``sizes``).

        Returns:
            (bytes to charge now: its reads from outside the region not yet charged, plus its new
            writes; whether it opened a region, whose launch overhead is charged with it).
        """
        opened = self.region < 0
        if opened:
            self.region = self.regions
            self.regions += 1
            self.provisional[self.region] = 0
            self.reads = {}
        for t, _ in inputs:
            sid = storage_id(t)
            if sid not in self.alive:
                self.alive[sid] = StorageWeakRef(t.untyped_storage())
        self.sizes.update(storage_bytes)
        frontier = frozenset().union(*(self.sources.get(storage_id(t), {storage_id(t)}) for t, _ in inputs))
        charged = 0
        for t, nbytes in inputs:
            sid = storage_id(t)
            if self.written.get(sid) == self.region:
                continue
            self._read_after(sid)
            done = self.reads.get(sid, 0)
            more = max(min(nbytes, self.sizes.get(sid, nbytes) - done), 0)
            self.reads[sid] = done + more
            charged += more
        for t, nbytes, _ in outputs:
            sid = storage_id(t)
            key = (self.region, sid)
            if key in self.writes:
                grown = max(nbytes - self.writes[key].nbytes, 0)
                self.writes[key].nbytes += grown
                charged += grown
                continue
            self.writes[key] = _Write(self.region, nbytes, StorageWeakRef(t.untyped_storage()))
            self.written[sid] = self.region
            charged += nbytes
        for t, _, recomputable in outputs:
            if recomputable:
                self.sources[storage_id(t)] = frontier
            else:
                self.sources.pop(storage_id(t), None)
        self.provisional[self.region] += charged
        return charged, opened

    def barrier(self, inputs: Iterable[torch.Tensor], outputs: Iterable[torch.Tensor] = ()) -> None:
        """An operator the region does not fuse (a GEMM, attention, a collective): it ends the open
        region, what it reads of the regions' writes must have been written to memory, and what it
        writes (in place too) is a frontier of its own."""
        self.region = -1
        for t in inputs:
            self._read_after(storage_id(t))
        for t in outputs:
            self.sources.pop(storage_id(t), None)

    def _read_after(self, sid: int) -> None:
        region = self.written.get(sid)
        if region is not None and region != self.region:
            self.writes[(region, sid)].read_after = True

    def compiled_saves(
        self, saved: dict[int, int], fixed: set[int], weights: set[int]
    ) -> tuple[int, set[int], set[int]]:
        """What the compiled block saves for backward where the eager one saves ``saved``: a greedy
        min cut, each saved storage an element-wise operator made replaced by its frontier where that
        adds no more bytes than the storage itself (so never more than the eager block saves).

        Args:
            saved: storage id -> bytes of each storage the eager block saves.
            fixed: of those, the storages saved as they are whatever made them (the block's outputs,
                what an eager loss saves).
            weights: the storages of its parameters and buffers (kept by the model, not per microbatch).

        Returns:
            (the bytes saved; the saved storages recomputed instead, which the forward then never
            writes; the storages kept, which it must write).
        """
        kept = {sid for sid in saved if sid in fixed or sid not in self.sources}
        recomputed: set[int] = set()
        for sid in saved:
            if sid in kept:
                continue
            new = self.sources[sid] - kept - weights
            if sum(saved.get(x, self.sizes.get(x, 0)) for x in new) <= saved[sid]:
                kept |= new
                recomputed.add(sid)
            else:
                kept.add(sid)
        kept -= weights
        return sum(saved.get(sid, self.sizes.get(sid, 0)) for sid in kept), recomputed - kept, kept

    def settle(self, recomputed: set[int] = frozenset(), kept: set[int] = frozenset()) -> dict[int, tuple[int, int]]:  # type: ignore[assignment]
        """The regions' bytes once the phase has ended.

        Args:
            recomputed: storages alive after the phase that the compiled backward recomputes instead
                (``compiled_saves``): not written either, unless something read them after their region.
            kept: storages the compiled block saves (``compiled_saves``): written, even where they
                died with the phase (an eager block may not save a frontier it keeps).

        Returns:
            region -> (bytes charged provisionally, bytes it really moves): the writes that nothing
            read after their region and that died with the phase (or are recomputed) are taken back.
        """
        self.region = -1
        moved = dict(self.provisional)
        for (_, sid), w in self.writes.items():
            if w.read_after or sid in kept:
                continue
            if sid in recomputed or w.ref.expired():
                moved[w.region] -= w.nbytes
        return {r: (self.provisional[r], moved[r]) for r in self.provisional}

    def snapshot(self) -> Fusion:
        """A copy to return to (``restore``) when an operator charged in parts is charged whole instead."""
        copied = {f.name: copy.copy(getattr(self, f.name)) for f in fields(self)}
        copied["writes"] = {k: replace(w) for k, w in self.writes.items()}
        return Fusion(**copied)

    def restore(self, other: Fusion) -> None:
        """Return to the state ``other`` (a ``snapshot``) holds."""
        for f in fields(self):
            setattr(self, f.name, getattr(other, f.name))
