"""Tier 3: ring attention (``planner.run.ring_attention``) on gloo processes against torch's own
``scaled_dot_product_attention`` of the whole sequence: each rank's output rows and the gradients of
its queries and of its own chunk of keys and values, causal (with the mirrored query blocks context
parallelism computes, and with contiguous ones), under a boolean and an additive mask, with
grouped-query heads, on 2 and 3 ranks. The whole model's equality: tests/test_run_cp.py."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_run_tp import spawned  # noqa: E402

from planner.run.context_shard import Mirrored  # noqa: E402
from planner.run.ring_attention import Ring, ring_attention  # noqa: E402

B, HQ, LENGTH, D = 2, 4, 24, 8


def _inputs(heads_kv: int, mask: str) -> tuple:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, LENGTH, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, heads_kv, LENGTH, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, heads_kv, LENGTH, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, HQ, LENGTH, D, generator=g, dtype=torch.float64)
    m = None
    if mask == "bool":  # a padding mask: the last three keys of the second sequence masked
        m = torch.ones(B, 1, 1, LENGTH, dtype=torch.bool)
        m[1, ..., -3:] = False
    elif mask == "additive":
        m = torch.randn(B, 1, LENGTH, LENGTH, generator=g, dtype=torch.float64)
    return q, k, v, dout, m


def _rank(rank: int, size: int, store_path: str, heads_kv: int, mask: str, mirrored: bool, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
    try:
        q, k, v, dout, m = _inputs(heads_kv, mask)
        n = LENGTH // size
        if mirrored:
            rows = Mirrored(rank, size).positions(n // 2, q.device)
        else:
            rows = rank * n + torch.arange(n)
        own = slice(rank * n, (rank + 1) * n)
        mq = q.index_select(2, rows).clone().requires_grad_()
        mk, mv = k[:, :, own].clone().requires_grad_(), v[:, :, own].clone().requires_grad_()
        rows_mask = None if m is None else (m if m.shape[-2] == 1 else m.index_select(-2, rows))
        ring = Ring(dist.group.WORLD, rank, size)
        out = ring_attention(mq, mk, mv, rows, mask=rows_mask, causal=mask == "causal", scale=None, ring=ring)
        out.backward(dout.index_select(2, rows))
        torch.save(
            {"rows": rows, "out": out.detach(), "dq": mq.grad, "dk": mk.grad, "dv": mv.grad}, f"{out_dir}/{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("size", "heads_kv", "mask", "mirrored"),
    [
        (2, 4, "causal", True),
        (3, 2, "causal", True),  # grouped-query heads; one rank computes both of another's blocks
        (3, 4, "causal", False),
        (2, 2, "bool", False),
        (2, 4, "additive", True),
    ],
)
def test_ring_attention_equals_attention_over_the_whole_sequence(
    tmp_path: Path, size: int, heads_kv: int, mask: str, mirrored: bool
) -> None:
    spawned(_rank, (size, str(tmp_path / "store"), heads_kv, mask, mirrored, str(tmp_path)), size)
    q, k, v, dout, m = _inputs(heads_kv, mask)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=mask == "causal", enable_gqa=heads_kv != HQ)
    want.backward(dout)
    n = LENGTH // size
    for rank in range(size):
        got = torch.load(tmp_path / f"{rank}.pt")
        rows = got["rows"]
        own = slice(rank * n, (rank + 1) * n)
        torch.testing.assert_close(got["out"], want.detach().index_select(2, rows), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got["dq"], q.grad.index_select(2, rows), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got["dk"], k.grad[:, :, own], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got["dv"], v.grad[:, :, own], rtol=1e-9, atol=1e-9)
