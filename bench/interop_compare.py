"""The splits other trainers choose, given to ``planner plan --compare``, beside the plan: estimated
for models/llama.py 8B on 8 H100s, and planned and measured on this machine for a shipped model.

    python -m bench.interop_compare            # needs the interop extra (torchtitan, deepspeed); ~5 min

Each trainer's split comes from its own code: torchtitan's ``_generate_llm_fqn_per_model_part``
(its default when no module lists are given; its 0.3 names ``lm_head`` what models/llama.py calls
``output``), Megatron's even split (``--num-layers`` over the pipeline stages, as a layout string),
and DeepSpeed's ``partition_balanced`` over the blocks' parameter counts (``partition_method=
"parameters"``). The section between the markers of docs/interop.md is replaced.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from bench.common import DOCS, MODELS, alternate, machine, table, write_between_markers
from planner.api import make_plan
from planner.schema.plan import Plan, Prediction
from planner.schema.request import PlanRequest

DOC = DOCS / "interop.md"
BEGIN = "<!-- BEGIN interop-compare (written by bench/interop_compare.py) -->"
END = "<!-- END interop-compare -->"
LLAMA = MODELS / "llama.py"
ESTIMATED = dict(size="8b", gpus=8, gpu_type="h100", batch_size=32, dp=1, tp=1)
MEASURED = dict(size="tiny", overrides={"vocab_size": 16384}, gpus=2, batch_size=16)
ROUNDS, STEPS = 3, 12


def trainer_splits(plan: Plan) -> dict[str, str]:
    """Each trainer's split of the plan's model over its stages, as ``--compare`` takes it."""
    from deepspeed.runtime.utils import partition_balanced
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    stages, layers = plan.n_stages, sum(b.is_layer for b in plan.blocks)
    titan = _generate_llm_fqn_per_model_part(stages, layers, 1, 1)
    titan = [["output" if n == "lm_head" else n for n in part] for part in titan]
    per = layers // stages
    megatron = "|".join(("E" if k == 0 else "") + "t" * per + ("L" if k == stages - 1 else "") for k in range(stages))
    parts = partition_balanced(weights=[b.params for b in plan.blocks], num_parts=stages)
    return {
        "torchtitan default (module lists)": "fqns:" + json.dumps(titan),
        "Megatron even split (layout)": megatron,
        'DeepSpeed partition_method="parameters"': "parts:" + ",".join(map(str, parts)),
    }


def _plan(compare: str | None = None, method: str = "optimal", **options: object) -> Plan:
    out = Path(tempfile.mkdtemp()) / "plan.json"
    request = PlanRequest.build(model_file=LLAMA, compare=compare, method=method, output=out, progress=False, **options)
    return make_plan(request)


def _row(name: str, pred: Prediction, plan: Plan) -> list[str]:
    limit = plan.memory_limit_bytes
    fits = "yes" if limit is None or pred.max_memory_bytes <= limit else "NO"
    counts = [b - a for a, b in zip(pred.starts, [*pred.starts[1:], len(plan.blocks)])]
    return [
        name,
        "+".join(map(str, counts)),
        f"{pred.step_time_s * 1e3:.1f}",
        f"{pred.step_time_s / plan.prediction.step_time_s:.3f}x",
        f"{pred.max_memory_bytes / 2**30:.2f}",
        fits,
    ]


def estimated() -> str:
    """The table for Llama 3 8B on 8 H100s (pipeline only: --dp 1 --tp 1)."""
    plan = _plan(**ESTIMATED)
    rows = [_row(f"planner ({plan.schedule}, m={plan.n_microbatches})", plan.prediction, plan)]
    for name, spec in trainer_splits(plan).items():
        compared = _plan(compare=spec, **ESTIMATED)
        rows.append(_row(name, compared.baselines["given"], compared))
        print(name, rows[-1], flush=True)
    headers = ["split", "blocks per stage", "predicted step ms", "vs plan", "max GiB per rank", "fits 80 GB"]
    return table(rows, headers)


def measured() -> tuple[str, str]:
    """A shipped model planned here (measured costs) with each trainer's split given beside it, and
    torchtitan's default trained against the plan."""
    plan = _plan(**MEASURED)
    splits = trainer_splits(plan)
    rows = [_row(f"planner ({plan.schedule}, m={plan.n_microbatches})", plan.prediction, plan)]
    for name, spec in splits.items():
        compared = _plan(compare=spec, **MEASURED)
        rows.append(_row(name, compared.baselines["given"], compared))
    predicted = table(rows, ["split", "blocks per stage", "predicted step ms", "vs plan", "max GiB per rank", "fits"])
    given = _plan(compare=splits["torchtitan default (module lists)"], method="given", **MEASURED)
    folder = Path(tempfile.mkdtemp())
    times, _ = alternate({"planner": plan, "torchtitan default": given}, folder, ROUNDS, STEPS, echo=False)
    run_rows = []
    for name, p in (("planner", plan), ("torchtitan default", given)):
        step = statistics.median(times[name])
        blocks = "+".join(str(s.end - s.start) for s in p.stages)
        run_rows.append([name, blocks, f"{p.prediction.step_time_s * 1e3:.1f}", f"{step * 1e3:.1f}"])
    ratio = statistics.median(times["torchtitan default"]) / statistics.median(times["planner"])
    ran = table(run_rows, ["split", "blocks per stage", "predicted step ms", "measured median step ms"])
    return predicted, (
        f"{ran}\n\nMeasured: torchtitan's default split takes {ratio:.2f}x the plan's step "
        f"({ROUNDS} rounds of {STEPS} steps, alternating)."
    )


def main() -> None:
    est = estimated()
    predicted, ran = measured()
    body = (
        f"Written by `python -m bench.interop_compare` on {machine()}.\n\n"
        "**Estimated**: `planner plan models/llama.py --size 8b --gpus 8 --gpu-type h100 -b 32 --dp 1 --tp 1 "
        "--compare SPLIT` for each trainer's split (a split of the plan's stage count is costed under the plan's "
        "schedule; each row is the `your split (--compare)` row of its plan):\n\n"
        f"{est}\n\n"
        "**Measured costs, here**: `planner plan models/llama.py --size tiny --set vocab_size=16384 --gpus 2 -b 16 "
        "--compare SPLIT` (the output layer over a large vocabulary costs about as much as the six blocks before "
        "it; each plan profiles anew, so each row's `vs plan` is against its own plan):\n\n"
        f"{predicted}\n\n"
        "The plan and torchtitan's default (`--compare <its lists> --method given`), both trained with "
        "`planner run`:\n\n"
        f"{ran}"
    )
    write_between_markers(DOC, BEGIN, END, body)


if __name__ == "__main__":
    main()
