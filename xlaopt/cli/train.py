"""`xlaopt train`: train a model on a (simulated) device mesh, alone or as one process of a job."""
from __future__ import annotations

import argparse
import dataclasses
import math

from xlaopt.cli import flags
from xlaopt.cli.requests import ProgramRequest, RowSource, request_of, write_json
from xlaopt.errors import UserError


@dataclasses.dataclass(frozen=True)
class TrainRequest:
    program: ProgramRequest
    rows: RowSource
    steps: int
    ckpt: str | None
    ckpt_every: str | None
    keep: int
    keep_every: int | None
    resume: bool
    local_ckpt: str | None
    local_every: str | None
    mtbf: str
    local_peers: int | None
    no_progress: bool
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    processes: int | None
    restarts: int
    peer_timeout: float | None
    on_nonfinite: str
    learning_rate: float | None
    argv: tuple[str, ...]  # the command line, for `--processes` to start its processes with
    started: float  # when this process started (time to first step)


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model on synthetic data on a (simulated) device mesh")
    flags.program_args(p, "bfloat16")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--data", default=None, metavar="DIR|memory",
                   help="a sample store (`xlaopt data make DIR`) for Cosmos 3 models; default: a synthetic "
                        "store made on first use under $XLAOPT_CACHE (~/.cache/xlaopt); `memory`: the "
                        "in-memory synthetic stream. Decoder models train on the in-memory text stream")
    p.add_argument("--mix", default=None, metavar="NAME",
                   help="train on a store of this named sample mix of real shapes (xlaopt.data.mixes: cosmos3-480p, "
                        "cosmos3-mid, cosmos3-720p), made on first use under $XLAOPT_CACHE; rows default to the (text, generator) "
                        "budget the mix is weighted for. Not with --data")
    p.add_argument("--skip-oversize", action="store_true",
                   help="skip stored samples longer than a row (counted in the loader state and the summary) "
                        "instead of stopping with an error")
    p.add_argument("--ckpt", default=None, metavar="DIR", help="save checkpoints (state and data position) here")
    p.add_argument("--ckpt-every", default=None, metavar="K|auto",
                   help="save every K steps (default: only after the last step); `auto`: planned in the run from "
                        "its first save's cost and --mtbf (Daly's interval, for both tiers with --local-ckpt)")
    p.add_argument("--mtbf", default="llama3", metavar="HOURS|llama3",
                   help="for --ckpt-every auto: the mean time between failures per device, in hours, or `llama3` "
                        "(Llama 3 405B's published rate, about 50,700 h a GPU; the default)")
    p.add_argument("--keep", type=int, default=3, metavar="N", help="keep the newest N checkpoints (default 3)")
    p.add_argument("--keep-every", type=int, default=None, metavar="K",
                   help="also keep every checkpoint whose step is a multiple of K")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --ckpt DIR, or start fresh when there is none")
    p.add_argument("--local-ckpt", default=None, metavar="DIR",
                   help="also keep a local checkpoint tier: each process saves its own shards under DIR on its node's "
                        "own disk (e.g. /dev/shm/JOB), copied to --local-peers other processes; a restore takes the "
                        "newest step over both tiers (needs --ckpt for the persistent tier)")
    p.add_argument("--local-every", default=None, metavar="K|auto",
                   help="save to the local tier every K steps, or `auto` (default: 10 with --local-ckpt; auto when "
                        "--ckpt-every is)")
    p.add_argument("--local-peers", type=int, default=None, metavar="P",
                   help="how many other processes keep a copy of each process's local shards (default: 1 in a "
                        "multi-process job, 0 alone)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="join a multi-process jax.distributed job (process 0's address; with --num-processes "
                        "and --process-id). Each process brings mesh devices / N devices and reads its own rows")
    p.add_argument("--num-processes", type=int, default=None, metavar="N")
    p.add_argument("--process-id", type=int, default=None, metavar="I")
    p.add_argument("--processes", type=int, default=None, metavar="N",
                   help="run as a local job of N processes (a free loopback port for the coordinator, mesh "
                        "devices / N each), supervised and reported as one")
    p.add_argument("--restarts", type=int, default=0, metavar="K",
                   help="with --processes and --ckpt: after a failure (a process killed or lost, a crash), start "
                        "every process again with --resume, up to K times; the processes are forked from one that "
                        "imported JAX once, so a restart starts in a fraction of a cold start")
    p.add_argument("--peer-timeout", type=float, default=None, metavar="S",
                   help="in a multi-process job, stop with an error naming the culprit once no step has finished "
                        "for S seconds (a dead, stopped or stuck process; default 60)")
    p.add_argument("--on-nonfinite", default="stop", choices=("stop", "skip"),
                   help="a step whose loss, gradients or updated state are not all finite: stop the run before "
                        "saving that state (what is committed stays finite; default), or skip such steps' updates "
                        "and count them")
    p.add_argument("--learning-rate", type=float, default=None, metavar="LR",
                   help="peak AdamW learning rate (default: xlaopt.program.TrainSettings')")
    p.add_argument("--topology", default=None, help=flags.CLUSTER_HELP)


def main(args: argparse.Namespace) -> int:
    return run(request_of(TrainRequest, args, program=ProgramRequest.of(args),
                          rows=RowSource(args.data, args.mix, args.skip_oversize)))


def _refuse_fp8(program: ProgramRequest) -> None:
    """fp8 matmuls are a GPU setting: refused before any work, not emulated for a whole run."""
    from xlaopt.cli.programs import layout_of
    from xlaopt.execution import parse_execution

    if parse_execution(program.execution_settings, layout_of(program).execution).matmuls == "fp8":
        raise UserError("matmuls=fp8: fp8 matmuls run on Hopper GPUs (price them with analyze or plan --target gpu on "
                        "an h100 or h200 topology; verify checks them on the CPU); train here with matmuls=compute")


def _interval(flag: str, given: str | None) -> int | str | None:
    """A checkpoint interval flag's value: a positive step count, `auto`, or None (not given)."""
    if given is None or given == "auto":
        return given
    try:
        steps = int(given)
    except ValueError:
        raise UserError(f"{flag} {given!r}: give a number of steps or `auto`") from None
    if steps < 1:
        raise UserError(f"{flag} {steps}: must be a positive number of steps")
    return steps


def _local_tier(request: TrainRequest, processes: int, auto: bool) -> tuple[str | None, int | str | None, int]:
    """(directory, interval, peers) of the local checkpoint tier, checked before any work."""
    from xlaopt.io import node_local

    if request.local_ckpt is None:
        if request.local_every is not None or request.local_peers is not None:
            raise UserError("--local-every and --local-peers need --local-ckpt DIR")
        return None, None, 0
    if request.ckpt is None:
        raise UserError("--local-ckpt needs --ckpt DIR: the local tier backs a persistent one, which serves a "
                        "restart the local tier cannot (a lost node with its peer, another layout)")
    every = _interval("--local-every", request.local_every) or ("auto" if auto else 10)
    peers = (1 if processes > 1 else 0) if request.local_peers is None else request.local_peers
    node_local.check_peers(peers, processes)
    node_local.check_local(request.local_ckpt, request.ckpt)
    return request.local_ckpt, every, peers


def run(request: TrainRequest) -> int:
    if request.steps < 1:
        raise UserError(f"--steps {request.steps}: need at least 1 step")
    rate = request.learning_rate
    if rate is not None and not (math.isfinite(rate) and rate >= 0):
        raise UserError(f"--learning-rate {rate:g}: need a finite rate >= 0")
    every = _interval("--ckpt-every", request.ckpt_every)
    if request.ckpt is None and (request.resume or every is not None):
        raise UserError("--resume and --ckpt-every need --ckpt DIR")
    from xlaopt.goodput.failures import failure_model

    failures = failure_model(request.mtbf)
    local_tier = _local_tier(request, request.processes or request.num_processes or 1, auto=every == "auto")
    _check_restarts(request)
    if request.processes is not None:
        return _launch(request)
    _refuse_fp8(request.program)
    # Imported here, not at the top: `xlaopt --help` and the cheap commands import no JAX.
    import jax

    from xlaopt.cli import programs
    from xlaopt.runtime.faults import peer_timeout_s
    from xlaopt.runtime.saving import CheckpointOptions
    from xlaopt.runtime.train import FaultOptions, format_summary, train

    job = programs.Job(request.coordinator, request.num_processes, request.process_id, request.peer_timeout)
    program, data = programs.program_on_devices(request.program, request.rows, job,
                                                learning_rate=rate, nonfinite=request.on_nonfinite)
    ckpt = None
    if request.ckpt is not None:
        ckpt = CheckpointOptions(request.ckpt, every, request.resume, request.keep, request.keep_every, *local_tier,
                                 failures=failures)
    program, passes = programs.apply_pipeline(request.program, program, request.program.dump_hlo,
                                              programs.cluster(request.program, program))
    lead = jax.process_index() == 0  # in a multi-process job, one process reports
    faults = FaultOptions(peer_timeout_s(request.peer_timeout), request.started)
    result = train(program, request.steps, progress=lead and not request.no_progress, data_dir=data, ckpt=ckpt,
                   skip_oversize=request.rows.skip_oversize, faults=faults)
    result["passes"] = passes
    if lead:
        print(result["message"] if not result["steps"] else format_summary(result))
        write_json(request.program.json, result)
    return 0


def _launch(request: TrainRequest) -> int:
    """`train --processes N`: checked here, then run as N local processes (one of them: in-process).
    Without JAX unless a layout file must be read: a restarted job's processes start 1.3 s sooner
    (the import of JAX and the models, measured here); each process checks the rest itself."""
    from xlaopt.cli import main
    from xlaopt.mesh import MeshSpec
    from xlaopt.runtime import launch
    from xlaopt.runtime.faults import peer_timeout_s

    if request.program.layout is None:
        devices = MeshSpec.parse(request.program.mesh).num_devices
    else:
        from xlaopt.cli import programs

        devices = programs.layout_of(request.program).mesh.num_devices
    launch.check_processes(request.processes, request.coordinator, devices)
    argv = launch.strip_option(list(request.argv[1:]), "--processes")
    argv = launch.strip_option(argv, "--restarts")
    if request.processes == 1 and not request.restarts:
        return main(["train", *argv])
    return launch.launch(argv, request.processes, peer_timeout_s(request.peer_timeout), request.restarts)


def _check_restarts(request: TrainRequest) -> None:
    if request.restarts < 0:
        raise UserError(f"--restarts {request.restarts}: give how many times a failed job may start again (0: never)")
    if request.restarts and request.processes is None:
        raise UserError("--restarts needs --processes N: the launcher restarts the processes it started (a job "
                        "joined with --coordinator is restarted by whatever started it)")
    if request.restarts and request.ckpt is None:
        raise UserError("--restarts needs --ckpt DIR: a restart resumes from the newest checkpoint, and without one "
                        "would train from the start again")
