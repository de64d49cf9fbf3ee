"""`planner probe` and hardware files: the pure fits on synthetic points (tier 1), rank 0's measurements
on this CPU (tier 2), and the command on 2 gloo processes whose file plans like a measured plan (tier 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from cli import main
from planner.core.levers.hardware import GPUS, HardwareError, HardwareSpec
from planner.core.levers.hardware_file import (
    FORMAT_VERSION,
    CollectivePoint,
    CollectiveSweep,
    CopyPoint,
    GemmPoint,
    HardwareFile,
    Measured,
    hardware_named,
    read_hardware_file,
    shipped_file,
    write_hardware_file,
)
from planner.core.levers.probe_fit import (
    COST_TERMS,
    default_task,
    fit_alpha_beta,
    fit_gemms,
    hardware_file_of,
    link_points,
    sweep,
)
from planner.errors import PlannerError
from planner.schema.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "models" / "gpt.py")


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


# --- tier 1: the fits, exact on points made from known constants ---------------------------------


def _sweep(alpha: float, beta: float, ranks: int, ops: tuple[str, ...]) -> CollectiveSweep:
    points = {}
    for op in ops:
        a, b = COST_TERMS[op](2 if op == "send_recv" else ranks)
        points[op] = [CollectivePoint(nbytes=n, seconds=a * alpha + b * n / beta) for n in sweep(4096, 2**24)]
    return CollectiveSweep(ranks=ranks, ops=points)


def test_alpha_beta_fit_recovers_latency_and_bandwidth_from_send_recv_and_ring_collectives() -> None:
    group = _sweep(25e-6, 40e9, 8, ("send_recv", "all_reduce", "all_gather", "reduce_scatter"))
    alpha, beta, rms = fit_alpha_beta(link_points(group, ["send_recv", "all_reduce", "all_gather", "reduce_scatter"]))
    assert alpha == pytest.approx(25e-6, rel=1e-9) and beta == pytest.approx(40e9, rel=1e-9)
    assert rms == pytest.approx(0.0, abs=1e-9)
    # the ring's terms: an all-reduce of n bytes on 8 ranks is 14 latencies and 2 * 7/8 n bytes
    assert COST_TERMS["all_reduce"](8) == (14.0, 1.75)


def test_alpha_beta_fit_keeps_latency_non_negative_and_refuses_too_few_points() -> None:
    # pure bandwidth with a little noise that would make the latency negative
    alpha, beta, _ = fit_alpha_beta([(1.0, 1e6, 1e-3 * 0.99), (1.0, 1e8, 0.1)])
    assert alpha >= 0 and beta == pytest.approx(1e9, rel=0.02)
    with pytest.raises(PlannerError, match="at least two sizes"):
        fit_alpha_beta([(1.0, 1e6, 1e-3)])


def test_gemm_fit_recovers_the_ceiling_and_half_dimension() -> None:
    ceiling, half = 800e12, 128.0
    shapes = [(4096, 4096, 4096), (8192, 8192, 8192), (64, 8192, 8192), (256, 8192, 8192), (8192, 8192, 16)]
    points = []
    for m, n, k in shapes:
        flops, d = 2.0 * m * n * k, min(m, n, k)
        points.append((flops, d, flops / (ceiling * d / (d + half))))
    got_ceiling, got_half = fit_gemms(points)
    assert got_ceiling == pytest.approx(ceiling, rel=1e-9) and got_half == pytest.approx(half, rel=1e-9)
    # one dimension alone cannot separate the two: the ceiling alone, no curve
    same = [(2.0 * 1024**3, 1024, 2.0 * 1024**3 / 5e11)] * 2
    assert fit_gemms(same) == (pytest.approx(5e11), 0.0)


def _measured(device: str = "cpu", ranks: int = 2) -> Measured:
    return Measured(
        device=device,
        device_name="test",
        backend="gloo" if device == "cpu" else "nccl",
        dtype="fp32" if device == "cpu" else "bf16",
        world_size=ranks,
        gpus_per_node=ranks,
        threads=1,
        host="h",
        torch_version="t",
        date="d",
        quick=True,
        memory_bytes=2**34,
        gemms=[
            GemmPoint(m=d, n=d, k=d, seconds=2.0 * d**3 / rate) for d, rate in ((256, 5e10), (512, 6e10), (1024, 7e10))
        ],
        copies=[CopyPoint(nbytes=2**20, seconds=1e-5), CopyPoint(nbytes=2**26, seconds=2 * 2**26 / 20e9)],
        attention=[],
        op_overhead_s=4e-6,
        intra_node=_sweep(2e-4, 2e9, ranks, ("send_recv", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")),
    )


def test_a_cpu_probe_becomes_a_spec_as_planner_costs_cpu_would_calibrate_it() -> None:
    doc = hardware_file_of(_measured(), "cpu-test")
    spec = doc.spec
    assert spec.kind == "cpu" and spec.name == "cpu-test"
    assert spec.peak_flops == {"fp32": pytest.approx(6e10)}  # the median rate, efficiency 1, no curve
    assert spec.matmul_efficiency == 1.0 and spec.gemm_half_dim == 0.0
    assert spec.memory_Bps == pytest.approx(20e9)  # the largest copy
    assert spec.intra_node_latency_s == pytest.approx(2e-4) and spec.intra_node_Bps == pytest.approx(2e9)
    assert (spec.inter_node_latency_s, spec.inter_node_Bps) == (spec.intra_node_latency_s, spec.intra_node_Bps)
    assert spec.op_overhead_s == 4e-6 and spec.attention_fwd_efficiency is None
    assert "not measured (one node)" in doc.derived["inter_node_Bps"]
    assert doc.derived["fit.intra_node.all_to_all"].startswith("alpha 200.0 us, beta 2.000 GB/s")


def test_one_rank_keeps_the_default_link_and_says_so() -> None:
    doc = hardware_file_of(_measured().model_copy(update={"intra_node": None, "world_size": 1}), "one")
    assert doc.spec.intra_node_latency_s == 1.5e-3 and "not measured (one rank)" in doc.derived["intra_node_Bps"]


def test_default_sweeps() -> None:
    quick = default_task("cpu", "fp32", True, 2, 1)
    assert quick.sizes[0] == 4096 and quick.sizes[-1] == 4 * 2**20 and quick.repeats == 3
    assert default_task("cpu", "fp32", False, 2, 1).sizes[-1] == 64 * 2**20
    assert default_task("cuda", "bf16", False, 8, 1).sizes[-1] == 2**30
    assert default_task("cpu", "fp32", True, 2, 1, [(3, 4, 5)]).gemms == [(3, 4, 5)]
    with pytest.raises(PlannerError, match="--dtype"):
        default_task("cpu", "fp64", True, 2, 1)


# --- tier 1: the file format ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(GPUS))
def test_every_shipped_gpu_round_trips_through_a_file(name: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.json"
    write_hardware_file(path, shipped_file(name))
    assert read_hardware_file(path).spec == GPUS[name]
    assert hardware_named(str(path)) == GPUS[name]


def test_a_probe_file_round_trips_with_its_measurements(tmp_path: Path) -> None:
    doc = hardware_file_of(_measured(), "cpu-test")
    write_hardware_file(tmp_path / "cpu.json", doc)
    again = read_hardware_file(tmp_path / "cpu.json")
    assert again == doc and again.format == FORMAT_VERSION and again.measured is not None


def test_a_format_1_gpu_probe_reads_its_overhead_as_the_hosts_dispatch(tmp_path: Path) -> None:
    # `planner probe --gpus 1` on a lent H200 before format 2 (bench/gpu_probe.py, docs/probe_gpu.md): its
    # tiny model's step per operator, in op_overhead_s then, is the host's time issuing an operator
    path = ROOT / "tests" / "fixtures" / "h200_probe_format1.json"
    raw = json.loads(path.read_text())
    doc = read_hardware_file(path)
    assert raw["format"] == 1 and doc.format == 2 and doc.measured is not None
    assert doc.spec.dispatch_s == raw["spec"]["op_overhead_s"] == doc.measured.op_overhead_s
    assert doc.spec.op_overhead_s == HardwareSpec.model_fields["op_overhead_s"].default
    # a format-1 file without measurements (a shipped GPU, maybe edited) keeps what it says
    shipped = shipped_file("h200").model_dump(mode="json")
    shipped["format"] = 1
    del shipped["spec"]["dispatch_s"]
    (tmp_path / "h200.json").write_text(json.dumps(shipped))
    assert read_hardware_file(tmp_path / "h200.json").spec == GPUS["h200"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "no such file"),
        ("{", "not a hardware file"),
        ('{"format": 1, "spec": {"name": "x"}}', "not a hardware file (spec.peak_flops: Field required)"),
        ("[1]", "not a hardware file"),
    ],
)
def test_a_bad_hardware_file_is_one_line(text: str | None, message: str, tmp_path: Path) -> None:
    path = tmp_path / "hw.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(HardwareError, match="^--gpu-type .*hw.json: ") as e:
        read_hardware_file(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_newer_format_is_refused_by_name(tmp_path: Path) -> None:
    doc = shipped_file("h100").model_copy(update={"format": FORMAT_VERSION + 1})
    (tmp_path / "new.json").write_text(doc.model_dump_json())
    with pytest.raises(HardwareError, match="newer than this planner reads"):
        read_hardware_file(tmp_path / "new.json")


def test_write_shipped_writes_every_gpu(tmp_path: Path) -> None:
    result = invoke("probe", "--write-shipped", str(tmp_path / "gpus"))
    assert result.exit_code == 0, result.output
    assert sorted(p.stem for p in (tmp_path / "gpus").glob("*.json")) == sorted(GPUS)
    assert HardwareFile.model_validate_json((tmp_path / "gpus" / "h100.json").read_text()).spec == GPUS["h100"]


def test_a_refused_write_shipped_writes_no_file(tmp_path: Path) -> None:
    """A file in the folder that is no hardware file refuses the whole command before any is written."""
    folder = tmp_path / "gpus"
    folder.mkdir()
    (folder / "l4.json").write_text("precious")
    result = invoke("probe", "--write-shipped", str(folder))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "l4.json holds something that is not a hardware file" in result.output
    assert "move that file away, or choose another folder" in result.output
    assert [p.name for p in folder.iterdir()] == ["l4.json"] and (folder / "l4.json").read_text() == "precious"
    # a missing folder is made under a parent that exists, as mkdir makes it; not a missing tree
    result = invoke("probe", "--write-shipped", str(tmp_path / "no" / "gpus"))
    assert result.exit_code == 2 and "does not exist; create it" in result.output
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("given", [("-o", "h.json"), ("--gpus", "2")])
def test_write_shipped_with_a_measurement_option_is_refused(tmp_path: Path, given: tuple[str, str]) -> None:
    result = invoke("probe", "--write-shipped", str(tmp_path / "gpus"), *given)
    assert result.exit_code == 2 and f"give it without {given[0]}" in result.output
    assert not (tmp_path / "gpus").exists()


def test_probe_needs_gpus_and_an_output() -> None:
    result = invoke("probe", "--gpus", "2")
    assert result.exit_code == 2 and "give --gpus N and -o FILE.json" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (("--microbatch-size", "4"), "--microbatch-size describes"),
        (("-s", "tiny", "--set", "d=8"), "--size and --set describe"),
    ],
)
def test_model_options_without_a_model_file_are_refused(tmp_path: Path, given: tuple[str, ...], named: str) -> None:
    result = invoke("probe", "--gpus", "2", "-o", str(tmp_path / "hw.json"), *given)
    assert result.exit_code == 2 and f"{named} the model's GEMMs: give its MODEL_FILE too" in result.output
    assert not (tmp_path / "hw.json").exists() and "Traceback" not in result.output


def test_plan_with_a_bad_hardware_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "hw.json").write_text("{}")
    result = invoke("plan", str(ROOT / "models" / "toy.py"), "--gpus", "2", "--gpu-type", str(tmp_path / "hw.json"))
    assert result.exit_code == 2, result.output
    assert "not a hardware file (spec: Field required)" in result.output and "Traceback" not in result.output


# --- tier 2: rank 0's measurements on this CPU ---------------------------------------------------


def test_rank_zero_measures_this_cpu_and_fits_a_spec() -> None:
    from planner.core.levers.probe_fit import ProbeTask
    from planner.costs.probe import probe_here

    task = ProbeTask(
        device="cpu",
        dtype="fp32",
        gemms=[(64, 64, 64), (128, 128, 128), (16, 128, 128)],
        copies=[2**20, 4 * 2**20],
        attention=[(1, 2, 32, 16)],
        sizes=[4096],
        gpus_per_node=1,
        threads=1,
        warmup=1,
        repeats=2,
        quick=True,
        progress=False,
    )
    measured = probe_here(task)
    assert [(g.m, g.n, g.k) for g in measured.gemms] == task.gemms and all(g.seconds > 0 for g in measured.gemms)
    assert len(measured.copies) == 2 and measured.attention[0].fwd_flops == 4 * 32 * 32 * 16 * 2
    assert measured.intra_node is None and measured.world_size == 1 and 0 < measured.op_overhead_s < 1e-2
    spec = hardware_file_of(measured, "here").spec
    assert 1e8 < spec.peak_flops["fp32"] < 1e13 and 1e8 < spec.memory_Bps < 1e12


def test_model_gemms_are_the_linear_layers_forward_and_backward() -> None:
    from planner.capture.load import load_model_file
    from planner.costs.probe import model_gemms

    mf = load_model_file(GPT, "tiny")
    shapes = model_gemms(mf, 2)
    dim, tokens = mf.config["dim"], 2 * mf.config["seq_len"]
    ffn = mf.config.get("ffn_dim") or 4 * dim
    # a feed-forward layer: forward, the input's gradient, the weight's gradient
    assert {(tokens, ffn, dim), (tokens, dim, ffn), (ffn, dim, tokens)} <= set(shapes)


# --- tier 3: the command on 2 gloo processes -----------------------------------------------------

# The agreement bound: a plan made from the probe's file against a plan measured here, same layout.
# Measured on this 2-core machine (docs/probe.md): see the ratios there. Both sides are single draws
# of a noisy machine (docs/machine_noise.md: about 23 % between two draws of one measurement). The
# two draws must see the same machine: beside the parallel pass's other worker the measured plan came
# out 1.8x the probe's (0.55), so this runs in the serial timing pass.
AGREEMENT = (0.6, 1.6)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timing
def test_probe_file_plans_like_a_measured_plan(tmp_path: Path) -> None:
    hw = tmp_path / "cpu.json"
    probed = invoke("probe", "--gpus", "2", "--quick", "--no-progress", "-o", str(hw))
    assert probed.exit_code == 0, probed.output
    doc = read_hardware_file(hw)
    assert doc.measured is not None and doc.measured.intra_node is not None
    assert set(doc.measured.intra_node.ops) == {"send_recv", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    layout = ["--size", "tiny", "--gpus", "2", "--schedule", "1f1b", "--microbatches", "4", "-q"]
    steps = {}
    # a file twice as slow in everything it computes: its plan must say so (the file is what is read)
    slow = doc.spec.model_copy(
        update={
            "peak_flops": {k: v / 2 for k, v in doc.spec.peak_flops.items()},
            "memory_Bps": doc.spec.memory_Bps / 2,
            "op_overhead_s": doc.spec.op_overhead_s * 2,
        }
    )
    write_hardware_file(tmp_path / "slow.json", doc.model_copy(update={"spec": slow}))
    for name, extra in (
        ("file", ["--gpu-type", str(hw)]),
        ("slow", ["--gpu-type", str(tmp_path / "slow.json")]),
        ("measured", []),
    ):
        out = tmp_path / f"{name}.plan.json"
        result = invoke("plan", GPT, *layout, *extra, "-o", str(out))
        assert result.exit_code == 0, result.output
        steps[name] = Plan.load(out).prediction.step_time_s
    assert Plan.load(tmp_path / "file.plan.json").profile.hardware == "cpu"
    assert steps["slow"] / steps["file"] > 1.6  # compute doubled; the messages' fixed costs are not
    ratio = steps["file"] / steps["measured"]
    print(
        f"probe-file plan {steps['file'] * 1e3:.1f} ms vs measured plan {steps['measured'] * 1e3:.1f} ms: {ratio:.2f}"
    )
    assert AGREEMENT[0] < ratio < AGREEMENT[1], steps
    json.loads(hw.read_text())  # plain JSON a reader can open


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_failing_rank_comes_back_as_one_line() -> None:
    from planner.costs.probe import probe_rank
    from planner.run.spawn import launch_function

    with pytest.raises(PlannerError, match=r"^rank [01] failed: ValidationError: ") as e:
        launch_function(probe_rank, ("{}",), nproc=2, threads=1, timeout_s=60)
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_measure_the_links_across_nodes(tmp_path: Path) -> None:
    """Two `planner probe` commands on this machine, one rank each, meeting at a c10d rendezvous:
    the path of a multi-node probe, with localhost standing in for the network."""
    import subprocess
    import sys

    from run_factory import free_port

    port = free_port("localhost")
    args = ["--gpus", "2", "--gpus-per-node", "1", "--quick", "--no-progress", "--rdzv-endpoint", f"localhost:{port}"]
    nodes = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "cli.py"), "probe", *args, "-o", str(tmp_path / f"node{i}.json")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    written = [p for p in (tmp_path / "node0.json", tmp_path / "node1.json") if p.exists()]
    assert len(written) == 1, outputs  # the node of rank 0 writes; the other says so
    assert any("the node of rank 0 writes" in out for out in outputs)
    doc = read_hardware_file(written[0])
    assert doc.measured is not None and doc.measured.intra_node is None
    assert doc.measured.inter_node is not None and doc.measured.inter_node.ranks == 2
    assert doc.derived["inter_node_Bps"].startswith("alpha-beta least squares over send_recv")
    assert "not measured (one rank)" in doc.derived["intra_node_Bps"]


@pytest.mark.multiprocess
def test_a_node_alone_at_its_rendezvous_is_one_line_within_the_timeout(tmp_path: Path) -> None:
    """One node of a two-node probe started, the other never: the line names the endpoint, the
    timeout and what to start on every node (it was an internal error before)."""
    from run_factory import free_port

    port = free_port("localhost")
    out = tmp_path / "hw.json"
    result = invoke(
        "probe", "--gpus", "2", "--gpus-per-node", "1", "--quick", "--no-progress", "--timeout", "3",
        "--rdzv-endpoint", f"localhost:{port}", "-o", str(out),
    )  # fmt: skip
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0] == (
        f"error: --rdzv-endpoint localhost:{port}: the 2 nodes did not all join within 3 s (--timeout 3); start the "
        "same command, with the same --gpus, --gpus-per-node and --rdzv-endpoint, on every node"
    )
    assert not out.exists()
