"""`planner export`: a plan in torchtitan's, Megatron's, DeepSpeed's and torch's CSV terms, exact
for known splits, refused in one line where the target cannot express the split, and checked
against each target's own code (the `interop` extra: skipped where a package is not installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner

from cli import main
from planner.report.export import (
    csv_rows,
    deepspeed_parts,
    export_plan,
    megatron_layer_counts,
    megatron_layout,
    megatron_recompute,
    torchtitan_fqns,
)
from planner.report.renames import ExportError, parse_renames, renamed
from planner.schema.plan import Plan
from tests.run_factory import MODELS, REL, ROOT, plan_with_starts

LLAMA = MODELS / "llama.py"
EXAMPLE = ROOT / "examples" / "train_with_plan.py"
FIXTURE = ROOT / "tests" / "fixtures" / "interop_run.py"
# models/llama.py tiny traces into: tok_embeddings, layers.0 .. layers.3, norm, output


def _interleaved(starts: list[int]) -> Plan:
    return plan_with_starts(
        LLAMA, starts, schedule="interleaved-1f1b", stages_per_rank=2, batch_size=8, n_microbatches=4
    )


def test_torchtitan_gets_each_stages_modules_in_stage_order() -> None:
    plan = _interleaved([0, 2, 4, 6])
    assert torchtitan_fqns(plan, {}) == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "norm"],
        ["output"],
    ]
    text = export_plan(plan, "torchtitan-toml")
    table = tomllib.loads(text)
    assert table["parallelism"]["pipeline_parallel_degree"] == 2
    assert table["parallelism"]["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert table["parallelism"]["pipeline_parallel_microbatch_size"] == 2
    assert table["parallelism"]["module_fqns_per_model_part"] == torchtitan_fqns(plan, {})
    assert table["training"] == {"local_batch_size": 8, "global_batch_size": 8}


def test_a_name_torchtitan_cannot_keep_is_named_with_the_rename_that_fixes_it() -> None:
    plan = plan_with_starts(EXAMPLE, [0, 4], schedule="1f1b", batch_size=8, n_microbatches=2)
    with pytest.raises(ExportError, match=r"block 'model.embed' \(stage 0\).*--rename model.embed=embed$"):
        torchtitan_fqns(plan, {"embed": "model.embed"})
    with pytest.raises(ExportError, match=r"'model.layers.0'.*--rename model.layers=layers$"):
        torchtitan_fqns(plan, {"layers": "model.layers"})
    assert renamed("model.layers.12", parse_renames(["model.layers=layers", "model=m"])) == "layers.12"
    assert renamed("model.layers_x", {"model.layers": "layers"}) == "model.layers_x"  # whole prefixes only
    with pytest.raises(ExportError, match="OLD=NEW"):
        parse_renames(["layers"])


def test_a_rename_that_would_be_ignored_or_break_the_export_is_refused() -> None:
    plan = plan_with_starts(LLAMA, [0, 3], schedule="1f1b", batch_size=8, n_microbatches=2)
    assert torchtitan_fqns(plan, {"layers": "blocks"})[0] == ["tok_embeddings", "blocks.0", "blocks.1"]
    export_plan(plan, "torchtitan", {"layers": "blocks"})  # accepted
    for renames, fmt, message in (
        ({"nothing": "x"}, "torchtitan", "no block is 'nothing' or inside it (the blocks: tok_embeddings, layers.0"),
        (parse_renames(["layers=b=c"]), "torchtitan", "'b=c' is not a module path"),
        ({"layers.0": "norm"}, "torchtitan", "gives blocks 'layers.0' and 'norm' one name, 'norm'"),
        ({"layers": "norm"}, "torchtitan", "makes 'norm' (block 'norm') the parent of 'norm.0' (block 'layers.0')"),
        ({"layers": "blocks"}, "megatron", "--to megatron names no modules, so --rename would change nothing"),
        ({"layers": "blocks"}, "csv", "--to csv names no modules"),
    ):
        with pytest.raises(ExportError) as caught:
            export_plan(plan, fmt, renames)
        assert message in str(caught.value), (renames, fmt)
    with pytest.raises(ExportError, match="--rename layers is given twice"):
        parse_renames(["layers=a", "layers=b"])


def test_megatron_layout_puts_embedding_layers_and_loss_in_vpp_by_pp_order() -> None:
    plan = _interleaved([0, 2, 4, 5])
    assert megatron_layout(plan) == "Et|tt|t|L"
    assert megatron_layer_counts(plan) == [1, 2, 1, 0]
    deep = plan_with_starts(LLAMA, [0, 5], schedule="1f1b", batch_size=8, n_microbatches=2, size="tiny")
    assert megatron_layout(deep) == "Et*4|L"
    text = export_plan(deep, "megatron")
    assert "--decoder-first-pipeline-num-layers 4 --decoder-last-pipeline-num-layers 0" in text


def test_megatron_refuses_what_its_layout_cannot_say() -> None:
    with pytest.raises(ExportError, match=r"norm, output are Megatron's loss \(L\).*stages \[2, 3\]"):
        megatron_layout(_interleaved([0, 2, 4, 6]))
    zbv = plan_with_starts(LLAMA, [0, 2, 4, 6], schedule="zbv", stages_per_rank=2, batch_size=8, n_microbatches=4)
    with pytest.raises(ExportError, match="V shape is not expressible"):
        megatron_layout(zbv)


def test_deepspeed_parts_are_the_stage_starts_and_one_stage_per_rank() -> None:
    plan = plan_with_starts(LLAMA, [0, 3], schedule="1f1b", batch_size=8, n_microbatches=2)
    assert deepspeed_parts(plan) == [0, 3, 7]
    with pytest.raises(ExportError, match="one stage per rank"):
        deepspeed_parts(_interleaved([0, 2, 4, 6]))


def test_csv_is_torchs_action_order() -> None:
    plan = plan_with_starts(LLAMA, [0, 3], schedule="gpipe", batch_size=8, n_microbatches=2)
    assert csv_rows(plan) == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]
    assert export_plan(plan, "csv") == "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n"


def test_the_command_writes_replaces_and_refuses(tmp_path: Path) -> None:
    plan = plan_with_starts(LLAMA, [0, 3], schedule="1f1b", batch_size=8, n_microbatches=2)
    plan.save(tmp_path / "plan.json")
    runner = CliRunner()
    out = tmp_path / "megatron.sh"
    for _ in range(2):  # the second replaces the first export
        result = runner.invoke(main, ["export", str(tmp_path / "plan.json"), "--to", "megatron", "-o", str(out)])
        assert result.exit_code == 0, result.output
    assert '--pipeline-model-parallel-layout "Ett|ttL"' in out.read_text()
    csv = tmp_path / "order.csv"
    for _ in range(2):
        result = runner.invoke(main, ["export", str(tmp_path / "plan.json"), "--to", "csv", "-o", str(csv)])
        assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["export", str(tmp_path / "plan.json"), "--to", "csv", "-o", str(LLAMA)])
    assert result.exit_code == 2 and "not a `planner export` output" in result.stderr
    result = runner.invoke(main, ["export", str(tmp_path / "plan.json"), "--to", "deepspeed"])
    assert result.exit_code == 0 and "PARTS = [0, 3, 7]" in result.stdout
    result = runner.invoke(main, ["export", str(tmp_path / "plan.json"), "--to", "megatron", "--rename", "x"])
    assert result.exit_code == 2 and "give OLD=NEW" in result.stderr


def test_megatron_gets_the_plans_activation_checkpointing() -> None:
    # LLAMA tiny: embedding, 4 layers, norm + output; stages [0, 3) and [3, 7): 2 layers each
    plan = plan_with_starts(LLAMA, [0, 3], schedule="1f1b", batch_size=8, n_microbatches=2)
    assert megatron_recompute(plan) == ([], [])

    def with_modes(*modes: str) -> Plan:
        return plan.model_copy(
            update={"stages": [s.model_copy(update={"recompute": m}) for s, m in zip(plan.stages, modes)]}
        )

    # "full:2" on stage 0: the embedding and layer 0 recompute, one decoder layer; stage 1 all of its 2
    args, notes = megatron_recompute(with_modes("full:2", "full"))
    assert args == ["--recompute-granularity full", "--recompute-method block", "--recompute-num-layers 2"]
    assert "stage(s) 0 recompute fewer" in " ".join(notes)
    # the embedding counts for nothing: "full:2" there and "full:1" on stage 1 are one layer each
    args, notes = megatron_recompute(with_modes("full:2", "full:1"))
    assert args[-1] == "--recompute-num-layers 1" and not any("fewer" in n for n in notes)
    args, notes = megatron_recompute(with_modes("selective", "never"))
    assert args == ["--recompute-granularity selective"] and "attention core" in notes[0]
    text = export_plan(with_modes("never", "full:3"), "megatron")
    assert "    --recompute-num-layers 2\n)" in text and "# stage(s) 0 recompute fewer" in text


# ---- against the targets' own code (the `interop` extra) ----


def test_megatron_cores_parser_reads_back_the_planned_layers() -> None:
    layout_mod = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    from megatron.core.transformer.enums import LayerType

    for plan in (
        _interleaved([0, 2, 4, 5]),
        plan_with_starts(LLAMA, [0, 3], schedule="1f1b", batch_size=8, n_microbatches=2),
    ):
        layout = layout_mod.PipelineParallelLayerLayout(megatron_layout(plan), plan.n_ranks)
        layout.validate_layer_layout(num_layers=4, mtp_num_layers=None)
        v = layout.virtual_pipeline_model_parallel_size
        assert v == plan.stages_per_rank
        for stage, count in enumerate(megatron_layer_counts(plan)):
            rank, chunk = stage % plan.n_ranks, stage // plan.n_ranks
            assert layout.layout[rank][chunk].count(LayerType.decoder) == count
            assert stage == next(s.index for s in plan.stages if s.rank == rank and s.index // plan.n_ranks == chunk)


def test_torchtitan_gets_the_plans_activation_checkpointing() -> None:
    plan = _interleaved([0, 2, 4, 6])
    assert tomllib.loads(export_plan(plan, "torchtitan-toml"))["activation_checkpoint"] == {"mode": "none"}
    selective = plan.model_copy(
        update={"stages": [s.model_copy(update={"recompute": "selective"}) for s in plan.stages]}
    )
    table = tomllib.loads(export_plan(selective, "torchtitan-toml"))
    assert table["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    # torchtitan checkpoints every block alike: stages that differ get the strongest, and a note says so
    stages = [s.model_copy(update={"recompute": "full" if s.index == 1 else "selective"}) for s in plan.stages]
    mixed = export_plan(plan.model_copy(update={"stages": stages}), "torchtitan-toml")
    assert tomllib.loads(mixed)["activation_checkpoint"] == {"mode": "full"}
    assert "stages differ (full, selective), so the strongest, full, is set" in mixed
    assert "activation_checkpoint = SelectiveAC.Config()" in export_plan(selective, "torchtitan")
    assert "activation_checkpoint = None" in export_plan(plan, "torchtitan")


def test_torchtitan_takes_the_exported_config() -> None:
    pytest.importorskip("torchtitan")
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping, _split_module

    from planner.capture.load import load_model_file

    for plan in (
        _interleaved([0, 2, 4, 6]),
        plan_with_starts(LLAMA, [0, 2, 4, 6], schedule="zbv", stages_per_rank=2, batch_size=8, n_microbatches=4),
    ):
        plan = plan.model_copy(update={"stages": [s.model_copy(update={"recompute": "full"}) for s in plan.stages]})
        namespace: dict = {}
        exec(export_plan(plan, "torchtitan"), namespace)
        parallelism = namespace["parallelism"]
        assert type(namespace["activation_checkpoint"]).__qualname__ == "FullAC.Config"  # torchtitan's own class
        model = load_model_file(LLAMA, "tiny").build()
        for rank in range(plan.n_ranks):
            indices = _get_pp_rank_to_stage_indices_mapping(
                rank, plan.n_ranks, parallelism.pipeline_parallel_schedule, len(parallelism.module_fqns_per_model_part)
            )
            assert list(indices) == [s.index for s in plan.stages_of(rank)]  # torchtitan places them as planned
        for stage in plan.stages:
            part = _split_module(model, parallelism.module_fqns_per_model_part[stage.index])
            held = {
                n
                for n, m in part.named_children()
                if m is not None and not (isinstance(m, type(model.layers)) and len(m) == 0)
            }
            planned = {b.name.split(".")[0] for b in plan.blocks[stage.start : stage.end]}
            assert held == planned
            layers = sum(1 for b in plan.blocks[stage.start : stage.end] if b.name.startswith("layers."))
            assert len(part.layers) == layers


def _torchrun(tmp_path: Path, mode: str, plan: Plan, fmt: str) -> list[dict]:
    plan_file, export = tmp_path / "plan.json", tmp_path / f"export.{fmt}"
    plan.save(plan_file)
    export.write_text(export_plan(plan, fmt))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={plan.n_ranks}"]
    out = tmp_path / "out"
    proc = subprocess.run(
        [*cmd, str(FIXTURE), mode, str(plan_file), str(export), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(plan.n_ranks)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchs_runtime_runs_the_exported_csv_to_the_unsplit_losses(tmp_path: Path) -> None:
    from tests.test_own_script import _unsplit

    # the zero-bubble two-part backward (I and W actions) over 4 stages on 2 ranks, a tied weight across them
    plan = plan_with_starts(
        EXAMPLE, [0, 2, 4, 6], schedule="interleaved-zb", stages_per_rank=2, batch_size=8, n_microbatches=4
    )
    ranks = _torchrun(tmp_path, "csv", plan, "csv")
    losses = next(r for r in ranks if r)
    assert losses == pytest.approx(_unsplit(plan, steps=3)[0], rel=REL)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchtitans_split_of_the_export_trains_as_unsplit(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    import torch

    from planner.capture.load import load_model_file

    plan = plan_with_starts(LLAMA, [0, 3], schedule="1f1b", batch_size=8, n_microbatches=4)
    ranks = _torchrun(tmp_path, "torchtitan", plan, "torchtitan")
    mf = load_model_file(LLAMA, "tiny")
    model = mf.build(plan.model.seed)
    for stage, rank in zip(plan.stages, ranks):  # each rank's stage holds exactly the planned blocks' parameters
        planned = sorted(
            n
            for b in plan.blocks[stage.start : stage.end]
            for n, _ in model.get_submodule(b.name).named_parameters(prefix=b.name)
        )
        assert len(rank["stages"][str(stage.index)]) == len(planned)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data, expected = mf.train_batches(8, seed=plan.model.seed), []
    for _ in range(3):
        (tokens,), target = next(data)
        loss = mf.module.loss_fn(model(tokens), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    assert ranks[-1]["losses"] == pytest.approx(expected, rel=REL)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_deepspeeds_pipeline_module_takes_the_exported_parts(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    plan = plan_with_starts(EXAMPLE, [0, 3], schedule="1f1b", batch_size=8, n_microbatches=2)
    ranks = _torchrun(tmp_path, "deepspeed", plan, "deepspeed")
    assert [r["parts"] for r in ranks] == [[0, 3, 7], [0, 3, 7]]
    assert [r["local"] for r in ranks] == [[0, 3], [3, 7]]


def test_megatron_core_takes_the_exported_checkpointing() -> None:
    config_mod = pytest.importorskip("megatron.core.transformer.transformer_config")
    import torch

    plan = plan_with_starts(LLAMA, [0, 3], schedule="1f1b", batch_size=8, n_microbatches=2)
    stages = [s.model_copy(update={"recompute": m}) for s, m in zip(plan.stages, ("full:2", "full"))]
    args, _ = megatron_recompute(plan.model_copy(update={"stages": stages}))
    fields = {a.split()[0][2:].replace("-", "_"): a.split()[1] for a in args}
    config = config_mod.TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        recompute_granularity=fields["recompute_granularity"],
        recompute_method=fields["recompute_method"],
        recompute_num_layers=int(fields["recompute_num_layers"]),
    )
    assert (config.recompute_method, config.recompute_num_layers) == ("block", 2)


def test_sequence_parallelism_is_carried_to_megatron_and_its_absence_noted() -> None:
    plan = plan_with_starts(LLAMA, [0, 3], schedule="1f1b", n_microbatches=2, tp=2)
    split = plan.model_copy(update={"sequence_parallel": True})

    def arguments(text: str) -> list[str]:
        return [w for line in text.splitlines() if not line.startswith("#") for w in line.split()]

    assert "--sequence-parallel" in arguments(export_plan(split, "megatron"))
    plain = export_plan(plan, "megatron")
    assert "--sequence-parallel" not in arguments(plain) and "# planned without sequence parallelism" in plain
    assert "tensor parallel 2 with sequence parallelism" in export_plan(split, "torchtitan-toml")


def test_expert_parallelism_is_carried_to_megatron_and_torchtitan_where_it_can_say_it() -> None:
    # Megatron-Core carves its expert-parallel group out of the data-parallel ranks, as the plan does;
    # torchtitan borrows it from FSDP's shard degree x tp, which DDP replicas do not give
    fixture = ROOT / "tests" / "fixtures" / "moe_file.py"
    plan = plan_with_starts(fixture, [0, 2], schedule="1f1b", n_microbatches=2, dp=2, ep=2)
    text = export_plan(plan, "megatron")
    assert "--expert-model-parallel-size 2" in text and "experts sharded over 2 replicas (expert parallel 2)" in text
    with pytest.raises(ExportError, match=r"torchtitan takes its expert_parallel_degree out of .* \(1 x 1\)"):
        export_plan(plan, "torchtitan")
    sharded = plan.model_copy(update={"dp_mode": "fsdp"})  # what torchtitan could run: ep out of the shards
    namespace: dict = {}
    exec(export_plan(sharded, "torchtitan"), namespace)
    assert namespace["parallelism"].expert_parallel_degree == 2
    assert "--expert-model-parallel-size" not in export_plan(plan_with_starts(fixture, [0, 2], dp=2), "megatron")
    assert "--expert-tensor-parallel-size" not in text  # tp 1


def test_an_expert_group_over_tensor_parallel_ranks_exports_each_expert_whole() -> None:
    # the plan's group spans the tensor-parallel ranks, each expert whole: Megatron's expert tensor-parallel
    # size 1 (its default is tp), torchtitan's ep out of dp_shard x tp
    pytest.importorskip("transformers")
    plan = plan_with_starts(ROOT / "models" / "hf" / "mixtral.py", [0], dp=2, dp_mode="fsdp", tp=2, ep=4)
    text = export_plan(plan, "megatron")
    assert "--expert-model-parallel-size 4" in text and "--expert-tensor-parallel-size 1" in text
    assert "experts sharded over 4 ranks (2 replica(s) x 2 tensor-parallel ranks, each expert whole)" in text
    namespace: dict = {}
    renames = {
        "model.embed_tokens": "tok_embeddings",
        "model.layers": "layers",
        "model.norm": "norm",
        "lm_head": "output",
    }
    renames["model.rotary_emb"] = "rotary_emb"
    exec(export_plan(plan, "torchtitan", renames), namespace)
    assert namespace["parallelism"].expert_parallel_degree == 4 and namespace["parallelism"].tensor_parallel_degree == 2


def _float8(plan: Plan, recipe: str) -> Plan:
    from planner.schema.plan_parts import Float8Linears

    kept = {"output": "outside the repeated layers", "layers.0.attention.wk": "too small"}
    f8 = Float8Linears(recipe=recipe, converted=27, kept=kept)  # type: ignore[arg-type]
    return plan.model_copy(update={"profile": plan.profile.model_copy(update={"float8": f8})})


def test_a_float8_plan_exports_its_recipe_and_the_layers_it_keeps_in_bf16() -> None:
    base = plan_with_starts(LLAMA, [0, 3], schedule="1f1b", batch_size=8, n_microbatches=2, dp=2, dp_mode="fsdp")
    tensorwise, rowwise = _float8(base, "tensorwise"), _float8(base, "rowwise")
    table = tomllib.loads(export_plan(tensorwise, "torchtitan-toml"))
    assert table["model"] == {"converters": ["float8"]}
    assert table["float8"] == {
        "recipe_name": "tensorwise",
        "filter_fqns": ["output", "layers.0.attention.wk"],
        "enable_fsdp_float8_all_gather": True,  # tensorwise under FSDP: the weights gathered in float8
        "precompute_float8_dynamic_scale_for_fsdp": True,
    }
    assert tomllib.loads(export_plan(rowwise, "torchtitan-toml"))["float8"]["enable_fsdp_float8_all_gather"] is False
    # torchtitan 0.3's converter runs rowwise only: a tensorwise plan is refused in one line, naming the ways out
    with pytest.raises(ExportError, match=r"rowwise recipes only.*--dtype fp8-rowwise.*--to torchtitan-toml"):
        export_plan(tensorwise, "torchtitan")
    megatron = export_plan(tensorwise, "megatron")
    assert "--fp8-format hybrid" in megatron and "--fp8-recipe tensorwise" in megatron
    assert "--fp8-recipe blockwise" in export_plan(rowwise, "megatron")  # TE's nearest to rowwise
    assert "kept in bf16: output, layers.0.attention.wk" in export_plan(rowwise, "deepspeed")
    python = export_plan(rowwise, "torchtitan")
    assert (
        'Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=["output", "layers.0.attention.wk"])' in python
    )

    # torchtitan's converter module imports triton (absent from torch's CPU wheel): its source says what its
    # config takes, the fields the export writes and the recipe names it accepts
    import ast
    import importlib.util

    spec = importlib.util.find_spec("torchtitan")
    if spec is None or spec.origin is None:
        pytest.skip("torchtitan is not installed (the interop extra)")
    source = Path(spec.origin).parent / "components" / "quantization" / "float8.py"
    tree = ast.parse(source.read_text())
    converter = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Float8LinearConverter")
    config = next(n for n in converter.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    fields = {n.target.id: ast.unparse(n.annotation) for n in config.body if isinstance(n, ast.AnnAssign)}
    assert (
        "filter_fqns" in fields and "'rowwise'" in fields["recipe_name"] and "tensorwise" not in fields["recipe_name"]
    )
