"""Typed PRNG keys in a train state, stored as their raw data.

An optax state may hold a typed key (``optax.add_noise``'s ``rng_key``,
dtype ``key<fry>``), which neither Orbax nor the checksums can write. A
checkpoint stores each such leaf as ``jax.random.key_data`` (uint32, the
key's shape plus the implementation's, e.g. ``(2,)`` for threefry) and
restore wraps it back with the implementation the trainer's own state has
(:func:`zeropp_jax.prng_keys.keys_as_data` and its inverse, which a
wrapped layer's random streams use the same way).
Other leaves pass through unchanged. No collective: the data keeps the
key's sharding, with the trailing axes replicated.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from zeropp_jax.prng_keys import is_key, keys_from_data, state_as_data


def to_data(tree: Any) -> Any:
    """``tree`` with every typed key replaced by its uint32 data (what a checkpoint stores)."""
    data, treedef, _ = state_as_data(tree)
    return jax.tree.unflatten(treedef, data)


def data_like(abstract: Any) -> Any:
    """``abstract`` (``ShapeDtypeStruct`` leaves) with each key's data shape, dtype and sharding."""
    def data(x):
        if not is_key(x):
            return x
        shape = jax.eval_shape(jax.random.key_data, x)
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            spec = tuple(sharding.spec) + (None,) * (len(shape.shape) - len(sharding.spec))
            sharding = NamedSharding(sharding.mesh, P(*spec))
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)

    return jax.tree.map(data, abstract)


def from_data(tree: Any, abstract: Any) -> Any:
    """``tree`` (restored, keys as data) with the keys of ``abstract`` wrapped back."""
    leaves, treedef = jax.tree.flatten(tree)
    impls = [_impl(x) if is_key(x) else None for x in jax.tree.leaves(abstract)]
    return jax.tree.unflatten(treedef, keys_from_data(leaves, impls))


def _impl(key: jax.ShapeDtypeStruct) -> Any:
    """The PRNG implementation of an abstract key (read while tracing its shape)."""
    found = []

    def probe(k):
        found.append(jax.random.key_impl(k))
        return jax.random.key_data(k)

    jax.eval_shape(probe, key)
    return found[0]
