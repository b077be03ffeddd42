"""Imported reference weights as an xlaopt checkpoint (a train state at step 0 that the
checkpoint manager writes atomically), and back out of one."""
from __future__ import annotations

import dataclasses
import pathlib
import shutil

import jax
import jax.numpy as jnp

from xlaopt import loss_scale
from xlaopt.checkpoint import CheckpointManager
from xlaopt.checkpoint.layout import committed_steps
from xlaopt.errors import UserError
from xlaopt.interop.diffusers_config import ReferenceSettings, load_config
from xlaopt.interop.diffusers_weights import (
    SafetensorsDir,
    WeightsError,
    check_tensors,
    export_diffusers,
    import_params,
    param_shardings,
)
from xlaopt.program import TrainState
from xlaopt.step import make_optimizer

SOURCE_KEY = "imported_from"


def initial_state(program, params, state_shardings) -> TrainState:
    """Step 0 with fresh optimizer moments (and loss scale, under float16), laid out on the
    program's state shardings."""
    opt = make_optimizer(program.settings)
    make = jax.jit(lambda p: TrainState(jnp.zeros((), jnp.int32), p, opt.init(p), loss_scale.initial(program.execution)),
                   out_shardings=state_shardings)
    return make(params)


def run_meta(program, settings: ReferenceSettings, directory) -> dict:
    """The metadata `xlaopt train` saves (model, config, seed, batch, data position), plus
    where the weights came from and the reference settings an export needs."""
    return {"model": program.model.name, "config": dataclasses.asdict(program.model),
            "seed": program.settings.seed, "batch": dataclasses.asdict(program.settings.batch), "data": None,
            SOURCE_KEY: {"format": "diffusers", "dir": str(directory), "reference": settings.to_json()}}


def import_to_checkpoint(directory, out, mesh_spec=None, name: str = "cosmos3-diffusers", step: int = 0,
                         settings=None) -> dict:
    """Validate everything, then place the weights on `mesh_spec` (laid out for training with
    `settings`, a `TrainSettings`) and save them with fresh optimizer state as `out`'s step `step`. On any failure nothing is left behind: the checkpoint step is committed
    atomically, and a directory this call created is removed."""
    config, reference = load_config(directory, name)
    files = SafetensorsDir(directory)
    try:
        check_tensors(files, config, reference)
        n_tensors = len(files.tensors)
    finally:
        files.close()
    load = lambda shardings: import_params(directory, shardings, name)[2]
    meta = lambda program: run_meta(program, reference, directory)
    info = _write_imported(out, config, mesh_spec, settings, step, load, meta)
    return {**info, "tensors": n_tensors, "reference": reference}


def import_llama_to_checkpoint(directory, out, mesh_spec=None, name: str = "hf-llama", step: int = 0,
                               settings=None) -> dict:
    """A Hugging Face Llama directory (`xlaopt.interop.hf_llama`) as `out`'s step `step`, as
    `import_to_checkpoint` writes a diffusers one: its config refused or mapped before any weight
    is read, the weights placed on `mesh_spec` shard by shard."""
    from xlaopt.interop import hf_llama

    config = hf_llama.config_from_hf(hf_llama.read_config(directory), name)
    load = lambda shardings: hf_llama.load(directory, config, shardings, name)[1]
    meta = lambda program: {"model": program.model.name, "config": dataclasses.asdict(program.model),
                            "seed": program.settings.seed, "batch": dataclasses.asdict(program.settings.batch),
                            "data": None, SOURCE_KEY: {"format": "hf-llama", "dir": str(directory)}}
    return _write_imported(out, config, mesh_spec, settings, step, load, meta)


def _write_imported(out, config, mesh_spec, settings, step: int, load, meta) -> dict:
    out = pathlib.Path(out)
    if out.exists() and committed_steps(out):
        raise WeightsError(f"{out}: already holds checkpoints {committed_steps(out)}; import into a new directory")
    created = not out.exists()
    try:
        shardings, program = param_shardings(config, mesh_spec, settings)
        from xlaopt.compile import compile_program
        compiled = compile_program(program)
        params = load(shardings)
        state = initial_state(program, params, compiled.state_shardings)
        manager = CheckpointManager(out)
        manager.save(step, state, meta(program))
        manager.close()
    except BaseException:
        if created and out.exists():
            shutil.rmtree(out, ignore_errors=True)
        raise
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    n_tensors = len(jax.tree.leaves(params))
    return {"step": step, "tensors": n_tensors, "params": n_params, "config": config, "program": program}


def export_llama_checkpoint(ckpt, out_dir, step: int | None = None, dtype: str = "float32") -> list[str]:
    """A decoder's checkpoint (trained, or imported with `import_llama_to_checkpoint`) -> a Hugging
    Face Llama directory (`hf_llama.save`), read without writing to the checkpoint."""
    from xlaopt.execution import ExecutionConfig
    from xlaopt.inference.checkpoint_params import SavedRun
    from xlaopt.interop import hf_llama

    saved = SavedRun.open(str(ckpt), step)
    config = saved.config()
    if config.family != "decoder":
        raise WeightsError(f"{ckpt}: a checkpoint of {saved.meta['model']} ({config.family}); the hf-llama layout "
                           f"holds a decoder LLM's")
    params = saved.model_params(config, ExecutionConfig(compute_dtype="float32"))
    # The context length is not part of the model's math: kept from the imported source's config.
    source, positions = saved.meta.get(SOURCE_KEY) or {}, None
    if source.get("format") == "hf-llama":
        try:
            positions = hf_llama.read_config(source["dir"]).get("max_position_embeddings")
        except UserError:
            positions = None  # the source is gone: hf_llama.save derives one
    return hf_llama.save(out_dir, config, params, dtype=dtype, max_position_embeddings=positions)


def export_checkpoint(ckpt, out_dir, step: int | None = None, dtype: str = "float32") -> list[str]:
    """A checkpoint written by `import_to_checkpoint` (and trained on) -> a diffusers directory."""
    from xlaopt.compile import compile_program
    from xlaopt.models.cosmos3_config import Cosmos3Config
    from xlaopt.program import TrainProgram

    manager = CheckpointManager(ckpt)
    step = manager.latest() if step is None else step
    meta = manager.manifest(step)["meta"]
    if SOURCE_KEY not in meta:
        raise WeightsError(f"{ckpt}: step {step} was not imported from a reference model; its reference "
                           f"settings (which heads exist, fps modulation) are unknown")
    cfg = dict(meta["config"])
    cfg["mrope_sections"] = tuple(cfg["mrope_sections"])
    config = Cosmos3Config(**cfg)
    settings = ReferenceSettings.from_json(meta[SOURCE_KEY]["reference"])
    compiled = compile_program(TrainProgram(config))
    state, _ = compiled.restore_state(manager, step)
    return export_diffusers(state.params, config, settings, out_dir, dtype)
