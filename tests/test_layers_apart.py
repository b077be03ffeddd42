"""`layers_apart.evaluate_by_layer`: a jaxpr whose layer scan reads a stack held as its layers
(`Layers`, a buffer a layer) gives the numbers of the jaxpr on the stack, forward and backward (a
reversed scan); the scan is unrolled, reads no slice of a stack, and what it would stack comes
back a layer at a time."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxpr_as_fun

from xlaopt.transforms.layers_apart import apart, evaluate_by_layer, is_layers, scanned_inputs

K, D = 4, 8


def _layers(w_KDD, shift_KD, x_BD):
    """K layers over x (their outputs kept, stacked by the scan), then the shifts read whole."""
    def layer(x, w):
        y = jnp.tanh(x @ w)
        return y, y

    y, ys_KBD = jax.lax.scan(layer, x_BD, w_KDD)
    return y + shift_KD.sum(0), ys_KBD


def _inputs():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    w = jax.random.normal(k1, (K, D, D)) / np.sqrt(D)
    shift = jax.random.normal(k2, (K, D))
    x = jax.random.normal(k3, (2, D))
    dy = jax.random.normal(k4, (2, D))
    return w, shift, x, dy


def _stacked(outs):
    return [o.stacked() if is_layers(o) else o for o in outs]


def test_layers_held_apart_give_the_stacks_numbers_forward_and_backward():
    w, shift, x, dy = _inputs()
    forward = jax.make_jaxpr(_layers)(w, shift, x)

    def backward(w_KDD, shift_KD, x_BD, dy_BD):
        _, vjp = jax.vjp(lambda w, s, x: _layers(w, s, x)[0], w_KDD, shift_KD, x_BD)
        return vjp(dy_BD)

    transposed = jax.make_jaxpr(backward)(w, shift, x, dy)
    assert any(e.primitive.name == "scan" and e.params["reverse"] for e in transposed.jaxpr.eqns)
    assert scanned_inputs(forward) == [True, False, False]  # the weights; the shifts are read whole
    for closed, args in ((forward, (w, shift, x)), (transposed, (w, shift, x, dy))):
        by_layer = jax.jit(lambda w, *rest, closed=closed: evaluate_by_layer(closed, apart(w), *rest))(*args)
        whole = jax.jit(jaxpr_as_fun(closed))(*args)
        for a, b in zip(_stacked(by_layer), whole, strict=True):
            np.testing.assert_array_equal(a, b)
    ys = jax.jit(lambda w, s, x: evaluate_by_layer(forward, apart(w), s, x))(w, shift, x)[1]
    d_w = jax.jit(lambda w, s, x, dy: evaluate_by_layer(transposed, apart(w), s, x, dy))(w, shift, x, dy)[0]
    assert is_layers(ys) and len(ys) == K and is_layers(d_w) and len(d_w) == K  # never stacked


def test_the_unrolled_scan_reads_each_layer_from_its_own_buffer():
    """Lowered, the forward with the weights apart has no loop and slices nothing: each layer's
    weights are an argument of their own, each layer's kept output a result of its own. The
    shifts, read whole, stay one argument."""
    w, shift, x, _ = _inputs()
    forward = jax.make_jaxpr(_layers)(w, shift, x)
    lowered = jax.jit(lambda w, s, x: evaluate_by_layer(forward, w, s, x)).lower(apart(w), shift, x)
    text = lowered.as_text()
    assert "stablehlo.while" not in text and "slice" not in text, text
    assert text.count(f"tensor<{D}x{D}xf32>") >= K  # K weight arguments, [D, D] each
    outs = jax.eval_shape(lambda w, s, x: evaluate_by_layer(forward, w, s, x), apart(w), shift, x)
    assert [o.shape for o in outs[1]] == [(2, D)] * K
    whole = jax.jit(jaxpr_as_fun(forward)).lower(w, shift, x).as_text()
    assert "stablehlo.while" in whole and "dynamic_slice" in whole  # the check above can fail
