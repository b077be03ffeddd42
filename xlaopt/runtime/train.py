"""The training loop: compile the program, stream batches, step, time, summarise."""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import math
import statistics
import sys
import time

import jax
import numpy as np

from xlaopt.analysis.hardware import mesh_peak
from xlaopt.checkpoint import CheckpointError, CheckpointManager, Retention, local_format
from xlaopt.checkpoint.local import LocalTier
from xlaopt.checkpoint.saved_model import config_differences
from xlaopt.compile import compile_program
from xlaopt.data.loader import Loader, LoaderState
from xlaopt.data.prefetch import prefetch
from xlaopt.data.store import SampleStore
from xlaopt.errors import RunFailed, UserError
from xlaopt.families import family_of
from xlaopt.program import TrainProgram
from xlaopt.runtime import distributed, goodput
from xlaopt.runtime.faults import DEFAULT_PEER_TIMEOUT_S, PeerLost, PeerWatch, StopSignal
from xlaopt.runtime.progress import ProgressBar
from xlaopt.runtime.saving import CheckpointOptions, Saves
from xlaopt.sharding import row_groups
from xlaopt.step import param_count


def _counted(program: TrainProgram, batch: dict):
    """A host batch with its real (non-padding) tokens and model FLOPs."""
    family = family_of(program.model)
    return batch, family.real_tokens(batch), family.step_flops(program, batch)


@dataclasses.dataclass(frozen=True)
class FaultOptions:
    """How the run meets faults (xlaopt.runtime.faults); a non-finite loss or state is the
    program's `TrainSettings.nonfinite`. `started`: when the process started (time.time()),
    for goodput's start-up share."""
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S
    started: float | None = None


def _run_meta(program: TrainProgram, loader) -> dict:
    # `execution` is a record of how the run executed; a resume never compares it.
    return {"model": program.model.name, "config": dataclasses.asdict(program.model),
            "seed": program.settings.seed, "batch": dataclasses.asdict(program.settings.batch),
            "trainable": program.settings.trainable, "execution": dataclasses.asdict(program.execution),
            "mesh": program.mesh.as_dict(),
            "data": loader.state().to_json() if loader is not None else None}


def _check_same_run(meta: dict, program: TrainProgram, where: str) -> None:
    """Refuse a checkpoint of another model or other data; any execution config is fine."""
    now = _run_meta(program, None)
    fields = config_differences(program.model, meta)
    if meta["model"] != now["model"] or fields:
        raise CheckpointError(f"{where} holds a checkpoint of {meta['model']} ({', '.join(fields[:8]) or 'same fields'}); "
                              f"this run trains {now['model']}. Use another --ckpt directory or the same model settings")
    for key in ("seed", "batch"):
        if meta[key] != json.loads(json.dumps(now[key])):
            raise CheckpointError(f"{where}: saved with {key} {meta[key]}, this run has {now[key]}; an exact "
                                  f"resume needs the same {key}")
    # A run may train less than the checkpoint did (fine-tuning part of an imported or trained
    # model: the moments of what it freezes are dropped), not more: the saved optimizer state
    # has no moments for parameters the checkpoint froze.
    trained = meta.get("trainable", "all")  # checkpoints from before the setting trained everything
    if trained not in ("all", now["trainable"]):
        raise CheckpointError(f"{where}: saved by a run training {trained!r} parameters, this run trains "
                              f"{now['trainable']!r}; the optimizer state is of the trained ones only. Resume with "
                              f"--trainable {trained}, or use another --ckpt directory")


def _timed(fn, *args):
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


# How long a process waits at the step loop's start for its slowest peer to restore and compile.
STEP_LOOP_BARRIER_MS = 30 * 60 * 1000


def train(program: TrainProgram, steps: int, progress: bool = True, data_dir: str | None = None,
          ckpt: CheckpointOptions | None = None, skip_oversize: bool = False,
          faults: FaultOptions = FaultOptions()) -> dict:
    """Train up to step `steps` on a sample store (`data_dir`, Cosmos 3) or on the family's
    synthetic stream; returns the run's JSON-able summary.

    Per step, `data_wait_s` is the time blocked waiting for the next host batch and
    `step_time_s` the time from having it to the loss being on the host (transfer and
    compute). Rates and MFU use steps after the first (its time includes warm-up).
    With `ckpt`, the state and the data position are saved asynchronously; a resumed run
    sees exactly the batches an uninterrupted one would. The loader and the checkpoint
    manager are closed however the run ends, a step that raises included. SIGTERM stops the
    run after a step every process agrees on, with one final save (`stopped_by`).
    """
    if program.execution.attention == "io_only":
        raise UserError("execution setting attention=io_only is a pricing stand-in that computes wrong values; "
                        "train with attention=dense or blockwise")
    watch = (PeerWatch(faults.peer_timeout_s, distributed.client(), jax.process_index(), jax.process_count())
             if jax.process_count() > 1 else None)
    with watch or contextlib.nullcontext():
        run = _Run(program, ckpt, faults, watch)
        try:
            run.setup(data_dir, skip_oversize)
            if run.start >= steps:
                run.close()
                return {"model": program.model.name, "steps": [], "resumed_from": run.start,
                        "message": f"{ckpt.directory} is at step {run.start}; nothing to do for --steps {steps}"}
            records, tokens, flops, saves = run.loop(steps, progress)
            run.close()
        except BaseException as e:
            if watch is not None:
                watch.report(f"{type(e).__name__}: {e}")
            # A save in flight waits at a barrier for the lost peer: it can never commit.
            run.close(failed=True, wait_saves=not isinstance(e, PeerLost))
            raise
        return _summary(run, data_dir, records, tokens, flops, saves)


class _Run:
    """One training run's parts: the compiled program, its data, its checkpoints, its state."""

    def __init__(self, program: TrainProgram, ckpt: CheckpointOptions | None, faults: FaultOptions,
                 watch: PeerWatch | None):
        self.program, self.ckpt, self.faults, self.watch = program, ckpt, faults, watch
        self.manager = self.loader = self.resumed = self.local = self.local_blob = self.saves = None
        self.local_restored = False
        self.meta: dict | None = None
        self.stopped_by: str | None = None
        self._closed = False
        if ckpt is not None:
            self.manager = CheckpointManager(ckpt.directory, Retention(ckpt.keep_last, ckpt.keep_every))
            self.local = LocalTier(ckpt.local, ckpt.local_peers, fresh=not ckpt.resume) if ckpt.local else None
            self.resumed = self.manager.latest() if ckpt.resume else None
            if ckpt.resume and self.local is not None:
                self._fetch_local()
            if self.resumed is not None and self.meta is None:
                self.meta = self.manager.manifest(self.resumed)["meta"]
            if self.meta is not None:  # a checkpoint of another run is refused before compiling
                _check_same_run(self.meta, program, ckpt.directory)
        self.ledger = goodput.Ledger(ckpt.directory if ckpt else None, faults.started or time.time(),
                                     resume=bool(ckpt and ckpt.resume), write=jax.process_index() == 0)

    def _fetch_local(self) -> None:
        """Take the local tier's newest whole step when it is at least as new as the persistent one,
        and was saved on this layout; the blob is rebuilt into arrays once the program is compiled."""
        t0 = time.perf_counter()
        step = self.local.agree(self.resumed)
        if step is None:
            return
        header, payload, where = self.local.fetch(step)
        if header["meta"].get("mesh") != self.program.mesh.as_dict():
            if jax.process_index() == 0:
                print(f"xlaopt train: the local tier's step {step} was saved on mesh {header['meta'].get('mesh')}, "
                      f"this run has {self.program.mesh.as_dict()}: restoring the persistent tier", file=sys.stderr)
            return
        if header["meta"].get("trainable", "all") != self.program.settings.trainable:
            return  # its blob holds another set's optimizer state: the persistent tier maps it
        self.resumed, self.meta = step, header["meta"]
        self.local_blob = (header, payload, where, time.perf_counter() - t0)

    def setup(self, data_dir: str | None, skip_oversize: bool) -> None:
        program, meta = self.program, self.meta
        self.compiled = compiled = compile_program(program)
        if data_dir is not None:  # before compiling: a store the batch cannot hold fails fast, and reading starts
            loader_state = LoaderState.from_json(meta["data"]) if meta and meta["data"] else None
            self.loader = Loader(SampleStore(data_dir), program.model, program.settings.batch,
                                 seed=program.settings.seed, state=loader_state, rows=compiled.local_rows,
                                 skip_oversize=skip_oversize, balance_groups=row_groups(program))
        restoring = None
        if self.resumed is not None and self.local_blob is None:
            # The persistent restore reads while the step compiles (its target traced first, here).
            compiled.abstract_state  # noqa: B018
            restoring = concurrent.futures.ThreadPoolExecutor(1, "xlaopt-restore").submit(
                _timed, compiled.restore_state, self.manager, self.resumed)
        t0 = time.perf_counter()
        compiled.train_step  # noqa: B018 (compile before the clock starts)
        self.compile_s = time.perf_counter() - t0
        self.key = jax.random.key(program.settings.seed)
        t0 = time.perf_counter()
        restore_s = 0.0
        if self.resumed is None:
            self.state = compiled.init(jax.random.fold_in(self.key, 0))
        elif self.local_blob is not None:
            self.local_restored = True
            header, payload, where, fetch_s = self.local_blob
            self.state = local_format.assemble(header, payload, compiled.abstract_state, where)
            self.local_blob = None
            restore_s = fetch_s + time.perf_counter() - t0
            # Per process, how many places on the copy it restored was held (0: its own).
            self.ledger.record(local_restore_s=restore_s, local_from=self.local.sources)
        else:
            (self.state, _), total_s = restoring.result()
            restore_s = time.perf_counter() - t0  # what the start waited for beyond the compile
            self.ledger.record(restore_s=restore_s, restore_total_s=total_s)
        self.start = int(self.state.step)
        started = self.faults.started or time.time()
        setup_s = max(0.0, time.time() - started - restore_s)
        self.ledger.record(resumed_from=self.start, processes=jax.process_count(), setup_s=setup_s)
        if self.ckpt is not None:
            attempt = {"setup_s": setup_s, **({"restore_s": restore_s} if self.resumed is not None else {})}
            if self.local_restored:
                attempt = {"setup_s": setup_s, "local_restore_s": restore_s}
            self.saves = Saves(self.ckpt, self.manager, self.local, self.ledger, self.start, self._collective, attempt)

    def _batches(self, steps: int):
        program, compiled, start = self.program, self.compiled, self.start
        if self.loader is not None:
            return (_counted(program, next(self.loader)) for _ in range(start, steps))
        data = family_of(program.model).synthetic(program.model, program.settings.batch, program.settings.seed)
        return prefetch(lambda i: _counted(program, compiled.local_part(data.batch(start + i))), steps - start)

    def loop(self, steps: int, progress: bool):
        stop = StopSignal(jax.process_count() > 1)
        try:
            return self._steps(steps, progress, stop)
        finally:
            stop.close()
            if self.watch is not None:
                self.watch.disarm()

    def _steps(self, steps: int, progress: bool, stop: StopSignal):
        compiled, loader, ledger, watch = self.compiled, self.loader, self.ledger, self.watch
        batches = self._batches(steps)
        bar = ProgressBar(steps - self.start) if progress else None
        records, flops, tokens = [], [], []
        if watch:
            if jax.process_count() > 1:
                # Processes restore, compile and open their data at their own pace (a loaded
                # machine lags one by tens of seconds): the step timeout counts from when all are
                # ready. The coordination service's barrier, not a collective: gloo gives up on
                # a peer that has not joined within 30 s (seen under load as "Gloo context
                # initialization failed"). A peer lost before then is the watchdog's silence
                # check's, which runs unarmed.
                distributed.client().wait_at_barrier("xlaopt/step-loop-starts", STEP_LOOP_BARRIER_MS)
            watch.arm(self.start)
        for step in range(self.start, steps):
            t_wait = time.perf_counter()
            batch, n_tokens, n_flops = next(batches)
            t_step = time.perf_counter()
            if watch:
                watch.entering()
            with self._collective():
                self.state, metrics = compiled.train_step(self.state, compiled.put_batch(batch), self.key)
                metrics = {k: float(v) for k, v in metrics.items()}
            t_end = time.perf_counter()
            if watch:
                watch.progress(step + 1)
            self._check_finite(step, metrics)
            records.append({"step": step, "loss": metrics["loss"], "step_time_s": t_end - t_step,
                            "data_wait_s": t_step - t_wait,
                            **{k: v for k, v in metrics.items() if k != "loss"}})
            ledger.step(step, t_end - t_step, t_step - t_wait, metrics["loss"])
            flops.append(n_flops)
            tokens.append(n_tokens)
            if loader is not None:
                loader.size_window(t_end - t_step)
            stopping = stop.reached(step + 1) and step + 1 < steps
            if self.saves is not None:
                self.saves.after(step + 1, steps, self.state, lambda: _run_meta(self.program, loader), stopping,
                                 lambda: [r["step_time_s"] for r in records])
            if bar:
                bar.update(step + 1 - self.start, f"loss {metrics['loss']:.3f}  {t_end - t_step:.2f}s/step")
            if stopping:
                self.stopped_by = "SIGTERM"
                break
        return records, tokens, flops, self.saves.records if self.saves is not None else []

    @contextlib.contextmanager
    def _collective(self):
        """A collective that fails because a peer went away raises PeerLost, naming the peer."""
        try:
            yield
        except jax.errors.JaxRuntimeError as e:
            if self.watch is None:
                raise
            raise self.watch.lost(e) from None

    def _check_finite(self, step: int, metrics: dict) -> None:
        """Under TrainSettings.nonfinite='stop', end the run before a state that is not all
        finite, or came with a non-finite loss, could be saved: what is committed stays good."""
        if not metrics.get("nonfinite", 0.0):
            return
        if self.manager is not None:
            self.manager.wait()  # the save in flight holds a good state: let it commit
        last = self.manager.latest() if self.manager is not None else None
        kept = (f"the newest checkpoint kept in {self.ckpt.directory}, step {last}, is all finite" if last is not None
                else "no checkpoint was saved before it")
        what = "the loss" if not math.isfinite(metrics["loss"]) else "the updated state"
        raise RunFailed(f"step {step}: {what} is not finite (loss {metrics['loss']}); stopped before saving that "
                        f"state ({kept}). Resume with a lower learning rate, or run with --on-nonfinite skip to skip "
                        f"such steps")

    def close(self, failed: bool = False, wait_saves: bool = True) -> None:
        """Stop the loader's reads and finish pending saves (so the last good checkpoint commits).
        After a failure the manager's closing barrier is skipped: peers may be gone; after a lost
        peer (`wait_saves=False`) the save in flight is abandoned too: it cannot commit."""
        if self._closed:
            return
        self._closed = True
        if self.loader is not None:
            self.loader.close()
        t0 = time.perf_counter()
        try:
            if wait_saves:
                self._close_manager(failed)
        finally:
            self.ledger.record(save_s=time.perf_counter() - t0, t=round(time.time(), 3))
            self.ledger.close()

    def _close_manager(self, failed: bool) -> None:
        if self.manager is None:
            return
        if not failed:
            self.manager.close()
            return
        try:
            self.manager.wait()
        except Exception as e:  # the step's error is the one to raise; say this one too
            print(f"xlaopt train: the checkpoint save in flight also failed: {e}", file=sys.stderr)


def _summary(run: _Run, data_dir: str | None, records: list, tokens: list, flops: list, saves: list) -> dict:
    program, compiled, loader, ckpt = run.program, run.compiled, run.loader, run.ckpt
    rows = compiled.local_rows
    tokens, flops = _job_totals(tokens, flops, len(rows) / program.settings.batch.batch_size)
    for record, n in zip(records, tokens):
        record["tokens"] = n
    timed = records[1:] or records
    busy = sum(r["step_time_s"] + r["data_wait_s"] for r in timed)
    dtype = program.execution.compute_dtype
    peak = mesh_peak(compiled.mesh.devices.ravel().tolist(), dtype)
    model_flops = float(np.mean(flops))
    head, tail = [r["loss"] for r in records[:5]], [r["loss"] for r in records[-5:]]
    return {
        "model": program.model.name,
        "param_count": param_count(program),
        "mesh": program.mesh.as_dict(),
        "compute_dtype": dtype,
        "execution": dataclasses.asdict(program.execution),
        "batch": dataclasses.asdict(program.settings.batch),
        "compile_s": run.compile_s,
        "steps": records,
        "loss_first5_mean": statistics.fmean(head),
        "loss_last5_mean": statistics.fmean(tail),
        # Steps whose update was skipped: a float16 gradient overflow, or --on-nonfinite skip.
        "skipped_steps": int(sum(r.get("skipped", 0.0) for r in records)),
        "median_step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "tokens_per_s": sum(tokens[1:] or tokens) / busy,
        "data_wait_fraction": sum(r["data_wait_s"] for r in timed) / busy,
        "padding_fraction": 1.0 - sum(tokens) / (len(tokens) * program.settings.batch.tokens),
        "data": ({"store": str(data_dir), "prefetch_window": loader.prefetch, "state": loader.state().to_json(),
                  "rows_read": [rows.start, rows.stop]}
                 if loader is not None else {"synthetic": family_of(program.model).name}),
        "model_flops_per_step": model_flops,
        "mfu": sum(flops[1:] or flops) / busy / peak.flops_per_s,
        "peak_flops_per_s": peak.flops_per_s,
        "peak_source": peak.source,
        "checkpoint": ({"dir": ckpt.directory, "resumed_from": run.resumed, "saves": saves,
                        "planned": run.saves.planned if run.saves is not None else None,
                        "committed": run.manager.steps()} if ckpt is not None else None),
        "stopped_by": run.stopped_by,
        "goodput": goodput.goodput(run.ledger.history(), time.time()),
    }


def _job_totals(tokens: list[int], flops: list[float], share: float) -> tuple[list[int], list[float]]:
    """Per-step tokens and FLOPs of the whole job. Each process counted the rows it read, a
    `share` of the batch; processes holding the same rows (a mesh replicating the batch
    across them) counted them alike, so the sum over processes is divided by that overlap."""
    if jax.process_count() == 1:
        return tokens, flops
    from jax.experimental import multihost_utils

    overlap = jax.process_count() * share
    tokens = multihost_utils.process_allgather(np.asarray(tokens, np.int32)).sum(axis=0) / overlap
    flops = multihost_utils.process_allgather(np.asarray(flops, np.float32)).astype(np.float64).sum(axis=0) / overlap
    return [round(t) for t in tokens], [float(f) for f in flops]


def format_summary(result: dict) -> str:
    return "\n".join([
        f"model {result['model']}  params {result['param_count'] / 1e6:.1f}M  mesh "
        + ",".join(f"{a}={s}" for a, s in result["mesh"].items() if s > 1) + f"  {result['compute_dtype']}",
        f"steps {len(result['steps'])}  loss {result['loss_first5_mean']:.3f} -> {result['loss_last5_mean']:.3f}"
        f" (mean of first / last 5)"
        + ((f"  {result['skipped_steps']} updates skipped on float16 overflow (last step's loss scale "
            f"{result['steps'][-1]['loss_scale']:g})" if "loss_scale" in result["steps"][-1]
            else f"  {result['skipped_steps']} updates skipped (not finite)") if result["skipped_steps"] else ""),
        f"median step {result['median_step_time_s']:.3f}s  tokens/s {result['tokens_per_s']:.0f}  "
        f"data wait {100 * result['data_wait_fraction']:.1f}%  compile {result['compile_s']:.1f}s"
        + (f"  skipped {result['data']['state']['skipped']} samples longer than a row"
           if result["data"].get("state", {}).get("skipped") else ""),
        f"model FLOPs/step {result['model_flops_per_step'] / 1e9:.1f} G  MFU {100 * result['mfu']:.1f}% "
        f"of {result['peak_source']}",
        _format_goodput(result["goodput"]) + (f"  stopped by {result['stopped_by']} after step "
                                              f"{result['steps'][-1]['step'] + 1}" if result["stopped_by"] else ""),
    ])


def _format_goodput(g: dict) -> str:
    causes = sorted(((v, k.removesuffix("_s")) for k, v in g["badput"].items() if v > 0), reverse=True)[:3]
    return (f"goodput {100 * g['goodput']:.1f}% of {g['wall_s']:.1f}s wall  (badput: "
            + ", ".join(f"{name} {v:.1f}s" for v, name in causes) + ")"
            + (f"  restarts {g['restarts']}, steps lost and redone {g['lost_steps']}, the last one's start to its "
               f"first step {g['restart_times'][-1]['to_first_step_s']:.1f}s" if g["restarts"] else ""))
