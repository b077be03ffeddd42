"""The parameters a serving command samples from when given `--ckpt DIR`: those of a checkpoint
that `xlaopt train` or `xlaopt import-weights` wrote, read alone (the optimizer's moments stay on
disk) and laid out as the serving placement lays out the model's own init."""
from __future__ import annotations

import dataclasses
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp

from xlaopt.checkpoint.layout import CheckpointError, committed_steps, open_root, read_manifest, step_dir_name
from xlaopt.checkpoint.restore import restore_tree
from xlaopt.checkpoint.saved_model import config_differences, saved_config
from xlaopt.checkpoint.tree import named_leaves


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """A checkpoint directory's step to serve, and the model config it was saved with."""
    directory: str
    step: int
    meta: dict

    @classmethod
    def open(cls, directory: str, step: int | None = None) -> SavedRun:
        """Read only: a serving command writes nothing, and cleans up no other run's debris."""
        root = open_root(directory, create=False)
        steps = committed_steps(root)
        if not steps:
            raise CheckpointError(f"--ckpt {directory}: no committed checkpoint there; train with `xlaopt train "
                                  f"--ckpt {directory}` or import weights with `xlaopt import-weights`")
        if step is not None and step not in steps:
            raise CheckpointError(f"--ckpt-step {step}: {directory} holds steps {steps}")
        step = steps[-1] if step is None else step
        return cls(str(root), step, read_manifest(root / step_dir_name(step))["meta"])

    def config(self, given=None):
        """The saved model's config; `given` (from --model and --set) must be that config."""
        saved = saved_config(self.meta, self.directory)
        if given is not None:
            fields = config_differences(given, self.meta)
            if fields:
                raise CheckpointError(f"--ckpt {self.directory} holds {self.meta['model']}'s step {self.step}, "
                                      f"which differs from --model {given.name}: {', '.join(fields[:6])}; drop "
                                      f"--model and --set to serve the checkpoint's own model")
        return saved

    def params(self, model: nn.Module, batch: dict, placement=None):
        """The step's parameters, shaped as `model.init` on `batch` makes them, placed as
        `placement` places them (one device without)."""
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        abstract = jax.eval_shape(lambda b: nn.meta.unbox(model.init(jax.random.key(0), b))["params"], batch)
        if placement is None:
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            shardings = jax.tree.map(lambda _: device, abstract)
        else:
            shardings = placement.param_shardings
        target = {"params": jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                         abstract, shardings)}
        # The checkpoint holds a whole train state; only its parameters are read (`partial`).
        step_dir = pathlib.Path(self.directory) / step_dir_name(self.step)
        manifest = read_manifest(step_dir)
        held = {leaf["name"] for leaf in manifest["leaves"]}
        missing = [name for name in named_leaves(target)[0] if name not in held]
        if missing:
            raise CheckpointError(f"--ckpt {self.directory}: step {self.step} lacks {len(missing)} of the "
                                  f"{self.meta['model']} parameters ({', '.join(missing[:3])}"
                                  f"{', ...' if len(missing) > 3 else ''}): not a train state of that model")
        tree, _ = restore_tree(step_dir, manifest, target, partial=True)
        return tree["params"]

    def model_params(self, config, execution, placement=None):
        """The step's parameters for `config`'s model built with `execution`, shaped on a one-row
        batch of its family's contract (parameters do not depend on the batch's shape)."""
        import numpy as np

        from xlaopt.families import family_of

        family = family_of(config)
        shape = dataclasses.replace(family.default_batch(config), batch_size=1)
        batch = {k: np.zeros(s, d) for k, (s, d, _) in family.batch_spec(config, shape).items()}
        return self.params(family.module(config, execution), batch, placement)
