"""Agreement between the processes of a `jax.distributed` job, through JAX's own coordination
service (its key-value store), so a background thread can wait without running collectives."""
from __future__ import annotations

import jax

from xlaopt.checkpoint.layout import CheckpointError

TIMEOUT_MS = 30 * 60 * 1000  # a peer slower than this to write its shards is presumed lost


def _client():
    from jax._src import distributed  # the runtime's client; JAX has no public handle on it

    if distributed.global_state.client is None:
        raise CheckpointError(f"{jax.process_count()} processes but no jax.distributed client; "
                              f"call jax.distributed.initialize() before saving")
    return distributed.global_state.client


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        _client().wait_at_barrier(name, TIMEOUT_MS)


def announce(key: str, value: str) -> None:
    """Tell process 0 this process is done with `key` (no-op alone)."""
    if jax.process_count() > 1:
        _client().key_value_set(f"{key}/{jax.process_index()}", value, allow_overwrite=True)


def gather(key: str) -> list[str]:
    """Process 0: every process's announcement for `key`, waiting for those not yet made."""
    if jax.process_count() == 1:
        return []
    client = _client()
    return [client.blocking_key_value_get(f"{key}/{i}", TIMEOUT_MS) for i in range(1, jax.process_count())]


def share(key: str, value: str) -> list[str]:
    """Every process's `value` for `key`, in process order; every process calls it with a key used once."""
    if jax.process_count() == 1:
        return [value]
    client = _client()
    client.key_value_set(f"{key}/{jax.process_index()}", value)
    return [client.blocking_key_value_get(f"{key}/{i}", TIMEOUT_MS) for i in range(jax.process_count())]
