"""`analyze`: the tiny model's step compiled from abstract parameters on a small mesh and priced on
an H100 topology, with every key the CLI's JSON promises; bad input named clearly."""
import json

import pytest

from xlaopt.analysis.analyze import analyze, format_analysis
from xlaopt.analysis.topology import parse_topology
from xlaopt.cli import main
from xlaopt.data.batch import BatchShape
from xlaopt.errors import UserError
from xlaopt.mesh import MeshSpec
from xlaopt.pipeline import pipeline, run_pipeline
from xlaopt.program import TrainProgram, TrainSettings

from conftest import needs_devices

REQUIRED = ("step_time_s", "mfu", "exposed_comm_s", "comm_by_axis", "memory_per_device_bytes", "collectives")


@pytest.fixture(scope="module")
def tiny_fsdp2(tiny_config):
    program = TrainProgram(tiny_config, MeshSpec.parse("fsdp=2"),
                           settings=TrainSettings(batch=BatchShape(2, 48, 96)))
    program, _ = run_pipeline(program, pipeline())
    return program


@needs_devices(2)
def test_analyze_tiny_on_h100(tiny_fsdp2, tmp_path):
    trace = tmp_path / "trace.json"
    result = analyze(tiny_fsdp2, parse_topology("h100:1x8"), "cpu", str(trace))
    assert set(REQUIRED) <= set(result)
    json.dumps(result)  # JSON-ready
    assert 0 < result["mfu"] < 1
    # The CPU schedule overlaps nothing: every collective is exposed, the step is serial.
    assert result["exposed_comm_s"] == pytest.approx(result["comm_s"], rel=1e-9) and result["comm_s"] > 0
    assert result["step_time_s"] == pytest.approx(result["compute_s"] + result["comm_s"], rel=1e-9)
    assert set(result["comm_by_axis"]) == {"fsdp"}  # fsdp=2: the only axis that communicates
    assert result["comm_by_axis"]["fsdp"]["bytes"] > 0
    mem = result["memory_per_device_bytes"]
    assert mem["arguments"] > 0 and mem["peak_estimate"] >= mem["arguments"] and result["fits_hbm"]
    kinds = {c["kind"] for c in result["collectives"]}
    assert "all-gather" in kinds and all(c["link_level"] == "nvlink4" for c in result["collectives"])
    # Gradient sync: the reductions over fsdp (FSDP's gradient reduce-scatters, the loss's mean),
    # not the parameter gathers; all exposed on the CPU schedule.
    grad_sync = [c for c in result["collectives"] if c["kind"] in ("reduce-scatter", "all-reduce")]
    assert grad_sync and result["grad_sync_s"] == pytest.approx(sum(c["time_s"] for c in grad_sync), rel=1e-9)
    assert 0 < result["exposed_grad_sync_s"] == pytest.approx(result["grad_sync_s"], rel=1e-9)
    assert result["exposed_grad_sync_s"] < result["exposed_comm_s"]  # the gathers are not gradient sync
    # the step's matmul FLOPs (with recomputation) are at least the model's FLOPs
    assert result["hlo_matmul_flops_per_step"] >= result["model_flops_per_step"] * 0.9
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e["ph"] == "X" for e in events)
    text = format_analysis(result)
    assert "step time" in text and "MFU" in text and "fsdp" in text
    assert result["attention"]["impl"] == result["attention"]["target_default"] == "dense"
    assert "dense (the cpu target's default)" in text


def test_mesh_larger_than_topology_names_both(tiny_config, capsys):
    program = TrainProgram(tiny_config, MeshSpec.parse("fsdp=8"))
    with pytest.raises(UserError, match=r"fsdp=8.*8 devices.*h100:1x4.*4"):
        analyze(program, parse_topology("h100:1x4"))
    assert main(["analyze", "--model", "cosmos3-tiny", "--mesh", "data=2,fsdp=8", "--topology", "h100:1x8"]) == 2
    assert "data=2,fsdp=8 needs 16 devices but topology h100:1x8 has 8" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--mesh", "fsdp=1024", "--topology", "h100:128x8"], "at most 512 simulated CPU devices"),
    (["--mesh", "fsdp=8", "--topology", "tpu9:1x8"], "unknown topology preset 'tpu9'"),
])
def test_cpu_target_mesh_cap_and_unknown_topology(argv, message, capsys):
    assert main(["analyze", "--model", "cosmos3-tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@needs_devices(2)
def test_gpu_target_reads_async_collectives_and_their_overlap(tiny_fsdp2):
    """With xlaopt[gpu-aot] (not installed by the test command: ~1 GB of CUDA wheels), the step
    compiles deviceless for H100s and XLA's GPU schedule runs collectives async: the analysis
    reports the compute each one overlaps."""
    pytest.importorskip("jax_cuda12_plugin", reason="--target gpu needs pip install -e '.[gpu-aot]'")
    result = analyze(tiny_fsdp2, parse_topology("h100:1x8"), "gpu")
    assert set(REQUIRED) <= set(result)
    asynchronous = [c for c in result["collectives"] if c["is_async"]]
    assert asynchronous and {c["kind"] for c in asynchronous} >= {"all-gather", "reduce-scatter"}
    assert sum(c["overlapped_compute_s"] for c in asynchronous) > 0
    # Overlap hides communication: the step is shorter than compute plus communication in series.
    assert result["step_time_s"] < result["compute_s"] + result["comm_s"]


@pytest.mark.parametrize("argv,message", [
    (["--mix", "cosmos3-999"], "unknown mix 'cosmos3-999'; registered mixes: cosmos3-480p, cosmos3-720p"),
    (["--mix", "cosmos3-720p", "--text-len", "512", "--gen-len", "7680"],
     "the smallest budget that works is (512, 44160)"),
])
def test_bad_mix_and_row_budget_are_named(argv, message, capsys):
    assert main(["analyze", "--model", "cosmos3-tiny", "--mesh", "fsdp=2", "--topology", "h100:1x8",
                 "--batch-size", "2", *argv]) == 2
    assert message in capsys.readouterr().err


@needs_devices(2)
def test_cli_prices_rows_packed_from_a_mix(tmp_path):
    """`--mix`: the rows priced are the loader's first batch of the mix, balanced over the devices."""
    from xlaopt.data.mixes import get_mix
    from xlaopt.data.plan import plan_batch

    out = tmp_path / "a.json"
    argv = ["--model", "cosmos3-tiny", "--set", "num_layers=2", "--mesh", "fsdp=2", "--batch-size", "4",
            "--text-len", "256", "--gen-len", "2048", "--exec", "attention=segment", "--exec", "attention_block=128"]
    assert main(["analyze", *argv, "--topology", "h100:1x8", "--mix", "cosmos3-480p", "--skip-oversize",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    shape = BatchShape(4, 256, 2048)
    plan = plan_batch(get_mix("cosmos3-480p").lengths(10_000), shape, skip_oversize=True)
    assert result["fill"] == pytest.approx(plan.fill) and result["data"].startswith("mix cosmos3-480p")
    assert result["attention_pairs_executed_over_needed"] >= 1.0
    assert set(result["attention"]["pair_loop_trips_busiest_device"]) == {"xlaopt_pairs_L256_S256",
                                                                          "xlaopt_pairs_L2048_S2304"}


@needs_devices(2)
def test_analyze_float16_step(tmp_path):
    """The float16 step (loss scaling included) compiles and prices at the float16 peak."""
    out = tmp_path / "fp16.json"
    assert main(["analyze", "--model", "llama-tiny", "--set", "num_layers=2", "--mesh", "fsdp=2",
                 "--topology", "h100:1x8", "--dtype", "float16", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["compute_dtype"] == "float16" and 0 < result["mfu"] < 1
    assert any("matmuls at the float16 peak" in note for note in result["notes"])



@pytest.mark.parametrize("argv, target, attention", [
    ([], "gpu", "cudnn"),  # the planner's choice on a GPU, so the compile prices what the job would run
    ([], "cpu", "dense"),
    (["--exec", "attention=dense"], "gpu", "dense"),  # asked for: kept
    (["--exec", "attention=segment"], "gpu", "segment"),
    # A split sequence, which cuDNN's attention refuses, reaches it through Ulysses where the heads
    # split over context; where they do not (2 query heads a tensor rank, context 4) it is dense.
    (["--mesh", "context=2,fsdp=4"], "gpu", "cudnn"),
    (["--mesh", "context=4,tensor=4"], "gpu", "dense"),
])
def test_a_target_defaults_to_the_attention_the_planner_runs_there(tiny_config, argv, target, attention):
    from xlaopt.analysis.analyze import _attention_used
    from xlaopt.cli import build_parser, programs
    from xlaopt.cli.requests import ProgramRequest
    from xlaopt.program import cudnn_takes_sequence

    args = build_parser().parse_args(["analyze", "--model", "cosmos3-tiny", "--topology", "h100:1x8",
                                      "--target", target, "--mesh", "fsdp=8", *argv])
    request = ProgramRequest.of(args)
    program = programs.program(request, tiny_config, programs.layout_of(request), BatchShape(8, 48, 96),
                               target=target)
    assert program.execution.attention == attention
    # The report names what it priced and whether that is the target's default.
    default = "cudnn" if target == "gpu" and cudnn_takes_sequence(tiny_config, program.mesh, program.sequence_axes) \
        else "dense"
    said = _attention_used({"target": target, "attention": {"impl": attention, "target_default": default}})
    assert said.startswith(attention)
    assert ("(the " + target + " target's default)" in said) == (attention == default), said
