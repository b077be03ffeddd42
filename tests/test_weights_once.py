"""The weights' own work run once a step (`xlaopt.transforms.weights_once`): fp8's quantization of
each weight leaves the micro-batch loop, and the gradients are bit for bit those of the step that
quantizes at every micro-batch."""
import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from xlaopt.data.batch import BatchShape
from xlaopt.data.synthetic_text import SyntheticText
from xlaopt.execution import ExecutionConfig
from xlaopt.models.fp8 import FORWARD
from xlaopt.models.registry import get_config
from xlaopt.program import TrainProgram, TrainSettings
from xlaopt.step import build_grad_fn, build_init
from xlaopt.transforms import weights_once

from conftest import SMALL, loop_line

FP8 = ExecutionConfig(compute_dtype="bfloat16", matmuls="fp8", micro_batches=2)


def _depths(jaxpr, shapes, depth=0) -> set:
    """The scan depths at which an array shaped as one of `shapes` is cast to fp8 (E4M3)."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == FORWARD \
                and tuple(eqn.invars[0].aval.shape) in shapes:
            found.add(depth)
        for value in eqn.params.values():
            for sub in (value if isinstance(value, (tuple, list)) else (value,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found |= _depths(inner, shapes, depth + (eqn.primitive.name == "scan"))
    return found


def _computations(text: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) ", line)
        if head and line.rstrip().endswith("{"):
            name, comps[head.group(1)] = head.group(1), []
        elif line.startswith("}"):
            name = None
        elif name:
            comps[name].append(line)
    return comps


def _quantized_in(text: str, trips: int) -> tuple[collections.Counter, collections.Counter]:
    """The shapes quantized to E4M3 (a clamp converted, fp8's `quantize`; XLA:CPU's own f8 <-> f16
    round trips are not clamped) inside the loop of `trips` iterations, and in the whole module."""
    comps = _computations(text)
    inside, todo = set(), [re.search(r"body=%([\w.\-]+)", loop_line(text, trips)).group(1)]
    while todo:  # every computation the loop's body calls, fuses, loops over or branches to
        name = todo.pop()
        if name not in inside and name in comps:
            inside.add(name)
            todo += [c for line in comps[name] for c in re.findall(r"(?:calls|body|condition|to_apply)=%([\w.\-]+)", line)]
            todo += [c for line in comps[name] for group in re.findall(r"branch_computations=\{([^}]*)\}", line)
                     for c in re.findall(r"%([\w.\-]+)", group)]
    shapes = lambda names: collections.Counter(  # noqa: E731
        m for n in names for line in comps[n] for m in re.findall(r"= (f8e4m3fn\[[\d,]*\])\S* convert\(%clamp", line))
    return shapes(inside), shapes(comps)


def test_fp8_weights_are_quantized_once_a_step_and_the_gradients_are_bit_for_bit_the_same():
    """In the jaxpr and in XLA:CPU's compiled module (4 micro-batches): inside the micro-batch
    loop E4M3 quantizes activations only, every weight's per-layer slice outside it, where the
    step that quantizes at every micro-batch does it inside; the gradients are the same."""
    execution = dataclasses.replace(FP8, micro_batches=4)
    program = TrainProgram(get_config("llama-tiny", SMALL), settings=TrainSettings(batch=BatchShape(8, 32, 0)),
                           execution=execution)
    key = jax.random.key(0)
    params = build_init(program)(key).params
    batch = SyntheticText(program.model, program.settings.batch, seed=0).batch(0)
    # The layers' projections, as their scan slices them.
    shapes = {w.shape[1:] for w in jax.tree.leaves(params["layers"]) if w.ndim > 2}
    once = build_grad_fn(program)
    every = build_grad_fn(program.replace(execution=dataclasses.replace(execution, weights_work_once=False)))
    # Depth 2: inside the layers' scan inside the micro-batch loop; 1: in the layers' scan alone.
    assert _depths(jax.make_jaxpr(every)(params, batch, key).jaxpr, shapes) == {2}
    assert _depths(jax.make_jaxpr(once)(params, batch, key).jaxpr, shapes) == {1}
    once, every = (jax.jit(fn).lower(params, batch, key).compile() for fn in (once, every))
    weights = {"f8e4m3fn[" + ",".join(map(str, (1, *shape))) + "]" for shape in shapes}
    (once_loop, once_all), (every_loop, _) = (_quantized_in(fn.as_text(), trips=4) for fn in (once, every))
    assert weights <= set(every_loop) and weights <= set(once_all)
    assert not weights & set(once_loop) and once_loop  # the activations still are, at every micro-batch
    loss, _, grads = once(params, batch, key)
    ref_loss, _, ref_grads = every(params, batch, key)
    assert loss == ref_loss
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_array_equal(got, want)


def test_split_holds_the_fp8_weights_and_their_scales_and_makes_the_rest_again():
    def fn(w, x):  # a weight quantized per tensor, a zero buffer, the weight read as it is too
        scale = jnp.max(jnp.abs(w)) / 448.0
        q = (w / scale).astype(FORWARD)
        y = x @ q.T.astype(jnp.float32) * scale + jnp.zeros((4, 2))
        return {"y": y.sum(), "w": (x @ w.T).sum()}

    w, x = jnp.arange(6.0).reshape(2, 3) - 2.0, jnp.ones((4, 3))
    once, each = weights_once.split(fn, w, jax.ShapeDtypeStruct(x.shape, x.dtype))
    held = once(w)
    assert jax.tree.map(float, each(held, w, x)) == jax.tree.map(float, fn(w, x))
    # Held: the fp8 weight (transposed or not) and scalars; not the zeros, not a copy of the weight.
    assert {(h.dtype, h.ndim > 0) for h in held} <= {(jnp.dtype(FORWARD), True), (jnp.dtype(jnp.float32), False)}
    assert any(h.dtype == FORWARD for h in held)
    # `each` quantizes nothing: no absolute maximum taken, no cast to fp8.
    eqns = jax.make_jaxpr(each)(held, w, x).jaxpr.eqns
    assert not [e for e in eqns if e.primitive.name == "reduce_max" or
                (e.primitive.name == "convert_element_type" and e.params["new_dtype"] == FORWARD)]


def test_held_values_keep_the_layout_of_the_parameter_shaped_as_them():
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    # (4, 2): one parameter's shape; (2, 2): two parameters' with two layouts, left to the partitioner.
    hold = weights_once.in_layouts([(4, 2), (2, 2), (2, 2)], [PartitionSpec("fsdp"), PartitionSpec(),
                                                               PartitionSpec("fsdp")])
    with jax.set_mesh(mesh):
        text = jax.jit(lambda a, b: hold([a, b])).lower(jnp.ones((4, 2)), jnp.ones((2, 2))).as_text()
    constraints = [line for line in text.splitlines() if "sharding_constraint" in line]
    assert len(constraints) == 1 and '[{"fsdp"}, {}]' in constraints[0] and "tensor<4x2xf32>" in constraints[0]
