"""The two-way attention mask of Cosmos 3 over packed samples.

Each sample is a causal reasoner split (text) and one full generator split. Reasoner
queries see their own sample's reasoner tokens causally; generator queries see every
token of their own sample; nothing crosses samples. Segment id 0 is padding, which
behaves as one more lone causal split (it only ever sees padding).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def two_way_mask(segment_ids_BS: jax.Array, is_generator_BS: jax.Array) -> jax.Array:
    """[B, S, S] boolean mask (query, key) for tokens in any order; causality follows index order."""
    S = segment_ids_BS.shape[1]
    same_sample_BSS = segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :]
    q_gen_BS1 = is_generator_BS[:, :, None]
    k_gen_B1S = is_generator_BS[:, None, :]
    causal_SS = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
    reasoner_sees_BSS = ~q_gen_BS1 & ~k_gen_B1S & causal_SS[None]
    return same_sample_BSS & (q_gen_BS1 | reasoner_sees_BSS)
