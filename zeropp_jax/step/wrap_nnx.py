"""The wrap policy for Flax NNX modules (see :mod:`zeropp_jax.step.wrap`).

For ``flax.nnx.Module`` classes and a loss that builds its module from its
``params`` argument with ``nnx.merge`` (as :func:`zeropp_jax.nnx_loss` does).
NNX modules are plain Python objects, so the listed classes' ``__call__`` is
swapped for a dispatcher while the loss is traced (and restored after).

1. :func:`discover` finds each called block's parameters among the
   loss's inputs by identity (``nnx.merge`` puts the traced input arrays
   into the module's ``Param`` variables unchanged); the block's path is the
   input path of its parameters less their path inside the block.
2. :func:`wrap_loss` hands the loss a parameter tree with a placeholder
   (``jax.ShapeDtypeStruct``) for each parameter of a wrapped block; a call
   of a block whose parameters are placeholders splits the block
   (``nnx.split``), merges it again inside ``layer`` with ``gather(unit)``,
   and writes its other state (random-stream counters) back with
   ``nnx.update``. Blocks under ``nnx.scan`` / ``nnx.vmap`` see sliced
   parameters and are refused by :func:`discover`.

PRNG keys in the block's state (its random streams) cross ``layer`` as raw
key data (``jax.random.key_data``), which ``layer``'s ordering arithmetic
accepts, and are wrapped again inside.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax

from zeropp_jax.step.blocks import as_layer, depth, inside_block, trace_calls
from zeropp_jax.step.gather import Unit
from zeropp_jax.tree_paths import cut_paths, paste_paths


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


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


def _block_path(module: Any, where: dict) -> tuple | None:
    """The path in the loss's parameters of an NNX ``module``'s ``Param``s,
    found by identity in ``where`` (``id(leaf) -> path``); ``None`` if the
    module has none."""
    from flax import nnx

    own = jax.tree_util.tree_flatten_with_path(nnx.state(module, nnx.Param))[0]
    if not own:
        return None
    prefixes = set()
    for inner, leaf in own:
        outer, rel = where.get(id(leaf)), _keys(inner)
        if outer is None or outer[len(outer) - len(rel):] != rel:
            raise ValueError(
                f"wrap: the parameters of a {type(module).__name__} are not the loss's "
                "params inputs; wrapped NNX blocks must be built by nnx.merge from "
                "params unchanged (zeropp_jax.nnx_loss does) and called outside "
                "nnx.scan/nnx.vmap. Otherwise mark layers with zp.gather/zp.layer, "
                "or use per_layer=False"
            )
        prefixes.add(outer[: len(outer) - len(rel)])
    if len(prefixes) != 1:
        raise ValueError(
            f"wrap: the parameters of a {type(module).__name__} lie under several "
            f"paths {sorted(prefixes)}; a wrapped block must own one sub-tree"
        )
    return prefixes.pop()


def discover(
    loss_fn: Callable, params: Any, example_batch: Any, classes: Sequence[type],
    extra_args: tuple = (),
) -> list[tuple]:
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
      Distinct key paths into ``params`` (tuples of dict keys: strings, and
      integers for ``nnx.List`` items), in call order.

    Raises:
      ValueError: if no instance of ``classes`` is called with parameters,
        or a block's parameters are not the loss's inputs (see
        :func:`_block_path`).
    """
    found: list[tuple] = []

    def intercepting(p):
        where = {id(x): _keys(path) for path, x in jax.tree_util.tree_flatten_with_path(p)[0]}

        def record(call, module, args, kwargs):
            if depth():
                return call(module, *args, **kwargs)
            path = _block_path(module, where)
            if path is not None and path not in found:
                found.append(path)
            with inside_block():
                return call(module, *args, **kwargs)

        return _nnx_calls(tuple(classes), record)

    trace_calls(loss_fn, params, example_batch, extra_args, intercepting, classes, found)
    return found


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
      each block is gathered when called and again in the backward. The
      listed classes' ``__call__`` is swapped while it is traced, so trace
      it on one thread at a time.
    """
    from flax import nnx

    classes, paths = tuple(classes), [tuple(p) for p in paths]

    def apply(call, module, unit, args, kwargs):
        graphdef, _, other = nnx.split(module, nnx.Param, ...)
        leaves, treedef = jax.tree.flatten(other)
        impls = [jax.random.key_impl(x) if _is_key(x) else None for x in leaves]

        def encode(state):
            return [jax.random.key_data(x) if i else x
                    for x, i in zip(jax.tree.leaves(state), impls)]

        def decode(data):
            return jax.tree.unflatten(treedef, [
                jax.random.wrap_key_data(x, impl=i) if i else x for x, i in zip(data, impls)])

        def run(params, data, *a, **kw):
            block = nnx.merge(graphdef, params, decode(data))
            out = call(block, *a, **kw)
            return out, encode(nnx.split(block, nnx.Param, ...)[2])

        out, data = as_layer(run, unit, args, kwargs, state=encode(other))
        nnx.update(module, decode(data))  # e.g. the dropout stream's counter
        return out

    def wrapped(params, batch, *rest):
        rest_params, subtrees = cut_paths(params, paths)
        if not any(isinstance(t, Unit) for t in subtrees):
            return loss_fn(params, batch, *rest)
        units, holders = {}, []
        for unit in subtrees:
            shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in unit.layout.leaves]
            units.update((id(x), unit) for x in shapes)
            holders.append(jax.tree.unflatten(unit.layout.treedef, shapes))

        def dispatch(call, module, args, kwargs):
            leaves = jax.tree.leaves(nnx.state(module, nnx.Param))
            unit = units.get(id(leaves[0])) if leaves and not depth() else None
            if unit is None:
                return call(module, *args, **kwargs)
            return apply(call, module, unit, args, kwargs)

        with _nnx_calls(classes, dispatch):
            return loss_fn(paste_paths(rest_params, paths, holders), batch, *rest)

    return wrapped
