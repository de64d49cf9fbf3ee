"""``planner run``'s options, validated once: ``RunRequest`` (``planner.schema.request`` holds the base
that turns a validation error into one line, and ``planner plan``'s ``PlanRequest``).

Pure module: pydantic only, never torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from planner.schema.bounds import TimeoutSeconds
from planner.schema.request import _Request


class RunRequest(_Request):
    """Every option of ``planner run`` (see ``planner run --help``)."""

    OPTIONS: ClassVar[dict[str, str]] = {
        "plan_file": "PLAN_FILE",
        "steps": "--steps",
        "nnodes": "--nnodes",
        "rdzv_endpoint": "--rdzv-endpoint",
        "rdzv_id": "--rdzv-id",
        "node_rank": "--node-rank",
        "output": "--output",
        "timeout_s": "--timeout",
        "data": "--data",
        "tokenizer": "--tokenizer",
        "eval_every": "--eval-every",
        "eval_batches": "--eval-batches",
        "eval_fraction": "--eval-fraction",
        "checkpoint_dir": "--checkpoint-dir",
        "checkpoint_every": "--checkpoint-every",
        "save_checkpoints": "--no-checkpoint",
        "resume": "--resume",
        "warmup": "--warmup",
        "lr_decay": "--lr-decay",
    }

    plan_file: Path = Field(description="The plan to train (relative model paths resolve against its folder).")
    steps: int = Field(default=20, ge=1, description="Optimizer steps.")
    nnodes: int = Field(default=1, ge=1, description="Machines taking part (torchrun's --nnodes).")
    rdzv_endpoint: str | None = Field(
        default=None, description="host:port of the rendezvous (None: localhost, a free port)."
    )
    rdzv_id: str | None = Field(
        default=None, description="Rendezvous id shared by every machine (None: from the plan)."
    )
    node_rank: int | None = Field(
        default=None,
        ge=0,
        description="This machine's index, 0..nnodes-1, for a static rendezvous (None: c10d assigns ranks).",
    )
    output: Path | None = Field(default=None, description="Where run.json goes (None: PLAN's name with .run.json).")
    echo: bool = Field(default=True, description="Print one line per step.")
    timeout_s: TimeoutSeconds = Field(  # bounds: under 5 s a healthy rank would be taken for a hung one
        default=300.0,
        gt=0,
        le=86400,
        description="Seconds a rank may wait on another (a collective, a send, the rendezvous) before the run stops.",
    )
    data: Path | None = Field(
        default=None, description="A text file or a folder of .txt files (None: the model file's own batches)."
    )
    tokenizer: Literal["char", "byte", "word"] = Field(default="char", description="How --data text becomes token ids.")
    eval_every: int = Field(
        default=0, ge=0, description="Evaluate on the held-out split of --data every N steps (0: only at the end)."
    )
    eval_fraction: float = Field(
        default=0.1,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="The share of --data's tokens held out for evaluation (the end of it).",
    )
    eval_batches: int = Field(
        default=0, ge=0, description="Held-out batches per evaluation (0: the whole held-out split)."
    )
    checkpoint_dir: Path | None = Field(
        default=None, description="Where checkpoints go (None: PLAN's name with .ckpt, next to the plan)."
    )
    checkpoint_every: int = Field(
        default=0, ge=0, description="Save a checkpoint every N steps (0: only the final one, after the last step)."
    )
    save_checkpoints: bool = Field(default=True, description="Write checkpoints (False: --no-checkpoint).")
    resume: bool = Field(default=False, description="Continue from the newest checkpoint in the checkpoint folder.")
    warmup: int = Field(default=0, ge=0, description="Steps of linear learning-rate warm-up from 0.")
    lr_decay: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="The learning rate after the warm-up: constant, or decaying to 0 at --steps."
    )

    @model_validator(mode="after")
    def _endpoint(self) -> RunRequest:
        if self.rdzv_endpoint is not None:
            host, sep, port = self.rdzv_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ValueError(
                    f"--rdzv-endpoint {self.rdzv_endpoint}: expected HOST:PORT with a port number 0-65535, "
                    "e.g. --rdzv-endpoint node0:29500"
                )
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError(f"a run on {self.nnodes} nodes needs --rdzv-endpoint HOST:PORT reachable from every node")
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} is not a node of --nnodes {self.nnodes} (0..{self.nnodes - 1})"
            )
        if not self.save_checkpoints and (self.checkpoint_every or self.checkpoint_dir is not None):
            raise ValueError("--no-checkpoint writes no checkpoints: drop --checkpoint-every / --checkpoint-dir")
        if self.data is None:
            # each of these acts on --data's text only: without it, given, it would be ignored
            given = [
                option
                for option, value, default in (
                    ("--eval-every", self.eval_every, 0),
                    ("--eval-batches", self.eval_batches, 0),
                    ("--eval-fraction", self.eval_fraction, 0.1),
                    ("--tokenizer", self.tokenizer, "char"),
                )
                if value != default
            ]
            if given:
                one = len(given) == 1
                raise ValueError(
                    f"{', '.join(given)} {'acts' if one else 'act'} on the text of --data: give --data PATH too, "
                    f"or leave {'it' if one else 'them'} out"
                )
        return self

    @property
    def rdzv_host(self) -> str | None:
        """The rendezvous host (None: this machine, a free port)."""
        return self.rdzv_endpoint.rpartition(":")[0].strip("[]") if self.rdzv_endpoint else None

    @property
    def checkpoint_root(self) -> Path:
        """The folder checkpoints go to and are resumed from."""
        return self.checkpoint_dir if self.checkpoint_dir is not None else self.plan_file.with_suffix(".ckpt")

    @property
    def result_path(self) -> Path:
        """Where the run report is written."""
        return self.output if self.output is not None else self.plan_file.with_suffix(".run.json")
