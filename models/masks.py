"""The two-way attention mask of Cosmos 3 over packed samples.

Each sample is a causal reasoner split (text) and one full generator split. Reasoner
queries see their own sample's reasoner tokens causally; generator queries see every
token of their own sample; nothing crosses samples. Segment id 0 is padding, which
behaves as one more lone causal split (it only ever sees padding). A decoder LLM is the
special case with no generator tokens: causal within each packed document.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from xlaopt.models.layers import chunk_start


class Tokens(NamedTuple):
    """What the mask needs to know of each token: sample, tower, and order."""
    segment_BL: jax.Array
    is_generator_BL: jax.Array
    index_BL: jax.Array

    @classmethod
    def of(cls, segment_BL, is_generator_BL) -> "Tokens":
        L = segment_BL.shape[1]
        index = jnp.broadcast_to(chunk_start(L) + jnp.arange(L), segment_BL.shape)
        return cls(segment_BL, is_generator_BL, index)

    def slice(self, start: int, stop: int) -> "Tokens":
        return Tokens(*(a[:, start:stop] for a in self))

    def then(self, other: "Tokens") -> "Tokens":
        """These tokens followed by `other`'s along the sequence (the inverse of `slice`)."""
        return Tokens(*(jnp.concatenate([a, b], axis=1) for a, b in zip(self, other)))


def pair_mask(q: Tokens, k: Tokens) -> jax.Array:
    """[B, L, S] boolean mask (True = may attend) of queries q over keys k."""
    same_sample = q.segment_BL[:, :, None] == k.segment_BL[:, None, :]
    q_gen = q.is_generator_BL[:, :, None]
    reasoner_sees = ~q_gen & ~k.is_generator_BL[:, None, :] & (q.index_BL[:, :, None] >= k.index_BL[:, None, :])
    return same_sample & (q_gen | reasoner_sees)


def two_way_mask(segment_ids_BS: jax.Array, is_generator_BS: jax.Array) -> jax.Array:
    """[B, S, S] mask of a packed sequence over itself; causality follows index order."""
    tokens = Tokens.of(segment_ids_BS, is_generator_BS)
    return pair_mask(tokens, tokens)
