"""`planner probe`'s measurements on one rank: GEMMs, copies, attention, operator overhead, collectives.

``probe_rank`` is what every launched process runs (``planner.run.spawn`` starts them torchrun-style):
it joins the process group from the environment (nccl on a GPU, gloo on a CPU), rank 0 times the
device alone (``measure_device``) while the others wait, then all ranks time the collectives
together (``measure_collectives``) inside a node and, with several nodes, across them. The fits
that turn these points into a ``HardwareSpec`` are pure (``planner.core.levers.probe_fit``).

Every point is a median of ``repeats`` timings after ``warmup`` untimed calls; a GPU is synchronised
around each timing. A call shorter than a millisecond is timed over a batch of calls, so the
timer's resolution and the launch of one kernel do not decide it.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
from tqdm import tqdm

from planner.capture.load import ModelFile
from planner.capture.meta_cache import meta_build
from planner.core.levers.hardware_file import (
    AttentionPoint,
    CollectivePoint,
    CollectiveSweep,
    CopyPoint,
    GemmPoint,
    Measured,
)
from planner.core.levers.probe_fit import COLLECTIVES, ProbeTask
from planner.costs.cpu import _memory_capacity, _op_overhead
from planner.threads import torch_threads

_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of one call of ``fn``, timed over batches of calls of at least a millisecond.

    Args:
        fn: the call (its device work finishes by the next synchronisation).
        device: where it runs (a GPU is synchronised around each timing).
        warmup: untimed calls first (at least one, which also sizes the batch).
        repeats: timed batches.

    Returns:
        Seconds per call.
    """
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(max(1, warmup)):
        fn()
    _sync(device)
    first = (time.perf_counter() - t0) / max(1, warmup)
    batch = max(1, min(100, int(1e-3 / max(first, 1e-9))))
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / batch)
    return statistics.median(times)


def model_gemms(mf: ModelFile, microbatch_size: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """The GEMMs of a model's linear layers at a microbatch, forward and backward, as ``(m, n, k)``.

    The model is built and run on the meta device (nothing allocated); a hook on every ``nn.Linear``
    records the tokens ``m`` it sees. Forward is ``(m, out, in)``; backward computes the input's
    gradient ``(m, in, out)`` and the weight's ``(out, in, m)``.

    Args:
        mf: the loaded model file.
        microbatch_size: samples per microbatch.
        seed: the model file's seed.

    Returns:
        The distinct shapes, in the order the layers first ran.
    """
    with meta_build():
        model = mf.build(seed=seed)
    seen: dict[tuple[int, int, int], None] = {}

    def hook(module: nn.Module, args: tuple[Any, ...], _out: object) -> None:
        assert isinstance(module, nn.Linear)
        m = args[0].numel() // module.in_features
        o, i = module.out_features, module.in_features
        for shape in ((m, o, i), (m, i, o), (o, i, m)):
            seen.setdefault(shape, None)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    inputs, _ = mf.batch(microbatch_size, seed=seed)
    with torch.no_grad():
        model(*(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs))
    for h in handles:
        h.remove()
    return list(seen)


def _gemm(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Callable[[], object]:
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    return lambda: torch.matmul(a, b)


def _copy(nbytes: int, device: torch.device) -> Callable[[], object]:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _attention(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    """Forward and backward calls of SDPA at ``(batch, heads, seq, head_dim)``."""
    q, k, v = (torch.randn(*shape, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v)
    grad = torch.randn_like(out)

    def forward() -> object:
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v)

    def backward() -> object:
        # the forward again (as autograd needs its graph) with the backward: the backward alone is their difference
        return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad)

    return forward, backward


def measure_device(task: ProbeTask, device: torch.device, bar: tqdm | None = None) -> dict[str, Any]:
    """Time GEMMs, copies, attention and a tiny model's operators on ``device`` (one rank, alone).

    Args:
        task: the sweep.
        device: this rank's device.
        bar: advanced once per point (None: no progress).

    Returns:
        ``Measured``'s device fields (gemms, copies, attention, op_overhead_s) as plain data.
    """
    dtype, w, r = _DTYPES[task.dtype], task.warmup, task.repeats
    torch.backends.cuda.matmul.allow_tf32 = task.dtype == "tf32"
    gemms = []
    for m, n, k in task.gemms:
        gemms.append(GemmPoint(m=m, n=n, k=k, seconds=median_seconds(_gemm(m, n, k, dtype, device), device, w, r)))
        _tick(bar)
    copies = []
    for nbytes in task.copies:
        copies.append(CopyPoint(nbytes=nbytes, seconds=median_seconds(_copy(nbytes, device), device, w, r)))
        _tick(bar)
    attention = []
    for b, h, s, d in task.attention:
        forward, both = _attention((b, h, s, d), dtype, device)
        fwd_s = median_seconds(forward, device, w, r)
        bwd_s = max(median_seconds(both, device, w, r) - fwd_s, 1e-9)
        q = (b, h, s, d)
        attention.append(
            AttentionPoint(
                batch=b,
                heads=h,
                seq=s,
                head_dim=d,
                fwd_flops=float(sdpa_flop_count(q, q, q)),
                bwd_flops=float(sdpa_backward_flop_count(q, q, q, q)),
                fwd_s=fwd_s,
                bwd_s=bwd_s,
            )
        )
        _tick(bar)
    overhead = _op_overhead(repeats=max(3, r), device=str(device))
    _tick(bar)
    return {
        "gemms": gemms,
        "copies": copies,
        "attention": attention,
        "op_overhead_s": overhead,
        "memory_bytes": _device_memory(device),
    }


def _tick(bar: tqdm | None) -> None:
    if bar is not None:
        bar.update(1)


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return _memory_capacity()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return platform.processor() or platform.machine() or "cpu"


def _collective(op: str, nbytes: int, group: Any, ranks: list[int], device: torch.device) -> Callable[[], object]:
    """One call of ``op`` over ``group`` at ``nbytes`` (as ``probe_fit.COST_TERMS`` counts them)."""
    p = len(ranks)
    n = max(p, nbytes // 4 // p * p)  # fp32 elements, a multiple of the ranks
    x = torch.ones(n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":
        part, out = torch.ones(n // p, device=device), torch.empty(n, device=device)
        return lambda: _ALL_GATHER(out, part, group=group)
    if op == "reduce_scatter":
        part = torch.empty(n // p, device=device)
        return lambda: _REDUCE_SCATTER(part, x, group=group)
    if op == "all_to_all":
        out = torch.empty(n, device=device)
        return lambda: dist.all_to_all_single(out, x, group=group)
    # send_recv: a ping-pong between the group's first two ranks, timed as two one-way messages
    first, second = ranks[0], ranks[1]
    me = dist.get_rank()

    def ping_pong() -> None:
        if me == first:
            dist.send(x, second)
            dist.recv(x, second)
        elif me == second:
            dist.recv(x, first)
            dist.send(x, first)

    return ping_pong


def _time_group(fn: Callable[[], object], group: Any, device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of a collective call, every rank of ``group`` starting together (a barrier first)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _groups(world: int, per_node: int) -> Iterator[tuple[str, list[int]]]:
    """The groups a probe measures: the first node's ranks, and one rank per node."""
    node = list(range(min(per_node, world)))
    if len(node) >= 2:
        yield "intra_node", node
    heads = list(range(0, world, per_node))
    if len(heads) >= 2:
        yield "inter_node", heads


def measure_collectives(task: ProbeTask, device: torch.device, bar: tqdm | None = None) -> dict[str, Any]:
    """Time every collective over each group at every size (every rank calls it; the group joined).

    Args:
        task: the sweep.
        device: this rank's device.
        bar: advanced once per (group, op, size) (None: no progress).

    Returns:
        ``{"intra_node": CollectiveSweep | None, "inter_node": ...}``: rank 0's medians.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    found: dict[str, Any] = {"intra_node": None, "inter_node": None}
    for name, ranks in _groups(world, task.gpus_per_node):
        group = dist.new_group(ranks)  # every rank creates every group, in the same order
        ops: dict[str, list[CollectivePoint]] = {}
        for op in COLLECTIVES:
            points = []
            for nbytes in task.sizes:
                if me in ranks:
                    fn = _collective(op, nbytes, group, ranks, device)
                    seconds = _time_group(fn, group, device, task.warmup, task.repeats)
                    # send_recv timed a round trip: two messages
                    points.append(CollectivePoint(nbytes=nbytes, seconds=seconds / 2 if op == "send_recv" else seconds))
                _tick(bar)
            ops[op] = points
        if me in ranks:
            found[name] = CollectiveSweep(ranks=len(ranks), ops=ops)
        dist.barrier()
    return found


def _points(task: ProbeTask, world: int) -> int:
    """Points the progress bar counts on rank 0."""
    groups = len(list(_groups(world, task.gpus_per_node)))
    return len(task.gemms) + len(task.copies) + len(task.attention) + 1 + groups * len(COLLECTIVES) * len(task.sizes)


def measured_record(task: ProbeTask, device: torch.device, world: int, parts: dict[str, Any]) -> Measured:
    """The ``Measured`` record of a probe from rank 0's parts.

    Args:
        task: the sweep.
        device: rank 0's device.
        world: ranks in all.
        parts: ``measure_device``'s and ``measure_collectives``' results.

    Returns:
        The record.
    """
    return Measured(
        device=device.type,
        device_name=_device_name(device),
        backend="nccl" if device.type == "cuda" else "gloo",
        dtype=task.dtype,
        world_size=world,
        gpus_per_node=min(task.gpus_per_node, world),
        threads=task.threads,
        host=socket.gethostname(),
        torch_version=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        quick=task.quick,
        **parts,
    )


def probe_here(task: ProbeTask) -> Measured:
    """A one-rank probe in this process (no collectives: there is no one to talk to).

    Args:
        task: the sweep.

    Returns:
        What was measured.
    """
    device = torch.device("cuda", 0) if task.device == "cuda" else torch.device("cpu")
    with torch_threads(task.threads), tqdm(total=_points(task, 1), desc="probe", disable=not task.progress) as bar:
        parts = measure_device(task, device, bar)
    return measured_record(task, device, 1, parts)


def probe_rank(task_json: str) -> str:
    """One launched rank of a probe: join the group torchrun-style, measure, leave.

    Args:
        task_json: the ``ProbeTask`` as JSON.

    Returns:
        Rank 0: its ``Measured`` record as JSON; the other ranks: an empty string.
    """
    task = ProbeTask.model_validate_json(task_json)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=task.timeout_s)
    if task.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    try:
        show = task.progress and rank == 0
        with torch_threads(task.threads), tqdm(total=_points(task, world), desc="probe", disable=not show) as bar:
            parts: dict[str, Any] = measure_device(task, device, bar) if rank == 0 else {}
            dist.barrier()  # the others wait while rank 0 has the machine to itself
            parts.update(measure_collectives(task, device, bar if rank == 0 else None))
        return measured_record(task, device, world, parts).model_dump_json() if rank == 0 else ""
    finally:
        dist.destroy_process_group()
