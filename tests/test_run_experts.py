"""Tier 3: expert parallelism's dispatch (``planner.run.experts``) on real gloo processes: an experts
module sharded over the ranks, each rank's tokens sent to the ranks holding their experts and back,
equals the unsplit module on the whole batch (outputs, input and router-weight gradients, and each
rank's experts' gradients), also where a rank receives no token."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_run_tp import gloo_pair, spawn_pair  # noqa: E402

from planner.capture.load import load_model_file  # noqa: E402
from planner.errors import PlanFileError  # noqa: E402
from planner.run.experts import ExpertDispatch, shard_experts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKENS, TOP_K = 6, 2


def _experts(model: str) -> torch.nn.Module:
    """A layer's experts module, the same on every rank: transformers' Mixtral's or the fixture file's."""
    path = ROOT / ("models/hf/mixtral.py" if model == "mixtral" else "tests/fixtures/moe_file.py")
    built = load_model_file(path, "tiny").build(seed=0)
    return built.get_submodule("model.layers.0.mlp.experts" if model == "mixtral" else "layers.0.moe.experts")


def _routed(n: int, n_experts: int, dim: int, lopsided: bool) -> tuple[torch.Tensor, ...]:
    """Every rank's tokens, router choices (distinct experts per token) and weights; ``lopsided``: every
    token routed to the first rank's experts only."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(n, TOKENS, dim, generator=g)
    pool = n_experts // n if lopsided else n_experts
    index = torch.stack([torch.randperm(pool, generator=g)[:TOP_K] for _ in range(n * TOKENS)]).reshape(
        n, TOKENS, TOP_K
    )
    weights = torch.rand(n, TOKENS, TOP_K, generator=g).softmax(-1)
    grad = torch.randn(n, TOKENS, dim, generator=g)
    return hidden, index, weights, grad


def _assert_unsplit(
    got: tuple[torch.Tensor, ...],
    want: tuple[torch.Tensor, ...],
    local: torch.nn.Module,
    whole: torch.nn.Module,
    first: int,
) -> None:
    """The dispatched layer's output and its input and router-weight gradients (``got``: the output, and
    the two inputs whose ``grad`` is compared) equal the unsplit module's (``want``), and each local
    expert's gradient equals its expert's in the unsplit module (from expert ``first`` on)."""
    out, h, w = got
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, want[2], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(local.named_parameters(), whole.parameters()):
        full = q.grad if q.grad is not None else torch.zeros_like(q)
        mine = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(mine, full[first : first + p.shape[0]], rtol=1e-5, atol=1e-6, msg=name)


def _dispatch_rank(rank: int, port: int, model: str, n: int, lopsided: bool) -> None:
    with gloo_pair(rank, port, n):
        whole = _experts(model)
        n_experts = next(whole.parameters()).shape[0]
        dim = next(p for p in whole.parameters()).shape[-1]
        hidden, index, weights, grad = _routed(n, n_experts, dim, lopsided)
        # the reference: every rank's tokens through the unsplit module
        ref_h = hidden.reshape(-1, dim).clone().requires_grad_()
        ref_w = weights.reshape(-1, TOP_K).clone().requires_grad_()
        ref = whole(ref_h, index.reshape(-1, TOP_K), ref_w)
        (ref * grad.reshape(-1, dim)).sum().backward()
        local = copy.deepcopy(whole)
        first = shard_experts(local, "layers.0.experts", rank, n)
        assert first == rank * n_experts // n and next(local.parameters()).shape[0] == n_experts // n
        layer = ExpertDispatch(local, n_experts)
        h = hidden[rank].clone().requires_grad_()
        w = weights[rank].clone().requires_grad_()
        out = layer(h, index[rank], w)
        (out * grad[rank]).sum().backward()
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
        _assert_unsplit((out, h, w), (ref[mine], ref_h.grad[mine], ref_w.grad[mine]), local, whole, first)
        if lopsided and rank > 0:  # no token reached this rank's experts: their gradients are zero
            assert all(p.grad is None or not p.grad.any() for p in local.parameters())


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("model", "n", "lopsided"),
    [("mixtral", 2, False), ("mixtral", 2, True), ("fixture", 4, False)],
    ids=["mixtral-2", "mixtral-2-one-rank-gets-all", "model-file-4"],
)
def test_dispatched_experts_equal_the_unsplit_layer(model: str, n: int, lopsided: bool) -> None:
    pytest.importorskip("transformers") if model == "mixtral" else None
    spawn_pair(functools.partial(_dispatch_rank, model=model, n=n, lopsided=lopsided), n)


def test_a_group_that_does_not_divide_the_experts_is_refused() -> None:
    experts = _experts("fixture")  # 4 experts
    with pytest.raises(PlanFileError, match=r"shards the experts of layers\.0 over 3 ranks, but .* holds 4 experts"):
        shard_experts(experts, "layers.0", 0, 3)


def _sliced_rank(rank: int, port: int) -> None:
    # 4 ranks: 2 replicas x 2 tensor-parallel ranks, one expert group over all 4; the two ranks of a
    # replica hold the same tokens and each routes its slice (3 and 2 of 5; 1 and none of 1)
    with gloo_pair(rank, port, 4):
        for tokens in (5, 1):
            _sliced(rank, tokens)


def _sliced(rank: int, tokens: int) -> None:
    """One layer over the 4 ranks of ``_sliced_rank``, each replica's ``tokens`` split over its pair."""
    import torch.distributed as dist

    whole = _experts("fixture")  # 4 experts: one per rank
    n_experts = next(whole.parameters()).shape[0]
    dim = next(whole.parameters()).shape[-1]
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(2, tokens, dim, generator=g)
    index = torch.stack([torch.randperm(n_experts, generator=g)[:TOP_K] for _ in range(2 * tokens)])
    index = index.reshape(2, tokens, TOP_K)
    weights = torch.rand(2, tokens, TOP_K, generator=g).softmax(-1)
    grad = torch.randn(2, tokens, dim, generator=g)
    ref_h = hidden.reshape(-1, dim).clone().requires_grad_()
    ref_w = weights.reshape(-1, TOP_K).clone().requires_grad_()
    ref = whole(ref_h, index.reshape(-1, TOP_K), ref_w)
    (ref * grad.reshape(-1, dim)).sum().backward()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in order
    replica = rank // 2
    local = copy.deepcopy(whole)
    first = shard_experts(local, "layers.0.experts", rank, 4)
    layer = ExpertDispatch(local, n_experts, tokens=pairs[replica])
    h = hidden[replica].clone().requires_grad_()
    w = weights[replica].clone().requires_grad_()
    out = layer(h, index[replica], w)
    (out * grad[replica]).sum().backward()
    mine = slice(replica * tokens, (replica + 1) * tokens)
    # each tensor-parallel rank ends with the whole replica's output and gradients, as unsplit
    _assert_unsplit((out, h, w), (ref[mine], ref_h.grad[mine], ref_w.grad[mine]), local, whole, first)


@pytest.mark.multiprocess
def test_tensor_parallel_ranks_route_their_slices_and_equal_the_unsplit_layer() -> None:
    # uneven slices (5 tokens), then a rank with no token (1)
    spawn_pair(_sliced_rank, 4)


def test_token_slices_cover_every_row_once() -> None:
    from planner.run.experts import _slice

    for total in range(0, 12):
        for parts in range(1, 5):
            rows = [i for k in range(parts) for i in range(total)[_slice(total, parts, k)]]
            assert rows == list(range(total)), (total, parts)
            sizes = [len(range(total)[_slice(total, parts, k)]) for k in range(parts)]
            assert max(sizes) - min(sizes) <= 1
