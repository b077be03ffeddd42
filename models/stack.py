"""How a homogeneous stack of layers runs: the seam between the model ("these layers, in
order") and the execution config ("run them this way"), which passes may rewrite.

`LayerStack` holds one layer module's parameters stacked along a leading `layers` axis, the
same tree whatever the strategy (so a checkpoint, a layout or an imported weight file fits
every strategy), and hands a strategy a pure function `layer_fn(params_i, carry, *args) ->
carry` with the stacked parameters. A strategy is a plain function registered by name in
`STRATEGIES`:
  scan      one `lax.scan` over the stacked parameters: compile time independent of depth;
  unrolled  one call per layer, so XLA schedules each layer on its own (and a pass can see
            layer i's weights apart from layer i+1's);
  pipeline  the layers cut into stages over the mesh axis `stage`, micro-batches handed from
            stage to stage (`xlaopt.models.pipeline`), each stage's layers a scan.
A gradient rewrite may hook each layer's parameters as the layer reads them
(`layer_params_through`): a hook `(params_i, path) -> params_i` that is the identity forward and
acts on the layer's parameter gradients in its backward, so whatever it does runs inside the
backward loop right after that layer's backward (`path`: the stack's parameter path).
A recomputation policy (`xlaopt.models.remat.REMAT_POLICIES`: what a layer keeps, by name) wraps
`layer_fn` in `jax.checkpoint`.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax

from xlaopt.models.grad_sums import gradient_scatter
from xlaopt.models.layers import constrain
from xlaopt.models.pipeline import pipeline_layers
from xlaopt.models.pipeline_1f1b import Tail, pipeline_loss_1f1b
from xlaopt.models.remat import REMAT_POLICIES
from xlaopt.models.tracing import installed

LayerFn = Callable[..., Any]  # (params_i, carry, *args) -> carry

_PARAMS_HOOK: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("xlaopt_layer_params_hook",
                                                                               default=None)


def layer_params_through(hook: Callable):
    """Context manager installing `hook(params_i, path) -> params_i` on every stacked layer's
    parameters while a model is traced (see the module docstring)."""
    return installed(_PARAMS_HOOK, hook)


def scan_layers(layer_fn: LayerFn, params_L, carry, args: tuple, spec: "StackSpec | None" = None):
    def body(c, params_i):
        return layer_fn(params_i, c, *args), None

    carry, _ = jax.lax.scan(body, carry, params_L)
    return carry


def unrolled_layers(layer_fn: LayerFn, params_L, carry, args: tuple, spec: "StackSpec | None" = None):
    depth = jax.tree.leaves(params_L)[0].shape[0]
    for i in range(depth):
        carry = layer_fn(jax.tree.map(lambda a, i=i: a[i], params_L), carry, *args)
    return carry


def pipelined_layers(layer_fn: LayerFn, params_L, carry, args: tuple, spec: "StackSpec", gather=None):
    return pipeline_layers(layer_fn, params_L, carry, args, spec.microbatches, inner=scan_layers, gather=gather,
                           virtual_stages=spec.virtual_stages)


# name -> strategy(layer_fn, params_L, carry, args, spec) -> carry
STRATEGIES: dict[str, Callable] = {"scan": scan_layers, "unrolled": unrolled_layers, "pipeline": pipelined_layers}


@dataclasses.dataclass(frozen=True)
class StackSpec:
    strategy: str = "scan"
    remat: str = "none"
    microbatches: int = 0  # pipeline: micro-batches a step's rows are cut into (0: one per stage)
    # pipeline: each stage's weights made whole along `embed` (FSDP's split) once a step, before
    # the ticks, instead of gathered layer by layer at every tick; they then stay resident.
    weights_once: bool = False
    virtual_stages: int = 1  # pipeline: rounds of the ring, each stage's layers cut into this many chunks
    schedule: str = "gpipe"  # pipeline: `xlaopt.models.pipeline.SCHEDULES`

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"layer stack {self.strategy!r}; use one of {', '.join(STRATEGIES)}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat {self.remat!r}; use one of {', '.join(REMAT_POLICIES)}")

    def wrap(self, layer_fn: LayerFn) -> LayerFn:
        policy = REMAT_POLICIES[self.remat]
        if not policy.checkpointed:
            return layer_fn
        # Under scan the loop boundary already stops XLA from merging the recomputation into
        # the forward pass; unrolled layers need the CSE barrier.
        return jax.checkpoint(layer_fn, policy=policy.jax_policy(), prevent_cse=self.strategy != "scan")

    @property
    def loss_inside(self) -> bool:
        """The loss runs inside the stack (`LayerStack.loss`): a 1F1B pipeline starts each
        micro-batch's backward on the last stage right after its forward."""
        return self.strategy == "pipeline" and self.schedule == "1f1b"


class LayerStack(nn.Module):
    """`length` copies of `layer_cls(**layer_fields)`, each called as `layer(carry, *args) -> carry`
    with its own parameters, run as `spec` says."""
    layer_cls: type
    layer_fields: dict
    length: int
    spec: StackSpec = StackSpec()

    def _layer(self) -> nn.Module:
        return self.layer_cls(**self.layer_fields, parent=None)  # detached: its params live here, stacked

    @nn.compact
    def __call__(self, carry, *args):
        layer = self._layer()
        if self.is_initializing():
            keys = jax.random.split(self.make_rng("params"), self.length)
            stacked = jax.vmap(lambda key: layer.init(key, carry, *args)["params"])(keys)
            # The new leading axis is named `layers` in each parameter's logical axes.
            stacked = jax.tree.map(lambda box: box.add_axis(0, {nn.PARTITION_NAME: "layers"}), stacked,
                                   is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
            for name, subtree in stacked.items():
                self.param(name, lambda _, tree=subtree: tree)
        params_L = nn.meta.unbox(dict(self.variables["params"]))

        run = STRATEGIES[self.spec.strategy]
        if self.spec.strategy == "pipeline" and self.spec.weights_once:
            run = functools.partial(run, gather=self._weights_layout(layer, carry, args))
        return run(self._layer_fn(layer), params_L, carry, args, self.spec)

    def loss(self, carry, args: tuple, tail: Tail, tail_params, tail_args, extra):
        """(loss, metrics) = `tail(tail_params, y, tail_args, extra)` of the stack's output `y`,
        computed inside the stack where the spec says so (`StackSpec.loss_inside`: 1F1B), else
        after it. `tail_args` lead with the rows, as `carry` does; they and `extra` are data,
        with no gradient."""
        if not self.spec.loss_inside or self.is_initializing():
            return tail(tail_params, self(carry, *args), tail_args, extra)
        layer = self._layer()
        layout = self._weights_layout(layer, carry, args, embed_whole=self.spec.weights_once)
        params_L = nn.meta.unbox(dict(self.variables["params"]))
        return pipeline_loss_1f1b(self._layer_fn(layer), params_L, carry, args,
                                  tail, tail_params, tail_args, extra, self.spec.microbatches, inner=scan_layers,
                                  gather=layout if self.spec.weights_once else None, like_weights=layout,
                                  virtual_stages=self.spec.virtual_stages,
                                  scatter=gradient_scatter(tuple(self.scope.path), params_L))

    def _layer_fn(self, layer: nn.Module) -> LayerFn:
        """The pure `(params_i, carry, *args) -> carry` of one layer, hooked and rematerialized
        as installed and specified."""
        hook, path = _PARAMS_HOOK.get(), tuple(self.scope.path)

        def layer_fn(params_i, c, *a):
            if hook is not None:
                params_i = hook(params_i, path)
            return layer.apply({"params": params_i}, c, *a)

        return self.spec.wrap(layer_fn)

    @staticmethod
    def _weights_layout(layer: nn.Module, carry, args, embed_whole: bool = True) -> Callable:
        """`params_k -> params_k`: a stage's stacked weights (or a tree shaped so) constrained to
        their logical axes, with `embed` (what FSDP splits) whole where `embed_whole`, so that the
        partitioner gathers each once."""
        boxed = jax.eval_shape(lambda c, a: layer.init(jax.random.key(0), c, *a)["params"], carry, args)
        is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
        names = jax.tree.map(lambda box: ("layers",) + tuple(None if n == "embed" and embed_whole else n
                                                             for n in box.names),
                             boxed, is_leaf=is_box)
        return lambda params_k: jax.tree.map(constrain, params_k, names)
