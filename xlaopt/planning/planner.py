"""Rank the candidate layouts for a model on a topology: drop those that cannot be built or do
not fit, price the rest analytically (microseconds each), then compile the best few and price
them from XLA's own schedule (`xlaopt.analysis.analyze`: deviceless GPU compile when the
`gpu-aot` extra is installed, else simulated CPU devices up to 512), and return the ranking with
every loser's reason. `exhaustive` compiles every candidate that fits (for testing the ranking).
The baseline is pure FSDP over every device, the common default, priced the same way.
"""
from __future__ import annotations

import dataclasses
import math
import time

from xlaopt.analysis.attention_work import needed_pairs
from xlaopt.analysis.costmodel import efficiency_for
from xlaopt.analysis.priced_batch import PricedBatch
from xlaopt.analysis.topology import Topology, preset
from xlaopt.errors import UserError
from xlaopt.families import family_of
from xlaopt.layout import Layout
from xlaopt.mesh import MAX_SIMULATED_DEVICES, MeshSpec
from xlaopt.planning.price import AnalyticPrice, price
from xlaopt.planning.residuals import saved_bytes_per_token_layer
from xlaopt.planning.shapes import analytic_shape
from xlaopt.planning.space import (
    PRECISIONS,
    REMATS,
    Candidate,
    Rejected,
    check_precisions,
    enumerate_space,
    pipeline_stages,
)
from xlaopt.program import TrainProgram
from xlaopt.sharding import with_sequence_parallel


@dataclasses.dataclass(eq=False)  # compared by identity: a candidate's price is one object the plan updates
class Priced:
    candidate: Candidate
    analytic: AnalyticPrice
    compiled: dict | None = None  # the `analyze` result, when compiled
    reason: str = ""

    @property
    def method(self) -> str:
        return "compiled" if self.compiled is not None else "analytic"

    @property
    def step_time_s(self) -> float:
        return self.compiled["step_time_s"] if self.compiled is not None else self.analytic.step_time_s

    @property
    def memory_bytes(self) -> float:
        if self.compiled is not None:
            return float(self.compiled["memory_per_device_bytes"]["peak_estimate"])
        return self.analytic.memory_bytes


@dataclasses.dataclass
class Plan:
    program: TrainProgram  # the base program: model, batch, execution, target
    topology: Topology
    method: str  # how the best few were priced: "compiled (gpu target)", "compiled (cpu target)" or "analytic"
    ranked: list[Priced]  # buildable and fitting, best first
    unfit: list[Priced]  # buildable, but over the device memory
    rejected: list[Rejected]  # cannot be built
    baseline: Priced | None  # None where pure FSDP cannot split the batch
    model_flops: float
    seconds: float
    memory_model: str = "traced"  # what the layers save for backward: traced from the program, or the formula (why)

    @property
    def best(self) -> Priced:
        return self.ranked[0]

    def program_for(self, candidate: Candidate) -> TrainProgram:
        return candidate_program(self.program, candidate)

    def layout_for(self, candidate: Candidate) -> Layout:
        p = self.program_for(candidate)
        return Layout(p.mesh, p.rules, p.settings.batch, p.execution, p.model.name, self.topology.name)

    def mfu(self, priced: Priced) -> float:
        from xlaopt.analysis.simulate import mfu

        return mfu(self.model_flops, priced.step_time_s, self.topology, priced.candidate.num_devices,
                   priced.candidate.compute_dtype)


def candidate_program(base: TrainProgram, c: Candidate) -> TrainProgram:
    execution = dataclasses.replace(base.execution, remat=c.remat, micro_batches=c.micro_batches,
                                    compute_dtype=c.compute_dtype, matmuls=c.matmuls,
                                    sharded_optimizer=c.sharded_optimizer)
    if c.pp > 1:  # the micro-batches are the pipeline's, run in one accumulation step
        execution = dataclasses.replace(execution, layer_stack="pipeline", micro_batches=1,
                                        pipeline_microbatches=c.micro_batches, pipeline_weights_once=c.weights_once,
                                        pipeline_virtual_stages=c.virtual_stages, pipeline_schedule=c.schedule)
    rules = with_sequence_parallel(base.rules) if c.sequence_parallel else base.rules
    return base.replace(mesh=c.mesh, rules=rules, execution=execution, shardings=None)


def compile_method(target: str, num_devices: int) -> str | None:
    """What compiles candidates for `target` on this machine, or None (analytic only)."""
    if target == "gpu":
        from xlaopt.analysis import gpu_aot

        return "compiled (gpu target)" if gpu_aot.available() else None
    import jax

    if num_devices <= min(MAX_SIMULATED_DEVICES, len(jax.devices("cpu"))):
        return "compiled (cpu target)"
    return None


def plan(program: TrainProgram, topology: Topology, batch: PricedBatch, top: int = 2, exhaustive: bool = False,
         precisions: tuple[str, ...] | None = None, on_compile=None,
         sequence_parallel: tuple[bool, ...] = (False, True), remats: tuple[str, ...] = REMATS,
         prepare=None, stages: tuple[int, ...] | None = None) -> Plan:
    """The plan (see the module docstring). `stages`: the pipeline stage counts tried (default
    `pipeline_stages`: whole nodes per stage). `prepare(program, topology)` readies a candidate's
    program for its compile: by default the layout applied (`laid_out`); `xlaopt plan` gives the
    pipeline's passes that follow the planner (`xlaopt.pipeline.after_planning`), so a candidate
    is priced as `xlaopt analyze` prices the planned layout."""
    t0 = time.perf_counter()
    from xlaopt.analysis.attention_work import batch_work

    precisions = _precisions_for(topology, precisions)
    asked_stages, stages = stages, _stages_for(topology, stages)
    work = batch_work(program.replace(mesh=MeshSpec()), batch.arrays)  # the batch's work, not a layout's
    shape = _shape(program, work, batch)
    space, rejected = enumerate_space(program.model, program.settings.batch, topology.num_devices,
                                      topology.devices_per_node, program.execution.attention, precisions,
                                      sequence_parallel, remats, stages, program.target)
    if not space:
        raise UserError(_no_split_message(program, topology, rejected))
    dense = program.execution.attention == "dense"
    hbm = topology.device.hbm_bytes
    eff = efficiency_for(topology)
    traced, memory_model = _traced_residuals(program, {(c.compute_dtype, c.matmuls) for c in space})
    priced = [Priced(c, price(c, shape, program.settings.batch, topology, program.target, dense, eff,
                              traced[c.compute_dtype, c.matmuls])) for c in space]
    fits = [p for p in priced if hbm <= 0 or p.analytic.memory_bytes <= hbm]
    unfit = [p for p in priced if not (hbm <= 0 or p.analytic.memory_bytes <= hbm)]
    for p in unfit:
        p.reason = f"needs {p.analytic.memory_bytes / 2**30:,.1f} GiB per device of {hbm / 2**30:,.1f} (analytic)"
    if not fits:
        # Larger topologies are searched over the same space (remats, split of the residual
        # stream, stages), so the one the message names is one this plan would find a fit on.
        raise UserError(_no_fit_message(program, topology, unfit, shape, dense, traced.get(("bfloat16", "compute")),
                                        dict(sequence_parallel=sequence_parallel, remats=remats), asked_stages))
    fits.sort(key=_rank_key)

    method = compile_method(program.target, topology.num_devices) if top > 0 or exhaustive else None
    baseline = None
    if method is not None:
        compile_one = lambda p: _compile(p, program, topology, batch, on_compile, prepare or laid_out)  # noqa: E731
        chosen = _compile_best(fits, top, exhaustive, hbm, compile_one)
        baseline = _compiled_baseline(priced, topology, chosen, compile_one)
        if baseline is not None and baseline in fits and baseline not in chosen:
            chosen.append(baseline)  # compiled anyway, so ranked by its compiled price
        replicated = _compiled_data_parallel(fits, chosen, hbm, compile_one)
        if replicated is not None:
            chosen.append(replicated)
        # The compiled few rank first, by their compiled price; the rest follow by the analytic one.
        tried = [p for p in fits if p.reason]  # compiled over memory, refused, or skipped by the memory scale
        compiled_fit = sorted((p for p in chosen if not p.reason), key=_rank_key)
        fits = compiled_fit + [p for p in fits if p not in chosen and not p.reason]
        unfit = tried + unfit
        if not compiled_fit:
            raise UserError(f"no compiled candidate fits {hbm / 2**30:,.1f} GiB per device (the analytic memory "
                            f"model was too optimistic); plan with a larger --top, or on more devices")
    else:
        method = "analytic"
        baseline = _baseline(priced, topology)
    best = fits[0]
    for p in fits[1:]:
        # Each against the best by the same method: compiled and analytic prices differ in level.
        if p.compiled is not None:
            p.reason = f"{p.step_time_s / best.step_time_s:.3f}x the best's compiled step time"
        else:
            p.reason = f"{p.analytic.step_time_s / best.analytic.step_time_s:.3f}x the best's analytic step time"
    best.reason = "best"
    return Plan(program, topology, method, fits, unfit, rejected, baseline, work.model_flops,
                time.perf_counter() - t0, memory_model)


def _precisions_for(topology: Topology, precisions: tuple[str, ...] | None) -> tuple[str, ...]:
    """The precisions asked for (checked), by default every one the device runs: fp8 only with an
    fp8 peak (Hopper on)."""
    has_fp8 = topology.device.has_fp8
    if precisions is None:
        return tuple(p for p in PRECISIONS if p != "fp8" or has_fp8)
    if "fp8" in check_precisions(precisions) and not has_fp8:
        raise UserError(f"precision fp8: {topology.device.name} has no fp8 matmuls; they run on Hopper GPUs "
                        f"(h100, h200 topologies)")
    return precisions


def _stages_for(topology: Topology, stages: tuple[int, ...] | None) -> tuple[int, ...]:
    """The pipeline stage counts asked for, each dividing the devices; by default whole nodes a stage."""
    if stages is None:
        return pipeline_stages(topology.nodes)
    bad = [s for s in stages if s < 1 or topology.num_devices % s]
    if bad:
        fits = [d for d in range(1, topology.num_devices + 1) if topology.num_devices % d == 0]
        raise UserError(f"pipeline stages {', '.join(map(str, bad))}: a stage count must divide the "
                        f"{topology.num_devices} devices of {topology.name} ({', '.join(map(str, fits))} do)")
    return tuple(stages)


def _traced_residuals(program: TrainProgram, precisions) -> tuple[dict, str]:
    """What each layer saves per token by (compute dtype, matmul format), traced from the program;
    where it cannot be traced here (cuDNN attention without JAX's CUDA plugin) the shape's
    formula, and why."""
    # float16 saves what bfloat16 saves, byte for byte (the same sizes and the same fp32 upcasts;
    # tests/test_plan.py checks it): traced once for both.
    traced_as = lambda dtype: "bfloat16" if dtype == "float16" else dtype  # noqa: E731
    try:
        traced = {}
        for dtype, matmuls in precisions:
            key = (traced_as(dtype), matmuls)
            if key not in traced:
                traced[key] = saved_bytes_per_token_layer(program, *key)
        return {(dtype, matmuls): traced[traced_as(dtype), matmuls] for dtype, matmuls in precisions}, "traced"
    except UserError as e:
        return dict.fromkeys(precisions), f"formula: the program cannot be traced here ({e})"


def _compile_best(fits: list[Priced], top: int, exhaustive: bool, hbm: float, compile_one) -> list[Priced]:
    """Compile candidates best-first, one per mesh family and remat policy (near-twins that differ
    in a split the analytic model prices alike would only compile the same error twice), until `top`
    fit, and on while a candidate left could still beat the best compiled price (its analytic
    price scaled by how far compiling its policy was off). A compiled step over memory teaches
    how far the analytic memory is off for its remat policy: later candidates whose analytic
    memory, scaled by that, is over are skipped uncompiled (with the reason). At most 3 x top
    compiles."""
    if exhaustive:
        for p in fits:
            compile_one(p)
            _check_memory(p, hbm)
        return list(fits)
    chosen, seen, scale, slower = [], set(), {}, {}
    attempts = 0
    for p in fits:
        c = p.candidate
        if attempts >= 3 * top:
            break
        if sum(not q.reason for q in chosen) >= top:
            # Past `top`, only a candidate that could still win: its analytic price, as far off as
            # compiling its remat policy showed (1 for a policy not compiled yet), under the best
            # compiled price. XLA's scheduler holds back prefetches near the memory limit, which
            # the analytic model does not see: a policy that saves more can compile slower.
            best = min(q.step_time_s for q in chosen if not q.reason)
            if p.analytic.step_time_s * slower.get(c.remat, 1.0) >= best:
                continue
        if (c.kind, c.remat) in seen:
            continue
        factor = scale.get(c.remat, 1.0)
        if hbm > 0 and p.analytic.memory_bytes * factor > hbm:
            p.reason = (f"needs ~{p.analytic.memory_bytes * factor / 2**30:,.1f} GiB per device of "
                        f"{hbm / 2**30:,.1f}: the analytic memory x{factor:.2f}, as far off as compiling "
                        f"remat={c.remat} showed")
            continue
        seen.add((c.kind, c.remat))
        attempts += 1
        compile_one(p)
        if p.compiled is not None:
            scale[c.remat] = max(scale.get(c.remat, 1.0), p.memory_bytes / p.analytic.memory_bytes)
            slower[c.remat] = min(slower.get(c.remat, math.inf), p.step_time_s / p.analytic.step_time_s)
        _check_memory(p, hbm)
        chosen.append(p)
    for p in fits:  # what the compiles showed applies to the candidates left uncompiled too
        factor = scale.get(p.candidate.remat, 1.0)
        if p.compiled is None and not p.reason and hbm > 0 and p.analytic.memory_bytes * factor > hbm:
            p.reason = (f"needs ~{p.analytic.memory_bytes * factor / 2**30:,.1f} GiB per device of "
                        f"{hbm / 2**30:,.1f}: the analytic memory x{factor:.2f}, as far off as compiling "
                        f"remat={p.candidate.remat} showed")
    return chosen


def _compiled_data_parallel(fits: list[Priced], chosen: list[Priced], hbm: float, compile_one) -> Priced | None:
    """The best pure data-parallel candidate, compiled, where its replicated state fits and none
    was compiled yet: a model small enough for it (a CNN, a ViT) is commonly run so, and the
    analytic model prices its one all-reduce and FSDP's per-layer gathers alike when both hide
    behind compute, which only the compiled schedule tells apart. Big models never fit it."""
    if any(p.candidate.kind == "DP" for p in chosen):
        return None
    p = next((p for p in fits if p.candidate.kind == "DP" and not p.reason), None)
    if p is None:
        return None
    compile_one(p)
    _check_memory(p, hbm)
    return p


def _check_memory(p: Priced, hbm: float) -> None:
    if p.compiled is not None and hbm > 0 and p.memory_bytes > hbm:
        p.reason = (f"compiled, needs {p.memory_bytes / 2**30:,.1f} GiB per device of {hbm / 2**30:,.1f} "
                    f"(analytic said {p.analytic.memory_bytes / 2**30:,.1f})")


def _compiled_baseline(priced: list[Priced], topology: Topology, chosen: list[Priced], compile_one) -> Priced | None:
    """The baseline, compiled: the first of `_baseline_options` whose compiled step fits."""
    hbm = topology.device.hbm_bytes
    options = _baseline_options(priced, topology)
    for p in options:
        if p.compiled is None and not p.reason:
            compile_one(p)
            _check_memory(p, hbm)
        if p.compiled is not None and not p.reason:
            return p
    return options[-1] if options else None


BASELINE_REMATS = ("none", "dots", "full")


def _rank_key(p: Priced):
    """Compiled prices among the compiled few; analytic ones for the rest."""
    c = p.candidate
    # Ties (fp16 prices as bf16) go to bf16, then to fewer micro-batches and less recomputation.
    return (p.step_time_s, c.precision != "bfloat16", c.micro_batches, REMATS.index(c.remat), c.sharded_optimizer)


def _shape(program: TrainProgram, work, batch: PricedBatch):
    if not family_of(program.model).generates_video:
        return analytic_shape(program.model)
    pairs = work.pairs_executed if work.pairs_executed is not None else work.pairs_needed
    text = float((batch.arrays["text_segment_ids_BT"] > 0).sum())
    gen = float((batch.arrays["gen_segment_ids_BV"] > 0).sum())
    trainable, text_attention = program.settings.trainable, 0.0
    if trainable != "all":  # the reasoner's own attention comes first (`cosmos3.attention_calls`): its share
        per_call = [float(needed_pairs(q, k).sum()) for q, k in family_of(program.model).attention_calls(batch.arrays)]
        text_attention = per_call[0] / max(sum(per_call), 1.0)
    return analytic_shape(program.model, pairs / program.settings.batch.batch_size, text / max(text + gen, 1.0),
                          trainable, text_attention)


def _baseline_options(priced: list[Priced], topology: Topology) -> list[Priced]:
    """Pure FSDP over every device in bf16, as it is commonly run: the least recomputation of
    none, dots and full (not a named policy), then the fewest micro-batches (gradient accumulation
    to fit), those the analytic memory lets fit first (none where, e.g., fewer rows than devices
    cannot split)."""
    n, hbm = topology.num_devices, topology.device.hbm_bytes
    options = [p for p in priced if (p.candidate.dp, p.candidate.tp, p.candidate.cp) == (1, 1, 1)
               and p.candidate.fsdp == n and p.candidate.precision == "bfloat16"
               and p.candidate.remat in BASELINE_REMATS]
    options.sort(key=lambda p: (hbm > 0 and p.analytic.memory_bytes > hbm, REMATS.index(p.candidate.remat),
                                p.candidate.micro_batches))
    return options


def _baseline(priced: list[Priced], topology: Topology) -> Priced | None:
    """The baseline priced analytically: the first of `_baseline_options`."""
    options = _baseline_options(priced, topology)
    return options[0] if options else None


def laid_out(program: TrainProgram, topology: Topology) -> TrainProgram:
    """A candidate's program with its layout applied and nothing else (`plan`'s default `prepare`)."""
    from xlaopt.context import PassContext
    from xlaopt.passes.mesh_layout import MeshLayout

    return MeshLayout().run(program, PassContext.for_program(program, topology)).program


def _compile(p: Priced, base: TrainProgram, topology: Topology, batch: PricedBatch, on_compile, prepare) -> None:
    """Compile and price a candidate after `prepare(program, topology)`."""
    from xlaopt.analysis.analyze import analyze

    program = prepare(candidate_program(base, p.candidate), topology)
    try:
        p.compiled = analyze(program, topology, program.target, batch=batch)
    except Exception as e:  # noqa: BLE001 - a compiler's refusal is a ranking fact, not the planner's failure
        if isinstance(e, UserError):
            raise
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        p.reason = f"does not compile for the {program.target} target: {first[:200]}"
    if on_compile is not None:
        on_compile(p)


def _no_split_message(program: TrainProgram, topology: Topology, rejected: list[Rejected]) -> str:
    b = program.settings.batch
    reasons = sorted({r.reason for r in rejected})
    nearest = nearest_working(b.batch_size, lambda rows: enumerate_space(
        program.model, dataclasses.replace(b, batch_size=rows), topology.num_devices, topology.devices_per_node,
        program.execution.attention, ("bfloat16",))[0])
    return (f"no layout of {program.model.name} splits a global batch of {b.batch_size} rows of "
            f"{b.text_len + b.gen_len} tokens over {topology.num_devices} devices ({topology.name}): "
            f"{'; '.join(reasons[:3])}; the nearest global batch that works is {nearest} rows")


def nearest_working(value: int, works) -> int | None:
    """The positive integer nearest `value` (below first at equal distance) for which `works` holds."""
    for delta in range(0, 4 * value + 1):
        for v in (value - delta, value + delta):
            if v >= 1 and works(v):
                return v
    return None


def _no_fit_message(program: TrainProgram, topology: Topology, unfit: list[Priced], shape, dense: bool,
                    traced: dict[str, float] | None, space_options: dict | None = None,
                    stages: tuple[int, ...] | None = None) -> str:
    least = min(unfit, key=lambda p: p.analytic.memory_bytes)
    hbm = topology.device.hbm_bytes
    name = topology.name.split(":")[0]
    rows_per_device = max(1, program.settings.batch.batch_size // topology.num_devices)
    smallest = None
    nodes = topology.nodes
    while smallest is None and nodes < 65536:
        nodes *= 2
        bigger = preset(name, nodes, topology.devices_per_node) if name in _preset_names() else None
        if bigger is None:
            break
        b = dataclasses.replace(program.settings.batch, batch_size=rows_per_device * bigger.num_devices)
        space, _ = enumerate_space(program.model, b, bigger.num_devices, bigger.devices_per_node,
                                   program.execution.attention, ("bfloat16",), **(space_options or {}),
                                   stages=_stages_for(bigger, stages), target=program.target)
        if any(price(c, shape, b, bigger, program.target, dense, efficiency_for(bigger), traced).memory_bytes <= hbm
               for c in space):
            smallest = bigger.name
    where = (f"the smallest {name} topology where a layout fits is {smallest} (at {rows_per_device} rows per "
             f"device)" if smallest else f"no {name} topology up to {nodes} nodes fits it")
    return (f"{program.model.name} does not fit on {topology.name} with any layout: the least memory is "
            f"{least.analytic.memory_bytes / 2**30:,.1f} GiB per device ({least.candidate}) of "
            f"{hbm / 2**30:,.1f}; {where}")


def _preset_names() -> tuple[str, ...]:
    from xlaopt.analysis.topology import PRESETS

    return tuple(p for p in PRESETS if p != "cpu")
