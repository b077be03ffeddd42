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
    assert "xla_gpu_enable_while_loop_double_buffering" not in options  # off unless asked for (docstring)
    assert OverlapFlags(double_buffering=True).options(PassContext("gpu"))[
        "xla_gpu_enable_while_loop_double_buffering"] is True
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
    with_double_buffering = pipeline({"overlap-flags": {"double_buffering": True}})
    for label, passes in (("without", ["mesh-layout"]), ("with", ["mesh-layout", "overlap-flags"])):
        dump = tmp_path / label
        program = _program("gpu", xla_dump_to=str(dump), xla_dump_hlo_pass_re="collective-pipeliner.*|"
                                                                              "loop-double-buffer.*")
        program, _ = run_pipeline(program, select_passes(with_double_buffering, passes),
                                  ctx=PassContext.for_program(program, topology))
        results[label] = analyze(program, topology)
        changed[label] = _passes_that_changed(dump)
    assert not changed["without"] & {"collective-pipeliner-forward", "loop-double-buffer-transformer"}
    assert {"collective-pipeliner-forward", "collective-pipeliner-backward",
            "loop-double-buffer-transformer"} <= changed["with"]
    assert results["with"]["exposed_comm_s"] < results["without"]["exposed_comm_s"]


def _prefetched_gathers(ins) -> list[str]:
    """The all-gather-starts of a loop body whose gathered values go to the next iteration (reach
    the ROOT tuple through no matmul) and are issued before the body's last matmul."""
    users: dict[str, list] = {}
    for i in ins:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    gemm = lambda i: i.opcode in ("custom-call", "fusion") and any(k in i.name for k in ("gemm", "dot"))  # noqa: E731
    last_gemm = max((k for k, i in enumerate(ins) if gemm(i)), default=-1)
    found = []
    for k, start in enumerate(ins):
        if start.opcode != "all-gather-start":
            continue
        done = next(i for i in ins if i.opcode == "all-gather-done" and start.name in i.operands)
        seen, stack, to_root, to_gemm = set(), [done], False, False
        while stack:
            for u in users.get(stack.pop().name, []):
                if u.name not in seen:
                    seen.add(u.name)
                    to_root |= u.is_root
                    to_gemm |= gemm(u)
                    if not u.is_root and not gemm(u):
                        stack.append(u)
        if to_root and not to_gemm and k < last_gemm:
            found.append(start.name)
    return found


def test_fsdp_weights_are_prefetched_a_layer_ahead_by_xlas_pipeliner(tmp_path):
    """FSDP weight prefetch on jax 0.10.2 is XLA's collective pipeliner, which overlap-flags
    switches on: with it each layer loop body issues an all-gather whose weights only the next
    iteration uses, before the body's own matmuls are done (the first layer's is peeled before the
    loop); without it every gather in a body feeds that body's matmuls."""
    pytest.importorskip("jax_cuda12_plugin", reason="--target gpu needs pip install -e '.[gpu-aot]'")
    from xlaopt.analysis.analyze import analyze
    from xlaopt.analysis.hlo import parse

    topology = parse_topology("h100:1x8")
    prefetched = {}
    for label, passes in (("without", ["mesh-layout"]), ("with", ["mesh-layout", "overlap-flags"])):
        program, _ = run_pipeline(_program("gpu"), select_passes(pipeline(), passes),
                                  ctx=PassContext.for_program(_program("gpu"), topology))
        analyze(program, topology, dump_dir=str(tmp_path / label))
        comps, entry = parse((tmp_path / label / "analyzed-gpu.compiled.hlo").read_text())
        bodies = {name: ins for name, ins in comps.items()
                  if name != entry and any(i.opcode == "all-gather-start" for i in ins)}
        assert len(bodies) == 2  # the forward and the backward layer loops
        prefetched[label] = {name: _prefetched_gathers(ins) for name, ins in bodies.items()}
    assert not any(prefetched["without"].values())
    assert all(prefetched["with"].values()), prefetched["with"]


def _split_sequence_program(mesh: str, sequence_parallel: bool, micro_batches: int, **options) -> TrainProgram:
    from xlaopt.sharding import DEFAULT_RULES, with_sequence_parallel

    return TrainProgram(get_config("llama-tiny"), MeshSpec.parse(mesh), target="gpu",
                        settings=TrainSettings(batch=BatchShape(16, 256, 0)),
                        execution=ExecutionConfig(micro_batches=micro_batches),
                        rules=with_sequence_parallel(DEFAULT_RULES, sequence_parallel), compiler_options=options)


def test_the_pipelined_all_gather_is_left_off_where_it_would_clone_the_micro_batch_loops_layers():
    topology = parse_topology("h100:1x8")
    program = _split_sequence_program("data=4,tensor=2", True, 4)
    result = OverlapFlags().run(program, PassContext.for_program(program, topology))
    assert result.program.compiler_options["xla_gpu_enable_pipelined_all_gather"] is False
    assert result.program.compiler_options["xla_gpu_enable_pipelined_reduce_scatter"] is True
    assert "sequence split over tensor" in result.report["pipelined_all_gather_off"]
    # One micro-batch, a sequence not split, a decoder's context (its loop runs manual over it, each
    # rank on its chunk), or the user's own choice: the pass keeps it on / leaves it.
    program = _split_sequence_program("data=4,context=2", False, 4)
    context, _ = run_pipeline(program, pipeline()[:-1], ctx=PassContext.for_program(program, topology))  # all but ours
    for program in (_split_sequence_program("data=4,tensor=2", True, 1), _split_sequence_program("fsdp=4,tensor=2", False, 4),
                    context, _split_sequence_program("data=4,tensor=2", True, 4, xla_gpu_enable_pipelined_all_gather=True)):
        result = OverlapFlags().run(program, PassContext.for_program(program, topology))
        assert result.program.compiler_options["xla_gpu_enable_pipelined_all_gather"] is True
        assert "pipelined_all_gather_off" not in result.report


def test_xlas_pipelined_all_gather_runs_a_split_sequences_micro_batches_twice():
    """The fact the rule above rests on, on jax 0.10.2's GPU compiler: with the flag on, the
    compiled step holds every micro-batch's layer loops twice (the clones feed only the gathers
    moved a micro-batch early) and the priced FLOPs double; with the pass's choice they equal one
    micro-batch's step. (Sequence parallel over tensor: on data=4,context=2 the decoder's loop now
    runs manual over context and the flag clones nothing, checked below.)"""
    pytest.importorskip("jax_cuda12_plugin", reason="--target gpu needs pip install -e '.[gpu-aot]'")
    from xlaopt.analysis.analyze import analyze

    topology = parse_topology("h100:1x8")
    flops = {}
    for label, micro_batches, forced in (("one", 1, {}), ("pass", 4, {}),
                                          ("forced", 4, {"xla_gpu_enable_pipelined_all_gather": True})):
        program = _split_sequence_program("data=4,tensor=2", True, micro_batches, **forced)
        program, _ = run_pipeline(program, pipeline(), ctx=PassContext.for_program(program, topology))
        flops[label] = analyze(program, topology)["hlo_flops_over_model_flops"]
    assert flops["pass"] == pytest.approx(flops["one"], rel=0.02)
    assert flops["forced"] > 1.6 * flops["one"], flops
    program = _split_sequence_program("data=4,context=2", False, 4)
    program, _ = run_pipeline(program, pipeline(), ctx=PassContext.for_program(program, topology))
    assert program.compiler_options["xla_gpu_enable_pipelined_all_gather"] is True
    assert analyze(program, topology)["hlo_flops_over_model_flops"] == pytest.approx(flops["one"], rel=0.02)
