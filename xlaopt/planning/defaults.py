"""What `xlaopt plan` plans when the command line leaves it open.

The global batch defaults to a realistic one per family, never one short row per device:
  - decoder on GPUs: sequences of 8,192 tokens, 4 per device (llama3-70b on 16 x 8 H100: 512);
  - ViT on GPUs: 32 images per device (ViT-B/16 on 16 x 8 H100: 4,096, the paper's batch);
  - Cosmos 3 on GPUs: rows of the mix's budget (default mix cosmos3-480p: 512 + 7,680 tokens), one
    row per device;
  - on a simulated CPU topology: the family's default batch (toy rows), grown to a multiple of
    the devices.
With `--from OLD_LAYOUT` the old layout's batch is kept where it splits over the new devices;
else the nearest global batch that does, said in the note. The attention is cuDNN's fused kernel
on the GPU target (the only one that is fast there) and dense elsewhere, unless `--exec` says.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from xlaopt.build import BatchRequest
from xlaopt.data.batch import BatchShape
from xlaopt.errors import UserError

DECODER_SEQ = 8192
DECODER_ROWS_PER_DEVICE = 4
IMAGES_PER_DEVICE = 32
DEFAULT_MIX = "cosmos3-480p"


def prepare_devices(requested: str, topology_text: str) -> None:
    """Ask for the simulated CPU devices a CPU-target plan compiles on, before anything starts
    JAX's backend (building a CPU topology measures the host)."""
    from xlaopt.analysis import gpu_aot
    from xlaopt.analysis.topology import preset_shape
    from xlaopt.mesh import MAX_SIMULATED_DEVICES, request_cpu_devices

    shape = preset_shape(topology_text)
    if shape is None or shape[1] > MAX_SIMULATED_DEVICES:
        return
    name, count = shape
    if requested == "cpu" or (requested == "auto" and (name == "cpu" or not gpu_aot.available())):
        request_cpu_devices(count)


def plan_target(requested: str, topology) -> tuple[str, str]:
    """(target, note) for `--target`."""
    from xlaopt.analysis import gpu_aot
    from xlaopt.mesh import MAX_SIMULATED_DEVICES

    gpu_topology = topology.device.hbm_bytes > 0
    if requested == "gpu" or (requested == "auto" and gpu_topology and gpu_aot.available()):
        if not gpu_aot.available():
            raise UserError("--target gpu compiles deviceless for NVIDIA GPUs and needs xlaopt[gpu-aot]; "
                            "install it, or use --target cpu")
        return "gpu", ""
    if gpu_topology and requested == "auto":
        note = "xlaopt[gpu-aot] is not installed: the best few compile on simulated CPU devices (no async " \
               "collectives; every collective exposed)"
        if topology.num_devices > MAX_SIMULATED_DEVICES:
            note = f"xlaopt[gpu-aot] is not installed and {topology.num_devices} devices exceed the " \
                   f"{MAX_SIMULATED_DEVICES} simulated CPU devices: analytic prices only"
        return "cpu", note
    return "cpu", ""


def plan_program(config, topology, *, target: str = "auto", mix: str | None = None, data: str | None = None,
                 batch: BatchRequest | None = None, execution_settings: Sequence[str] = (), seed: int = 0,
                 old=None, trainable: str = "all"):
    """(base TrainProgram, PricedBatch, note) for `xlaopt plan`: `target` as `--target`, rows of
    the named `mix` or the store `data`, the `batch` fields given, `execution_settings` as
    `--exec`'s KEY=VALUE, `old` the `--from` layout, `trainable` as `TrainSettings.trainable`."""
    from xlaopt.analysis.analyze import analysis_batch_size
    from xlaopt.analysis.priced_batch import mix_batch, store_batch, synthetic_batch
    from xlaopt.build import build_program
    from xlaopt.execution import ExecutionConfig, parse_execution, target_attention
    from xlaopt.families import family_of

    target, note = plan_target(target, topology)
    if target == "gpu":
        import jax

        jax.config.update("jax_platforms", "cpu")  # the GPU compiler runs deviceless, as for analyze --target gpu
    n = topology.num_devices
    gpu = topology.device.hbm_bytes > 0
    family = family_of(config)
    cosmos = family.packs_samples
    mix = mix if mix is not None else (DEFAULT_MIX if cosmos and gpu and data is None else None)
    if mix is not None and not cosmos:
        raise UserError(f"--mix: mixes hold Cosmos 3 samples; {config.name} is planned on its synthetic stream")
    default = family.default_batch(config)
    if old is not None and old.batch is not None:
        default = old.batch
    elif gpu and cosmos:
        from xlaopt.data.mixes import get_mix

        default = BatchShape(n, *get_mix(mix).row) if mix else dataclasses.replace(default, batch_size=n)
    elif gpu and family.decodes_text:  # text rows (Cosmos 3, which also decodes text, took the branch above)
        default = BatchShape(DECODER_ROWS_PER_DEVICE * n, DECODER_SEQ, 0)
    elif gpu:  # images: the config fixes the row
        default = dataclasses.replace(default, batch_size=IMAGES_PER_DEVICE * n)
    else:
        default = dataclasses.replace(default, batch_size=analysis_batch_size(_data_mesh(n), default.batch_size, None))
    batch = batch or BatchRequest()
    given_rows = batch.batch_size
    batch = batch.shape(default)
    base = old.execution if old is not None and old.execution is not None else ExecutionConfig()
    base = dataclasses.replace(base, attention=target_attention(target) if target == "gpu" or not old else base.attention)
    execution = parse_execution(execution_settings, base)
    if old is not None and given_rows is None:
        batch, changed = _splittable(config, batch, topology, execution.attention)
        if changed:
            note = (note + "; " if note else "") + changed
    program = build_program(config, batch=batch, execution=execution, seed=seed, target=target, trainable=trainable)
    priced = (mix_batch(program, mix) if mix is not None else store_batch(program, data) if data
              else synthetic_batch(program))
    return program, priced, note


def _data_mesh(n: int):
    from xlaopt.mesh import MeshSpec

    return MeshSpec.of(data=n)


def _splittable(config, batch: BatchShape, topology, attention: str) -> tuple[BatchShape, str]:
    """The old global batch if some layout of the new topology splits it, else the nearest one that
    does, multiples of the device count first (a cluster that shrinks keeps its rows per device)."""
    from xlaopt.planning.space import enumerate_space

    works = lambda rows: bool(enumerate_space(config, dataclasses.replace(batch, batch_size=rows),
                                              topology.num_devices, topology.devices_per_node, attention,
                                              ("bfloat16",))[0])
    rows, n = batch.batch_size, topology.num_devices
    if works(rows):
        return batch, ""
    from xlaopt.planning.planner import nearest_working

    per_device = sorted({max(1, rows // n) * n, -(-rows // n) * n}, key=lambda r: (abs(r - rows), r))
    candidate = next((r for r in per_device if works(r)), None) or nearest_working(rows, works)
    if candidate is None:
        raise UserError(f"no global batch near {rows} rows splits over {n} devices")
    return (dataclasses.replace(batch, batch_size=candidate),
            f"the old global batch of {rows} rows splits over no layout of {n} devices; re-planned "
            f"for {candidate} rows ({candidate / n:g} per device)")
