"""Train a plan made by ``planner plan`` with your own script: your model, data, optimizer and loop.

The planner gives this rank its stages (torch ``PipelineStage``), torch's schedule for the plan and
what a step needs around the optimizer; everything else is this script's. This file is also a model
file (``build_model`` / ``make_batch`` below), so it can be planned as it is:

    planner plan examples/train_with_plan.py --gpus 2 -b 8 -o plan.json
    torchrun --nproc-per-node 2 examples/train_with_plan.py plan.json --steps 20

A script of your own need not be a model file: plan a file that builds the same model (the plan
checks the structure by its fingerprint) and call ``planner.pipeline`` with the model you build.
The model here ties its output layer to its embedding, so the two stages holding them share a
weight (``Pipeline.finish_grads`` sums its gradients, so both copies stay equal).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyLM(nn.Module):
    """A small decoder language model: embedding, pre-norm transformer layers, tied output layer."""

    def __init__(self, vocab: int = 128, dim: int = 64, layers: int = 4, heads: int = 4, seq: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embed.weight, std=0.02)  # it is the output layer's weight too
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(x))


# The model-file contract (docs/architecture.md), so that `planner plan` can plan this file.
SIZES = {"tiny": {"dim": 64, "layers": 4}, "small": {"dim": 256, "layers": 8}}


def build_model(vocab: int = 128, dim: int = 64, layers: int = 4, heads: int = 4, seq: int = 32) -> nn.Module:
    return TinyLM(vocab, dim, layers, heads, seq)


def make_batch(batch_size: int, vocab: int = 128, seq: int = 32, **_ignored: object) -> tuple[tuple, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch_size, seq + 1))
    return (tokens[:, :-1],), tokens[:, 1:]


def batches(
    batch_size: int, vocab: int = 128, seq: int = 32, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This script's data: sequences that follow a fixed random successor rule (learnable), seeded."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=g)
    while True:
        seqs = torch.empty(batch_size, seq + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(0, vocab, (batch_size,), generator=g)
        for t in range(seq):
            seqs[:, t + 1] = successor[seqs[:, t]]
        noise = torch.rand(batch_size, seq + 1, generator=g) < 0.1
        seqs[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
        yield seqs[:, :-1], seqs[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def main() -> None:
    import torch.distributed as dist

    import planner

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plan", help="the plan.json `planner plan` wrote for this file")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="the model's and the data's seed (same on every rank)")
    parser.add_argument("--losses", help="write the step losses here (JSON), from the rank that computes them")
    parser.add_argument("--save", help="write a torch.distributed.checkpoint of the trained weights to this folder")
    args = parser.parse_args()

    plan = planner.load_plan(args.plan)
    torch.manual_seed(args.seed)  # every rank builds the same weights
    model = build_model(**plan.model.config)
    vocab, seq = plan.model.config.get("vocab", 128), plan.model.config.get("seq", 32)
    data = batches(plan.batch_size, vocab, seq, args.seed)
    example, _ = next(batches(plan.microbatch_size, vocab, seq, args.seed))  # sizes the stages' buffers

    pipe = planner.pipeline(plan, model, example, loss_fn=loss_fn)
    del model  # the stages hold their own copy of the weights
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    rows = slice(pipe.replica * pipe.batch_size, (pipe.replica + 1) * pipe.batch_size)  # this replica's rows

    losses = []
    for step in range(1, args.steps + 1):
        tokens, target = next(data)
        loss = pipe.step(tokens[rows], target[rows])
        pipe.finish_grads()  # microbatch mean, tied copies summed, replicas averaged
        norm = pipe.clip_grad_norm_(1.0)  # the whole model's gradient norm
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None and pipe.replica == 0:
            losses.append(float(loss))
            print(f"step {step}: loss {float(loss):.4f} (perplexity {math.exp(float(loss)):.1f}), grad norm {norm:.3f}")

    if args.save:
        import torch.distributed.checkpoint as dcp

        dcp.save(pipe.state_dict(), checkpoint_id=args.save)  # keyed by the unsplit model's names
    if args.losses and losses:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
