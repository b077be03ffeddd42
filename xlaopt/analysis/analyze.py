"""Price a training step on a cluster without running it: compile from abstract parameters,
read the scheduled HLO, simulate it on a topology.

    xlaopt analyze --model cosmos3-nano --topology h100:16x8 --mesh fsdp=128 [--target cpu|gpu]
                   [--trace OUT.json] [--json OUT]

Nothing is allocated: the step is lowered from `jax.ShapeDtypeStruct`s with shardings
(`CompiledProgram.lowered`) and compiled ahead of time.

Targets:
- `cpu` (default): compiled by XLA's CPU pipeline on simulated CPU devices, one per mesh device
  (JAX has no deviceless CPU topology: `jax.experimental.topologies.get_topology_desc(..., "cpu")`
  raises "topology not implemented for cpu" on jax 0.10.2), so the mesh is capped at
  `MAX_SIMULATED_DEVICES` (512). The CPU schedule has no async collectives: every collective is
  exposed. Its CPU-only artefacts are undone when pricing (bf16 matmuls priced at the bf16 peak,
  collectives at their bf16 bytes, all-reduce + slice priced as reduce-scatter; see
  `xlaopt.analysis.simulate`).
- `gpu`: compiled deviceless for the topology's GPUs (`xlaopt.analysis.gpu_aot`, the `gpu-aot` extra), any
  mesh up to the topology's size: XLA's real GPU schedule, async collectives and what overlaps them.
"""
from __future__ import annotations

import json
import math
import time

from xlaopt.analysis.priced_batch import PricedBatch, synthetic_batch
from xlaopt.analysis.topology import Topology
from xlaopt.errors import UserError
from xlaopt.execution import TARGETS, target_attention
from xlaopt.mesh import MAX_SIMULATED_DEVICES, MESH_AXES
from xlaopt.models.pipeline import BRANCH_SCOPE
from xlaopt.program import TrainProgram, cudnn_takes_sequence


def check_fits(program: TrainProgram, topology: Topology) -> None:
    if program.mesh.num_devices > topology.num_devices:
        raise UserError(f"mesh {program.mesh} needs {program.mesh.num_devices} devices but topology "
                        f"{topology.name} has {topology.num_devices}; use a smaller mesh or a larger topology")


def compiled_for(program: TrainProgram, topology: Topology, target: str):
    """(CompiledProgram, lower seconds, compile seconds)."""
    from xlaopt.compile import compile_program

    if target == "gpu":
        from xlaopt.analysis.gpu_aot import gpu_mesh

        compiled = compile_program(program, gpu_mesh(topology, program.mesh.sizes, MESH_AXES,
                                                     program.mesh.placement()))
    else:
        if program.mesh.num_devices > MAX_SIMULATED_DEVICES:
            raise UserError(f"--target cpu compiles on one simulated CPU device per mesh device, at most "
                            f"{MAX_SIMULATED_DEVICES}; mesh {program.mesh} has {program.mesh.num_devices}. "
                            f"Use --target gpu (needs xlaopt[gpu-aot]) for larger meshes")
        compiled = compile_program(program)
    t0 = time.perf_counter()
    compiled.lowered  # noqa: B018 (cached: lowering timed apart from compilation)
    t1 = time.perf_counter()
    compiled.train_step  # noqa: B018
    return compiled, t1 - t0, time.perf_counter() - t1


def analyze(program: TrainProgram, topology: Topology, target: str | None = None, trace: str | None = None,
            dump_dir: str | None = None, batch: PricedBatch | None = None) -> dict:
    """Compile `program`'s step for `target` (default: the program's own), simulate its schedule on
    `topology` for `batch` (default: the first batch of the family's synthetic stream); JSON-ready.
    `trace`: write the simulated timeline there (Perfetto JSON); `dump_dir`: write the compiled
    (scheduled) HLO there as `analyzed-<target>.compiled.hlo`."""
    return analyze_with_sim(program, topology, target, trace, dump_dir, keep_timeline=False, batch=batch)[0]


def analyze_with_sim(program: TrainProgram, topology: Topology, target: str | None = None, trace: str | None = None,
                     dump_dir: str | None = None, keep_timeline: bool = True, batch: PricedBatch | None = None):
    """`analyze`, also handing back the `SimResult` it priced (with its event timeline when
    `keep_timeline` or `trace`): (JSON-ready dict, SimResult). `xlaopt.analysis.notebook` draws from it."""
    from xlaopt.analysis.attention_work import batch_work
    from xlaopt.analysis.costmodel import efficiency_for
    from xlaopt.analysis.hlo import fp8_gemms
    from xlaopt.analysis.schedule import build_schedule
    from xlaopt.analysis.simulate import bounds, mfu, simulate, to_perfetto

    program, target, batch = _resolve(program, topology, target, batch)
    work = batch_work(program, batch.arrays)
    compiled, lower_s, compile_s = compiled_for(program, topology, target)
    executable = compiled.train_step
    t0 = time.perf_counter()
    text = executable.as_text()
    if dump_dir is not None:
        import pathlib

        pathlib.Path(dump_dir).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(dump_dir) / f"analyzed-{target}.compiled.hlo").write_text(text)
    schedule = build_schedule(text, loop_trips=work.loop_trips, custom_call_flops=work.custom_call_flops,
                              branch_taken=branches_taken(program))
    cpu = target == "cpu"
    dtype = program.execution.compute_dtype
    placed = topology.placed(program.mesh.placement())  # the replica groups' devices where the mesh order puts them
    sim = simulate(schedule, placed, program.mesh.as_dict(), eff=efficiency_for(topology), matmul_dtype=dtype if cpu else None,
                   cpu_fixups=cpu, keep_timeline=keep_timeline or trace is not None)
    price_s = time.perf_counter() - t0
    if trace is not None:
        with open(trace, "w") as f:
            json.dump(to_perfetto(sim, f"{program.model.name} on {program.mesh} ({topology.name}, {target})"), f)

    model_flops = work.model_flops
    n = program.mesh.num_devices
    averaged = work.loop_trips or work.mean_custom_call_flops != work.custom_call_flops
    hlo_flops = n * (_mean_device_flops(text, work) if averaged else schedule.flops)
    mem = memory_of(executable)
    collectives = _with_windows(sim.collectives, schedule)
    notes = _notes(target, dtype, compiled.compiler_notes, work)
    result = {
        "model": program.model.name, "mesh": program.mesh.as_dict(), "devices": n,
        "topology": topology.name, "device": topology.device.name, "target": target,
        "batch": {"batch_size": program.settings.batch.batch_size, "text_len": program.settings.batch.text_len,
                  "gen_len": program.settings.batch.gen_len},
        "data": batch.source,
        "fill": work.fill,
        "attention": _attention_json(program, target, work),
        "attention_pairs_executed_over_needed": work.pairs_executed_over_needed,
        "pipeline": _pipeline_json(program, schedule.loops, sim),
        "compute_dtype": dtype,
        "matmuls": program.execution.matmuls,  # "fp8": the projections' (MFU stays against the dtype's peak)
        "fp8_gemms": fp8_gemms(text),  # GEMMs on fp8 operands in the compiled step (`hlo.fp8_gemms`)
        "step_time_s": sim.step_time_s,
        "mfu": mfu(model_flops, sim.step_time_s, topology, n, dtype),
        "exposed_comm_s": sim.exposed_comm_s,
        "exposed_comm_by_axis_s": sim.exposed_by_axis,
        "exposed_grad_sync_s": sum(c["exposed_s"] for c in collectives if is_grad_sync(c)),
        "grad_sync_s": sum(c["time_s"] for c in collectives if is_grad_sync(c)),
        "comm_by_axis": sim.comm_by_axis,
        "compute_s": sim.compute_s,
        "comm_s": sim.comm_s,
        "compute_idle_fraction": sim.compute_idle_fraction,
        "comm_idle_fraction": sim.comm_idle_fraction,
        "bounds": bounds(sim),
        "model_flops_per_step": model_flops,
        "hlo_matmul_flops_per_step": hlo_flops,
        "hlo_flops_over_model_flops": hlo_flops / model_flops if model_flops else None,
        "memory_per_device_bytes": mem,
        "hbm_bytes": topology.device.hbm_bytes,
        "fits_hbm": topology.device.hbm_bytes <= 0 or mem["peak_estimate"] <= topology.device.hbm_bytes,
        "collectives": collectives,
        "schedule": {"ops": len(schedule.ops),
                     "loops": [dict(loop, time_s=sim.loop_time_s.get(loop["name"])) for loop in schedule.loops],
                     "async_collectives": sum(1 for c in collectives if c["is_async"])},
        "timings_s": {"lower": lower_s, "compile": compile_s, "simulate": price_s},
        "trace": trace,
        "notes": notes,
    }
    return result, sim


def _attention_json(program: TrainProgram, target: str, work) -> dict:
    return {"impl": program.execution.attention, "target_default": target_attention(
        target, not cudnn_takes_sequence(program.model, program.mesh, program.sequence_axes)),
            "block": program.execution.attention_block,
            "pairs_needed_per_layer": work.pairs_needed, "pairs_executed_per_layer": work.pairs_executed,
            "pair_loop_trips_busiest_device": work.loop_trips, "pair_loop_trips_mean_device": work.mean_loop_trips,
            "fused_call_flops_busiest_device": work.custom_call_flops,
            "fused_call_flops_mean_device": work.mean_custom_call_flops}


def branches_taken(program: TrainProgram) -> dict:
    """What the simulator needs of a pipeline's conditional branches (1F1B's), tick by tick."""
    schedule = program.pipeline_schedule
    return schedule.branches_taken() if schedule is not None else {}


def _pipeline_json(program: TrainProgram, loops: list[dict], sim) -> dict | None:
    """The pipeline's schedule, what its bubble costs and what a stage holds; None unpipelined.
    As priced: the tick loops (the step's outermost loops of `ticks` trips, forward and backward)
    and a tick's time, forward and backward, so the bubble's P - 1 ticks in seconds."""
    s = program.pipeline_schedule
    if s is None:
        return None
    out = {"schedule": s.name, "stages": s.stages, "microbatches": s.microbatches,
           "virtual_stages": s.virtual_stages, "ticks": s.ticks, "bubble_fraction": s.bubble_fraction,
           "saved_ticks": s.saved_ticks}
    ticking = [loop["name"] for loop in loops if loop.get("ops") and loop["trip_count"] == s.ticks]
    if ticking:
        # P - 1 of V M + P - 1 stage times, in GPipe's ticks or 1F1B's (a forward and a backward
        # each, the first and last VP - 1 of them running forwards or backwards alone). 1F1B's
        # tail (head and loss, on the last stage) runs once a micro-batch inside the ticks but in
        # none of the bubble's: it is taken out before the share.
        loops_s = sum(sim.loop_time_s[name] for name in ticking)
        tail_s = sim.branch_time_s.get(BRANCH_SCOPE.format("tail"), 0.0)
        bubble_s = (loops_s - tail_s) * s.bubble_fraction
        out.update(tick_loops=ticking, tick_loops_s=loops_s, tick_s=loops_s / s.ticks, tail_s=tail_s,
                   bubble_s=bubble_s,
                   bubble_fraction_of_step=bubble_s / sim.step_time_s if sim.step_time_s else None)
    return out


def _resolve(program: TrainProgram, topology: Topology, target: str | None, batch: PricedBatch | None):
    """(program for `target`, target, the batch priced), each checked against the others."""
    target = program.target if target is None else target
    if target not in TARGETS:
        raise UserError(f"--target {target!r}; use one of {', '.join(TARGETS)}")
    if target != program.target:
        program = program.replace(target=target)  # its compiler options are checked against the new target
    check_fits(program, topology)
    if program.execution.matmuls == "fp8" and not topology.device.has_fp8:
        raise UserError(f"--exec matmuls=fp8: {topology.device.name} has no fp8 matmuls; they run on Hopper GPUs "
                        f"(h100, h200 topologies): use matmuls=compute here")
    if batch is None:
        batch = synthetic_batch(program)
    if batch.shape != program.settings.batch:
        raise UserError(f"the priced batch is {batch.shape} but the program's is {program.settings.batch}")
    return program, target, batch


def memory_of(executable) -> dict:
    """XLA's memory analysis per device, and the peak it implies."""
    memory = executable.memory_analysis()
    mem = {"arguments": int(memory.argument_size_in_bytes), "outputs": int(memory.output_size_in_bytes),
           "aliased": int(memory.alias_size_in_bytes), "temp": int(memory.temp_size_in_bytes)}
    mem["peak_estimate"] = mem["arguments"] + mem["outputs"] - mem["aliased"] + mem["temp"]
    return mem


def _with_windows(collectives: list[dict], schedule) -> list[dict]:
    """Each simulated collective with what the schedule placed between its start and done."""
    windows = {(w["computation"], w["start"]): w for w in schedule.async_windows()}
    out = []
    for c in collectives:
        w = windows.get((c["computation"], c["name"]))
        if w is not None:
            c = dict(c, ops_between=w["ops_between"], compute_ops_between=w["compute_ops_between"],
                     flops_between=w["flops_between"])
        out.append(c)
    return out


def _notes(target: str, dtype: str, compiler_notes, work) -> list[str]:
    """What the price assumes, and what XLA said compiling the step."""
    notes = []
    if target == "cpu":
        notes.append("CPU schedule: XLA's CPU pipeline has no async collectives, so every collective is "
                     "exposed; bounds.perfect_overlap_s is the step time if all of it were hidden")
        notes.append(f"CPU artefacts undone when pricing: matmuls at the {dtype} peak, collectives at their "
                     f"pre-widening bytes, all-reduce + slice as reduce-scatter, f32->bf16->f32 fusions free")
    notes += [f"XLA, compiling this step: {n}" for n in compiler_notes]
    notes.append("one device simulated (SPMD); kernel launch overheads not modelled; compute priced by the "
                 "roofline with costmodel.FITTED efficiencies")
    if work.loop_trips:
        busiest = max(work.loop_trips.values())
        mean = max(work.mean_loop_trips.values())
        notes.append(f"segment-aware attention's pair loops run as long as each device's rows need: the step is "
                     f"priced on the busiest device ({busiest} trips per run of the longest loop, the average "
                     f"device {mean:.0f}); HLO FLOPs count each device's own. Each trip is a few small kernels: on "
                     f"a GPU they run at small-matmul efficiency plus launch overheads (not modelled), a fused "
                     f"kernel's work done the slow way")
    return notes


GRAD_SYNC_KINDS = ("all-reduce", "reduce-scatter")
BATCH_AXES = frozenset({"data", "fsdp"})


def is_grad_sync(collective: dict) -> bool:
    """A collective that synchronises gradients: a reduction over the axes that split the batch
    (data, fsdp) and nothing else. Tensor and context reductions are of activations; the loss's
    scalar mean over the batch counts too, at a few bytes."""
    axes = set(collective["mesh_axes"].split(","))
    if collective["kind"] == "all-gather" and axes == {"data"}:
        # hierarchical-grads' last step (the node's shards gathered back). The default rule table
        # splits parameters over fsdp, never over data alone, so no weight gather looks like this;
        # under a table that splits weights over data this would count their gathers too.
        return True
    return collective["kind"] in GRAD_SYNC_KINDS and bool(axes) and axes <= BATCH_AXES


def _mean_device_flops(text: str, work) -> float:
    """Matmul FLOPs of the average device: the step is priced on the busiest one (it sets the
    pace), but pair loops run as long as, and fused attention calls do as much as, each device's
    own rows need, so what the cluster executes is the average. Linear in the trips: each loop's
    body is measured one trip at a time; fused calls take the average device's FLOPs."""
    from xlaopt.analysis.schedule import build_schedule

    none = {tag: 0 for tag in work.loop_trips}
    flops = lambda trips: build_schedule(text, trips, custom_call_flops=work.mean_custom_call_flops).flops
    base = flops(none)
    return base + sum(mean * (flops(dict(none, **{tag: 1})) - base) for tag, mean in work.mean_loop_trips.items())


def _fp8_note(result: dict) -> str:
    if result.get("matmuls") != "fp8":
        return ""
    return f", fp8 matmuls ({result['fp8_gemms']} fp8 GEMMs in the HLO)" if result["target"] == "gpu" else ", fp8 matmuls"


def format_analysis(result: dict) -> str:
    gib = lambda b: f"{b / 2**30:,.2f} GiB"
    ms = lambda s: f"{s * 1e3:,.2f} ms"
    mem = result["memory_per_device_bytes"]
    mesh = ",".join(f"{a}={s}" for a, s in result["mesh"].items() if s > 1) or "single-device"
    b = result["batch"]
    lines = [
        f"{result['model']} on {mesh} ({result['devices']} devices), topology {result['topology']} "
        f"({result['device']}), target {result['target']}; batch {b['batch_size']} x "
        f"({b['text_len']} text + {b['gen_len']} gen) tokens, {result['compute_dtype']}"
        f"{_fp8_note(result)}",
        f"step time {ms(result['step_time_s'])}   MFU {result['mfu'] * 100:.2f}%   "
        f"compute {ms(result['compute_s'])}   comm {ms(result['comm_s'])}   exposed comm {ms(result['exposed_comm_s'])}"
        f"   exposed grad sync {ms(result['exposed_grad_sync_s'])}",
        f"compute stream idle {result['compute_idle_fraction'] * 100:.1f}%   comm stream idle "
        f"{result['comm_idle_fraction'] * 100:.1f}%   bounds: serial {ms(result['bounds']['serial_s'])}, "
        f"perfect overlap {ms(result['bounds']['perfect_overlap_s'])}",
        f"memory per device: arguments {gib(mem['arguments'])}, temp {gib(mem['temp'])}, outputs "
        f"{gib(mem['outputs'])} ({gib(mem['aliased'])} aliased), peak ~{gib(mem['peak_estimate'])}"
        + (f" of {gib(result['hbm_bytes'])} HBM" + ("" if result["fits_hbm"] else "  DOES NOT FIT")
           if result["hbm_bytes"] else ""),
        f"model FLOPs/step {result['model_flops_per_step']:.3e}; HLO matmul FLOPs/step "
        f"{result['hlo_matmul_flops_per_step']:.3e} (includes recomputation): "
        f"{_ratio(result['hlo_flops_over_model_flops'])} the model's",
        f"data: {result['data']}; fill {result['fill'] * 100:.1f}% of the slots; attention "
        f"{_attention_used(result)}: (query, key) pairs executed / needed "
        f"{_ratio(result['attention_pairs_executed_over_needed'])}",
    ]
    if result.get("pipeline"):
        p = result["pipeline"]
        rounds = f" x {p['virtual_stages']} virtual stages" if p.get("virtual_stages", 1) > 1 else ""
        lines.append(f"pipeline: {p['schedule']}, {p['stages']} stages{rounds} x {p['microbatches']} micro-batches: "
                     f"{p['ticks']} ticks, the bubble {p['bubble_fraction'] * 100:.1f}% of each device's time; "
                     f"a stage holds at most {p['saved_ticks']} ticks' activations for the backward"
                     + (f"; as priced a tick (forward and backward) {p['tick_s'] * 1e3:,.1f} ms, the bubble "
                        f"{p['bubble_s'] * 1e3:,.1f} ms ({p['bubble_fraction_of_step'] * 100:.1f}% of the step)"
                        if "tick_s" in p else ""))
    lines.append(f"{'mesh axes':<16}{'bytes/step':>14}{'comm':>14}{'exposed':>14}")
    for axes, c in sorted(result["comm_by_axis"].items(), key=lambda kv: -kv[1]["time_s"]):
        lines.append(f"{axes:<16}{gib(c['bytes']):>14}{ms(c['time_s']):>14}{ms(c['exposed_s']):>14}")
    lines.append(f"top collectives ({len(result['collectives'])} instructions):")
    lines.append(f"  {'name':<24}{'kind':<24}{'axes':<10}{'link':<10}{'runs':>6}{'comm':>13}{'exposed':>13}"
                 f"{'overlapped':>13}")
    for c in result["collectives"][:10]:
        lines.append(f"  {c['name'][:23]:<24}{c['kind'] + (' (async)' if c['is_async'] else ''):<24}"
                     f"{c['mesh_axes']:<10}{c['link_level']:<10}{c['executions']:>6}{ms(c['time_s']):>13}"
                     f"{ms(c['exposed_s']):>13}{ms(c['overlapped_compute_s']):>13}")
    t = result["timings_s"]
    lines.append(f"lower {t['lower']:.1f}s, compile {t['compile']:.1f}s, simulate {t['simulate']:.1f}s"
                 + (f"; trace written to {result['trace']}" if result.get("trace") else ""))
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def _attention_used(result: dict) -> str:
    a = result["attention"]
    if a["impl"] == a["target_default"]:
        return f"{a['impl']} (the {result['target']} target's default)"
    return f"{a['impl']} (not the {result['target']} target's default, {a['target_default']})"


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}x"


def analysis_batch_size(mesh, default: int, requested: int | None) -> int:
    """The family's default batch grown to a multiple of the batch-sharding ways (data x fsdp),
    so any mesh can be analysed; an explicit --batch-size is taken as given."""
    if requested is not None:
        return requested
    ways = mesh.size("data") * mesh.size("fsdp")
    return math.ceil(default / ways) * ways
