"""Building blocks shared by the towers: parameters with logical axes, RMSNorm, MLP, attention.

Shape letters used in names throughout `xlaopt.models`:
  B batch, T reasoner (text) tokens, V generator tokens, S = T + V, D d_model,
  H query heads, N kv heads, R = H / N (queries per kv head), K head_dim, F mlp_dim,
  E vocab, C generator raw-input channels.

Logical axis names (mapped to mesh axes by the one rule table in `xlaopt.sharding`):
  parameters: vocab, embed, heads, kv_heads, head_dim, mlp, latent, domains, modality,
              time_freq, time_hidden (and layers, added by the scan);
  activations: batch, seq, residual_seq, act_embed, act_heads, act_kv_heads, act_mlp, act_vocab.
`residual_seq` is the sequence of the residual stream between sub-blocks (`RESIDUAL_BLD`): the
rule table splits it like `seq`, or over the tensor ranks too (sequence parallelism).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from xlaopt.models import remat
from xlaopt.models.fp8 import project, project_all
from xlaopt.models.tracing import installed

RESIDUAL_BLD = ("batch", "residual_seq", "act_embed")
# A sub-block's normed input, whole along the sequence on every tensor rank (`gathered`).
SUBLAYER_IN_BLD = ("batch", "seq", "act_embed")

# Activation constraints are installed by whoever traces the model (the training program's
# layout, a pass recording shapes, ...); the model itself only names logical axes. They
# compose: each installed constraint sees the output of the ones installed before it.
_ACTIVATION_CONSTRAINTS: contextvars.ContextVar[tuple[Callable, ...]] = contextvars.ContextVar(
    "xlaopt_activation_constraints", default=())


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Annotate an activation with logical axes; a no-op unless a constraint is installed."""
    assert x.ndim == len(logical_axes), (x.shape, logical_axes)
    for fn in _ACTIVATION_CONSTRAINTS.get():
        x = fn(x, tuple(logical_axes))
    return x


@contextlib.contextmanager
def activation_constraint(fn: Callable):
    """Context manager adding `fn(x, logical_axes) -> x` to the installed constraints while a
    model is traced (innermost last)."""
    with installed(_ACTIVATION_CONSTRAINTS, _ACTIVATION_CONSTRAINTS.get() + (fn,)):
        yield


# The mesh axes that split a batch's rows, installed by whoever traces the model under a mesh:
# work that stays within a row (segment-aware attention) runs per device over them.
_BATCH_MESH_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("xlaopt_batch_mesh_axes",
                                                                                   default=())


def batch_mesh_axes() -> tuple[str, ...]:
    return _BATCH_MESH_AXES.get()


def rows_split_over(axes: tuple[str, ...]):
    """Context manager naming the mesh axes that split the batch's rows while a model is traced."""
    return installed(_BATCH_MESH_AXES, tuple(axes))


# The manual axis that splits every row's sequence into chunks, one a rank, where a step runs
# manual over it (context parallel's micro-batch loop, `xlaopt.transforms.micro_batches`): an op
# that reads a token's neighbour (`next_tokens`) fetches it from the next rank at the chunk's end.
_SEQUENCE_SPLIT: contextvars.ContextVar[str | None] = contextvars.ContextVar("xlaopt_sequence_split", default=None)


def sequence_split_over(axis: str | None):
    """Context manager naming the manual axis that splits the rows' sequences (None: none does)."""
    return installed(_SEQUENCE_SPLIT, axis)


def chunk_start(length: int):
    """Where this rank's `length` tokens start in their rows: 0 unless the sequences are split
    (`sequence_split_over`), then the rank's index along the axis times `length`."""
    axis = _SEQUENCE_SPLIT.get()
    return 0 if axis is None else jax.lax.axis_index(axis) * length


# The mesh axes the rule table splits attention heads over (`act_heads`), installed beside the
# rows': a kernel run per device in a shard_map keeps the heads where the layout put them.
_HEAD_MESH_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("xlaopt_head_mesh_axes",
                                                                                  default=())


def head_mesh_axes() -> tuple[str, ...]:
    return _HEAD_MESH_AXES.get()


def heads_split_over(axes: tuple[str, ...]):
    """Context manager naming the mesh axes that split attention heads while a model is traced."""
    return installed(_HEAD_MESH_AXES, tuple(axes))


def head_axes_among(axes, *arrays_BLHK) -> tuple[str, ...]:
    """Of the mesh axes that split attention heads, those in `axes`, for a shard_map over them
    that keeps each device's heads where the layout put them; none where the heads of one of
    `arrays_BLHK` (dimension 2) do not split over them all (every device then holds all heads)."""
    heads = tuple(a for a in head_mesh_axes() if a in axes)
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    ways = math.prod(sizes[a] for a in heads)
    return () if any(x.shape[2] % ways for x in arrays_BLHK) else heads


# The mesh axes a gradient rewrite has made manual (a shard_map over them wraps the whole loss):
# each device then sees only its own rows, so a token mean's count is summed over these axes
# (each device's share of the loss is its own tokens' sum over the global count, and the shares
# add up to the one-device loss), and activation constraints must not name them.
_MANUAL_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("xlaopt_manual_axes", default=())


def manual_axes() -> tuple[str, ...]:
    """The manual axes named by `manual_over`, and those of the mesh being traced: a custom VJP's
    backward inside a shard_map is traced by the shard_map's transpose, after the rewrite that
    entered `manual_over` has returned, and only the trace's mesh still says what is manual."""
    traced = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    return tuple(dict.fromkeys(_MANUAL_AXES.get() + traced))


def manual_over(axes: tuple[str, ...]):
    """Context manager naming the mesh axes a shard_map around the loss has made manual."""
    return installed(_MANUAL_AXES, tuple(axes))


def token_count(mask):
    """How many of the whole batch's elements `mask` holds: under manual axes (`manual_over`)
    every device's, summed over them. `mask` may be a tree of masks, counted leaf by leaf."""
    counts = jax.tree.map(jnp.sum, mask)
    return jax.lax.psum(counts, manual_axes()) if manual_axes() else counts


def token_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """The mean of `values` where `mask` holds, over the whole batch: under manual axes
    (`manual_over`) this device's masked sum over the count of every device's tokens, the share
    of the mean that, summed over the devices, is the mean."""
    return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(token_count(mask), 1)


# How a matmul that contracts over a dimension tensor parallelism splits runs: by default one
# projection (`project`: in fp8 where the trace says so), whose partial sums XLA then
# all-reduces; a rewrite may install its own (a ring that overlaps the reduction with the
# matmul, `xlaopt.transforms.collective_matmul`).
_REDUCE_MATMUL: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("xlaopt_reduce_matmul",
                                                                                default=None)


def reduce_matmul_through(impl: Callable):
    """Context manager installing `impl(equation, x, w, x_split, w_split)` for `reduce_matmul`."""
    return installed(_REDUCE_MATMUL, impl)


def reduce_matmul(equation: str, x: jax.Array, w: jax.Array, x_split: int, w_split: int) -> jax.Array:
    """`einsum(equation, x, w)` for the output projections ("bl...,...->bld"), contracting x's
    dimension `x_split` with w's `w_split`: the dimensions tensor parallelism splits."""
    impl = _REDUCE_MATMUL.get()
    return project(equation, x, w) if impl is None else impl(equation, x, w, x_split, w_split)


def param(module: nn.Module, name: str, shape: Sequence[int], axes: Sequence[str | None],
          init: Callable | None = None, fan_in_axes: Sequence[int] = (0,),
          batch_axes: Sequence[int] = ()) -> jax.Array:
    """An fp32 master parameter annotated with logical axes (fan-in scaled normal by default)."""
    if init is None:
        out_axes = tuple(i for i in range(len(shape)) if i not in fan_in_axes and i not in batch_axes)
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=tuple(fan_in_axes),
                                                out_axis=out_axes, batch_axis=tuple(batch_axes))
    return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def embedding_lookup(table_XD: jax.Array, ids_BT, row_axis: str) -> jax.Array:
    """Rows of a table; the table is first made whole along embed (as FSDP gathers any
    weight before use) so the output can take the batch sharding without the partitioner
    falling back to a full rematerialisation."""
    return jnp.take(constrain(table_XD, (row_axis, "act_embed")), ids_BT, axis=0)


def _embedding_lookup_fwd(table_XD, ids_BT, row_axis):
    return embedding_lookup(table_XD, ids_BT, row_axis), (table_XD, ids_BT)


def _embedding_lookup_bwd(row_axis, saved, grad_BTD):
    table_XD, ids_BT = saved
    # The table's gradient goes straight to the parameter's own sharding, as FSDP reduce-scatters
    # any weight's (transposing the forward's constraint would first make the whole table's
    # gradient replicated: one all-reduce over every device, across the network under HSDP). The
    # rows scattered into it first leave the FSDP axis for the model dimension, one all-to-all:
    # left to the partitioner, a batch over data x fsdp going to embed over fsdp became
    # "Involuntary full rematerialization" (the whole activation gathered on every device, every
    # micro-batch) under HSDP. Written embed first, the rule table gives embed fsdp and the rows
    # the rest of their axes (the fallback `batch` rule), so the reshard is an all-to-all over fsdp.
    grad_DBT = constrain(jnp.moveaxis(grad_BTD, -1, 0), ("embed", "batch", "residual_seq")[:grad_BTD.ndim])
    grad_XD = jnp.zeros(table_XD.shape, grad_BTD.dtype).at[ids_BT].add(jnp.moveaxis(grad_DBT, 0, -1))
    return constrain(grad_XD, (row_axis, "embed")).astype(table_XD.dtype), None


embedding_lookup.defvjp(_embedding_lookup_fwd, _embedding_lookup_bwd)


@jax.custom_vjp
def head_logits(h_BTD: jax.Array, head_DE: jax.Array) -> jax.Array:
    """The LM head's logits [B, T, E] in float32 (accumulated and kept in fp32 for the loss) from
    `h_BTD` and `head_DE` in the compute dtype. The backward's two matmuls run in the compute
    dtype, as every other matmul's do: autodiff of the fp32 output would hand them the fp32 logit
    gradient, and XLA would run both (the largest of a big-vocabulary model's step) in fp32,
    a third of the compiled llama3-8b step on H100."""
    return jnp.einsum("btd,de->bte", h_BTD, head_DE, preferred_element_type=jnp.float32)


def _head_logits_fwd(h_BTD, head_DE):
    return head_logits(h_BTD, head_DE), (h_BTD, head_DE)


def _head_logits_bwd(saved, grad_BTE):
    h_BTD, head_DE = saved
    grad_BTE = grad_BTE.astype(h_BTD.dtype)
    return (jnp.einsum("bte,de->btd", grad_BTE, head_DE).astype(h_BTD.dtype),
            jnp.einsum("btd,bte->de", h_BTD, grad_BTE).astype(head_DE.dtype))


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def next_token_loss(logits_BTE: jax.Array, tokens_BT: jax.Array, seg_BT: jax.Array) -> jax.Array:
    """Mean cross-entropy of each token's successor, where the successor belongs to the same
    (real, non-padding) sample."""
    targets_BT, has_next_BT = next_tokens(tokens_BT, seg_BT)
    return token_mean(token_nll(logits_BTE, targets_BT), has_next_BT)


def next_tokens(tokens_BT: jax.Array, seg_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(targets, has_next): each token's successor, and where it belongs to the same (real,
    non-padding) sample."""
    axis = _SEQUENCE_SPLIT.get()
    if axis is None:
        after = lambda x_BT: jnp.zeros_like(x_BT[:, :1])  # noqa: E731  past the row's end: padding
    else:  # a chunk's last token's successor is the next rank's first; the last rank's, padding
        ranks = jax.lax.axis_size(axis)
        after = lambda x_BT: jax.lax.ppermute(x_BT[:, :1], axis, [(r + 1, r) for r in range(ranks - 1)])  # noqa: E731
    tokens_BT, seg_BT = (jnp.concatenate([x_BT, after(x_BT)], axis=1) for x_BT in (tokens_BT, seg_BT))
    return tokens_BT[:, 1:], (seg_BT[:, 1:] == seg_BT[:, :-1]) & (seg_BT[:, :-1] != 0)


def token_nll(logits_BTE: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Each token's cross-entropy against its target."""
    return -jnp.take_along_axis(jax.nn.log_softmax(logits_BTE, axis=-1), targets_BT[..., None], axis=-1)[..., 0]


def one_hot_nll(logits_BTE: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """`token_nll` with the target's logit picked by a one-hot sum, not a gather: inside a
    pipeline's shard_map, a gather from logits whose vocabulary tensor splits, beside rows FSDP
    splits, aborts XLA:CPU's compile on jax 0.10.2 (llama-tiny on `stage=2,fsdp=2,tensor=2`, a
    test case). The sum is vocabulary-parallel cross-entropy as Megatron computes it."""
    onehot_BTE = jax.nn.one_hot(targets_BT, logits_BTE.shape[-1], dtype=logits_BTE.dtype)
    return jax.nn.logsumexp(logits_BTE, axis=-1) - jnp.sum(logits_BTE * onehot_BTE, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in fp32, returned in x's dtype. The backward keeps x
    and the scale and recomputes the fp32 values from them, as fused norm kernels (Transformer
    Engine's, Apex's) keep their input; autodiff kept x and the normalised value in fp32, 4x a
    bf16 x's bytes a norm. A custom_vjp, not `jax.checkpoint`: the checkpoint's optimisation
    barriers moved XLA's GPU schedule (FSDP gathers prefetched without the pipeliner's flag,
    collective matmul's ring transfers left without compute)."""
    return _rms_norm(x, scale, eps)


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


def _rms_norm_fwd(x, scale, eps):
    return _rms_norm(x, scale, eps), (x, scale)


def _rms_norm_bwd(eps, kept, dy):
    return jax.vjp(functools.partial(_rms_norm, eps=eps), *kept)[1](dy)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@jax.custom_vjp
def gathered(h_BLD: jax.Array) -> jax.Array:
    """A norm's output on the residual stream's shards, then whole along the sequence for the
    sub-block that reads it. Under sequence parallelism the gather comes after the norm, in the
    compute dtype, as Megatron gathers, and its transpose reduce-scatters the input gradient onto
    the shards (`onto_residual_shards`); left to propagation, XLA gathered the norm's fp32 input
    in the recomputed forward and gathered whole output-projection weights in the backward
    (llama3-70b on tensor=8)."""
    return _gather(h_BLD)


def _gather(h_BLD):
    return constrain(constrain(h_BLD, RESIDUAL_BLD), SUBLAYER_IN_BLD)


def _gathered_fwd(h_BLD):
    return _gather(h_BLD), None


def _gathered_bwd(_, grad_BLD):
    return (onto_residual_shards(grad_BLD),)


def onto_residual_shards(grad_BLD: jax.Array) -> jax.Array:
    """An input gradient of the sub-block `gathered` feeds, onto the residual stream's shards:
    the tensor ranks' partial sums reduced there (a reduce-scatter under sequence parallelism).
    fp8's projections call it on their unscaled sum (`fp8.fp8_einsums`): scaled first, XLA's GPU
    compile all-reduced the whole gradient and sliced it after the scaling."""
    return constrain(grad_BLD, RESIDUAL_BLD)


gathered.defvjp(_gathered_fwd, _gathered_bwd)


@jax.custom_vjp
def gathered_gradient(out_BLD: jax.Array) -> jax.Array:
    """A sub-block's output, unchanged; its gradient made whole along the sequence before the
    sub-block's backward reads it. Under sequence parallelism the gradient arrives on the
    residual stream's shards; told nothing, XLA computed the attention output projection's input
    gradient on those shards by gathering the whole projection weight and then exchanging heads
    for sequence (an all-to-all), where gathering the gradient (Megatron's order) keeps every
    weight on its tensor rank."""
    return out_BLD


def _gathered_gradient_fwd(out_BLD):
    return out_BLD, None


def _gathered_gradient_bwd(_, grad_BLD):
    return (constrain(grad_BLD, SUBLAYER_IN_BLD),)


gathered_gradient.defvjp(_gathered_gradient_fwd, _gathered_gradient_bwd)


class RMSNorm(nn.Module):
    dim: int
    axis_name: str
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = param(self, "scale", (self.dim,), (self.axis_name,), nn.initializers.ones)
        return rms_norm(x, scale, self.eps)


# The MLP's activations with their derivatives written out (`jax.custom_jvp`): the backward
# keeps one coefficient an input (silu and its gated derivative for SwiGLU), as fused activation
# kernels keep what their backward reads; autodiff of the composed ops kept silu's sigmoid and
# products besides, three more [tokens, mlp_dim] arrays a layer. A policy that saves the inputs by
# name recomputes the coefficients from them.
@jax.custom_jvp
def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return nn.silu(gate) * up


@_swiglu.defjvp
def _swiglu_jvp(primals, tangents):
    (gate, up), (d_gate, d_up) = primals, tangents
    sigmoid = jax.nn.sigmoid(gate)
    silu = gate * sigmoid
    return silu * up, (sigmoid * (1 + gate * (1 - sigmoid)) * up) * d_gate + silu * d_up


@jax.custom_jvp
def _relu2(u: jax.Array) -> jax.Array:
    return jnp.square(nn.relu(u))


@_relu2.defjvp
def _relu2_jvp(primals, tangents):
    (u,), (d_u,) = primals, tangents
    r = nn.relu(u)
    return r * r, (2 * r) * d_u


@jax.custom_jvp
def _gelu(u: jax.Array) -> jax.Array:
    return nn.gelu(u)


@_gelu.defjvp
def _gelu_jvp(primals, tangents):
    (u,), (d_u,) = primals, tangents
    value, derivative = jax.jvp(nn.gelu, (u,), (jnp.ones_like(u),))
    return value, derivative * d_u


_ACTIVATIONS = {"relu2": _relu2, "gelu": _gelu}  # gelu: GPT, MPT


class Mlp(nn.Module):
    d_model: int
    mlp_dim: int
    activation: str
    dtype: jnp.dtype
    input_grad: Callable | None = None  # applied to fp8's unscaled input gradient (`fp8.project_all`)

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        D, F = self.d_model, self.mlp_dim
        up_DF = param(self, "up_DF", (D, F), ("embed", "mlp")).astype(self.dtype)
        down_FD = param(self, "down_FD", (F, D), ("mlp", "embed")).astype(self.dtype)
        if self.activation == "swiglu":  # one fused projection (fp8: one scale), as Transformer Engine's fc1
            gate_DF = param(self, "gate_DF", (D, F), ("embed", "mlp")).astype(self.dtype)
            up_BLF, gate_BLF = project_all(("bld,df->blf", "bld,df->blf"), x_BLD, (up_DF, gate_DF), self.input_grad)
            h_BLF = _swiglu(checkpoint_name(gate_BLF, remat.MLP_GATE), checkpoint_name(up_BLF, remat.MLP_UP))
        else:
            (up_BLF,) = project_all(("bld,df->blf",), x_BLD, (up_DF,), self.input_grad)
            h_BLF = _ACTIVATIONS[self.activation](checkpoint_name(up_BLF, remat.MLP_IN))
        h_BLF = checkpoint_name(constrain(h_BLF, ("batch", "seq", "act_mlp")), remat.MLP_HIDDEN)
        return checkpoint_name(reduce_matmul("blf,fd->bld", h_BLF, down_FD, 2, 0), remat.MLP_OUT)
