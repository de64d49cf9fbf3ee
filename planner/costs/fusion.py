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
then takes back the writes nothing read afterwards and applies the kernel's floor (``HardwareSpec``).

What a compiled block saves for backward: AOTAutograd's partitioner (``min_cut_rematerialization_
partition``, torch.compile's default) recomputes cheap element-wise operators in backward instead of
saving their outputs, but never matrix products, attention, reductions (``ban_recompute_reductions``)
or random operators. ``Fusion`` follows every storage an element-wise operator writes back to its
*frontier*: the storages it is computed from that such an operator did not make (a GEMM's output,
a reduction's, the block's input). A compiled block saves, for each tensor the eager block saves, the
tensor itself where something else made it, else its frontier (``saved_bytes``); and the forward
writes none of the tensors so replaced (``settle``'s ``recomputed``). Llama's SwiGLU then saves
``w1 x`` and ``w3 x`` instead of those, ``silu`` of the first and the product; its RMSNorm its input
and the reciprocal root instead of the fp32 copy, the normalised tensor and the output.

What it leaves out: the partitioner's min cut may save a frontier's smaller descendant instead (a
bf16 cast of an fp32 product), so the frontier can overstate what it saves; a region is
program-ordered (inductor also fuses independent operators ahead, as SwiGLU's ``silu`` before ``w3``
runs) and one kernel, although inductor splits some (a reduction whose consumers cannot join it, which
then reads a tensor twice).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

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
        provisional: bytes charged so far per region (external reads, every write).
        writes: (region, storage id) -> the write; a storage written again in the same region counts once.
        written: storage id -> the region that last wrote it.
        reads: the storages the open region has read from outside itself (each is charged once).
        sources: storage id -> its frontier, for each storage a recomputable operator wrote last.
        sizes: storage id -> bytes of the storage, for each storage an operator here read.
    """

    region: int = -1
    regions: int = 0
    provisional: dict[int, int] = field(default_factory=dict)
    writes: dict[tuple[int, int], _Write] = field(default_factory=dict)
    written: dict[int, int] = field(default_factory=dict)
    reads: set[int] = field(default_factory=set)
    sources: dict[int, frozenset[int]] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)

    def operator(
        self,
        inputs: Iterable[tuple[torch.Tensor, int]],
        outputs: Iterable[tuple[torch.Tensor, int]],
        recomputable: bool = True,
        storage_bytes: dict[int, int] | None = None,
    ) -> tuple[int, bool]:
        """Record a memory-bound operator into the open region (opening one if none is).

        Args:
            inputs: (tensor, bytes) of each tensor the operator reads.
            outputs: (tensor, bytes) of each tensor it writes.
            recomputable: the partitioner may recompute it in backward (not a reduction, not random):
                its outputs' frontier is its inputs' (``sources``); else they are a frontier themselves.
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
            self.reads = set()
        charged = 0
        inputs, outputs = list(inputs), list(outputs)
        self.sizes.update(storage_bytes or {})
        if recomputable:
            frontier = frozenset().union(*(self.sources.get(storage_id(t), {storage_id(t)}) for t, _ in inputs))
        for t, nbytes in inputs:
            sid = storage_id(t)
            if self.written.get(sid) == self.region or sid in self.reads:
                continue
            self._read_after(sid)
            self.reads.add(sid)
            charged += nbytes
        for t, nbytes in outputs:
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
        for t, _ in outputs:
            if recomputable:
                self.sources[storage_id(t)] = frontier
            else:
                self.sources.pop(storage_id(t), None)
        self.provisional[self.region] += charged
        return charged, opened

    def barrier(self, inputs: Iterable[torch.Tensor]) -> None:
        """An operator the region does not fuse (a GEMM, attention, a collective): it ends the open
        region, and what it reads of the regions' writes must have been written to memory."""
        self.region = -1
        for t in inputs:
            self._read_after(storage_id(t))

    def _read_after(self, sid: int) -> None:
        region = self.written.get(sid)
        if region is not None and region != self.region:
            self.writes[(region, sid)].read_after = True

    def settle(self, recomputed: set[int] | None = None) -> dict[int, tuple[int, int]]:
        """The regions' bytes once the phase has ended.

        Args:
            recomputed: storages alive after the phase that the compiled backward recomputes instead
                (saved by the eager block, made by recomputable operators): not written either.

        Returns:
            region -> (bytes charged provisionally, bytes it really moves): the writes that nothing
            read after their region and that died with the phase (or are recomputed) are taken back.
        """
        self.region = -1
        recomputed = recomputed or set()
        moved = dict(self.provisional)
        for (_, sid), w in self.writes.items():
            if not w.read_after and (sid in recomputed or w.ref.expired()):
                moved[w.region] -= w.nbytes
        return {r: (self.provisional[r], moved[r]) for r in self.provisional}

    def saved_bytes(self, saved: dict[int, int], weights: set[int]) -> int:
        """What the compiled block saves for backward where the eager one saves ``saved``.

        Args:
            saved: storage id -> bytes of each storage the eager block saves.
            weights: the storages of its parameters and buffers (kept by the model, not per microbatch).

        Returns:
            Bytes: each saved storage that no recomputable operator made, and the frontiers of those
            that one did, each storage once.
        """
        kept: set[int] = set()
        for sid in saved:
            kept |= self.sources.get(sid, {sid})
        return sum(saved.get(sid, self.sizes.get(sid, 0)) for sid in kept - weights)

    def snapshot(self) -> Fusion:
        """A copy to return to (``restore``) when an operator charged in parts is charged whole instead."""
        return Fusion(
            self.region,
            self.regions,
            dict(self.provisional),
            {k: _Write(w.region, w.nbytes, w.ref, w.read_after) for k, w in self.writes.items()},
            dict(self.written),
            set(self.reads),
            dict(self.sources),
            dict(self.sizes),
        )

    def restore(self, other: Fusion) -> None:
        """Return to the state ``other`` (a ``snapshot``) holds."""
        self.region, self.regions = other.region, other.regions
        self.provisional, self.writes, self.written, self.reads = (
            other.provisional,
            other.writes,
            other.written,
            other.reads,
        )
        self.sources, self.sizes = other.sources, other.sizes
