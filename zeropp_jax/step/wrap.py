"""A wrap policy for unmodified Flax models (FSDP's ``ModuleWrapPolicy``).

``make_trainer(..., wrap=(Block,), example_batch=batch)`` makes every
instance of a listed module class its own unit, and the remaining parameters
one more unit (:data:`~zeropp_jax.layout.REMAINDER`, gathered whole before
the loss; none when every parameter is inside a wrapped block). The user's
loss function is not changed.

Flax Linen (classes of ``flax.linen.Module``):

1. :func:`discover` traces ``loss_fn`` once, abstractly (``jax.eval_shape``),
   under a flax method interceptor that records the parameter path
   (``module.scope.path``) of every instance of a listed class one of whose
   methods (``__call__``, ``attend``, ...; not ``setup``) is called outside
   another wrapped block; those paths become the nested units of the layout.
   :func:`check` then traces it once more with those parameters sealed, so
   that a read of them outside the block's methods (another module reading
   ``variables``, e.g. a tied head) is refused at ``make_trainer``.
2. :func:`wrap_loss` runs ``loss_fn`` under an interceptor that replaces each
   such method call: the parameter tree holds a
   :class:`~zeropp_jax.step.gather.Unit` at the block's path (flax never
   reads it: the block's ``setup`` is skipped there and its methods are
   intercepted), and the block is applied as a fresh top-level module
   (``top.apply(variables, *args, method=name)``, running its ``setup``) to
   ``gather(unit)`` inside :func:`~zeropp_jax.step.gather.layer`, so it is
   gathered when called and gathered again in the backward. Two methods
   called (``__call__`` and ``attend`` of a tied embedding) are two layers on
   one unit; their gradients sum. The block's other variable collections
   (read only: frozen ``batch_stats``) are the layer's inputs; a block called
   with mutable collections is refused.

Random streams: flax derives a ``make_rng`` key from the stream's root key
(given to ``apply``, or split by ``nn.scan``), a static suffix of scope names
hashed into it, and per-scope call counters (``flax.core.scope.LazyRng``,
``Scope.rng_counters``). The layer takes the block scope's root keys as
inputs (under ``nn.scan``/``nn.remat`` they are tracers of that transform)
and rebuilds the scope's streams, suffix and counters included, around the
top-level module (:mod:`zeropp_jax.step.linen_apply`), so a wrapped block draws exactly
the keys (dropout masks) it draws unwrapped, and the counters it advanced are
written back for its next call.

A block under ``nn.scan`` sees one layer's slice of its stacked parameters;
:func:`discover` notices the extra leading axis and the layout makes that
path one stacked unit, which the scan slices into one ``Unit`` per layer
(one gather per layer, forward and backward).

Flax NNX (classes of ``flax.nnx.Module``): :mod:`zeropp_jax.step.wrap_nnx`.

While a wrapped block is applied, calls of listed classes pass through (the
re-application calls the same class, and listed classes nested inside a
wrapped block belong to the outer block's unit). An attribute that a wrapped
block defines in ``setup`` cannot be read from outside it in the step (its
``setup`` runs only inside the layer); call a method instead.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np

from zeropp_jax.nnx_model import UNITS_BY_WRAP_ONLY, loss_mark
from zeropp_jax.tree_paths import REMAINDER, cut_paths
from zeropp_jax.step import wrap_nnx
from zeropp_jax.step.blocks import (
    NeverCalled, as_layer, depth, inside_block, leaf_paths, plain_keys, subtree, trace_calls,
)
from zeropp_jax.step.gather import Unit
from zeropp_jax.step.linen_apply import block_apply


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
    """A method (``setup`` too) of a bound instance of ``classes``, called
    outside any wrapped block; not a function flax wraps around a module
    itself (``_validate_setup``'s lambda, on an empty scope)."""
    return (
        depth() == 0
        and isinstance(context.module, classes)
        and context.module.scope is not None
        and callable(getattr(type(context.module), context.method_name, None))
    )


def check_per_layer(loss_fn: Callable, per_layer: bool) -> None:
    """Raises ``ValueError`` for ``per_layer=True`` with a loss marked
    :data:`UNITS_BY_WRAP_ONLY`, naming ``wrap=`` (NNX said "Incorrect
    number of leaves")."""
    maker = loss_mark(loss_fn, UNITS_BY_WRAP_ONLY)
    if per_layer and maker:
        raise ValueError(
            f"per_layer=True hands the loss one Unit handle per top-level entry, which "
            f"{maker}'s module cannot hold; gather per block with wrap=(Block,) and "
            "example_batch= (each instance of the block class its own unit), or use "
            "per_layer=False"
        )


def prepare(
    loss_fn: Callable, params: Any, classes: Sequence[type], example_batch: Any, *,
    per_layer: bool, stacked: Sequence[str], rng: Any,
) -> tuple[Callable, list, list]:
    """``make_trainer``'s ``wrap=``: the wrapped loss, the units' key paths and
    which of them stack layers (:func:`discover`, then :func:`check`).

    Raises:
      ValueError: without ``example_batch``, with ``per_layer``/``stacked``,
        or from :func:`discover` and :func:`check`.
    """
    if example_batch is None:
        raise ValueError(
            "wrap= needs example_batch=: a batch loss_fn accepts (shapes are "
            "enough), traced once to find the wrapped modules' parameters"
        )
    if per_layer or stacked:
        raise ValueError("wrap= replaces per_layer= and stacked=; pass only wrap")
    if isinstance(classes, type):  # wrap=Block for wrap=(Block,), as isinstance takes
        classes = (classes,)
    key = () if rng is None else (jax.random.key(0),)  # the loss takes a key
    nnx_classes = _nnx_classes(classes)
    if nnx_classes:
        paths, stacked = wrap_nnx.discover(loss_fn, params, example_batch, nnx_classes, key)
        return wrap_nnx.wrap_loss(loss_fn, nnx_classes, paths), paths, stacked
    paths, stacked = discover(loss_fn, params, example_batch, classes, key)
    check(loss_fn, params, example_batch, classes, paths, key)
    _check_unit_names(params, paths)
    return wrap_loss(loss_fn, classes), paths, stacked


def _check_unit_names(params: Any, paths: list) -> None:
    """A unit is named by its path joined with ``/``; two units must not share
    a name, nor a wrapped module take the remaining parameters' (``rest``)."""
    names = ["/".join(map(str, p)) for p in paths]
    rest, _ = cut_paths(params, paths)
    if jax.tree_util.tree_leaves(rest):
        names.append(REMAINDER)
    taken = sorted({n for n in names if names.count(n) > 1})
    if taken:
        raise ValueError(
            f"wrap= makes two units named {taken[0]!r} (a unit is named by its module's "
            f"path; {REMAINDER!r} holds the parameters outside every wrapped module): "
            "rename the module")


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
      str), in call order (of any method but ``setup``), modules with no
      parameters skipped; and those whose parameters carry a leading layer
      axis the module does not see (a module under ``nn.scan``: one unit per
      layer).

    Raises:
      ValueError: if no instance of ``classes`` is called with parameters
        found in ``params``. Where some are, a warning names the others.
    """
    import flax.linen as nn

    classes = _check_classes(classes)
    found: list[tuple[str, ...]] = []
    stacked: list[tuple[str, ...]] = []
    where: dict[int, tuple] = {}  # id of a traced parameter -> its key path in params

    def record(next_fun, args, kwargs, context):
        if context.method_name == "setup" or not _is_target(context, classes):
            return next_fun(*args, **kwargs)
        inner = context.module.variables.get("params")
        path = _located(params, tuple(context.module.scope.path), inner, where)
        if path is None and jax.tree.leaves(inner):  # e.g. a frozen model's, closed over
            elsewhere.append("/".join(map(str, context.module.scope.path)))
            if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(inner)):
                derived.append(elsewhere[-1])  # made from the traced parameters: a copy or cast
        if path is not None and path not in found:
            found.append(path)
            outer = subtree(params, path)
            if np.ndim(jax.tree.leaves(outer)[0]) == np.ndim(jax.tree.leaves(inner)[0]) + 1:
                stacked.append(path)
        with inside_block():
            return next_fun(*args, **kwargs)

    def intercepting(traced):
        where.clear()
        where.update(leaf_paths(traced)[1])
        return nn.intercept_methods(record)

    elsewhere: list[str] = []  # scope paths of called blocks whose parameters were not found
    derived: list[str] = []  # those of them whose parameters the loss made from params
    try:
        trace_calls(loss_fn, params, example_batch, extra_args, intercepting, classes, found)
    except NeverCalled as e:
        if not elsewhere:
            raise
        raise ValueError(
            f"wrap: loss_fn called {classes[0].__name__} blocks with parameters (at "
            f"{sorted(set(elsewhere))} of the variables their model was applied to), but "
            "none was found as a sub-dict of the tree given to make_trainer: blocks are "
            "found in nested dicts (not tuples or lists), by their parameters themselves "
            "(not a copy or cast the loss made of them), and under a lifted transform "
            "(nn.scan, nn.remat) only at their path from the root of the tree, so pass the "
            "tree the model's apply reads its 'params' from, or use per_layer=False") from e
    if derived:  # some found, these made from params (not a frozen model's): gathered whole
        warnings.warn(
            f"wrap: loss_fn also called {classes[0].__name__} blocks with parameters it made "
            f"from the tree given to make_trainer, not found as a sub-dict of it (at "
            f"{sorted(set(derived))} of the variables their model was applied to): those "
            f"in that tree stay in the {REMAINDER!r} unit, gathered whole before the loss. "
            "Blocks are found in nested dicts (not tuples or lists), by their parameters "
            "themselves (not a copy or cast the loss made of them), and under a lifted "
            "transform (nn.scan, nn.remat) only at their path from the root of the tree",
            stacklevel=2)
    return found, stacked


def _located(params: Any, scope_path: tuple, inner: Any, where: dict[int, tuple]) -> Any:
    """The key path in ``params`` of a called block's parameters ``inner``
    (``None``: it has none there).

    The block's Linen scope path is relative to the variables its model was
    applied to, which may be a part of ``params`` (``p["enc"]`` of
    ``{"enc": ..., "head": ...}``) or hold it under ``"params"`` (the whole
    variables dict): the block is found by its first parameter, the same
    traced array as in ``params`` (:func:`discover` records them), and by
    its scope path where that is not so (a lifted transform's copy: a layer's
    slice under ``nn.scan``, ``nn.remat``'s); only a path through nested
    mappings counts (a unit is cut out of dicts).
    """
    leaves = jax.tree_util.tree_flatten_with_path(inner)[0] if inner is not None else []
    path = scope_path
    if leaves and id(leaves[0][1]) in where:
        full, rel = where[id(leaves[0][1])], plain_keys(leaves[0][0])
        if full[len(full) - len(rel):] == rel:
            path = full[:len(full) - len(rel)]
    return path if leaves and subtree(params, path) is not None else None


@jax.tree_util.register_pytree_node_class
class _Sealed:
    """A wrapped block's parameters in :func:`check`'s trace: a pytree node
    (children: the parameters, sliced by ``nn.scan`` like a ``Unit``; aux:
    the path) whose reads as a mapping raise the ``ValueError`` that refuses
    a read outside the block's methods."""

    def __init__(self, value: Any, path: tuple[str, ...]):
        self.value = value
        self.path = path

    def tree_flatten(self):
        return (self.value,), self.path

    @classmethod
    def tree_unflatten(cls, path, children):
        return cls(children[0], path)

    def _refuse(self, *_: Any) -> Any:
        where = "/".join(self.path)
        raise ValueError(
            f"wrap: the parameters of the wrapped block at {where} are read outside "
            "its methods (by another module reading its variables, e.g. a tied head "
            "reading the embedding table); only a call of one of the block's methods "
            "gathers them (Embed.attend does). "
            "Leave the block's class out of wrap= (its parameters then join the rest "
            "unit, gathered before the loss), or read them through a method of the block"
        )

    __getitem__ = __contains__ = __iter__ = keys = items = values = get = _refuse

    def __getattr__(self, name: str) -> Any:  # e.g. .copy() of a FrozenDict
        if name.startswith("__") or name in ("value", "path"):  # protocol probes, or
            raise AttributeError(name)                          # not yet set (a copy)
        self._refuse()


def _seal(params: Any, paths: Sequence[tuple[str, ...]], prefix: tuple = ()) -> Any:
    """``params`` (nested mappings) with the sub-tree at each path a
    :class:`_Sealed`; each mapping on the way keeps its type (a ``FrozenDict``
    stays one, so a loss calling ``params.unfreeze()`` traces as it runs)."""
    if prefix in paths:
        return _Sealed(params, prefix)
    if not any(p[:len(prefix)] == prefix for p in paths):
        return params
    return type(params)({k: _seal(v, paths, prefix + (k,)) for k, v in params.items()})


def check(
    loss_fn: Callable, params: Any, example_batch: Any, classes: Sequence[type],
    paths: Sequence[tuple[str, ...]], extra_args: tuple = (),
) -> None:
    """Traces ``loss_fn`` abstractly as :func:`wrap_loss` runs it, the blocks'
    parameters (at ``paths``, from :func:`discover`) sealed: they reach each
    block only through its intercepted methods, applied without a gather.

    Raises:
      ValueError: if anything else reads them (:class:`_Sealed`) or an
        attribute a block sets in its ``setup``, or a block is called with
        mutable collections.
    """
    import flax.linen as nn

    classes = _check_classes(classes)
    intercept = _interceptor(classes, _Sealed,
                             lambda apply, sealed, args, kwargs, state:
                             _inside(apply, sealed.value, state, *args, **kwargs))

    def traced(p, b, rest):
        with nn.intercept_methods(intercept):
            return loss_fn(_seal(p, paths), b, *rest)

    try:
        jax.eval_shape(traced, params, example_batch, tuple(extra_args))
    except AttributeError as e:  # the same trace without the wrapping passed (discover)
        if not isinstance(getattr(e, "obj", None), classes):
            raise  # not an attribute of a wrapped block
        raise ValueError(
            f"wrap: loss_fn failed with the blocks wrapped ({e}): an attribute a wrapped "
            "block defines in its setup (e.g. Embed.embedding) cannot be read from "
            "outside it, as its setup runs only when one of its methods is called. "
            "Call a method of the block instead, or leave its class out of wrap="
        ) from e


def _inside(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    with inside_block():
        return fn(*args, **kwargs)


def _interceptor(classes: tuple[type, ...], held: type, run: Callable) -> Callable:
    """A flax method interceptor for wrapped blocks whose parameters are a
    ``held`` (``Unit`` in the step, :class:`_Sealed` in :func:`check`): it
    skips their ``setup`` and returns ``run(apply, params, args, kwargs,
    state)`` for their other methods (``apply, state``:
    :func:`~zeropp_jax.step.linen_apply.block_apply`)."""

    def intercept(next_fun, args, kwargs, context):
        if not _is_target(context, classes):
            return next_fun(*args, **kwargs)
        module = context.module
        params = module.variables.get("params")  # a layer's slice under nn.scan
        if not isinstance(params, held):
            return next_fun(*args, **kwargs)
        if context.method_name == "setup":  # it runs inside the layer, on the gathered params
            return None
        # The block runs as its own apply: one that writes is refused there.
        apply, state = block_apply(module, context.method_name)
        return run(apply, params, args, kwargs, state)

    return intercept


def wrap_loss(loss_fn: Callable, classes: Sequence[type]) -> Callable:
    """``loss_fn`` with every method call of ``classes`` applied to its gathered unit.

    Outside a ZeRO step (plain parameters at the blocks' paths) the calls run
    unchanged, so the returned function is ``loss_fn`` on one device.
    """
    import flax.linen as nn

    intercept = _interceptor(_check_classes(classes), Unit,
                             lambda apply, unit, args, kwargs, state:
                             as_layer(apply, unit, args, kwargs, state=state))

    def wrapped(params, batch, *rest):
        with nn.intercept_methods(intercept):
            return loss_fn(params, batch, *rest)

    return wrapped
