"""A Hugging Face config.json (or its folder) as the model: planned measured and estimated, trained
to the unsplit losses, its ties and architectures as transformers builds them; a config that cannot
be built is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from planner.schema.plan import Plan
from tests.run_factory import MODELS, assert_trains_like_unsplit

transformers = pytest.importorskip("transformers")

LLAMA_70B = MODELS / "hf" / "configs" / "llama-3-70b"


def _llama(folder: Path, **extra: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=172,
        vocab_size=512,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
        **extra,
    )
    config.to_json_file(str(folder / "config.json"))
    return folder


def _plan(tmp_path: Path, model: Path, *args: str) -> tuple[Plan, str]:
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(main, ["plan", str(model), "--gpus", "2", "-b", "8", "-o", str(out), "-q", *args])
    assert result.exit_code == 0, result.output
    return Plan.load(out), result.output


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_config_folder_plans_and_trains_as_unsplit(tmp_path: Path) -> None:
    folder = _llama(tmp_path / "tiny-llama")
    plan, _ = _plan(tmp_path, folder, "--repeats", "1", "--warmup", "0", "--schedule", "1f1b")
    assert plan.model.path.endswith("config.json") and plan.model.config["hf_config"].endswith("config.json")
    assert [b.name for b in plan.blocks][:3] == ["model.embed_tokens", "model.rotary_emb", "model.layers.0"]
    assert [t.names for t in plan.ties] == [("model.embed_tokens.weight", "lm_head.weight")]  # as transformers ties
    assert_trains_like_unsplit(plan, tmp_path, "config.json")


def test_set_changes_the_config_and_the_sequence(tmp_path: Path) -> None:
    folder = _llama(tmp_path / "tiny-llama")
    plan, _ = _plan(
        tmp_path, folder / "config.json", "--gpu-type", "cpu", "--set", "num_hidden_layers=2", "--set", "seq_len=16"
    )
    assert sum(b.is_layer for b in plan.blocks) == 2
    assert plan.model.config["seq_len"] == 16


@pytest.mark.parametrize(
    "config",
    [
        transformers.T5Config(
            vocab_size=128,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            architectures=["T5ForConditionalGeneration"],
        ),
        transformers.BertConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            num_labels=3,
            architectures=["BertForSequenceClassification"],
        ),
    ],
    ids=["encoder-decoder", "classification"],
)
def test_other_architectures_get_their_own_batches(tmp_path: Path, config: object) -> None:
    path = tmp_path / "config.json"
    config.to_json_file(str(path))  # type: ignore[attr-defined]
    plan, _ = _plan(tmp_path, path, "--gpu-type", "cpu")
    assert plan.n_stages >= 2


@pytest.mark.slow
def test_llama_3_70b_config_plans_as_the_model_file_does(tmp_path: Path) -> None:
    """The shipped config.json of Llama 3 70B, shortened to 2 layers, against models/hf/llama.py's 70b.

    Two layers on 4 GPUs at tp 2 still split over two pipeline ranks (tp auto would pick one stage of
    tp 4), at a quarter of the tracing of 8 layers on 8 GPUs: this was the suite's slowest test (67 s
    at 8 layers, 39 s at 4).
    """
    args = ["--gpus", "4", "--tp", "2", "--gpu-type", "h100", "-b", "8", "-q"]
    mine = tmp_path / "a.json"
    theirs = tmp_path / "b.json"
    r1 = CliRunner().invoke(
        main, ["plan", str(LLAMA_70B), *args, "--set", "num_hidden_layers=2", "--set", "seq_len=8192", "-o", str(mine)]
    )
    r2 = CliRunner().invoke(
        main,
        ["plan", str(MODELS / "hf" / "llama.py"), "--size", "70b", "--set", "n_layers=2", *args, "-o", str(theirs)],
    )
    assert r1.exit_code == 0 and r2.exit_code == 0, r1.output + r2.output
    a, b = Plan.load(mine), Plan.load(theirs)
    assert a.n_ranks == 2 and len(a.stages) >= 2 and a.tp == 2
    assert [s.start for s in a.stages] == [s.start for s in b.stages]
    assert a.prediction.step_time_s == pytest.approx(b.prediction.step_time_s, rel=1e-3)


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (
            {"model_type": "llama", "architectures": ["FooForCausalLM"]},
            [],
            "names architecture 'FooForCausalLM', which transformers",
        ),
        ({"model_type": "llama"}, [], 'names no "architectures"'),
        ({"architectures": ["LlamaForCausalLM"]}, [], "cannot read it as a model config"),
        ([1, 2], [], "holds no JSON object"),
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, ["--size", "tiny"], "has no sizes"),
        (
            {"model_type": "llama", "architectures": "LlamaForCausalLM"},
            [],
            '"architectures" is the string \'LlamaForCausalLM\', not a list of class names; write "architectures": '
            '["LlamaForCausalLM"]',
        ),
        (
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": -5},
            [],
            "transformers cannot read it as a model config (Class validation error",
        ),
    ],
    ids=["unknown class", "no architectures", "no model type", "not an object", "size", "a string", "invalid"],
)
def test_a_config_that_cannot_be_built_is_one_line(
    tmp_path: Path, content: object, args: list[str], message: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(content))
    result = CliRunner().invoke(main, ["plan", str(path), "--gpus", "2", "--gpu-type", "cpu", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert "build_model() raised" not in result.stderr  # the file's own fault, said directly


def test_a_transformers_model_trains_through_the_library_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """planner.pipeline with a Hugging Face model and its batch by name (one rank, no torchrun): the
    plan's microbatches equal the unsplit model's step, the output given to the loss as its logits."""
    import torch
    import torch.distributed as dist

    import planner
    from planner.capture import hf_config

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    folder = _llama(tmp_path / "tiny-llama")
    plan, _ = _plan(tmp_path, folder, "--gpu-type", "cpu", "--gpus", "1", "-m", "2")
    config = transformers.AutoConfig.from_pretrained(str(folder))

    def build() -> torch.nn.Module:
        torch.manual_seed(3)
        return transformers.LlamaForCausalLM(config)

    batch, target = hf_config.make_batch(8, hf_config=str(folder / "config.json"))
    try:
        pipe = planner.pipeline(plan, build(), batch, loss_fn=hf_config.loss_fn)
        loss = pipe.step(batch, target)
        pipe.finish_grads()
        norm = pipe.clip_grad_norm_(None)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    model = build()
    want = hf_config.loss_fn(model(**batch).logits, target)
    want.backward()
    want_norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))
    assert float(loss) == pytest.approx(float(want), rel=1e-4)
    assert norm == pytest.approx(float(want_norm), rel=1e-4)


def test_a_model_whose_attention_drops_out_plans_the_gather_not_the_ring(tmp_path: Path) -> None:
    # ring attention runs attention without dropout: auto leaves it out, asking for it is one line
    folder = _llama(tmp_path / "m", attention_dropout=0.1)
    args = ["--gpu-type", "cpu", "--cp", "2", "--dp", "1", "--set", "seq_len=16"]
    plan, _ = _plan(tmp_path, folder, *args)
    assert (plan.cp, plan.cp_attention) == (2, "all-gather")
    result = CliRunner().invoke(
        main, ["plan", str(folder), "--gpus", "2", "-o", str(tmp_path / "r.json"), *args, "--cp-attention", "ring"]
    )
    assert result.exit_code == 2 and "this model's attention drops out (p=0.1)" in result.output, result.output
    assert not (tmp_path / "r.json").exists()
    # without dropout the same model may take the ring
    plain, _ = _plan(tmp_path, _llama(tmp_path / "p"), *args, "--cp-attention", "ring")
    assert plain.cp_attention == "ring"


def test_planning_a_transformers_model_prints_nothing_of_torchao(tmp_path: Path) -> None:
    # transformers imports torchao where it is installed, whose import warns of CUDA extensions this
    # machine lacks and of a registration torch deprecates: none of it is the user's concern
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    args = [
        "plan",
        str(_llama(tmp_path / "m")),
        "--gpus",
        "2",
        "--gpu-type",
        "cpu",
        "-q",
        "-o",
        str(tmp_path / "q.json"),
    ]
    done = subprocess.run(
        [sys.executable, "-c", "import cli; cli.console()", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "torchao" not in done.stderr and "register_constant" not in done.stderr, done.stderr
    # nor training it: the ranks' server imports transformers with those loggers quiet (planner.run.quiet_imports)
    ran = subprocess.run(
        [sys.executable, "-c", "import cli; cli.console()", "run", str(tmp_path / "q.json"), "--steps", "1"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    assert "torchao" not in ran.stderr + ran.stdout and "register_constant" not in ran.stderr, ran.stderr
