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

What it leaves out (each makes the estimate of a compiled block pessimistic, never optimistic about
memory): AOTAutograd's partitioner recomputes cheap elementwise outputs in backward instead of saving
them, so a compiled block saves less than the eager block whose saved tensors the estimate counts
(torchtitan measured 82.4 -> 77.0 GiB for Llama 3.1 8B with compile); and a region is one kernel
although inductor sometimes splits one (a reduction whose consumers cannot join it), which reads a
tensor twice.
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
    """

    region: int = -1
    regions: int = 0
    provisional: dict[int, int] = field(default_factory=dict)
    writes: dict[tuple[int, int], _Write] = field(default_factory=dict)
    written: dict[int, int] = field(default_factory=dict)
    reads: set[int] = field(default_factory=set)

    def operator(
        self, inputs: Iterable[tuple[torch.Tensor, int]], outputs: Iterable[tuple[torch.Tensor, int]]
    ) -> tuple[int, bool]:
        """Record a memory-bound operator into the open region (opening one if none is).

        Args:
            inputs: (tensor, bytes) of each tensor the operator reads.
            outputs: (tensor, bytes) of each tensor it writes.

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

    def settle(self) -> dict[int, tuple[int, int]]:
        """The regions' bytes once the phase has ended.

        Returns:
            region -> (bytes charged provisionally, bytes it really moves): the writes that nothing
            read after their region and that died with the phase are taken back.
        """
        self.region = -1
        moved = dict(self.provisional)
        for w in self.writes.values():
            if not w.read_after and w.ref.expired():
                moved[w.region] -= w.nbytes
        return {r: (self.provisional[r], moved[r]) for r in self.provisional}

    def snapshot(self) -> Fusion:
        """A copy to return to (``restore``) when an operator charged in parts is charged whole instead."""
        return Fusion(
            self.region,
            self.regions,
            dict(self.provisional),
            {k: _Write(w.region, w.nbytes, w.ref, w.read_after) for k, w in self.writes.items()},
            dict(self.written),
            set(self.reads),
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
