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


def plain_keys(path: tuple) -> tuple:
    """A ``jax.tree_util`` key path as the tuple of its keys (a dict key as
    it is, a sequence index as its ``int``)."""
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def leaf_paths(tree: Any, keys: Callable[[tuple], tuple] = plain_keys) -> tuple[dict, dict]:
    """``(inputs, where)``: each leaf of ``tree`` by its key path (``keys`` of
    its ``jax.tree_util`` path), and each leaf's path by its ``id``, which
    finds a block's parameters among a loss's traced inputs by identity."""
    flat = [(keys(path), x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return dict(flat), {id(x): path for path, x in flat}


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


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
