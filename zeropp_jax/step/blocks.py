"""Applying one wrapped block as a layer (the wrap policy's shared part).

A wrap policy (:mod:`zeropp_jax.step.wrap` for Linen,
:mod:`zeropp_jax.step.wrap_nnx` for NNX) replaces a call of a listed module
class with :func:`as_layer`: the block runs on ``gather(unit)`` inside
:func:`~zeropp_jax.step.gather.layer`, so its parameters are gathered when it
is called and again in the backward; a block applied by a scan over stacked
layers (``nn.scan``, ``nnx.scan``) gets one layer's slice of a stacked unit
per iteration. :func:`inside_block` counts, per thread, the blocks being
applied, so calls of listed classes nested in a wrapped block pass through
(they belong to the outer block's unit).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np

from zeropp_jax.step.gather import Unit, gather, layer


class _Depth(threading.local):
    """How many wrapped blocks are being applied or recorded on this thread."""

    value = 0


_DEPTH = _Depth()


def depth() -> int:
    """How many wrapped blocks are being applied (or recorded) on this thread."""
    return _DEPTH.value


@contextlib.contextmanager
def inside_block():
    """Marks the enclosed code as the body of a wrapped block."""
    _DEPTH.value += 1
    try:
        yield
    finally:
        _DEPTH.value -= 1


def subtree(params: Any, path: tuple) -> Any:
    """The sub-tree of nested mappings ``params`` at key ``path``, or ``None``."""
    node = params
    for key in path:
        if not hasattr(node, "keys") or key not in node:
            return None
        node = node[key]
    return node


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


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


def is_key(x: Any) -> bool:
    """Whether ``x`` (an array or a ``ShapeDtypeStruct``) is a typed PRNG key."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def as_layer(fn: Callable, unit: Unit, args: tuple, kwargs: dict, state: Any = None) -> Any:
    """``fn(gather(unit), state, *args, **kwargs)`` as one ``layer``.

    Array leaves of the arguments are the layer's inputs (so its gather is
    ordered after them); other leaves (flags, ``None``) stay static.
    ``state`` (a pytree of arrays the block carries, e.g. random-stream
    counters) comes after the arguments, so the layer's ordering probes an
    activation first.
    """
    leaves, treedef = jax.tree.flatten((args, kwargs, state))
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]

    def block(unit, *arrays):
        full = list(leaves)
        for i, x in zip(dynamic, arrays, strict=True):
            full[i] = x
        a, kw, st = jax.tree.unflatten(treedef, full)
        with inside_block():
            return fn(gather(unit), st, *a, **kw)

    return layer(block)(unit, *[leaves[i] for i in dynamic])


class NeverCalled(ValueError):
    """:func:`trace_calls` found no wrapped block called with parameters."""


def trace_calls(
    loss_fn: Callable, params: Any, example_batch: Any, extra_args: tuple,
    intercepting: Callable[[Any], Any], classes: Sequence[type], found: list,
) -> None:
    """Traces ``loss_fn(params, example_batch, *extra_args)`` abstractly
    (``jax.eval_shape``) inside the context ``intercepting(traced_params)``,
    which records the wrapped blocks' paths into ``found``.

    Raises:
      NeverCalled: (a ``ValueError``) if ``found`` is still empty afterwards.
    """

    def traced(p, b, rest):
        with intercepting(p):
            return loss_fn(p, b, *rest)

    jax.eval_shape(traced, params, example_batch, tuple(extra_args))
    if not found:
        names = ", ".join(c.__name__ for c in classes)
        raise NeverCalled(
            f"wrap: loss_fn never called a module of class {names} that has "
            "parameters (on the example batch); check the classes, or use "
            "per_layer=False"
        )
