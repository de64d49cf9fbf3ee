"""Overlap as it happens: which part of a rank's collectives its compute hides, as FSDP2 and DDP run them.

Pure module: never imports torch, nor the rest of the planner. It takes the seconds of each
collective and of each piece of compute (what ``planner.core.levers.data_parallel`` costs) and
places them on two timelines, the compute stream and one collective stream, as torch issues them:

* **FSDP2 units, prefetched one ahead** (``prefetched``). ``fully_shard`` issues the next unit's
  all-gather when the current unit starts (forward: the next in module order; backward: the next in
  reverse post-forward order, torch's ``FSDPModule.set_modules_to_forward_prefetch`` /
  ``set_modules_to_backward_prefetch`` docstrings, torch 2.13): a gather can hide only behind the
  compute of the unit before it, not behind the rank's whole compute. The first unit's gather is
  exposed. In backward each unit's reduce-scatter (and, under HSDP, the all-reduce of its shard over
  the replicate groups right after it) is issued when its backward ends and runs behind the next
  units' backward; FSDP waits for the last of them at the end of the backward
  (``set_is_last_backward``'s docstring: "FSDP waits on pending gradient reduction"), so it is exposed.
  Every collective of one process group runs on that group's one NCCL stream in the order it was
  issued (torch's ``ProcessGroupNCCL`` keeps one stream per device), so a prefetched gather queues
  behind the reduce-scatter issued before it, as both queue on the same NICs.
* **DDP buckets** (``bucketed``). ``DistributedDataParallel`` all-reduces its gradients in buckets
  of ``bucket_cap_mb`` = 25 MiB, the first one 1 MiB (torch docs, ``DistributedDataParallel``:
  ``bucket_cap_mb`` "default 25"; torch/nn/parallel/distributed.py caps the first bucket at 1 MiB,
  ``first_bucket_bytes_cap``, where the default is used), filled in backward order; a bucket's all-reduce
  starts once its last gradient exists, one after another, and the end of the backward waits for
  the last one.
* **Compute beside a collective is slower** (``COMPUTE_SLOWDOWN``). NCCL's kernels take SMs and
  memory bandwidth: Lee et al., "Characterizing Compute-Communication Overlap in GPU-Accelerated
  Distributed Deep Learning: Performance and Power Implications" (arXiv 2507.03114, 2025), measure
  GPT and Llama training on 4 A100, H100, MI250 and MI210 and find the compute that overlaps
  communication 18.9 % slower on average (40 % at most) than the same compute alone. The planner
  charges ``COMPUTE_SLOWDOWN`` x the hidden seconds (the time compute ran beside a collective) on
  top of the exposed ones (``charged_s``).

Every function here is exact arithmetic on the times it is given; ``tests/test_overlap.py`` checks
hand-computed cases and the properties (exposed at least the first gather, at most the traffic,
never more with faster links).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

COMPUTE_SLOWDOWN = 0.189
"""How much slower compute runs beside a collective on a GPU: 18.9 %, the mean slowdown Lee et al.
measured over GPT and Llama training on A100, H100, MI250 and MI210 (arXiv 2507.03114, 2025,
abstract and section 5: "an average computational slowdown of 18.9 %, with a maximum of 40.0 %").
Not fitted to any run the planner is checked against."""

DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's bucket cap: ``bucket_cap_mb`` = 25 MiB by default (torch docs, ``DistributedDataParallel``)."""

DDP_FIRST_BUCKET_BYTES = 2**20
"""DDP's first bucket cap with the default bucket size: 1 MiB (torch/nn/parallel/distributed.py's
``first_bucket_bytes_cap`` default), so that the first all-reduce starts early in the backward."""


class Overlap(NamedTuple):
    """A timeline's collectives: their seconds in all, and how many the compute stream waits for."""

    traffic_s: float
    exposed_s: float

    @property
    def hidden_s(self) -> float:
        """Seconds of collectives that ran beside compute (``traffic_s - exposed_s``)."""
        return max(0.0, self.traffic_s - self.exposed_s)

    def plus(self, other: Overlap) -> Overlap:
        """Two timelines' figures summed (``+`` would concatenate the tuples)."""
        return Overlap(self.traffic_s + other.traffic_s, self.exposed_s + other.exposed_s)

    def times(self, k: float) -> Overlap:
        """The figures of ``k`` such timelines one after another."""
        return Overlap(k * self.traffic_s, k * self.exposed_s)


NONE = Overlap(0.0, 0.0)
"""No collective at all."""


def exposed_only(traffic_s: float) -> Overlap:
    """Collectives nothing hides: ranks that share CPU cores (gloo) communicate on the cores they
    compute on, and a reduction run after the backward (the runner's own) waits whole."""
    return Overlap(traffic_s, traffic_s)


def charged_s(overlap: Overlap, slowdown: float) -> float:
    """What a timeline's collectives add to the rank's time: the exposed seconds, plus ``slowdown``
    x the hidden ones (the compute that ran beside them took that much longer, ``COMPUTE_SLOWDOWN``).

    Args:
        overlap: the timeline's figures.
        slowdown: the compute slowdown beside a collective (0: none, as on CPUs).

    Returns:
        Seconds.
    """
    return overlap.exposed_s + slowdown * overlap.hidden_s


def prefetched(gathers: Sequence[float], compute: Sequence[float], reduces: Sequence[float] = ()) -> Overlap:
    """One pass over FSDP2 units in the order they compute, each unit's all-gather prefetched while
    the unit before it computes, and (in backward) each unit's reduce-scatter issued when it ends.

    The collective stream runs in issue order: unit 0's gather at the start; unit i+1's gather when
    unit i starts computing; unit i's reduction when it ends. Unit i computes once its gather is
    done and unit i-1 has ended. Without reductions the exposed time is
    ``g_0 + sum_i max(0, g_{i+1} - c_i)``; with them, a gather waits behind the reductions issued
    before it, and the last reductions that outlast the compute are exposed.

    Args:
        gathers: each unit's all-gather seconds, in compute order (0: nothing to gather).
        compute: each unit's compute seconds, the same order.
        reduces: each unit's reduce-scatter seconds (plus HSDP's all-reduce after it); empty: none
            (a forward).

    Returns:
        The pass's collective seconds and what the compute waits for (``end - sum(compute)``).

    Raises:
        ValueError: the sequences differ in length.
    """
    n = len(compute)
    if len(gathers) != n or (reduces and len(reduces) != n):
        raise ValueError(f"{len(gathers)} gathers, {len(compute)} computes, {len(reduces)} reductions")
    if n == 0:
        return NONE
    reductions = list(reduces) if reduces else [0.0] * n
    stream = gathers[0]  # when the collective stream is free
    ready = stream  # when the next unit's gather is done
    clock = 0.0  # when the compute stream is free
    for i in range(n):
        start = max(clock, ready)
        if i + 1 < n:  # prefetch the next unit's gather as this one starts
            stream = max(stream, start) + gathers[i + 1]
            ready = stream
        clock = start + compute[i]
        if reductions[i]:
            stream = max(stream, clock) + reductions[i]
    end = max(clock, stream)
    return Overlap(sum(gathers) + sum(reductions), max(0.0, end - sum(compute)))


def fsdp_unit_pass(
    gathers: Sequence[float], forward: Sequence[float], backward: Sequence[float], reduces: Sequence[float]
) -> Overlap:
    """One microbatch through FSDP2 units that reshard after forward: a forward over the units in
    order (their gathers prefetched), then a backward in reverse order (gathered again, prefetched,
    each unit's reduction behind the next units' backward). Each of the two starts cold: the action
    before it on the rank belongs to another microbatch or stage, whose hooks do not prefetch into it.

    Args:
        gathers: each unit's all-gather seconds, in module order.
        forward: each unit's forward seconds.
        backward: each unit's backward seconds (recomputation included).
        reduces: each unit's reduction seconds (reduce-scatter, plus HSDP's all-reduce).

    Returns:
        The figures of both passes together.
    """
    ahead = prefetched(gathers, forward)
    back = prefetched(gathers[::-1], backward[::-1], reduces[::-1])
    return ahead.plus(back)


def buckets(
    grad_bytes: Sequence[float], first: float = DDP_FIRST_BUCKET_BYTES, cap: float = DDP_BUCKET_BYTES
) -> list[tuple[float, int]]:
    """DDP's buckets over gradients in the order backward produces them: the first up to ``first``
    bytes, the rest up to ``cap``; a piece's gradients may fill the rest of a bucket and spill into
    the next (DDP assigns whole parameters, so a bucket here can split one of them: the model counts
    bytes, not tensors).

    Args:
        grad_bytes: the gradients' bytes of each piece (a block), in backward order.
        first: the first bucket's cap.
        cap: every other bucket's cap.

    Returns:
        ``(bytes, piece)`` per bucket: its size and the piece whose gradient completes it.
    """
    out: list[tuple[float, int]] = []
    room, filled = first, 0.0
    for k, nbytes in enumerate(grad_bytes):
        left = float(nbytes)
        while left > 0:
            take = min(left, room - filled)
            filled += take
            left -= take
            if filled >= room:
                out.append((filled, k))
                room, filled = cap, 0.0
        # a piece with no gradient bytes adds nothing
    if filled > 0:
        out.append((filled, len(grad_bytes) - 1))
    return out


def bucketed(
    grad_bytes: Sequence[float],
    compute: Sequence[float],
    allreduce_s: Callable[[float], float],
    first: float = DDP_FIRST_BUCKET_BYTES,
    cap: float = DDP_BUCKET_BYTES,
) -> Overlap:
    """DDP's all-reduces during one backward: each bucket's starts when the piece that completes it
    has computed its backward (and the bucket before it is done: one stream); the backward's end
    waits for the last one.

    Args:
        grad_bytes: each piece's gradient bytes as reduced, in backward order.
        compute: each piece's backward seconds, the same order.
        allreduce_s: seconds of an all-reduce of so many bytes over the group.
        first: the first bucket's cap (``DDP_FIRST_BUCKET_BYTES``).
        cap: every other bucket's cap (``DDP_BUCKET_BYTES``).

    Returns:
        The all-reduces' seconds and what the backward waits for after its compute.

    Raises:
        ValueError: the sequences differ in length.
    """
    if len(grad_bytes) != len(compute):
        raise ValueError(f"{len(grad_bytes)} gradients, {len(compute)} computes")
    done, t = [], 0.0
    for c in compute:
        t += c
        done.append(t)
    stream, traffic = 0.0, 0.0
    for nbytes, piece in buckets(grad_bytes, first, cap):
        took = allreduce_s(nbytes)
        traffic += took
        stream = max(stream, done[piece]) + took
    return Overlap(traffic, max(0.0, stream - t))


def spread(total: float, weights: Sequence[float]) -> list[float]:
    """``total`` seconds shared out in proportion to ``weights`` (evenly where they sum to 0): a
    stage's compute over its units, whose own times lack what the stage adds (recomputation, a cold
    start)."""
    whole = sum(weights)
    if not weights:
        return []
    if whole <= 0:
        return [total / len(weights)] * len(weights)
    return [total * w / whole for w in weights]


__all__ = [
    "COMPUTE_SLOWDOWN",
    "DDP_BUCKET_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "NONE",
    "Overlap",
    "bucketed",
    "buckets",
    "charged_s",
    "exposed_only",
    "fsdp_unit_pass",
    "prefetched",
    "spread",
]
