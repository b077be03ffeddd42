"""overlap-flags: XLA's GPU overlap options as a pass. Where it fits (the GPU target only), what
it sets (thresholds sized from the topology, the user's own options kept), and, with the
gpu-aot extra, that the XLA passes it switches on really rewrite the step in jax 0.10.2's
compiler (its own per-pass dumps say so) and hide communication."""
import pathlib

import pytest

from xlaopt.analysis.topology import parse_topology
from xlaopt.cli import main
from xlaopt.context import PassContext
from xlaopt.data.batch import BatchShape
from xlaopt.errors import UserError
from xlaopt.execution import ExecutionConfig
from xlaopt.mesh import MeshSpec
from xlaopt.models.registry import get_config
from xlaopt.passes.overlap_flags import OverlapFlags
from xlaopt.pipeline import pipeline, run_pipeline, select_passes
from xlaopt.program import TrainProgram, TrainSettings


def _program(target: str, **options) -> TrainProgram:
    return TrainProgram(get_config("llama-tiny"), MeshSpec.parse("fsdp=8"),
                        settings=TrainSettings(batch=BatchShape(8, 256, 0)), target=target,
                        execution=ExecutionConfig(attention="cudnn" if target == "gpu" else "dense"),
                        compiler_options=options)


def test_skipped_on_the_cpu_target_and_refused_when_asked_for_by_name(capsys):
    program = _program("cpu")
    out, records = run_pipeline(program, pipeline())
    record = {r.name: r for r in records}["overlap-flags"]
    assert not record.changed and "cpu target" in record.report["skipped"] and not out.compiler_options
    with pytest.raises(UserError, match="^overlap-flags: sets XLA GPU compiler flags; this program compiles for "
                                        "the cpu target"):
        run_pipeline(program, select_passes(pipeline(), ["overlap-flags"]),
                     ctx=PassContext.for_program(program, requested=["overlap-flags"]))
    assert main(["analyze", "--model", "llama-tiny", "--set", "num_layers=2", "--mesh", "fsdp=2", "--topology", "h100:1x8",
                 "--passes", "mesh-layout,overlap-flags"]) == 2
    err = capsys.readouterr().err
    assert "overlap-flags: sets XLA GPU compiler flags" in err and err.count("\n") == 1


def test_sets_the_flags_sizes_the_thresholds_from_the_topology_and_keeps_the_users():
    topology = parse_topology("h100:16x8")
    program = _program("gpu", xla_gpu_enable_pipelined_all_reduce=False)
    result = OverlapFlags().run(program, PassContext.for_program(program, topology))
    options = dict(result.program.compiler_options)
    # A ring over 16 nodes on 400 Gb/s InfiniBand (50 GB/s, 10 us a step): latency a tenth of transfer.
    assert options["xla_gpu_all_gather_combine_threshold_bytes"] == 15 * 10e-6 * 50e9 / 0.1 == 75_000_000
    assert options["xla_gpu_enable_pipelined_all_gather"] is True
    assert options["xla_gpu_enable_while_loop_double_buffering"] is True
    assert options["xla_gpu_enable_pipelined_all_reduce"] is False  # the user's own option wins
    assert result.report["left_to_the_user"] == {"xla_gpu_enable_pipelined_all_reduce": False}
    assert result.changed and "xla_gpu_enable_pipelined_all_reduce" not in result.report["set"]
    one_node = OverlapFlags().options(PassContext("gpu", parse_topology("h100:1x8")))
    assert one_node["xla_gpu_reduce_scatter_combine_threshold_bytes"] == round(7 * 3e-6 * 450e9 / 0.1)
    bare = OverlapFlags(pipelined_collectives=False).options(PassContext("gpu"))  # no topology: XLA's thresholds
    assert not any("combine" in k or "pipelined" in k for k in bare)


def _passes_that_changed(dump: pathlib.Path) -> set[str]:
    """With a pass filter XLA dumps the module before the first matching pass and after each one
    (`...NNNN.<pipeline>.after_<pass>.before_<next>.txt`), changed or not: a pass changed the
    module where its dump differs from the one before it."""
    body = lambda f: [line for line in f.read_text().splitlines() if not line.startswith(("HloModule", "//"))]  # noqa: E731
    files = sorted(dump.glob("module_*.jit_train_step.[0-9][0-9][0-9][0-9].*.txt"))
    return {after.name.split(".after_")[1].split(".before_")[0]
            for before, after in zip(files, files[1:]) if body(after) != body(before)}


def test_the_passes_it_switches_on_rewrite_the_step_in_xlas_own_dumps(tmp_path):
    pytest.importorskip("jax_cuda12_plugin", reason="--target gpu needs pip install -e '.[gpu-aot]'")
    from xlaopt.analysis.analyze import analyze

    topology = parse_topology("h100:1x8")
    results, changed = {}, {}
    for label, passes in (("without", ["mesh-layout"]), ("with", ["mesh-layout", "overlap-flags"])):
        dump = tmp_path / label
        program = _program("gpu", xla_dump_to=str(dump), xla_dump_hlo_pass_re="collective-pipeliner.*|"
                                                                              "loop-double-buffer.*")
        program, _ = run_pipeline(program, select_passes(pipeline(), passes),
                                  ctx=PassContext.for_program(program, topology))
        results[label] = analyze(program, topology)
        changed[label] = _passes_that_changed(dump)
    assert not changed["without"] & {"collective-pipeliner-forward", "loop-double-buffer-transformer"}
    assert {"collective-pipeliner-forward", "collective-pipeliner-backward",
            "loop-double-buffer-transformer"} <= changed["with"]
    assert results["with"]["exposed_comm_s"] < results["without"]["exposed_comm_s"]
