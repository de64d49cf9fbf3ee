"""Tier 1 (pure): the balance report's tables, exact, on hand-made costs."""

from __future__ import annotations

from plan_factory import MB, big_head_blocks, block, plan_of_blocks

from planner.report.tables import batch_norm_line, render, stage_table, summary_table

EXPECTED_STAGES = """\
  stage  blocks (n)              params    fwd ms    bwd ms    comm ms    total ms    act MB/mb    in flight    memory MB    of slowest    hidden ms/step    exposed ms/step
-------  ----------------------  --------  --------  --------  ---------  ----------  -----------  -----------  -----------  ------------  ----------------  -----------------
      0  embed .. layers.2 (4)   16.00k    31.00     61.00     2.00       94.00       4.0          2            15.2         88%           0.00              8.00
      1  layers.3 .. output (2)  13.00k    35.00     70.00     2.00       107.00      2.0          1            6.2          100%          0.00              8.00"""

EXPECTED_SUMMARY = """\
partition                             blocks per stage    slowest ms/mb    step ms    bubble    imbalance    max mem MB    fits    step vs plan
------------------------------------  ------------------  ---------------  ---------  --------  -----------  ------------  ------  --------------
planner (searched) *                  4+2                 107.00           522.00     23.0%     1.065        15.2          yes     1.000x
uniform layers (torchtitan/Megatron)  3+3                 137.00           612.00     34.3%     1.363        13.2          yes     1.172x
parameter-balanced (DeepSpeed)        4+2                 107.00           522.00     23.0%     1.065        15.2          yes     1.000x"""


def test_stage_table_exact() -> None:
    # By hand: stage 0 = embed (1+1 ms) + 3 layers (10+20 ms each) + one 1 MB boundary at 1 MB/ms
    # each way = 31 + 61 + 2 = 94 ms; stage 1 = layer (10+20) + head (25+50) + 2 = 107 ms.
    # Memory of stage 0: 16k fp32 params x (weights + grads + 2 AdamW moments) = 0.24 MB,
    # + 2 in-flight microbatches (1F1B, stage 0 of 2) x (4 MB saved + 1 MB cached output) + 1 MB
    # output gradient + 4 microbatches x 1 MB receive buffers (the gradient coming back) = 15.2 MB.
    # Communication per step: one replica, nothing to hide; each stage waits for its 2 ms of messages
    # in each of the 4 microbatches: 8 ms exposed.
    assert stage_table(plan_of_blocks(big_head_blocks())) == EXPECTED_STAGES


def test_summary_table_exact() -> None:
    # The uniform split (3 layer-blocks each side) leaves the big head with a full half of the
    # layers: 45 + 90 + 2 = 137 ms on the slowest stage, against 107 ms for the exact plan.
    assert summary_table(plan_of_blocks(big_head_blocks())) == EXPECTED_SUMMARY


def test_baselines_over_the_memory_limit_are_marked_not_faster() -> None:
    # With a 12 MB limit the exact plan recomputes stage 0 (11.2 MB, 589 ms); the parameter-balanced
    # split is faster on paper (522 ms) but needs 15.2 MB: the report says so instead of "0.886x".
    # (In one pass: --accumulation auto runs it in 4 passes instead, at 522 ms with no recomputation.)
    plan = plan_of_blocks(big_head_blocks(), memory_limit_bytes=12 * MB, accumulation=1)
    text = summary_table(plan)
    rows = {line.split("  ")[0]: line for line in text.splitlines()}
    assert "fits 12.0 MB" in text.splitlines()[0]
    assert "NO: needs 1.27x the limit  (cannot run)" in rows["parameter-balanced (DeepSpeed)"]
    assert "NO: needs 1.10x the limit  (cannot run)" in rows["uniform layers (torchtitan/Megatron)"]
    assert rows["planner (searched) *"].rstrip().endswith("yes                        1.000x")
    assert plan.prediction.max_memory_bytes <= 12 * MB < plan.baselines["params"].max_memory_bytes


def test_render_names_chosen_method_and_figures() -> None:
    text = render(plan_of_blocks(big_head_blocks(), method="uniform"))
    assert "uniform layers (torchtitan/Megatron) *" in text
    assert "predicted step 612.00 ms, bubble 34.3%, imbalance 1.363" in text
    assert "schedule 1f1b, batch 16 = 4 microbatches of 4; 6 blocks" in text


def test_render_says_when_ranks_share_cores() -> None:
    """Four CPU ranks on two cores, one thread each: the header says what takes turns on the cores."""
    plan = plan_of_blocks(big_head_blocks())
    assert "share" not in render(plan).splitlines()[1]  # the profile records no core count
    shared = plan.model_copy(update={"profile": plan.profile.model_copy(update={"cores": 1})})
    share = f"{plan.link.cpu_share:.0%}"
    assert f"; ranks share 1 core: compute and {share} of each message's time take turns on them" in render(shared)
    assert "share" not in render(plan.model_copy(update={"profile": plan.profile.model_copy(update={"cores": 2})}))


def test_render_cautions_when_stages_compute_less_than_a_message_costs() -> None:
    """The CPU link's fixed 1.5 ms per message was fitted to stages of milliseconds: a plan whose
    stages compute less per action is told it is predicted too slow, and how to fix it; stages of
    tens of ms, a calibrated link or another link get no such line."""
    from planner.schema.costs import GLOO_CPU_LINK

    tiny = plan_of_blocks([block(f"b{i}", 0.25, 0.5, 10) for i in range(4)])  # 0.5 + 1.0 ms per stage
    on_cpu = tiny.model_copy(update={"link": GLOO_CPU_LINK})
    assert (
        "note: the stages compute 0.75 ms per forward or backward on average, less than the 1.50 ms each "
        "message is charged" in render(on_cpu)
    )
    assert "--calibrate RUN.json" in render(on_cpu)
    assert "note: the stages compute" not in render(tiny)  # the test link: not the CPU default
    calibrated = GLOO_CPU_LINK.model_copy(update={"name": "gloo-cpu+calibrated"})
    assert "note: the stages compute" not in render(tiny.model_copy(update={"link": calibrated}))
    big = plan_of_blocks(big_head_blocks()).model_copy(update={"link": GLOO_CPU_LINK})
    assert "note: the stages compute" not in render(big)


def test_with_method_switches_to_a_baseline_split() -> None:
    from planner.core.step.predict import with_method

    plan = plan_of_blocks(big_head_blocks())
    uniform = with_method(plan, "uniform")
    assert uniform.method == "uniform" and uniform.prediction == plan.baselines["uniform"]
    assert [s.end for s in uniform.stages] == [3, 6]
    assert uniform.baselines["optimal"] == plan.prediction
    assert uniform == plan_of_blocks(big_head_blocks(), method="uniform").model_copy(
        update={"baselines": uniform.baselines}
    )


def test_a_batch_norm_model_is_cautioned_only_where_the_plan_splits_its_batch() -> None:
    plan = plan_of_blocks(big_head_blocks(), m=4)  # batch 16 in 4 microbatches of 4, one replica
    norms = plan.model_copy(
        update={"model": plan.model.model_copy(update={"batch_norms": ["layers.0.bn", "layers.1.bn"]})}
    )
    assert batch_norm_line(norms) == (
        "note: 2 batch-norm layers (layers.0.bn, ...) normalize each microbatch by its own statistics: with 4 "
        "microbatches of 4 this does not train as the unsplit model on the batch of 16 (as in GPipe); GroupNorm or "
        "LayerNorm normalize each sample alone, and -m 1 with no replicas keeps the whole batch"
    )
    assert batch_norm_line(norms) in render(norms)
    assert batch_norm_line(plan) is None  # no batch norm
    whole = plan_of_blocks(big_head_blocks(), schedule="gpipe", m=1)
    one = whole.model_copy(update={"model": whole.model.model_copy(update={"batch_norms": ["bn"]})})
    assert batch_norm_line(one) is None  # one microbatch, one replica: the whole batch normalized at once
    replicas = one.model_copy(update={"dp": 2})
    assert batch_norm_line(replicas) is not None and "with 2 replicas this" in batch_norm_line(replicas)  # type: ignore[operator]
