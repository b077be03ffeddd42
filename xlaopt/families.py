"""Model families: what the training program needs to know about a kind of model.

A family ties a config class (by its `family` name) to the module, its batch contract, its
loss, its model-FLOPs counter and a synthetic producer. The program, the passes and the
training loop go through this table only, so a new model is one more entry.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from xlaopt.data.batch import BatchShape, cosmos3_batch_spec, decoder_batch_spec, resnet_batch_spec, vit_batch_spec
from xlaopt.data.synthetic_cosmos import SyntheticCosmos
from xlaopt.data.synthetic_images import SyntheticImages
from xlaopt.data.synthetic_text import SyntheticText
from xlaopt.models import cosmos3, decoder, flops, objective, resnet, vit


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    module: Callable  # (config, ExecutionConfig) -> flax module
    batch_spec: Callable  # (config, BatchShape) -> {name: (shape, dtype, logical axes)}
    loss: Callable  # (module, params, batch with its draws, key) -> (loss, metrics)
    train_flops: Callable  # (config, host batch) -> model FLOPs of one training step
    synthetic: Callable  # (config, BatchShape, seed) -> producer with .batch(i)
    segment_keys: tuple[str, ...]  # batch arrays whose nonzero entries are real tokens
    attention_calls: Callable  # host batch -> ((query Tokens, key Tokens), ...) of one layer's attentions
    default_batch: Callable  # config -> BatchShape
    # What the model can do, asked instead of its name. Transformer towers of `num_layers` layers
    # each, resident while serving (none for a CNN, whose parameters only fsdp can split).
    towers: int = 1
    decodes_text: bool = False  # a causal text tower with a vocabulary head: a KV-cached token step
    # The loss can run inside the layer stack, as the stack's tail (`LayerStack.loss`), which a
    # 1F1B pipeline needs.
    loss_in_stack: bool = False
    # Outside attention each token's work reads that token alone (and its successor's id,
    # `layers.next_tokens`), and every batch array is (rows, sequence): a step may run manual over
    # the axis context parallelism splits the sequences over (`step.manual_sequence_axis`).
    sequence_local: bool = False
    # A generator tower denoising video latents after the text: rows have a text and a generator
    # part, and the model serves a denoising step.
    generates_video: bool = False
    # Its batches can be packed from stored samples (a store, a mix); else only its synthetic stream.
    packs_samples: bool = False
    # The step's random draws from a (micro-)batch and key, {name: array}, added to the batch
    # before the loss sees it; their logical axes as (name, axes) pairs.
    draws: Callable = lambda batch, key: {}
    draw_axes: tuple[tuple[str, tuple], ...] = ()
    # Model state that is not a parameter (a ResNet's running batch-norm averages): its first
    # value from the model's init variables, and each step's new value from the old and the
    # step's metrics, whose entries it consumes: (config, state, metrics) -> (state, metrics).
    init_state: Callable = lambda variables: None
    update_state: Callable | None = None
    # Named subsets of the parameters a run may train alone, the rest frozen (`TrainSettings.
    # trainable`): (name, parameter path prefixes) pairs; "all" is every family's default.
    trainable_sets: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def trainable_prefixes(self, name: str) -> tuple[str, ...] | None:
        """The path prefixes of set `name` ("all": None, every parameter); a KeyError for a name
        the family does not have."""
        return None if name == "all" else dict(self.trainable_sets)[name]

    def step_flops(self, program, batch: dict[str, np.ndarray]) -> float:
        """Model FLOPs of `program`'s training step on a host batch, frozen parameters' backward
        left out (`TrainSettings.trainable`)."""
        trainable = program.settings.trainable
        if trainable == "all":
            return self.train_flops(program.model, batch)
        return self.train_flops(program.model, batch, trainable=trainable)

    @property
    def trainable_names(self) -> tuple[str, ...]:
        return ("all",) + tuple(name for name, _ in self.trainable_sets)

    @property
    def has_layer_stack(self) -> bool:
        return self.towers > 0

    def with_draws(self, batch: dict, key) -> dict:
        return {**batch, **self.draws(batch, key)}

    def real_tokens(self, batch: dict[str, np.ndarray]) -> int:
        return int(sum((batch[k] > 0).sum() for k in self.segment_keys))


# Cosmos 3 rows of 160 tokens: two of the synthetic mix's largest clips (48 latent tokens) fit
# one row's generator budget, so packing stays under 1% padding (144-token rows: up to 2.7%
# over 40 batches).
def _module(cls):
    """The family's flax module with the parts of the execution config a model takes."""
    def build(config, execution):
        return cls(config, jnp.dtype(execution.compute_dtype), stack=execution.stack,
                   attention=execution.attention_spec)
    return build


def _resnet_module(config, execution):
    return resnet.ResNet(config, jnp.dtype(execution.compute_dtype))


def _resnet_update(config, running, metrics):
    metrics = dict(metrics)
    return resnet.update_running(running, metrics.pop(resnet.BATCH_MOMENTS), config.bn_momentum), metrics


FAMILIES = {
    "cosmos3": Family("cosmos3", _module(cosmos3.Cosmos3), cosmos3_batch_spec, objective.loss_fn, flops.batch_train_flops,
                      SyntheticCosmos, ("text_segment_ids_BT", "gen_segment_ids_BV"), cosmos3.attention_calls,
                      lambda c: BatchShape(8, 56, 104), towers=2, decodes_text=True, generates_video=True,
                      packs_samples=True, draws=objective.draws, draw_axes=objective.DRAW_AXES,
                      trainable_sets=(("generator", cosmos3.GENERATOR_SET),), loss_in_stack=True),
    "decoder": Family("decoder", _module(decoder.Decoder), decoder_batch_spec, decoder.loss_fn, decoder.batch_train_flops,
                      SyntheticText, ("segment_ids_BT",), decoder.attention_calls, lambda c: BatchShape(8, 128, 0),
                      decodes_text=True, loss_in_stack=True, sequence_local=True),
    "vit": Family("vit", _module(vit.ViT), vit_batch_spec, vit.loss_fn, vit.batch_train_flops,
                  functools.partial(SyntheticImages, batch_spec=vit_batch_spec),
                  ("segment_ids_BT",), vit.attention_calls, lambda c: BatchShape(8, c.tokens, 0)),
    # A row is an image, one "token"; no attention.
    "resnet": Family("resnet", _resnet_module, resnet_batch_spec, resnet.loss_fn, resnet.batch_train_flops,
                     functools.partial(SyntheticImages, batch_spec=resnet_batch_spec), ("valid_B",),
                     lambda batch: (), lambda c: BatchShape(8, 1, 0), towers=0,
                     init_state=lambda variables: variables["batch_stats"], update_state=_resnet_update),
}


def family_of(config: Any) -> Family:
    return FAMILIES[config.family]
