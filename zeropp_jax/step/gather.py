"""Per-layer parameter gathering: the ``Unit`` handle, ``gather`` and ``layer``.

Inside the train step the model does not see parameters, it sees one
:class:`Unit` per layer: an opaque pytree node holding this device's source
shard and a zero "gradient sink".  ``gather(unit)`` all-gathers the layer
(quantized with qwZ, over ``local`` only with hpZ), unflattens it to the
layer's own pytree in the compute dtype and returns it.  Its custom VJP sends
the layer's gradient straight into a reduce-scatter and hands the result to
the sink, so the step differentiates with respect to the sinks and never
holds a full gradient.  ``layer(fn)`` is ``jax.checkpoint``: the gathered
weights are not saved for the backward pass, which gathers them again (the
``2L`` gathers of ZeRO-3). Stacked layers run by
:func:`~zeropp_jax.step.prefetch.scan_layers` gather one layer ahead instead
(:func:`gather_payload`, decoded a layer later by :func:`decode_payload`, and
:func:`reduce_gradient` are its collectives).

Outside a ZeRO step (plain parameter dicts) ``gather`` is the identity, so
the same model code trains on one device unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import jax.extend.core

from zeropp_jax.wire import collectives
from zeropp_jax.layout import UnitLayout, unflatten_unit
from zeropp_jax.mesh import NODE
from zeropp_jax.step.linearize import linearize, pull_back
from zeropp_jax.step.plan import GatherPlan as GatherPlan


@jax.tree_util.register_pytree_node_class
class Unit:
    """One layer's parameters as seen by the model inside the step.

    Children (sliced by ``lax.scan`` for stacked units):
      source: what this device sends, prepared once per step: the shard
        ``(..., s)`` in the compute dtype, or its qwZ ``Quantized`` pair
        (with hpZ, the node's secondary partition).
      sink: ``(..., r)`` zeros (dtype: :func:`~zeropp_jax.step.geometry.sink_dtype`);
        its gradient is the layer's reduce-scattered gradient.
      order: ``None``, or a float32 scalar zero computed from the layer's
        inputs (set by :func:`layer`): the payload this device sends is
        made to depend on it, so the gather cannot start before them.
    Aux data: the unit's :class:`UnitLayout` and :class:`GatherPlan`."""

    def __init__(self, source: Any, sink: jax.Array, layout: UnitLayout, plan: GatherPlan,
                 order: jax.Array | None = None):
        self.source = source
        self.sink = sink
        self.layout = layout
        self.plan = plan
        self.order = order

    def tree_flatten(self):
        return (self.source, self.sink, self.order), (self.layout, self.plan)

    @classmethod
    def tree_unflatten(cls, aux, children):
        source, sink, order = children
        return cls(source, sink, *aux, order=order)

    def ordered(self, order: jax.Array | None) -> "Unit":
        """This unit with its gather made to wait for ``order`` (see :func:`layer`)."""
        return Unit(self.source, self.sink, self.layout, self.plan, order=order)

    def tied(self, zero: jax.Array | None) -> "Unit":
        """This unit with its source computed after ``zero`` (:func:`tie_after`)."""
        return Unit(tie_after(self.source, zero), self.sink, self.layout, self.plan, self.order)

    def __repr__(self):
        return f"Unit({self.layout.name!r}, stack={self.layout.stack})"

    def _not_parameters(self, *_, **__):
        raise TypeError(
            f"the loss used the zeropp_jax.Unit handle of unit {self.layout.name!r} as "
            "parameters: with per_layer=True (or stacked=) the loss gets one Unit per layer "
            "and its parameters from zp.gather(unit), inside zp.layer. A model not written "
            "for that takes wrap=(BlockClass,) instead, or per_layer=False to gather the "
            "whole model at once (README: 'An existing Flax model').")

    # A model handed a Unit where it expects parameters fails here, saying why.
    __iter__ = __contains__ = __getitem__ = __array__ = __jax_array__ = _not_parameters


@jax.tree_util.register_pytree_node_class
class Formed:
    """A unit's source that already is its layer's hpZ secondary (:func:`layer` forms it)."""

    def __init__(self, payload: Any):
        self.payload = payload

    def tree_flatten(self):
        return (self.payload,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def secondary_payload(plan: GatherPlan, source: Any, order: jax.Array | None = None) -> Any:
    """One layer's hpZ secondary partition from its primary payload (``plan.secondary_bits``).

    Args:
      plan: the unit's gather plan.
      source: one layer's primary payload, ``(U / D,)`` in the compute
        dtype or qwZ's ``Quantized`` codes and scales.
      order: as :func:`gather_payload`.

    Returns:
      ``source`` itself when ``plan.secondary_bits`` is ``None`` (a
      :class:`Formed` source: its payload); else its all-gather over ``node``,
      ``(U / local,)``, decoded when ``plan.bits`` is 0. Mesh axes: ``node``.
    """
    if isinstance(source, Formed):
        return source.payload
    if plan.secondary_bits is None:
        return source
    with jax.named_scope("hpz_secondary"):
        payload = collectives.all_gather(tie_after(source, order), (NODE,))
        if plan.secondary_bits and not plan.bits:
            payload = collectives.decode_gathered(
                payload, bits=plan.secondary_bits, block=plan.block,
                out_dtype=plan.compute_dtype, kernels=plan.kernels,
            )
    return payload


def gather_payload(plan: GatherPlan, source: Any, order: jax.Array | None = None) -> Any:
    """One layer's gathered payload in its wire form: wait for ``order``, gather ``source``.

    Args:
      plan: the unit's gather plan.
      source: one layer's encoded shard (``(s,)`` array or ``Quantized``).
      order: ``None``, or a float32 scalar zero (:func:`zero_after`) that
        the payload is made to depend on.

    Returns:
      The all-gather over ``plan.gather_axes`` of ``source`` (``(U,)``, or
      qwZ's ``Quantized`` codes and scales), not yet decoded.
    """
    if collectives.axes_size(plan.gather_axes) > 1:
        source = tie_after(source, order)  # a group of one sends nothing
    return collectives.all_gather(source, plan.gather_axes, two_level=plan.two_level)


def decode_payload(plan: GatherPlan, payload: Any) -> jax.Array:
    """A gathered payload (:func:`gather_payload`) as flat ``(U,)`` parameters in ``plan.compute_dtype``."""
    return collectives.decode_gathered(
        payload, bits=plan.bits, block=plan.block, out_dtype=plan.compute_dtype,
        kernels=plan.kernels.layer_decode,
    )


def gather_flat(plan: GatherPlan, source: Any, order: jax.Array | None = None) -> jax.Array:
    """One layer's flat parameters: wait for ``order``, gather ``source``, decode.

    Returns:
      The layer's flat ``(U,)`` parameters in ``plan.compute_dtype``, after
      an all-gather over ``plan.gather_axes`` (:func:`gather_payload`, then
      :func:`decode_payload`; first over ``node`` with
      ``plan.secondary_bits``: :func:`secondary_payload`). Not
      differentiable (see :func:`reduce_gradient` for its transpose).
    """
    secondary = secondary_payload(plan, source, order)
    return decode_payload(plan, gather_payload(plan.resident(), secondary, order))


def reduce_gradient(plan: GatherPlan, cotangent: jax.Array) -> jax.Array:
    """The gradient of a layer's sink: its ``(U,)`` cotangent reduce-scattered
    (and all-reduced over ``plan.sum_axes``), in the cotangent's dtype."""
    grad = collectives.reduce_scatter(cotangent, plan.reduce_axes, plan.reduce_dtype,
                                      two_level=plan.two_level, sum_bits=plan.sum_bits)
    if plan.sum_axes:
        grad = collectives.all_reduce(grad, plan.sum_axes, plan.reduce_dtype,
                                      sum_bits=plan.sum_bits, varying=True)
    return grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_flat(plan: GatherPlan, source: Any, sink: jax.Array, order: Any) -> jax.Array:
    """:func:`gather_flat` whose VJP hands :func:`reduce_gradient` to ``sink``."""
    del sink  # only carries the gradient
    return gather_flat(plan, source, order)


def _gather_fwd(plan, source, sink, order):  # a scalar keeps the sink's dtype
    return _gather_flat(plan, source, sink, order), jnp.zeros((), sink.dtype)


def _gather_bwd(plan, like, cotangent):
    return None, reduce_gradient(plan, cotangent).astype(like.dtype), None


_gather_flat.defvjp(_gather_fwd, _gather_bwd)


def _is_unit(x: Any) -> bool:
    return isinstance(x, Unit)


def gather(tree: Any) -> Any:
    """Gathers every :class:`Unit` in ``tree`` into its layer's parameters.

    Args:
      tree: a ``Unit``, a pytree containing ``Unit``s, or plain parameters
        (returned unchanged, so model code also runs without ZeRO).

    Returns:
      The tree with each ``Unit`` replaced by its layer's parameter pytree in
      the compute dtype; leaves of a stacked unit that was not sliced keep
      their leading layer axis. Touches the plan's ``gather_axes`` (forward)
      and ``reduce_axes`` (backward).
    """

    def one(x):
        if not _is_unit(x):
            return x
        with jax.named_scope(f"gather_{x.layout.name}"):
            flat = _gather_flat(x.plan, x.source, x.sink, x.order)
        return unflatten_unit(flat, x.layout)

    return jax.tree.map(one, tree, is_leaf=_is_unit)


def layer(fn: Callable) -> Callable:
    """Marks ``fn`` as one layer: its gathered weights are recomputed, not saved.

    ``fn(*args)`` should call :func:`gather` on the :class:`Unit` handles among its
    arguments. The forward keeps only ``fn``'s inputs (shards and
    activations); the backward re-runs ``fn``, gathering the layer again, so
    at most one layer's full parameters are alive at a time (``2L`` gathers
    per step for ``L`` layers).

    Like ``jax.checkpoint``, with the ordering made explicit in the data:

    * forward: the units' shards are made to depend on the layer's other
      inputs (its activations), so a layer's gather cannot be scheduled
      before the previous layer has produced them; otherwise a scheduler
      that ignores memory may issue every gather of a Python loop of layers
      at the start;
    * backward: the recomputation (its sources) depends on the incoming
      cotangent, so it cannot be merged with the forward gather.
      ``jax.checkpoint`` relies on optimization barriers for this, which
      some XLA backends (CPU) drop before common-subexpression elimination.

    The dependency is :func:`zero_after`'s ``0 * probe``, one element-wise
    add over the payload each device sends. With ``GatherPlan.keep_activations`` the
    forward keeps the layer's activations (:mod:`~zeropp_jax.step.linearize`)
    and the backward recomputes the gathers and what was not kept only.

    A unit that forms its hpZ secondary per layer (``GatherPlan.secondary_bits``)
    gathers it over ``node`` once, in the forward, and keeps it (``1/local``
    of the layer) for the recomputation, which gathers inside the node only.
    """

    @functools.wraps(fn)
    def wrapped(*args):
        args = _in_order(args)  # units carry an order scalar from here on
        args = _formed(args)  # and hold their hpZ secondary, kept for the recomputation
        converted, consts = _closure_converted(fn, *args)
        return _rematerialized(converted, tuple(consts), args)

    return wrapped


def _closure_converted(fn: Callable, *args: Any) -> tuple[Callable, list]:
    """``jax.closure_convert`` hoisting every value ``fn`` closes over from an
    enclosing trace, whatever its dtype.

    ``jax.closure_convert`` hoists only values that may carry a tangent
    (floats); an int or bool one (an attention mask or positions read from
    the batch, closed over by a block under ``lax.scan``) stayed a constant
    of the converted function, which :func:`_rematerialized` takes as a
    static argument, and compiling failed ("No constant handler"). Hoisted,
    it is one more input (its cotangent ``float0``). Returns
    ``(converted, consts)``: ``converted(*args, *consts)`` is ``fn(*args)``.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    hoist = [isinstance(c, jax.core.Tracer) for c in closed.consts]
    kept = [c for c, h in zip(closed.consts, hoist) if not h]
    hoisted = [c for c, h in zip(closed.consts, hoist) if h]
    out_tree = jax.tree.structure(out_shape)

    def converted(*args_and_consts):
        n = len(args_and_consts) - len(hoisted)
        given, keep = iter(args_and_consts[n:]), iter(kept)
        consts = [next(given) if h else next(keep) for h in hoist]
        run = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(closed.jaxpr, consts))
        return jax.tree.unflatten(out_tree, run(*jax.tree.leaves(args_and_consts[:n])))

    return converted, hoisted


def _in_order(args: tuple, after: Any = None) -> tuple:
    """``args`` with each unit's gather ordered after the other arguments and ``after``."""
    activations = jax.tree.map(lambda x: None if _is_unit(x) else x, args, is_leaf=_is_unit)
    # The cotangent first (backward): a layer's first activation may be a
    # replicated constant that tie_after cannot add to a varying payload.
    order = zero_after((after, activations))
    if order is None:  # nothing to wait for; a scalar all the same (one pytree structure)
        order = jnp.zeros((), jnp.float32)
    # one type in both passes (fn is traced with the forward's): varying as the activations
    vary = frozenset().union(*map(varying_axes, filter(_is_numeric, jax.tree.leaves(activations))))
    if vary - varying_axes(order):
        order = jax.lax.pcast(order, tuple(sorted(vary - varying_axes(order))), to="varying")
    return jax.tree.map(lambda x: x.ordered(order) if _is_unit(x) else x, args, is_leaf=_is_unit)


def _call_in_order(fn: Callable, consts: tuple, args: tuple, after: Any = None) -> Any:
    return fn(*_in_order(args, after), *consts)


def _formed(args: tuple) -> tuple:
    """``args`` with each unit whose plan forms its hpZ secondary per layer
    (``GatherPlan.secondary_bits``) holding it, gathered over ``node`` here,
    after the layer's inputs, once: the recomputation in the backward reads
    the saved secondary and gathers inside the node only."""
    def form(x):
        if not _is_unit(x) or x.plan.secondary_bits is None or isinstance(x.source, Formed):
            return x
        with jax.named_scope(f"gather_{x.layout.name}"):
            formed = Formed(secondary_payload(x.plan, x.source, x.order))
        return Unit(formed, x.sink, x.layout, x.plan, order=x.order)

    return jax.tree.map(form, args, is_leaf=_is_unit)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rematerialized(fn: Callable, consts: tuple, args: tuple) -> Any:
    return _call_in_order(fn, consts, args)


def _remat_fwd(fn, consts, args):
    units = [x for x in jax.tree.leaves(args, is_leaf=_is_unit) if _is_unit(x)]
    if not any(u.plan.keep_activations for u in units):
        return _call_in_order(fn, consts, args), (consts, args, None)
    # the layer's flat parameters, which its saved activations must not include
    flats = [jax.eval_shape(functools.partial(gather_flat, u.plan), u.source) for u in units]
    out, lin = linearize(functools.partial(_call_in_order, fn), consts, args, drop=flats)
    return out, (consts, args, lin)


def _remat_bwd(fn, residuals, cotangent):
    # The recomputation's inputs (activations and constants) wait for the
    # cotangent; the units' gathers wait for those and the cotangent.
    consts, args, lin = residuals
    zero = zero_after(cotangent)
    consts, args = jax.tree.map(
        lambda x: x if _is_unit(x) else tie_after(x, zero), (consts, args), is_leaf=_is_unit
    )
    if lin is not None:  # the gathers (and what was not kept) recomputed from these:
        # the forward's order scalar may not depend on the cotangent, the sources do
        args = jax.tree.map(lambda x: x.tied(zero) if _is_unit(x) else x, args,
                            is_leaf=_is_unit)
        return pull_back(lin, (consts, args), cotangent)
    _, vjp = jax.vjp(lambda c, a: _call_in_order(fn, c, a, after=cotangent), consts, args)
    return vjp(cotangent)


_rematerialized.defvjp(_remat_fwd, _remat_bwd)


def zero_after(deps: Any) -> jax.Array | None:
    """A float32 scalar zero computed from the first numeric leaf of ``deps`` (``None`` if none).

    ``0 * probe``, guarded against a non-finite probe: opaque to every
    compiler pass, so whatever :func:`tie_after` adds it to waits for ``deps``.
    """
    probes = [x for x in jax.tree.leaves(deps) if _is_numeric(x)]
    if not probes:
        return None
    probe = jnp.reshape(probes[0], (-1,))[0].astype(jnp.float32)
    return jnp.where(jnp.isfinite(probe), probe * 0.0, 0.0)


def _is_numeric(x: Any) -> bool:
    """A non-empty float or integer array (what a zero can be added to)."""
    return (
        hasattr(x, "dtype") and x.dtype != jnp.bool_ and bool(x.size)
        and (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer))
    )


def tie_after(tree: Any, zero: jax.Array | None) -> Any:
    """``tree`` unchanged in value but computed after ``zero`` (``x + zero`` per array)."""
    if zero is None:
        return tree
    zero_vma = varying_axes(zero)

    def tie(x):
        if not _is_numeric(x):
            return x  # bools, PRNG keys, empty arrays, non-arrays
        if not zero_vma <= varying_axes(x):
            return x  # adding a varying zero would change x's type
        return x + zero.astype(x.dtype)

    return jax.tree.map(tie, tree)


def varying_axes(x: jax.Array) -> frozenset:
    """Mesh axes over which ``x`` varies inside shard_map (JAX 0.10 and 0.11)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", frozenset()))
