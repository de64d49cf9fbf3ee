"""Tier 2 (CPU torch): the temporaries a backward holds at its peak (``planner.costs.backward_temps``),
what the profiler and the estimate record of them, and how the memory model counts them.

Exact where the shapes say what the answer is: a feed-forward block's backward holds two gradients as
wide as its hidden layer at once; a cross-entropy's two the size of the logits.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from planner.capture.trace import trace_model
from planner.core.levers.hardware import get_hardware
from planner.core.split.stage_model import stage_memory_parts
from planner.costs.backward_temps import BackwardTemps, backward_temp_bytes
from planner.costs.estimate import estimate_blocks
from planner.costs.measure import profile_model
from planner.costs.settings import ProfileSettings, Sample
from planner.schema.costs import BlockCost, OptimizerSpec
from tests.plan_factory import block
from tests.test_recompute import B, D, Mlp, _mse

DEVICES = ["cpu", "meta"]


@pytest.mark.parametrize("device", DEVICES)
def test_a_feed_forward_backward_holds_two_hidden_wide_gradients(device: str) -> None:
    n, d, hidden = 64, 256, 1024
    x = torch.randn(n, d, device=device, requires_grad=True)
    w1 = torch.randn(hidden, d, device=device, requires_grad=True)
    w2 = torch.randn(d, hidden, device=device, requires_grad=True)
    y = F.linear(F.silu(F.linear(x, w1)), w2)
    grad = torch.ones_like(y)  # received: made before the backward, not one of its temporaries
    # the gradient of silu's output and of its input, both n x hidden fp32, live at once; the
    # gradients of x, w1 and w2 survive the backward and are not temporaries
    assert backward_temp_bytes(lambda: torch.autograd.backward(y, grad)) == 2 * n * hidden * 4


@pytest.mark.parametrize("device", DEVICES)
def test_a_cross_entropy_backward_holds_two_logit_sized_gradients(device: str) -> None:
    n, d, vocab = 64, 32, 100
    h = torch.randn(n, d, device=device, requires_grad=True)
    w = torch.randn(vocab, d, device=device, requires_grad=True)
    loss = F.cross_entropy(h @ w.t(), torch.randint(0, vocab, (n,), device=device))
    # nll_loss's gradient and log_softmax's (the logits'), n x vocab fp32 each, + the loss's own 4 bytes
    assert backward_temp_bytes(loss.backward) == 2 * n * vocab * 4 + 4


def test_what_survives_or_existed_before_is_not_counted() -> None:
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(4, 16, requires_grad=True)
    y = x @ w.t()
    grad = torch.ones_like(y)
    # the only new tensors are x's and w's gradients, which survive
    assert backward_temp_bytes(lambda: y.backward(grad)) == 0
    assert x.grad is not None and w.grad is not None
    # freed after the mode ends (a zero_grad): still a survivor of that backward
    y2 = x @ w.t()
    x.grad = w.grad = None
    with BackwardTemps() as temps:
        y2.backward(grad)
    x.grad = w.grad = None
    assert temps.peak() == 0


def test_a_sparse_gradient_is_passed_over() -> None:
    # nn.Embedding(sparse=True) makes a sparse gradient, which has no storage to watch: not counted,
    # and no error (the profile of such a model must not fail)
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    out = embedding(torch.tensor([1, 2, 3])).sum()
    assert backward_temp_bytes(out.backward) >= 0
    assert embedding.weight.grad is not None and embedding.weight.grad.is_sparse


def test_floating_bytes_count_at_the_planning_width() -> None:
    n, d, hidden = 16, 8, 32
    x = torch.randn(n, d, device="meta", requires_grad=True)
    w1 = torch.randn(hidden, d, device="meta", requires_grad=True)
    w2 = torch.randn(d, hidden, device="meta", requires_grad=True)
    y = F.linear(F.silu(F.linear(x, w1)), w2)
    grad = torch.ones_like(y)
    with BackwardTemps(float_bytes=2) as temps:  # an fp32 run standing for a bf16 plan
        torch.autograd.backward(y, grad)
    assert temps.peak() == 2 * n * hidden * 2


def test_the_profiler_and_the_estimate_record_the_blocks_temporaries() -> None:
    torch.manual_seed(0)
    model = Mlp()
    x, y = torch.randn(B, D), torch.randn(B, D)
    traced = trace_model(model, (x,))
    measured = profile_model(traced, Sample((x,), y, _mse), ProfileSettings(progress=False, warmup=0, repeats=1))
    estimated = estimate_blocks(traced, (x,), y, _mse, get_hardware("h100"), dtype="fp32", progress=False)
    first, last = measured.costs
    # block 0, Linear(D, 4D) + GELU: the gradient of the addmm's output (B x 4D fp32); its input is the
    # user's data (no gradient), its weights' gradients survive
    assert first.bwd_temp_bytes == 4 * B * 4 * D
    # block 1, Linear(4D, D), from its output's gradient: nothing but what survives (its input's and
    # its weights' gradients)
    assert last.bwd_temp_bytes == 0
    # from the loss on: at least the loss's gradient of the output and the output's own (B x D fp32
    # each), which the block's backward then consumes
    assert first.loss_temp_bytes is None
    assert last.loss_temp_bytes is not None and last.loss_temp_bytes >= 2 * 4 * B * D
    # the estimate runs the same operators on meta tensors: the same bytes
    for e, m in zip(estimated, measured.costs):
        assert (e.bwd_temp_bytes, e.loss_temp_bytes) == (m.bwd_temp_bytes, m.loss_temp_bytes)


def _block(name: str, act: int, temp: int | None, out: int = 0, cut: int = 10, loss: int | None = None) -> BlockCost:
    """A block of ``act`` bytes of activations (half of them kept by selective checkpointing) whose
    backward holds ``temp`` bytes of temporaries (``loss`` from its loss on)."""
    fields = {"activation_bytes": act, "selective_bytes": act // 2, "cut_bytes": cut, "output_bytes": out}
    fields |= {"bwd_temp_bytes": temp, "loss_temp_bytes": loss}
    return block(name, 1.0, 1.0, 0).model_copy(update=fields)


SGD = OptimizerSpec(name="sgd")


def test_the_stage_model_adds_one_backwards_temporaries() -> None:
    blocks = [_block("a", 100, 30), _block("b", 200, 50), _block("c", 300, 20, out=40, cut=0, loss=500)]
    # a middle stage: its output's gradient (the cut, 10) and the most temporaries of its blocks (50)
    never = stage_memory_parts(blocks, 0, 2, SGD, "never")
    assert (never.per_microbatch, never.once) == (300 + 10, 10 + 50)
    # full: the regions' inputs per microbatch; once the largest region rebuilt with its temporaries
    full = stage_memory_parts(blocks, 0, 2, SGD, "full")
    assert (full.per_microbatch, full.once) == (0 + 10 + 10, 10 + 200 + 50)
    # selective: half of each region kept, the other half rebuilt with the temporaries
    selective = stage_memory_parts(blocks, 0, 2, SGD, "selective")
    assert (selective.per_microbatch, selective.once) == (10 + 150 + 10, 10 + 100 + 50)
    # the whole stage one region: all of it rebuilt, then the most temporaries
    stage = stage_memory_parts(blocks, 0, 2, SGD, "stage")
    assert (stage.per_microbatch, stage.once) == (0 + 10, 10 + 300 + 50)
    # the last stage: its loss's backward (500, before anything is rebuilt), or the output's gradient
    # (40) with the block's own temporaries (20) and, checkpointed, its region rebuilt (300)
    assert stage_memory_parts(blocks, 2, 3, SGD, "never").once == 500
    assert stage_memory_parts(blocks, 2, 3, SGD, "full").once == 500
    small = [*blocks[:2], blocks[2].model_copy(update={"loss_temp_bytes": 100})]
    assert stage_memory_parts(small, 2, 3, SGD, "never").once == 100
    assert stage_memory_parts(small, 2, 3, SGD, "full").once == 40 + 300 + 20
    # what the loss saved (here 200 of the block's 300) is kept per microbatch, and freed by the
    # loss's backward before the block's: not counted again while the block's region is rebuilt
    held = [*blocks[:2], small[2].model_copy(update={"loss_bytes": 200})]
    full = stage_memory_parts(held, 2, 3, SGD, "full")
    assert (full.per_microbatch, full.once) == (10 + 200 + 40, max(100, 40 + (300 - 200) + 20 - 200))
    assert stage_memory_parts(held, 2, 3, SGD, "never").once == max(100, 40 + 20 - 200)
    # not measured: no temporaries, the output's gradient alone, as before
    old = [b.model_copy(update={"bwd_temp_bytes": None, "loss_temp_bytes": None}) for b in blocks]
    assert stage_memory_parts(old, 2, 3, SGD, "never").once == 40
    assert stage_memory_parts(old, 0, 2, SGD, "never").once == 10
