"""`stacked_reads.evaluate_reading_stacks`: a jaxpr run on chunk v of [V, k, ...] stacks gives the
numbers of the jaxpr run on the sliced chunk, forward and backward (a reversed scan), and the scan
reads each layer out of the whole stack: no chunk-sized slice of a scanned stack is left in the
program."""
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxpr_as_fun

from xlaopt.transforms.stacked_reads import evaluate_reading_stacks

V, K, D = 3, 4, 8


def _layers(w_KDD, shift_D, x_BD):
    """A chunk of K layers over x, then a shift read outside the scan (sliced to its chunk)."""
    def layer(x, w):
        y = jnp.tanh(x @ w)
        return y, y.sum()

    y, sums_K = jax.lax.scan(layer, x_BD, w_KDD)
    return y + shift_D, sums_K


def _stacks():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    w = jax.random.normal(k1, (V, K, D, D)) / np.sqrt(D)
    shift = jax.random.normal(k2, (V, D))
    x = jax.random.normal(k3, (2, D))
    dy = jax.random.normal(k4, (2, D))
    return w, shift, x, dy


def _chunk(stacks, v):
    return [s[v] for s in stacks]


def test_a_chunk_read_in_place_gives_the_chunks_numbers_forward_and_backward():
    w, shift, x, dy = _stacks()
    forward = jax.make_jaxpr(_layers)(w[0], shift[0], x)

    def backward(w_KDD, shift_D, x_BD, dy_BD):
        _, vjp = jax.vjp(lambda w, s, x: _layers(w, s, x)[0], w_KDD, shift_D, x_BD)
        return vjp(dy_BD)

    transposed = jax.make_jaxpr(backward)(w[0], shift[0], x, dy)
    assert any(e.primitive.name == "scan" and e.params["reverse"] for e in transposed.jaxpr.eqns)
    for v in range(V):
        in_place = jax.jit(lambda w, s, v, x: evaluate_reading_stacks(forward, [w, s], v, x))(w, shift, v, x)
        sliced = jaxpr_as_fun(forward)(*_chunk([w, shift], v), x)
        for a, b in zip(in_place, sliced, strict=True):
            np.testing.assert_array_equal(a, b)
        in_place = jax.jit(lambda w, s, v, x, dy: evaluate_reading_stacks(transposed, [w, s], v, x, dy))(
            w, shift, v, x, dy)
        sliced = jaxpr_as_fun(transposed)(*_chunk([w, shift], v), x, dy)
        for a, b in zip(in_place, sliced, strict=True):
            np.testing.assert_array_equal(a, b)


def test_the_scan_slices_one_layer_of_the_whole_stack_and_never_the_chunk():
    """In the lowered program the scanned stack is sliced [1, 1, D, D] (layer i of chunk v) inside
    the loop and never [1, K, D, D] (the chunk, which XLA's GPU compile copied at every tick);
    the shift, read outside the scan, is sliced to its chunk once."""
    w, shift, x, _ = _stacks()
    forward = jax.make_jaxpr(_layers)(w[0], shift[0], x)
    text = jax.jit(lambda w, s, v, x: evaluate_reading_stacks(forward, [w, s], v, x)).lower(w, shift, 1, x).as_text()
    slices = re.findall(r"stablehlo\.dynamic_slice %\S+, [^:]*: \(tensor<([\dx]+)xf32>.*?-> tensor<([\dx]+)xf32>",
                        text)
    assert set(slices) == {(f"{V}x{K}x{D}x{D}", f"1x1x{D}x{D}"), (f"{V}x{D}", f"1x{D}")}, slices
