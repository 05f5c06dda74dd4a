"""Typed PRNG keys as their raw data, and back.

A typed key (dtype ``key<fry>``) cannot cross a ``custom_vjp`` (a wrapped
layer's random streams), be written by Orbax or the checksums (an optax
state's ``rng_key``), or be closed over as a host copy: each of those takes
``jax.random.key_data`` (uint32: the key's shape plus the implementation's,
e.g. ``(2,)`` for threefry) and wraps it back with ``jax.random.wrap_key_data``
and the key's implementation. No mesh axes: pure element-wise data moves.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax


def is_key(x: Any) -> bool:
    """Whether ``x`` (an array or a ``ShapeDtypeStruct``) is a typed PRNG key."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def keys_as_data(leaves: Sequence[Any]) -> tuple[list, list]:
    """Typed PRNG keys among ``leaves`` as their raw ``uint32`` key data,
    which a layer can take as an input (a typed key cannot cross the layer's
    ``custom_vjp``): ``(data, impls)``, ``impls[i]`` the key's implementation
    or None for a leaf that is not a typed key (kept as it is)."""
    impls = [jax.random.key_impl(x) if is_key(x) else None for x in leaves]
    return [jax.random.key_data(x) if i else x for x, i in zip(leaves, impls, strict=True)], impls


def keys_from_data(data: Sequence[Any], impls: Sequence[Any]) -> list:
    """:func:`keys_as_data` undone: the typed keys again (``data`` and
    ``impls`` of one length)."""
    return [
        jax.random.wrap_key_data(x, impl=i) if i else x for x, i in zip(data, impls, strict=True)
    ]


def state_as_data(state: Any) -> tuple[list, Any, list]:
    """``(data, treedef, impls)``: the leaves of a pytree ``state`` as
    :func:`keys_as_data` gives them, and what :func:`state_from_data` needs."""
    leaves, treedef = jax.tree.flatten(state)
    data, impls = keys_as_data(leaves)
    return data, treedef, impls


def state_from_data(data: Sequence[Any], treedef: Any, impls: Sequence[Any]) -> Any:
    """:func:`state_as_data` undone: the pytree, its typed keys again."""
    return jax.tree.unflatten(treedef, keys_from_data(data, impls))
