"""Tier 2: the model-file contract is enforced at plan time, before any profiling.

A loss that sums instead of averaging, or a make_batch that ignores batch_size, would give a
pipeline that silently differs from the unsplit model; both are refused with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli import main

ROOT = Path(__file__).resolve().parents[1]
TOY = (ROOT / "models" / "toy.py").read_text()


def _plan(model: Path, tmp_path: Path, *extra: str) -> tuple[int, str]:
    out = tmp_path / "plan.json"
    args = [
        "plan",
        str(model),
        "--gpus",
        "2",
        "-b",
        "8",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "-q",
        "-o",
        str(out),
        *extra,
    ]
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def _variant(tmp_path: Path, old: str, new: str) -> Path:
    assert old in TOY
    path = tmp_path / "model.py"
    path.write_text(TOY.replace(old, new))
    return path


def test_a_summed_loss_is_refused_with_the_reason(tmp_path: Path) -> None:
    model = _variant(
        tmp_path, "return F.mse_loss(output, target)", "return F.mse_loss(output, target, reduction='sum')"
    )
    code, out = _plan(model, tmp_path)
    assert code == 2
    assert "loss_fn() sums over the batch instead of averaging" in out and "reduction='mean'" in out
    assert not (tmp_path / "plan.json").exists()


def test_a_loss_that_is_no_mean_is_refused(tmp_path: Path) -> None:
    # the mean of the first sample only: not a mean over the batch
    model = _variant(tmp_path, "return F.mse_loss(output, target)", "return F.mse_loss(output[:1], target[:1])")
    code, out = _plan(model, tmp_path)
    assert code == 2 and "loss_fn() is not a mean over the batch" in out


OUT_OF_MEMORY_OVER_TWO = (
    "if output.shape[0] > 2:\n"
    "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 32.00 GiB')\n"
    "    return F.mse_loss(output, target"
)


def test_the_contract_check_retries_on_one_sample_halves_when_twice_the_microbatch_runs_out_of_memory(
    tmp_path: Path,
) -> None:
    # On a GPU the check's full-precision forward of twice the microbatch can need more memory than
    # training does (a large vocabulary's fp32 logits): the promises hold at any size, so it retries small.
    from planner.capture.contract import check_batch_contract
    from planner.capture.load import load_model_file
    from planner.errors import ModelFileError

    fits = _variant(tmp_path, "return F.mse_loss(output, target", OUT_OF_MEMORY_OVER_TWO)
    mf = load_model_file(fits)
    check_batch_contract(mf, mf.build(0), 4, 0, torch.device("cpu"))  # 8 samples run out; 2 do not
    summed = tmp_path / "summed.py"
    summed.write_text(
        fits.read_text().replace("F.mse_loss(output, target)", "F.mse_loss(output, target, reduction='sum')")
    )
    mf = load_model_file(summed)
    with pytest.raises(ModelFileError, match="sums over the batch instead of averaging: .* on 2 samples"):
        check_batch_contract(mf, mf.build(0), 4, 0, torch.device("cpu"))  # the retry still checks the promise
    always = tmp_path / "always.py"
    always.write_text(fits.read_text().replace("output.shape[0] > 2", "output.shape[0] > 0"))
    mf = load_model_file(always)
    with pytest.raises(
        ModelFileError, match="loss_fn\\(\\) raised OutOfMemoryError.*on 2 x 4 samples ran out of memory"
    ):
        check_batch_contract(mf, mf.build(0), 4, 0, torch.device("cpu"))  # out of memory at one sample: said


def test_make_batch_that_ignores_batch_size_is_refused(tmp_path: Path) -> None:
    model = _variant(
        tmp_path, "def make_batch(batch_size: int,", "def make_batch(batch_size_ignored: int, batch_size: int = 3,"
    )
    code, out = _plan(model, tmp_path)
    assert code == 2
    assert "make_batch(4) returned tensors whose first dimension is [3], not 4" in out


def test_make_batch_that_ignores_batch_size_is_refused_for_estimates_too(tmp_path: Path) -> None:
    model = _variant(
        tmp_path, "def make_batch(batch_size: int,", "def make_batch(batch_size_ignored: int, batch_size: int = 3,"
    )
    code, out = _plan(model, tmp_path, "--gpu-type", "h100")
    assert code == 2
    assert "make_batch(4) returned tensors whose first dimension is [3], not 4" in out
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        ("return (output - target) ** 2", "loss_fn() returned (2, 5); expected a scalar tensor"),
        ("return F.mse_loss(output, target[:, :1].t())", "loss_fn() raised"),
    ],
)
def test_an_estimate_checks_the_loss_on_the_traced_output(loss: str, message: str, tmp_path: Path) -> None:
    """On the meta device the loss is checked on what the fx graph returned while its values were
    recorded (``GraphTrace.example_output``), not on a second run of the graph: the same refusals."""
    model = _variant(tmp_path, "return F.mse_loss(output, target)", loss)
    code, out = _plan(model, tmp_path, "--gpu-type", "h100")
    assert code == 2, out
    assert message in out
    assert not (tmp_path / "plan.json").exists()


def test_a_meta_trace_keeps_its_output_and_a_real_one_does_not() -> None:
    from planner.capture.load import load_model_file
    from planner.capture.meta_cache import meta_build
    from planner.capture.trace import trace_model

    mf = load_model_file(ROOT / "models" / "toy.py")
    inputs, _ = mf.batch(4, seed=0)
    real = trace_model(mf.build(seed=0), inputs)
    assert real.method == "fx" and real.example_output is None  # type: ignore[attr-defined]
    with meta_build():
        model = mf.build(seed=0)
    meta_inputs = tuple(x.to("meta") for x in inputs)
    meta = trace_model(model, meta_inputs, copied=False)
    out = meta.example_output  # type: ignore[attr-defined]
    assert isinstance(out, torch.Tensor) and out.device.type == "meta"
    assert tuple(out.shape) == tuple(mf.build(seed=0)(*inputs).shape)


def test_a_training_stream_of_another_batch_size_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text(TOY)
    code, out = _plan(model, tmp_path)
    assert code == 0, out
    model.write_text(
        TOY.replace(
            "x = torch.randn(batch_size, in_features, generator=g)",
            "x = torch.randn(batch_size // 2, in_features, generator=g)",
        ).replace(
            "y = x @ w + b + 0.1 * torch.randn(batch_size, out_features, generator=g)",
            "y = x @ w + b + 0.1 * torch.randn(batch_size // 2, out_features, generator=g)",
        )
    )
    result = CliRunner().invoke(main, ["run", str(tmp_path / "plan.json"), "--steps", "2"])
    assert result.exit_code == 2, result.output
    line = "train_batches(8) yields input 0 of shape [4, 10] float32 but the plan was made for shape [8, 10] float32"
    assert line in result.output
    assert "launching" not in result.output and "Traceback" not in result.output


def test_keyword_batches_are_bound_to_forward_by_name(tmp_path: Path) -> None:
    from planner.capture.load import load_model_file

    model = tmp_path / "kw.py"
    model.write_text(
        "import torch\nfrom torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(4, 4)\n"
        "    def forward(self, x, scale=None, mask=None):\n        return self.lin(x) * mask\n"
        "def build_model(**_):\n    return M()\n"
        "def make_batch(batch_size, key='mask', **_):\n"
        "    return {'x': torch.randn(batch_size, 4), key: torch.ones(batch_size, 4)}, torch.randn(batch_size, 4)\n"
        "SIZES = {'ok': {'key': 'mask'}, 'bad': {'key': 'masks'}}\n"
    )
    inputs, _ = load_model_file(model, "ok").batch(2)
    assert [type(x).__name__ for x in inputs] == ["Tensor", "NoneType", "Tensor"]  # scale took its default
    with pytest.raises(
        Exception, match=r"keyword input\(s\) 'masks' that the model's forward\(\) has no parameter of that name for"
    ):
        load_model_file(model, "bad").batch(2)


def test_binding_a_keyword_stream_does_not_reseed_it(tmp_path: Path) -> None:
    # the first keyword batch of a stream reads forward()'s signature from a meta build; the
    # build's seeding must not reach the stream, which draws from the global RNG
    from planner.capture.load import load_model_file

    model = tmp_path / "kwstream.py"
    model.write_text(
        "import torch\nfrom torch import nn\n"
        "def build_model(**_):\n    return nn.Linear(4, 4)\n"
        "def make_batch(batch_size, **_):\n    return {'input': torch.randn(batch_size, 4)}, torch.randn(batch_size, 4)\n"
        "def train_batches(batch_size, **_):\n    while True:\n        yield make_batch(batch_size)\n"
    )
    unbound = load_model_file(model)
    stream = unbound.train_batches(2, seed=3)
    first_unbound = [next(stream)[0][0] for _ in range(3)]
    built = load_model_file(model)
    built.build()  # the signature is known before the stream starts
    stream = built.train_batches(2, seed=3)
    first_built = [next(stream)[0][0] for _ in range(3)]
    for a, b in zip(first_unbound, first_built):
        assert torch.equal(a, b)


HF_FILES = [
    ("hf/gpt2", "tiny"),
    ("hf/llama", "tiny"),
    ("hf/llama", "tiny-tied"),
    ("hf/qwen", "tiny"),
    ("hf/bert_mlm", "tiny"),
]


@pytest.mark.parametrize(
    ("model", "size"),
    [(m, "tiny") for m in ["gpt", "encoder_lm", "resnet50", "shakespeare", "toy", "llama"]] + HF_FILES,
)
def test_the_shipped_models_keep_the_contract(model: str, size: str, tmp_path: Path) -> None:
    import torch

    from planner.capture.contract import check_batch_contract
    from planner.capture.load import load_model_file

    if model.startswith("hf/"):
        pytest.importorskip("transformers")
    mf = load_model_file(ROOT / "models" / f"{model}.py", size)
    check_batch_contract(mf, mf.build(0), 2, 0, torch.device("cpu"))  # raises if not


@pytest.mark.slow
@pytest.mark.parametrize("gpus", ["1", "2"])
def test_a_nan_loss_stops_the_run_naming_the_step(tmp_path: Path, gpus: str) -> None:
    # the data stream turns to NaN at its second batch (make_batch, used at plan time, stays clean)
    model = _variant(
        tmp_path,
        "        yield (x,), y\n",
        "        yield (x,), y\n        x = x * float('nan')\n        yield (x,), y\n",
    )
    out = tmp_path / "plan.json"
    planned = CliRunner().invoke(
        main, ["plan", str(model), "--gpus", gpus, "-b", "8", "--repeats", "1", "--warmup", "0", "-q", "-o", str(out)]
    )
    assert planned.exit_code == 0, planned.output
    result = CliRunner().invoke(main, ["run", str(out), "--steps", "4"])
    assert result.exit_code == 2, result.output
    assert (
        "step 2: the loss is nan; training stopped" in result.output
        or "step 2: the gradient norm is nan" in result.output
    )


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code", "word"), [("SIGTERM", 143, "terminated"), ("SIGINT", 130, "interrupted")])
def test_a_signal_during_planning_ends_with_one_line(tmp_path: Path, sig: str, code: int, word: str) -> None:
    import signal
    import subprocess
    import sys
    import time

    reached = tmp_path / "reached"  # make_batch leaves it as it starts to sleep
    model = _variant(
        tmp_path,
        "    x = torch.randn(batch_size, in_features)",
        f"    import pathlib, time; pathlib.Path({str(reached)!r}).touch(); time.sleep(60)\n"
        "    x = torch.randn(batch_size, in_features)",
    )
    out = tmp_path / "plan.json"
    # the command starts with SIGINT at its default, as from a shell: a child inherits an ignored
    # SIGINT, which Python then leaves ignored (no KeyboardInterrupt), and this test's process may
    # be one an earlier test left ignoring it (a clean-clone suite once ran past the 30 s wait below
    # on SIGINT alone; SIGTERM, which the command handles itself, never did)
    proc = subprocess.Popen(
        [sys.executable, "-c", "from cli import main; main()", "plan", str(model), "--gpus", "2", "-o", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # signalled once it plans, not after a fixed 4 s: on a loaded machine (the suite beside gloo ranks)
    # a SIGINT at 4 s once left the command running past the 30 s wait, the signal most likely sent
    # before it reached the sleep (the cause was not reproduced alone or under load)
    deadline = time.monotonic() + 60
    while not reached.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reached.exists(), proc.communicate()
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] == word and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.py", "reached"]  # nothing written, nothing left behind
