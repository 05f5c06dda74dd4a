"""A wrap policy for unmodified Flax models (FSDP's ``ModuleWrapPolicy``).

``make_trainer(..., wrap=(Block,), example_batch=batch)`` makes every
instance of a listed module class its own unit, and the remaining parameters
one more unit (:data:`~zeropp_jax.layout.REMAINDER`, gathered whole before
the loss; none when every parameter is inside a wrapped block). The user's
loss function is not changed.

Flax Linen (classes of ``flax.linen.Module``):

1. :func:`discover` traces ``loss_fn`` once, abstractly (``jax.eval_shape``),
   under a flax method interceptor that records the parameter path
   (``module.scope.path``) of every outermost call of a listed class; those
   paths become the nested units of the layout.
2. :func:`wrap_loss` runs ``loss_fn`` under an interceptor that replaces each
   such call: the parameter tree holds a :class:`~zeropp_jax.step.gather.Unit`
   at the block's path (flax never reads it, the call is intercepted first),
   and the block is applied as a fresh top-level module to ``gather(unit)``
   inside :func:`~zeropp_jax.step.gather.layer`, so it is gathered when called
   and gathered again in the backward. Its PRNG keys (one ``make_rng`` per
   stream) and its other variable collections (read only: frozen
   ``batch_stats``) are the layer's inputs; a block called with mutable
   collections is refused.

A block under ``nn.scan`` sees one layer's slice of its stacked parameters;
:func:`discover` notices the extra leading axis and the layout makes that
path one stacked unit, which the scan slices into one ``Unit`` per layer
(one gather per layer, forward and backward).

Flax NNX (classes of ``flax.nnx.Module``): :mod:`zeropp_jax.step.wrap_nnx`.

While a wrapped block is applied, calls of listed classes pass through (the
re-application calls the same class, and listed classes nested inside a
wrapped block belong to the outer block's unit).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from zeropp_jax.step import wrap_nnx
from zeropp_jax.step.blocks import (
    as_layer, depth, inside_block, keys_as_data, keys_from_data, subtree, trace_calls,
)
from zeropp_jax.step.gather import Unit


def _check_classes(classes: Sequence[type]) -> tuple[type, ...]:
    """The Linen classes, or a TypeError (NNX classes go to :func:`_nnx_classes`)."""
    import flax.linen as nn

    classes = tuple(classes)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad or not classes:
        raise TypeError(
            "wrap takes a tuple of flax.linen.Module classes or of flax.nnx.Module "
            f"classes (not mixed), got {classes!r}"
        )
    return classes


def _nnx_classes(classes: Sequence[type]) -> tuple[type, ...] | None:
    """``classes`` if all are NNX module classes, ``None`` otherwise."""
    from flax import nnx

    classes = tuple(classes)
    if classes and all(isinstance(c, type) and issubclass(c, nnx.Module) for c in classes):
        return classes
    return None


def _is_target(context: Any, classes: tuple[type, ...]) -> bool:
    return (
        depth() == 0
        and context.method_name == "__call__"
        and isinstance(context.module, classes)
        and context.module.scope is not None
    )


def prepare(
    loss_fn: Callable, params: Any, classes: Sequence[type], example_batch: Any, *,
    per_layer: bool, stacked: Sequence[str], rng: Any,
) -> tuple[Callable, list, list]:
    """``make_trainer``'s ``wrap=``: the wrapped loss, the units' key paths and
    which of them stack layers (:func:`discover`).

    Raises:
      ValueError: without ``example_batch``, or with ``per_layer``/``stacked``.
    """
    if example_batch is None:
        raise ValueError(
            "wrap= needs example_batch=: a batch loss_fn accepts (shapes are "
            "enough), traced once to find the wrapped modules' parameters"
        )
    if per_layer or stacked:
        raise ValueError("wrap= replaces per_layer= and stacked=; pass only wrap")
    key = () if rng is None else (jax.random.key(0),)  # the loss takes a key
    nnx_classes = _nnx_classes(classes)
    if nnx_classes:
        paths, stacked = wrap_nnx.discover(loss_fn, params, example_batch, nnx_classes, key)
        return wrap_nnx.wrap_loss(loss_fn, nnx_classes, paths), paths, stacked
    paths, stacked = discover(loss_fn, params, example_batch, classes, key)
    return wrap_loss(loss_fn, classes), paths, stacked


def discover(
    loss_fn: Callable, params: Any, example_batch: Any, classes: Sequence[type],
    extra_args: tuple = (),
) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """The parameter paths of the outermost calls of ``classes`` in ``loss_fn``.

    Args:
      loss_fn: the user's ``loss_fn(params, batch)``.
      params: the full parameters, or their shapes.
      example_batch: a batch (or its shapes) ``loss_fn`` accepts; only shapes
        and dtypes are used (nothing runs: ``jax.eval_shape``).
      classes: flax Linen module classes.
      extra_args: more arguments of ``loss_fn`` (a PRNG key).

    Returns:
      ``(paths, stacked)``: distinct key paths into ``params`` (tuples of
      str), in call order, modules with no parameters skipped; and those
      whose parameters carry a leading layer axis the module does not see
      (a module under ``nn.scan``: one unit per layer).

    Raises:
      ValueError: if no instance of ``classes`` is called with parameters.
    """
    import flax.linen as nn

    classes = _check_classes(classes)
    found: list[tuple[str, ...]] = []
    stacked: list[tuple[str, ...]] = []

    def record(next_fun, args, kwargs, context):
        if not _is_target(context, classes):
            return next_fun(*args, **kwargs)
        path = tuple(context.module.scope.path)
        outer = subtree(params, path)
        if path not in found and outer is not None:
            found.append(path)
            inner = context.module.variables.get("params")
            if np.ndim(jax.tree.leaves(outer)[0]) == np.ndim(jax.tree.leaves(inner)[0]) + 1:
                stacked.append(path)
        with inside_block():
            return next_fun(*args, **kwargs)

    trace_calls(loss_fn, params, example_batch, extra_args,
                lambda _: nn.intercept_methods(record), classes, found)
    return found, stacked


def _apply_block(module: Any, unit: Unit, args: tuple, kwargs: dict, rngs: dict) -> Any:
    """A Linen ``module(*args, **kwargs)`` on ``gather(unit)``, as one ``layer``.

    The block's PRNG keys (``rngs``: stream name -> key, typed keys as raw
    ``uint32`` key data) and its other variable collections (read only, e.g.
    frozen ``batch_stats``) enter the layer as its inputs, not closed over:
    under ``nn.scan`` or ``nn.remat`` they are tracers of that transform,
    which the layer's backward (a ``custom_vjp``) must not capture.
    """
    top = module.clone(parent=None, name=None)
    names = sorted(rngs)
    data, impls = keys_as_data([rngs[n] for n in names])
    others = {c: v for c, v in module.variables.items() if c != "params"}

    def apply(params, state, *a, **kw):
        data, variables = state
        keys = dict(zip(names, keys_from_data(data, impls)))
        return top.apply({**variables, "params": params}, *a, rngs=keys or None, **kw)

    return as_layer(apply, unit, args, kwargs, state=(data, others))


def wrap_loss(loss_fn: Callable, classes: Sequence[type]) -> Callable:
    """``loss_fn`` with every call of ``classes`` applied to its gathered unit.

    Outside a ZeRO step (plain parameters at the blocks' paths) the calls run
    unchanged, so the returned function is ``loss_fn`` on one device.
    """
    import flax.linen as nn

    classes = _check_classes(classes)

    def intercept(next_fun, args, kwargs, context):
        if not _is_target(context, classes):
            return next_fun(*args, **kwargs)
        module = context.module
        unit = module.variables.get("params")  # a layer's slice under nn.scan
        if not isinstance(unit, Unit):
            return next_fun(*args, **kwargs)
        if module.scope.mutable:  # False, or an empty set under nn.scan
            raise ValueError(
                f"wrap: {type(module).__name__} at {'/'.join(module.scope.path)} "
                "is called with mutable collections; wrapped blocks must be pure"
            )
        rngs = {name: module.make_rng(name) for name in module.scope.rngs if name != "params"}
        return _apply_block(module, unit, args, kwargs, rngs)

    def wrapped(params, batch, *rest):
        with nn.intercept_methods(intercept):
            return loss_fn(params, batch, *rest)

    return wrapped
