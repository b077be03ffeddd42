"""From a command's request to its program: the layout, the batch, the devices, the pipeline.

Imported by the commands' `run` functions only: it imports JAX (not its backends, whose device
count the commands set first)."""
from __future__ import annotations

import dataclasses

from xlaopt.analysis.topology import parse_topology
from xlaopt.build import BatchRequest, build_program, choose_layout, default_execution
from xlaopt.cli.requests import GlobalBatch, ProgramRequest, RowSource
from xlaopt.context import PassContext
from xlaopt.data.batch import BatchShape
from xlaopt.data.loader import split_budget
from xlaopt.data.mixes import get_mix
from xlaopt.errors import UserError
from xlaopt.execution import parse_execution
from xlaopt.families import family_of
from xlaopt.layout import Layout
from xlaopt.mesh import make_mesh, request_cpu_devices
from xlaopt.models.registry import get_config, parse_overrides
from xlaopt.pipeline import parse_pass_options, pipeline, run_pipeline, select_passes
from xlaopt.runtime import distributed
from xlaopt.runtime.faults import peer_timeout_s
from xlaopt.transforms.compiler_options import CompilerOptions


def config_of(model: str, overrides: tuple[str, ...]):
    return get_config(model, parse_overrides(model, overrides))


def given_batch(request: ProgramRequest) -> BatchRequest:
    return BatchRequest(request.batch_size, request.text_len, request.gen_len)


def global_batch(given: BatchRequest, flags: GlobalBatch, config, mix: str | None = None) -> BatchRequest:
    """`--global-batch` and `--seq` as the batch-size and row-length fields they stand for."""
    batch_size, text_len, gen_len = given.batch_size, given.text_len, given.gen_len
    if flags.global_batch is not None:
        if batch_size is not None and batch_size != flags.global_batch:
            raise UserError(f"--global-batch {flags.global_batch} and --batch-size {batch_size} disagree; "
                            f"they are the same setting, pass one")
        batch_size = flags.global_batch
    if flags.seq is None:
        return BatchRequest(batch_size, text_len, gen_len)
    if flags.seq < 2:
        raise UserError(f"--seq {flags.seq}: a row needs at least 2 tokens")
    if not family_of(config).generates_video:
        if text_len is not None or gen_len is not None:
            raise UserError(f"--seq is {config.name}'s sequence length; drop --text-len/--gen-len")
        return BatchRequest(batch_size, flags.seq, 0)
    if text_len is not None or gen_len is not None:
        raise UserError("--seq splits a row between text and generator tokens itself; give --seq or "
                        "--text-len/--gen-len, not both")
    if mix is not None:
        text, gen = get_mix(mix).row
    else:
        default = family_of(config).default_batch(config)
        text, gen = default.text_len, default.gen_len
    return BatchRequest(batch_size, *split_budget(flags.seq, text, gen))


def layout_of(request: ProgramRequest) -> Layout:
    return choose_layout(request.mesh, request.layout, request.model, request.sequence_parallel)


def compute_dtype(request: ProgramRequest, layout: Layout) -> str:
    """--dtype, else the layout file's, else the command's default."""
    if request.dtype is not None:
        return request.dtype
    return layout.execution.compute_dtype if layout.execution is not None else request.default_dtype


def program(request: ProgramRequest, config, layout: Layout, batch: BatchShape, *, target: str = "cpu",
            learning_rate: float | None = None, nonfinite: str | None = None):
    """The program of the model, layout and batch, with the request's settings."""
    base = dataclasses.replace(default_execution(layout, target, config), compute_dtype=compute_dtype(request, layout))
    return build_program(config, layout, batch, parse_execution(request.execution_settings, base),
                         seed=request.seed, learning_rate=learning_rate, nonfinite=nonfinite, target=target,
                         trainable=request.trainable,
                         compiler_options=CompilerOptions.parse(request.xla_options))


@dataclasses.dataclass(frozen=True)
class Job:
    """A multi-process jax.distributed job this process joins (`train` only)."""
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    peer_timeout: float | None = None


def program_on_devices(request: ProgramRequest, rows: RowSource | None = None, job: Job | None = None, **settings):
    """(the program the request describes, the store it trains on or None), with the simulated
    devices its mesh needs; `settings` as `program`'s."""
    rows, job = rows or RowSource(), job or Job()
    layout = layout_of(request)
    mesh = layout.mesh
    config = config_of(request.model, request.overrides)
    if distributed.check_args(job.coordinator, job.num_processes, job.process_id):
        request_cpu_devices(distributed.local_device_count(mesh.num_devices, job.num_processes))
        distributed.initialize(job.coordinator, job.num_processes, job.process_id, peer_timeout_s(job.peer_timeout))
    else:
        request_cpu_devices(mesh.num_devices)
    make_mesh(mesh)  # enough devices? say so before any compilation or data making
    given = given_batch(request).over(layout.batch)
    data, default = _rows(request, rows, config, given)
    return program(request, config, layout, given.shape(default), **settings), data


def _rows(request: ProgramRequest, rows: RowSource, config, given: BatchRequest) -> tuple[str | None, BatchShape]:
    """(the store the rows come from or None, the default batch shape they fit)."""
    default = family_of(config).default_batch(config)
    if rows.mix is not None:
        return _mix_rows(request, rows, config, given, default)
    data = rows.data
    if data is None and family_of(config).packs_samples:
        from xlaopt.data.synthetic_store import default_store  # makes a store: only when one is used

        data = str(default_store(config))
    if data is None or data == "memory":
        return None, default
    if not family_of(config).packs_samples:
        raise UserError(f"--data: sample stores hold Cosmos 3 samples; {request.model} trains on synthetic text")
    from xlaopt.data.store import SampleStore

    # A row's budget split in the ratio of the store's mean text and generator lengths.
    stats = SampleStore(data).manifest["stats"]
    text, gen = split_budget(default.text_len + default.gen_len, stats["text_tokens"]["mean"],
                             stats["gen_tokens"]["mean"])
    return data, BatchShape(default.batch_size, text, gen)


def _mix_rows(request, rows: RowSource, config, given: BatchRequest, default: BatchShape):
    """`train --mix`: the mix's store (made once, in the cache) and the batch shape, whose row
    budget (given, else the one the mix is weighted for) is checked against the mix first."""
    from xlaopt.data.synthetic_store import mix_store

    if rows.data is not None:
        raise UserError(f"--mix {rows.mix} and --data {rows.data} both given; a mix makes its own store, pass one "
                        f"or the other")
    if not family_of(config).packs_samples:
        raise UserError(f"--mix: mixes hold Cosmos 3 samples; {request.model} trains on synthetic text")
    mix = get_mix(rows.mix)
    row = given.over(BatchShape(default.batch_size, *mix.row))
    mix.check_row(row.text_len, row.gen_len, rows.skip_oversize)
    return str(mix_store(config, mix)), BatchShape(default.batch_size, row.text_len, row.gen_len)


def apply_pipeline(request: ProgramRequest, program, dump_dir: str | None, topology=None):
    """(the program after the pipeline the request selects, a record per pass)."""
    names = lambda text: [n.strip() for n in text.split(",") if n.strip()]  # noqa: E731
    only = names(request.passes) if request.passes is not None else None
    passes = select_passes(pipeline(parse_pass_options(request.pass_options)), only, names(request.disable))
    program, records = run_pipeline(program, passes, dump_dir, PassContext.for_program(program, topology, only or ()))
    return program, [{"name": r.name, "changed": r.changed, "report": r.report, "dumped": list(r.dumped)}
                     for r in records]


def cluster(request: ProgramRequest, program):
    """The optional --topology, checked against the program's mesh."""
    if not request.topology:
        return None
    topology = parse_topology(request.topology)
    if program.mesh.num_devices > topology.num_devices:
        raise UserError(f"mesh {program.mesh} needs {program.mesh.num_devices} devices; topology "
                        f"{topology.name} has {topology.num_devices}")
    return topology
