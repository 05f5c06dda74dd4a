"""The wrap policy for Flax NNX modules (see :mod:`zeropp_jax.step.wrap`).

For ``flax.nnx.Module`` classes and a loss that builds its module from its
``params`` argument with ``nnx.merge`` (as :func:`zeropp_jax.nnx_loss` does).
NNX modules are plain Python objects, so the listed classes' ``__call__`` is
swapped for a dispatcher while the loss is traced (and restored after).

1. :func:`discover` finds each called block's parameters among the
   loss's inputs by identity (``nnx.merge`` puts the traced input arrays
   into the module's ``Param`` variables unchanged); the block's path is the
   input path of its parameters less their path inside the block. A block
   applied by ``nnx.scan`` (layers stacked by ``nnx.vmap``, Flax's "scan
   over layers") sees one layer's slice of its parameters, new arrays: its
   path is the one sub-tree of the inputs with the block's parameter names,
   shapes and dtypes under one leading layer axis, and it becomes a stacked
   unit.
2. :func:`wrap_loss` hands the loss a parameter tree in which each wrapped
   block's first parameter holds its :class:`~zeropp_jax.step.gather.Unit`
   and the others hold empty ``(..., 0)`` arrays; ``nnx.scan`` slices these
   like parameters, so a scanned block sees one layer's ``Unit``. A call of
   a block holding a ``Unit`` splits the block (``nnx.split``), merges it
   again inside ``layer`` with ``gather(unit)`` (one gather per layer,
   forward and backward), and writes its other state (random-stream
   counters) back with ``nnx.update``, which ``nnx.scan`` stacks again.
   (Applied by ``nnx.vmap`` instead, the stack's per-layer gathers are
   batched into one gather of the whole stack.) A block holding a stacked
   ``Unit`` called whole, not by a scan, is refused.

Two stacks whose parameters have the same names, shapes and dtypes cannot
be told apart by :func:`discover` and are refused.

PRNG keys in the block's state (its random streams) cross ``layer`` as raw
key data (``jax.random.key_data``), which ``layer``'s ordering arithmetic
accepts, and are wrapped again inside.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from zeropp_jax.step.blocks import (
    as_layer, depth, inside_block, keys_as_data, keys_from_data, trace_calls,
)
from zeropp_jax.step.gather import Unit
from zeropp_jax.tree_paths import cut_paths, paste_paths


def _is_unit(x: Any) -> bool:
    return isinstance(x, Unit)


@contextlib.contextmanager
def _nnx_calls(classes: tuple[type, ...], handler: Callable):
    """While active, calling an instance of ``classes`` runs
    ``handler(call, module, args, kwargs)``, ``call`` being the class's own
    ``__call__``; outside, the classes are as they were."""
    saved = [(c, c.__dict__.get("__call__")) for c in classes]

    def dispatcher(call):
        def __call__(self, *args, **kwargs):
            return handler(call, self, args, kwargs)

        return __call__

    try:
        for c in classes:
            c.__call__ = dispatcher(c.__call__)
        yield
    finally:
        for c, own in saved:
            if own is None:
                del c.__call__  # it was inherited
            else:
                c.__call__ = own


def _keys(path: tuple) -> tuple:
    """A JAX key path as plain keys, up to the first non-dict entry (a
    ``Variable``'s ``value``)."""
    keys = []
    for entry in path:
        if not isinstance(entry, jax.tree_util.DictKey):
            break
        keys.append(entry.key)
    return tuple(keys)


def _params_of(module: Any) -> list[tuple[tuple, Any]]:
    """``(path inside the module, value)`` of an NNX ``module``'s ``Param``s,
    a :class:`Unit` being one value."""
    from flax import nnx

    own = jax.tree_util.tree_flatten_with_path(nnx.state(module, nnx.Param), is_leaf=_is_unit)[0]
    return [(_keys(path), leaf) for path, leaf in own]


_BUILT = (
    "wrapped NNX blocks must be built by nnx.merge from params unchanged "
    "(zeropp_jax.nnx_loss does) and called directly or by nnx.scan over a "
    "leading layer axis (layers stacked with nnx.vmap). Otherwise mark layers "
    "with zp.gather/zp.layer, or use per_layer=False"
)


def _block_path(module: Any, where: dict, inputs: dict) -> tuple[tuple, bool] | None:
    """``(path, stacked)``: where an NNX ``module``'s ``Param``s lie in the
    loss's parameters, and whether they are one layer's slice of a stack;
    ``None`` if the module has none.

    Args:
      module: the block being called.
      where: ``id(input leaf) -> its key path``.
      inputs: ``key path -> input leaf`` (shapes and dtypes).
    """
    own = _params_of(module)
    if not own:
        return None
    if not any(id(leaf) in where for _, leaf in own):
        return _stack_path(module, own, inputs), True
    prefixes = set()
    for rel, leaf in own:
        outer = where.get(id(leaf))
        if outer is None or outer[len(outer) - len(rel):] != rel:
            raise ValueError(
                f"wrap: the parameters of a {type(module).__name__} are not the loss's "
                f"params inputs; {_BUILT}"
            )
        prefixes.add(outer[: len(outer) - len(rel)])
    if len(prefixes) != 1:
        raise ValueError(
            f"wrap: the parameters of a {type(module).__name__} lie under several "
            f"paths {sorted(prefixes, key=str)}; a wrapped block must own one sub-tree"
        )
    return prefixes.pop(), False


def _stack_path(module: Any, own: list, inputs: dict) -> tuple:
    """The one sub-tree of the inputs holding ``own`` (a block's sliced
    parameters) stacked: the same names, and each leaf's shape and dtype
    under one common leading layer axis."""

    def signature(pairs, lead):
        return {rel: (lead + tuple(x.shape), x.dtype) for rel, x in pairs}

    under: dict[tuple, list] = {}
    for path, leaf in inputs.items():
        for cut in range(len(path)):
            under.setdefault(path[:cut], []).append((path[cut:], leaf))
    matches = [
        prefix for prefix, pairs in under.items()
        if pairs[0][1].ndim and signature(pairs, ()) == signature(own, pairs[0][1].shape[:1])
    ]
    if len(matches) != 1:
        found = f"{len(matches)} sub-trees {matches}" if matches else "no sub-tree"
        raise ValueError(
            f"wrap: the parameters of a {type(module).__name__} are not the loss's params "
            f"inputs, and {found} of the inputs holds them stacked along a leading layer "
            f"axis (a block applied by nnx.scan); {_BUILT}"
        )
    return matches[0]


def discover(
    loss_fn: Callable, params: Any, example_batch: Any, classes: Sequence[type],
    extra_args: tuple = (),
) -> tuple[list[tuple], list[tuple]]:
    """The parameter paths of the outermost calls of NNX ``classes`` in ``loss_fn``.

    Args:
      loss_fn: ``loss_fn(params, batch, *extra_args)``, building its module
        with ``nnx.merge`` from ``params`` unchanged (as the loss of
        :func:`zeropp_jax.nnx_loss` does).
      params: the parameters (a nested dict, e.g. from ``nnx_loss``), or
        their shapes.
      example_batch: a batch (or its shapes) ``loss_fn`` accepts; nothing
        runs (``jax.eval_shape``).
      classes: ``flax.nnx.Module`` classes.
      extra_args: more arguments of ``loss_fn`` (a PRNG key).

    Returns:
      ``(paths, stacked)``: distinct key paths into ``params`` (tuples of
      dict keys: strings, and integers for ``nnx.List`` items), in call
      order; and those of blocks applied by ``nnx.scan`` (parameters with a
      leading layer axis: one stacked unit, gathered layer by layer).

    Raises:
      ValueError: if no instance of ``classes`` is called with parameters,
        or a block's parameters are not the loss's inputs, whole or stacked
        (see :func:`_block_path`).
    """
    found: list[tuple] = []
    stacked: list[tuple] = []

    def intercepting(p):
        inputs = {_keys(path): x for path, x in jax.tree_util.tree_flatten_with_path(p)[0]}
        where = {id(x): path for path, x in inputs.items()}

        def record(call, module, args, kwargs):
            if depth():
                return call(module, *args, **kwargs)
            block = _block_path(module, where, inputs)
            if block is not None and block[0] not in found:
                found.append(block[0])
                if block[1]:
                    stacked.append(block[0])
            with inside_block():
                return call(module, *args, **kwargs)

        return _nnx_calls(tuple(classes), record)

    trace_calls(loss_fn, params, example_batch, extra_args, intercepting, classes, found)
    return found, stacked


def _holder(unit: Unit) -> Any:
    """The block's parameter tree as the loss receives it: ``unit`` as the
    first leaf, empty ``(..., 0)`` arrays (with a stacked unit's layer axis,
    so ``nnx.scan`` slices them) as the others."""
    lead = () if unit.layout.stack is None else (unit.layout.stack,)
    rest = [jnp.zeros(lead + (0,), s.dtype) for s in unit.layout.leaves[1:]]
    return jax.tree.unflatten(unit.layout.treedef, [unit, *rest])


def _unit_of(module: Any) -> Unit | None:
    """The :class:`Unit` an NNX block holds among its ``Param``s (see
    :func:`_holder`), one layer's under ``nnx.scan``; ``None`` if none."""
    units = [x for _, x in _params_of(module) if _is_unit(x)]
    if not units:
        return None
    unit = units[0]
    if unit.layout.stack is not None and unit.sink.ndim != 1:
        raise ValueError(
            f"wrap: a {type(module).__name__} at {unit.layout.name} holds "
            f"{unit.layout.stack} stacked layers and was called whole; apply it with "
            "nnx.scan over its leading layer axis (in_axes=0), which calls it once per layer"
        )
    return unit


def wrap_loss(loss_fn: Callable, classes: Sequence[type], paths: Sequence[tuple]) -> Callable:
    """``loss_fn`` with every call of the NNX blocks at ``paths`` applied to
    its gathered unit.

    Args:
      loss_fn: as for :func:`discover`.
      classes: the ``flax.nnx.Module`` classes.
      paths: the blocks' key paths in the parameters (from :func:`discover`).

    Returns:
      ``wrapped(params, batch, *rest)``. With plain parameters at ``paths``
      (outside a ZeRO step) it is ``loss_fn``; with a ``Unit`` at each path,
      each block is gathered when called and again in the backward (a
      stacked unit under ``nnx.scan``: one layer per iteration). The listed
      classes' ``__call__`` is swapped while it is traced, so trace it on
      one thread at a time.

    Raises:
      ValueError: (when traced) if a block holding a stacked unit is called
        whole rather than by ``nnx.scan``.
    """
    from flax import nnx

    classes, paths = tuple(classes), [tuple(p) for p in paths]

    def apply(call, module, unit, args, kwargs):
        graphdef, _, other = nnx.split(module, nnx.Param, ...)
        leaves, treedef = jax.tree.flatten(other)
        impls = keys_as_data(leaves)[1]

        def encode(state):
            return keys_as_data(jax.tree.leaves(state))[0]

        def decode(data):
            return jax.tree.unflatten(treedef, keys_from_data(data, impls))

        def run(params, data, *a, **kw):
            block = nnx.merge(graphdef, params, decode(data))
            out = call(block, *a, **kw)
            return out, encode(nnx.split(block, nnx.Param, ...)[2])

        out, data = as_layer(run, unit, args, kwargs, state=encode(other))
        nnx.update(module, decode(data))  # e.g. the dropout stream's counter
        return out

    def dispatch(call, module, args, kwargs):
        unit = None if depth() else _unit_of(module)
        if unit is None:
            return call(module, *args, **kwargs)
        return apply(call, module, unit, args, kwargs)

    def wrapped(params, batch, *rest):
        rest_params, subtrees = cut_paths(params, paths)
        if not any(_is_unit(t) for t in subtrees):
            return loss_fn(params, batch, *rest)
        with _nnx_calls(classes, dispatch):
            holders = [_holder(unit) for unit in subtrees]
            return loss_fn(paste_paths(rest_params, paths, holders), batch, *rest)

    return wrapped
