"""KV-cached autoregressive text decoding for causal text towers: the decoder LLM
(`models.decoder.Decoder`) and Cosmos 3's reasoner (`models.cosmos3.Cosmos3`, text only).

Both towers decode the same way: embed the new tokens, then per layer `TransformerBlock.qkv`,
append the keys and values to the cache, attend over the cache, `TransformerBlock.finish`;
then the final norm and the LM head. They differ only in where their parameters sit and how
they rotate, which a `Tower` says; the math is the model's own (its blocks and norms bound to
its training parameters with `.apply`), so a trained checkpoint decodes as is, with no new
parameters and no second copy of the layer code to drift from the training path.

Prefill and decode are one function (`extend`: L new tokens onto a cache), compiled twice:
once for the prompt's length, once for one token, the latter reused every step with the cache
donated so XLA updates it in place. `Decoding.generate` runs the loop and reports compile and
per-step wall times. Rows share one length (equal-length prompts): left-padding ragged
prompts is not supported.

On a mesh (`Decoding(model, placement)`, `inference.placement`) the parameters sit in their
training layout, the prompt's rows split over the batch axes, and each layer's cache (keys [B,
N, S, K], values [B, N, K, S]) takes its rows there too and its kv heads over `tensor`: the cache
and the outputs are constrained by logical axes (`K_CACHE_AXES`, `V_CACHE_AXES`,
`layers.constrain`, a no-op on one device) so each step's outputs land where the next step's
inputs were compiled to be, and the donated cache keeps one layout. The step runs layer by layer
over weights split once from the training stack (`layer_params`), so that every matmul reads its
weights and every attention its cache in place, as a decode step at the HBM floor must.

Serving executables are compiled with `SERVING_XLA_OPTIONS`: XLA's own all-reduce kernels, which
on one host's GPUs run a token step's small tensor-parallel all-reduces (rows x d_model) in about
half NCCL's latency (`analysis.costmodel.kernel_all_reduce_time_s`); elsewhere the option is inert.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from xlaopt.analysis.costmodel import ALL_REDUCE_KERNELS_OPTION
from xlaopt.errors import UserError
from xlaopt.models import cosmos3, decoder
from xlaopt.models.attention import attention
from xlaopt.models.block import TransformerBlock
from xlaopt.models.layers import RMSNorm, constrain, embedding_lookup

SERVING_XLA_OPTIONS = {ALL_REDUCE_KERNELS_OPTION: True}


@dataclasses.dataclass(frozen=True)
class Tower:
    """What decoding needs to know of a causal text tower: its block's fields, where its
    parameters sit in the model's tree, and its rotary tables of (t, h, w) positions."""
    block: dict  # TransformerBlock fields, exactly as the model builds the block
    layer_name: str  # the block's name under params["layers"]
    final_norm: str
    tied_head: bool  # LM head = embed_ED.T (else params["lm_head_DE"])
    rope: Callable  # positions_3BL -> (cos_BLK, sin_BLK)
    num_layers: int

    @property
    def dtype(self):
        return self.block["dtype"]


def decoder_tower(model: decoder.Decoder) -> Tower:
    c = model.config
    return Tower(decoder.block_fields(c, model.dtype), "block", "final_norm", c.tie_embeddings,
                 lambda pos_3BL: decoder.rope_tables(c, pos_3BL), c.num_layers)


def reasoner_tower(model: cosmos3.Cosmos3) -> Tower:
    """Cosmos 3's reasoner alone: its queries read reasoner keys only, so text decodes without
    the generator."""
    c = model.config
    return Tower(cosmos3.reasoner_fields(c, model.dtype), "reasoner", "reasoner_final_norm", False,
                 lambda pos_3BL: cosmos3.rope_tables(c, pos_3BL, model.rope_inv_freq), c.num_layers)


def tower_of(model) -> Tower:
    if isinstance(model, decoder.Decoder):
        return decoder_tower(model)
    if isinstance(model, cosmos3.Cosmos3):
        return reasoner_tower(model)
    raise UserError(f"KV-cached decoding needs a Decoder or a Cosmos3 model, not {type(model).__name__}")


# Logical axes of Cosmos 3 sampling's stacked reasoner cache [L, B, S, N, K] (`sample_cosmos`).
CACHE_AXES = (None, "batch", "seq", "act_kv_heads", "head_dim")
# One decoding layer's cache: keys [B, N, S, K], values [B, N, K, S], positions minor, which is how
# XLA's GPU dot of the probabilities with the values reads them. Kept as [B, S, N, K], XLA
# transposed the whole value cache at every step (2 x 2.7 GB a device on llama3-70b, BENCHMARKS.md).
K_CACHE_AXES = ("batch", "act_kv_heads", "seq", "head_dim")
V_CACHE_AXES = ("batch", "act_kv_heads", "head_dim", "seq")
PROMPT_AXES = ("batch", "seq")
TOKEN_AXES = ("batch",)
LOGITS_AXES = ("batch", "act_vocab")


class KVCache(NamedTuple):
    """Rotated keys and values, one array a layer (each updated in place, none sliced out of a
    stack); positions >= `length` are unwritten."""
    k_BNSK: tuple[jax.Array, ...]
    v_BNKS: tuple[jax.Array, ...]
    length: jax.Array  # int32 scalar: tokens cached, the same in every row

    @property
    def max_len(self) -> int:
        return self.k_BNSK[0].shape[2]

    def constrained(self) -> "KVCache":
        return KVCache(tuple(constrain(k, K_CACHE_AXES) for k in self.k_BNSK),
                       tuple(constrain(v, V_CACHE_AXES) for v in self.v_BNKS), self.length)


def cache_shapes(tower: Tower, batch: int, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One layer's (keys, values) cache shapes."""
    N, K = tower.block["num_kv_heads"], tower.block["head_dim"]
    return (batch, N, max_len, K), (batch, N, K, max_len)


def empty_cache(tower: Tower, batch: int, max_len: int) -> KVCache:
    k_shape, v_shape = cache_shapes(tower, batch, max_len)
    return KVCache(tuple(jnp.zeros(k_shape, tower.dtype) for _ in range(tower.num_layers)),
                   tuple(jnp.zeros(v_shape, tower.dtype) for _ in range(tower.num_layers)), jnp.zeros((), jnp.int32))


def layer_params(tower: Tower, params) -> dict:
    """The parameters with the layer stack split into one tree a layer, as decoding reads them:
    sliced from a stack inside the step (a scan), each layer's weights were copied out before its
    matmuls, twice the weights' bytes a token (llama3-70b, BENCHMARKS.md). Done once, on arrays
    or on abstract ones (`jax.ShapeDtypeStruct` with their shardings, for a compile)."""
    stacked = params["layers"][tower.layer_name]
    if not isinstance(stacked, dict):
        return params  # split already
    layers = tuple(jax.tree.map(lambda a, i=i: _layer_of(a, i), stacked) for i in range(tower.num_layers))
    return {**params, "layers": {**params["layers"], tower.layer_name: layers}}


def _layer_of(a, i: int):
    if isinstance(a, jax.ShapeDtypeStruct):
        s = a.sharding
        sharding = None if s is None else NamedSharding(s.mesh, PartitionSpec(*tuple(s.spec)[1:]))
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=sharding)
    return a[i]


def _layer(tower: Tower, params_i, x_BLD, k_BNSK, v_BNKS, rope, start):
    """One layer over the new tokens: their keys and values join the layer's cache, and they
    attend over it causally (a query at position p sees cached positions <= p)."""
    block = TransformerBlock(**tower.block)
    q_BLHK, k_BLNK, v_BLNK, _ = block.apply({"params": params_i}, x_BLD, *rope, method="qkv")
    k_BNSK = jax.lax.dynamic_update_slice(k_BNSK, k_BLNK.transpose(0, 2, 1, 3).astype(k_BNSK.dtype), (0, 0, start, 0))
    v_BNKS = jax.lax.dynamic_update_slice(v_BNKS, v_BLNK.transpose(0, 2, 3, 1).astype(v_BNKS.dtype), (0, 0, 0, start))
    # Each layer's write stays in place on a mesh: the cache keeps its layout, no reshard.
    k_BNSK, v_BNKS = constrain(k_BNSK, K_CACHE_AXES), constrain(v_BNKS, V_CACHE_AXES)
    B, L, S = x_BLD.shape[0], x_BLD.shape[1], k_BNSK.shape[2]
    mask_BLS = jnp.broadcast_to(jnp.arange(S)[None, :] <= start + jnp.arange(L)[:, None], (B, L, S))
    attn_BLHK = attention(q_BLHK, k_BNSK.transpose(0, 2, 1, 3), v_BNKS.transpose(0, 3, 1, 2), mask_BLS)
    return block.apply({"params": params_i}, x_BLD, attn_BLHK, method="finish"), k_BNSK, v_BNKS


def extend(tower: Tower, params, tokens_BL, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Next-token logits [B, E] (fp32) after the last of L new tokens, and the cache holding them.
    `params` as `layer_params` gives them. The caller keeps `cache.length + L <= cache.max_len`
    (`Decoding` checks it up front): under jit a write past the end cannot raise, XLA would clamp
    it onto the last slots."""
    B, L = tokens_BL.shape
    cache = cache.constrained()
    start = cache.length
    x_BLD = embedding_lookup(params["embed_ED"], tokens_BL, "vocab").astype(tower.dtype)
    positions_3BL = jnp.broadcast_to(start + jnp.arange(L, dtype=jnp.int32), (3, B, L))  # text: (p, p, p)
    rope = tower.rope(positions_3BL)
    # Layer by layer, not a scan: each layer's weights and cache are arguments of their own, read
    # in place by its matmuls and updated in place (the donated cache aliases the step's output).
    ks, vs = [], []
    for params_i, k_BNSK, v_BNKS in zip(params["layers"][tower.layer_name], cache.k_BNSK, cache.v_BNKS):
        x_BLD, k_BNSK, v_BNKS = _layer(tower, params_i, x_BLD, k_BNSK, v_BNKS, rope, start)
        ks.append(k_BNSK)
        vs.append(v_BNKS)
    return lm_logits(tower, params, x_BLD[:, -1:])[:, 0], KVCache(tuple(ks), tuple(vs), start + L).constrained()


def lm_logits(tower: Tower, params, x_BLD) -> jax.Array:
    """Final norm and LM head, as the model's forward pass computes them (fp32 logits)."""
    D = tower.block["d_model"]
    h_BLD = RMSNorm(D, "embed", tower.block["norm_eps"]).apply({"params": params[tower.final_norm]}, x_BLD)
    head_DE = params["embed_ED"].T if tower.tied_head else params["lm_head_DE"]
    return jnp.einsum("bld,de->ble", h_BLD, head_DE.astype(tower.dtype), preferred_element_type=jnp.float32)


def prefill(tower: Tower, params, prompt_BP, cache_len: int) -> tuple[jax.Array, KVCache]:
    """Logits [B, E] after the prompt, and a cache of `cache_len` positions holding it."""
    return extend(tower, params, prompt_BP, empty_cache(tower, prompt_BP.shape[0], cache_len))


def decode_step(tower: Tower, params, token_B, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Logits [B, E] after one more token per row, and the cache with it appended."""
    return extend(tower, params, token_B[:, None], cache)


def pick(logits_BE, cache: KVCache, key, temperature, greedy: bool) -> jax.Array:
    """The next token per row: argmax, or a draw at `temperature` from a key folded with the
    position the token will take (so a key and a prompt fix the whole sample)."""
    if greedy:
        return jnp.argmax(logits_BE, axis=-1).astype(jnp.int32)
    step_key = jax.random.fold_in(key, cache.length)
    return jax.random.categorical(step_key, logits_BE / temperature, axis=-1).astype(jnp.int32)


class Generation(NamedTuple):
    tokens_BN: np.ndarray  # the new tokens, int32
    logits_BNE: np.ndarray | None  # the logits each was picked from (keep_logits=True)
    stats: dict  # prefill_compile_s, decode_compile_s (0 when cached), prefill_s, decode_step_s


class Decoding:
    """KV-cached generation for one model (`tower_of`): the prefill executable per (batch,
    prompt length, cache length, mode) and the one-token decode executable per (batch, cache
    length, mode) are compiled on first use and kept. With a `placement` (`inference.placement`)
    they run on its mesh, the parameters and prompt placed there first."""

    def __init__(self, model, placement=None):
        self.tower = tower_of(model)
        self.placement = placement
        self._compiled: dict = {}
        self._served_for: tuple | None = None  # (the caller's params, them placed and split)
        self._prefill = jax.jit(functools.partial(prefill, self.tower), static_argnums=(2,))
        self._decode_step = jax.jit(functools.partial(decode_step, self.tower), donate_argnums=(2,))

    def prefill(self, params, prompt_BP, cache_len: int) -> tuple[jax.Array, KVCache]:
        """`prefill` jitted: logits [B, E] after the prompt, and its cache."""
        _check_prompt(prompt_BP, cache_len, _vocab(params))
        params, prompt_BP = self._put(params, prompt_BP, PROMPT_AXES, "the prompt")
        with self._on_mesh(prompt_BP.shape[0]):
            return self._prefill(params, prompt_BP, cache_len)

    def decode_step(self, params, token_B, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """`decode_step` jitted, the cache donated (do not read it again). Keep
        `cache.length < cache.max_len`: checking it here would wait for the device each step."""
        params, token_B = self._put(params, token_B, TOKEN_AXES, "the tokens")
        with self._on_mesh(token_B.shape[0]):
            return self._decode_step(params, token_B, cache)

    def generate(self, params, prompt_BP, new_tokens: int, *, temperature: float | None = None, key=None,
                 cache_len: int | None = None, keep_logits: bool = False) -> Generation:
        """`new_tokens` tokens after `prompt_BP` [B, P]: greedy (temperature None) or sampled at
        `temperature` with `key`. `cache_len` (default P + new_tokens) may be larger, so prompts
        of other lengths reuse the decode executable."""
        prompt_BP = np.asarray(prompt_BP)
        cache_len = prompt_BP.shape[-1] + new_tokens if cache_len is None else cache_len
        _check_generate(prompt_BP, new_tokens, cache_len, temperature, key, _vocab(nn.meta.unbox(params)))
        greedy = temperature is None
        key = jax.random.key(0) if greedy else key  # unused by argmax; keeps one signature
        temperature = jnp.float32(1.0 if greedy else temperature)
        params, prompt = self._put(params, prompt_BP, PROMPT_AXES, "the prompt")
        if self.placement is not None:
            key, temperature = self.placement.replicate(key), self.placement.replicate(temperature)
        args = (params, prompt, key, temperature)
        prefill_exe, prefill_compile_s = self._executable("prefill", _prefill_and_pick, args, cache_len, greedy)

        t0 = time.perf_counter()
        token_B, logits_BE, cache = prefill_exe(*args)
        token_B.block_until_ready()
        prefill_s = time.perf_counter() - t0
        tokens, logits, step_s = [token_B], [logits_BE], []
        decode_exe, decode_compile_s = (None, 0.0)
        for _ in range(new_tokens - 1):
            step_args = (params, token_B, cache, key, temperature)
            if decode_exe is None:
                decode_exe, decode_compile_s = self._executable("decode", _decode_and_pick, step_args, None, greedy)
            t0 = time.perf_counter()
            token_B, logits_BE, cache = decode_exe(*step_args)
            token_B.block_until_ready()  # per-step wall time, not dispatch time
            step_s.append(time.perf_counter() - t0)
            tokens.append(token_B)
            if keep_logits:
                logits.append(logits_BE)
        stats = dict(prefill_compile_s=prefill_compile_s, decode_compile_s=decode_compile_s, prefill_s=prefill_s,
                     decode_step_s=step_s)
        logits_BNE = np.stack([np.asarray(a) for a in logits], axis=1) if keep_logits else None
        return Generation(np.stack([np.asarray(t) for t in tokens], axis=1), logits_BNE, stats)

    def _executable(self, name: str, fn, args, cache_len, greedy: bool):
        """(compiled fn, seconds spent compiling now): lowered ahead of time so compile time is
        measured apart from the first step's run time."""
        cache_key = (name, tuple((np.shape(a), str(a.dtype)) for a in jax.tree.leaves(args)), cache_len, greedy)
        if cache_key in self._compiled:
            return self._compiled[cache_key], 0.0
        t0 = time.perf_counter()
        if name == "prefill":
            jitted = jax.jit(lambda p, prompt, k, t: fn(self.tower, p, prompt, k, t, cache_len, greedy))
        else:  # the cache (argument 2) is donated: each step updates it in place
            jitted = jax.jit(lambda p, tok, c, k, t: fn(self.tower, p, tok, c, k, t, greedy), donate_argnums=(2,))
        with self._on_mesh(args[1].shape[0]):
            exe = jitted.lower(*args).compile(compiler_options=SERVING_XLA_OPTIONS)
        self._compiled[cache_key] = exe
        return exe, time.perf_counter() - t0

    def _put(self, params, rows, axes, what: str):
        """The parameters served (`_served`) and int32 rows, on the placement's mesh when there is one."""
        rows = jnp.asarray(rows, jnp.int32)
        return self._served(params), rows if self.placement is None else self.placement.put(rows, axes, what)

    def _served(self, params):
        """`params` unboxed, placed and split a layer a tree (`layer_params`), once for the same
        params object: a caller's own token loop over `decode_step` would otherwise slice every
        layer out of the stack again for every token."""
        if self._served_for is not None and self._served_for[0] is params:
            return self._served_for[1]
        placed = nn.meta.unbox(params)
        if self.placement is not None:
            placed = self.placement.put_params(placed)
        served = layer_params(self.tower, placed)
        self._served_for = (params, served)
        return served

    def _on_mesh(self, rows: int):
        """Tracing under the placement's mesh and layout for `rows` rows (nothing on one device)."""
        return contextlib.nullcontext() if self.placement is None else self.placement.tracing(rows)


def _prefill_and_pick(tower, params, prompt_BP, key, temperature, cache_len, greedy):
    logits_BE, cache = prefill(tower, params, prompt_BP, cache_len)
    return _picked(pick(logits_BE, cache, key, temperature, greedy), logits_BE, cache)


def _decode_and_pick(tower, params, token_B, cache, key, temperature, greedy):
    logits_BE, cache = decode_step(tower, params, token_B, cache)
    return _picked(pick(logits_BE, cache, key, temperature, greedy), logits_BE, cache)


def _picked(token_B, logits_BE, cache: KVCache):
    """The step's outputs in the layout the next decode step is compiled for (a no-op on one device)."""
    return constrain(token_B, TOKEN_AXES), constrain(logits_BE, LOGITS_AXES), cache


def _vocab(params) -> int:
    return params["embed_ED"].shape[0]


def _check_prompt(prompt_BP, cache_len: int, vocab: int) -> None:
    if np.ndim(prompt_BP) != 2 or np.shape(prompt_BP)[1] < 1:
        raise UserError(f"prompt of shape {np.shape(prompt_BP)}: give [batch, prompt_len] token ids with "
                        f"prompt_len >= 1 (rows of equal length)")
    ids = np.asarray(prompt_BP)
    if ids.min() < 0 or ids.max() >= vocab:  # jnp.take would read NaN rows, not fail
        raise UserError(f"prompt token ids span [{ids.min()}, {ids.max()}]; the vocabulary is [0, {vocab - 1}]")
    if np.shape(prompt_BP)[1] > cache_len:
        raise UserError(f"prompt of {np.shape(prompt_BP)[1]} tokens does not fit a cache of {cache_len}; "
                        f"give cache_len >= {np.shape(prompt_BP)[1]}")


def _check_generate(prompt_BP, new_tokens: int, cache_len: int, temperature, key, vocab: int) -> None:
    if new_tokens < 1:
        raise UserError(f"new_tokens={new_tokens}: generate at least 1 token")
    _check_prompt(prompt_BP, cache_len, vocab)
    P = prompt_BP.shape[1]
    if P + new_tokens > cache_len:
        raise UserError(f"prompt of {P} tokens + new_tokens={new_tokens} = {P + new_tokens} positions exceed "
                        f"cache_len={cache_len}; give cache_len >= {P + new_tokens} or fewer new tokens")
    if temperature is not None and not temperature > 0:
        raise UserError(f"temperature={temperature}: sampling needs temperature > 0 (or temperature=None "
                        f"for greedy decoding)")
    if temperature is not None and key is None:
        raise UserError("sampling (temperature set) needs a key: pass key=jax.random.key(seed)")
    if temperature is None and key is not None:
        raise UserError("a key was given but temperature is None (greedy decoding ignores keys); "
                        "pass temperature > 0 to sample")
