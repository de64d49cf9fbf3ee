"""The meta operator cache answers repeated calls exactly as the meta kernels do (CPU torch tier)."""

from __future__ import annotations

import torch
from torch import nn

from planner.capture.graph import record_values, trace_fx
from planner.capture.meta_cache import MetaOpCache, meta_op_cache, on_meta


def _layers(n: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16)) for _ in range(n))
    )


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


def test_identical_layers_run_their_kernels_once_and_record_the_same_values() -> None:
    with torch.device("meta"):
        model = _layers(6)
    x = torch.empty(4, 16, device="meta")
    gm = trace_fx(model, (x,))
    cache = MetaOpCache()
    with cache:
        out = gm(x)
    # addmm, gelu, addmm, native_layer_norm: run for the first layer, answered for the other five
    assert (cache.misses, cache.hits) == (4, 5 * 4)
    assert out.shape == (4, 16) and out.device.type == "meta"
    assert record_values(gm, (x,)) == _recorded_plainly(gm, x)  # record_values caches on its own


def _recorded_plainly(gm: torch.fx.GraphModule, x: torch.Tensor) -> dict:
    """What record_values gives without the cache (the same interpreter, no dispatch mode)."""
    from planner.capture.blocks import describe

    values = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> object:
            out = super().run_node(n)
            values[n.name] = describe(out)
            return out

    with torch.no_grad():
        Recorder(gm).run(x)
    return values


def test_outputs_match_the_kernels_metadata_for_strided_and_multi_output_ops() -> None:
    a = torch.empty(3, 8, 5, device="meta").transpose(0, 2)  # not contiguous
    b = torch.empty(5, 8, 7, device="meta")
    expected = [
        torch.bmm(a.transpose(0, 1).transpose(1, 2), b.transpose(0, 1)),
        torch.nn.functional.layer_norm(b, (7,)),
        a * 2.0,
        torch.softmax(b, -1),
        torch.topk(b, 3, -1)[1],
    ]
    cache = MetaOpCache()
    with cache:
        for _ in range(2):  # the second round is answered from the cache
            got = [
                torch.bmm(a.transpose(0, 1).transpose(1, 2), b.transpose(0, 1)),
                torch.nn.functional.layer_norm(b, (7,)),
                a * 2.0,
                torch.softmax(b, -1),
                torch.topk(b, 3, -1)[1],  # one of two outputs
            ]
    assert cache.hits > 0
    for e, g in zip(expected, got):
        assert (g.shape, g.stride(), g.dtype, g.device) == (e.shape, e.stride(), e.dtype, e.device)


def test_views_in_place_and_real_results_are_never_replayed() -> None:
    x = torch.empty(4, 6, device="meta")
    cache = MetaOpCache()
    with cache:
        for _ in range(3):
            v = x.view(6, 4)
            assert v.untyped_storage().nbytes() == x.untyped_storage().nbytes()  # still a view of x
            y = x.clone()
            assert y.add_(1.0) is y  # in place returns its own tensor
            r = torch.arange(5)  # a CPU tensor holds values: never answered from the cache
            assert r.tolist() == [0, 1, 2, 3, 4]
            z = x * torch.tensor(2.0)  # a real (0-dim) tensor argument: the call runs
            assert z.device.type == "meta"
    assert not any(f is torch.ops.aten.view.default for f, *_ in cache.answers)
    assert not any(f is torch.ops.aten.add_.Tensor for f, *_ in cache.answers)
    assert not any(f is torch.ops.aten.mul.Tensor for f, *_ in cache.answers)


def test_gradients_flow_through_replayed_outputs() -> None:
    with torch.device("meta"):
        model = _layers(3)
    x = torch.empty(4, 16, device="meta", requires_grad=True)
    with meta_op_cache() as cache:
        model(x).sum().backward()
    assert cache is not None and cache.hits > 0
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    assert x.grad is not None and x.grad.shape == x.shape


def test_on_meta_looks_at_parameters_and_inputs() -> None:
    real = nn.Linear(2, 2)
    assert not on_meta(real, (torch.zeros(1, 2),))
    assert on_meta(real, (torch.zeros(1, 2, device="meta"),))
    with torch.device("meta"):
        assert on_meta(nn.Linear(2, 2))
    assert not on_meta(nn.ReLU(), (3, None))
