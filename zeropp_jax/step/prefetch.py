"""Stacked layers with depth-1 prefetch of their parameter gathers: ``scan_layers``.

``jax.lax.scan(layer(fn), carry, stacked)`` gathers layer ``i`` after layer
``i - 1`` has produced its output (:func:`~zeropp_jax.step.gather.layer`
orders each gather after the layer's inputs), so the all-gather and the
layer's compute run one after the other. :func:`scan_layers` computes the
same values with the gathers one layer ahead:

* forward: iteration ``i`` decodes layer ``i``'s gathered payload carried in
  from iteration ``i - 1``, computes layer ``i`` on it and issues the gather
  of layer ``i + 1``, ordered after layer ``i``'s *input* only. Nothing in the
  gather depends on layer ``i``'s compute, and nothing in that compute depends
  on the gather, so the two may overlap. Only the layers' inputs are saved for
  the backward pass, never gathered parameters.
* backward (in reverse): iteration ``i`` issues the gather of layer
  ``i - 1``, ordered after the cotangent arriving at layer ``i``, and the
  reduce-scatter of layer ``i + 1``'s parameter gradient, carried in from
  the iteration before, into the unit's sink; then it recomputes layer
  ``i``'s forward on the gathered parameters carried in and takes its VJP,
  whose gradient it carries on. Neither collective depends on the layer's
  VJP, so both may overlap it. (Reduced at the end of its own iteration, a
  layer's gradient had nothing left to overlap: XLA:GPU's schedule ran the
  reduce-scatter, and then the gather, after the VJP; benchmarks/RESULTS.md.)

With hpZ (one micro-batch, :meth:`~zeropp_jax.step.geometry.StepGeometry.forms_secondary_per_layer`)
the stacked unit's source is the primary payload, and the forward's gather
of layer ``i + 1`` first all-gathers its shard over ``node`` into the
layer's secondary partition, as DeepSpeed's ZeRO++ forms it: the one
parameter transfer across nodes of the step then runs a layer at a time
behind the forward's compute, rather than whole before it. The forward
returns the stacked secondaries, which the backward gathers inside the node.

With ``keep_activations`` (``GatherPlan.keep_activations``) the forward
also keeps each layer's activations (:func:`~zeropp_jax.step.linearize.linearize`,
stacked like the layers, the last layer's apart, which the backward then
also takes before its loop) and the backward applies the kept VJP to the
parameters it gathers again, instead of recomputing the layer's forward.

Each layer is still gathered twice and its gradient reduce-scattered once
(``2L`` gathers and ``L`` reduce-scatters per stacked unit, the collectives
of ZeRO-3), and at most two layers' gathered parameters are alive at a time:
one more than without prefetch; in the backward also one layer's gradient
waiting to be reduced. The first layer of each direction is gathered before
the loop and the last one computed after it, so no iteration gathers a
layer that does not exist; the backward also computes its first layer
(``L - 1``) before its loop, so every iteration has a gradient to reduce.

Memory. A loop carries the gathered layer in its wire form (qwZ's int8 codes
and scales, decoded in the iteration that computes the layer; without qwZ the
flat layer itself), and each gather also waits for the carried layer's
decoded values (a scalar read of them, nothing of the layer's compute). The
while loop then takes one copy of the carried layer, which the layer's
gradient reuses once the parameters are read, and the next gather lands
directly in the loop's buffer, rather than holding the carried layer, a copy
and the new one, and copying the new one into place. The backward loop also
passes the layers' closure constants through its carry, so that the layer
computed after it reads the loop's copy and not (kept alive across the loop)
whatever they were sliced from, such as a gathered unit. Two more orderings
keep buffers from being allocated early: the zeros the backward loop
accumulates the parameter gradients into wait for the incoming cotangent
(built before the forward, hpZ's zeros of the node's secondary partition stay
alive across it), and a layer computed outside a loop reads its parameters
only after its input (or cotangent) exists (:func:`_read_after`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from zeropp_jax.layout import unflatten_unit
from zeropp_jax.step.gather import (
    Unit, decode_payload, gather_flat, gather_payload, layer, reduce_gradient,
    secondary_payload, tie_after, varying_axes, zero_after,
)
from zeropp_jax.step.linearize import linearize, pull_back


def scan_layers(
    fn: Callable, carry: Any, stacked: Any, *, layer_fn: Callable | None = None,
) -> tuple[Any, Any]:
    """``jax.lax.scan`` over stacked layers, gathering each layer's parameters one layer ahead.

    Args:
      fn: ``fn(carry, x) -> (carry, y)``, one layer. ``x`` is one layer's
        slice of ``stacked``; ``fn`` reads parameters through
        :func:`~zeropp_jax.gather` (with prefetch it receives them already
        gathered, and ``gather`` passes them through).
      carry: the initial carry (the first layer's input activations).
      stacked: pytree whose leaves have a leading layer axis ``L``: stacked
        :class:`~zeropp_jax.Unit` handles (inside a ZeRO step) or plain
        parameter arrays, and any other per-layer inputs.
      layer_fn: how each layer is wrapped where prefetch does not run
        (``None``: :func:`~zeropp_jax.layer` when ``stacked`` holds units,
        nothing otherwise).

    Returns:
      ``(carry, ys)`` as ``jax.lax.scan(fn, carry, stacked)``: the last
      layer's carry and the stacked ``y``s (``None`` if ``fn`` returns none).

    Raises:
      ValueError: if a unit is not stacked, the units disagree on prefetch
        or the leaves of ``stacked`` on ``L``.

    With units whose plan has ``prefetch`` on (``ZeroConfig.prefetch``, the
    default) it is the prefetching custom VJP described in this module, which
    rematerializes like ``layer`` and replaces ``layer_fn``; with prefetch
    off (or ``L = 1``) it is ``jax.lax.scan(layer_fn(fn), carry, stacked)``;
    without units (one device, plain parameters) ``jax.lax.scan`` of ``fn``
    (or ``layer_fn(fn)``).

    Example::

      def block(h, params):
          p = zp.gather(params)
          return jnp.tanh(h @ p["w"]), None

      h, _ = zp.scan_layers(block, h, params["blocks"])
    """
    leaves, treedef = jax.tree.flatten(stacked, is_leaf=_is_unit)
    units = [x for x in leaves if _is_unit(x)]
    flat = [u.layout.name for u in units if u.layout is not None and u.layout.stack is None]
    if flat:  # it would be cut into scalars, one per "layer"
        raise ValueError(
            f"scan_layers scans stacked layers, but the unit(s) {flat} have no layer axis: "
            f"build the trainer with stacked=({flat[0]!r},) (per_layer=True alone makes "
            "each top-level entry one unit, gathered whole)")
    prefetch = {u.plan.prefetch for u in units}
    if len(prefetch) > 1:
        raise ValueError(
            "the stacked units disagree on prefetch (GatherPlan.prefetch); build them from "
            "one ZeroConfig"
        )
    length = _length(leaves) if units and prefetch.pop() else None
    if length is None or length == 1:  # one layer has no next layer to prefetch
        if layer_fn is None:
            layer_fn = layer if units else _identity
        return jax.lax.scan(layer_fn(fn), carry, stacked)
    others = tuple(x for x in leaves if not _is_unit(x))
    stack = _Stack(
        fn=None, treedef=treedef, is_unit=tuple(map(_is_unit, leaves)),
        plans=tuple(u.plan for u in units), layouts=tuple(u.layout for u in units),
        length=length,
    )
    example_flats = tuple(
        jax.eval_shape(functools.partial(gather_flat, u.plan), _at(u.source, 0))
        for u in units
    )
    converted, consts = jax.closure_convert(
        stack.apply(fn), carry, _at(others, 0), example_flats
    )
    stack = dataclasses.replace(stack, fn=converted)
    sources = tuple(u.source for u in units)
    sinks = tuple(u.sink for u in units)
    return _prefetched(stack, tuple(consts), carry, others, sources, sinks)


@dataclasses.dataclass(frozen=True)
class _Stack:
    """Static description of the stacked layers (the custom VJP's non-differentiable argument).

    ``fn(carry, others_i, flats, *consts) -> (carry, y)`` is the closure-converted
    layer on one layer's non-unit leaves and gathered flat parameters.
    """

    fn: Callable | None
    treedef: Any
    is_unit: tuple[bool, ...]  # per leaf of ``stacked``
    plans: tuple
    layouts: tuple
    length: int

    def apply(self, fn: Callable) -> Callable:
        """``fn`` on one layer's slice rebuilt from its other leaves and gathered flats."""

        def one_layer(carry, others_i, flats):
            others_i, units_i = iter(others_i), iter(zip(flats, self.layouts))
            leaves = [
                unflatten_unit(*next(units_i)) if unit else next(others_i)
                for unit in self.is_unit
            ]
            return fn(carry, jax.tree.unflatten(self.treedef, leaves))

        return one_layer

    def gather(self, sources: tuple, i: Any, after: Any, held: tuple = ()) -> tuple[tuple, tuple]:
        """Layer ``i``'s gathered payloads (wire form), sent after ``after`` and ``held``.

        ``held``: the decoded flats of the layer a loop carries (one per
        unit), each of which the gather waits for (one element's read).
        Returns ``(wires, secondaries)``: one payload per unit, and layer
        ``i``'s hpZ secondary of each unit whose plan forms it here
        (``GatherPlan.secondary_bits``, gathered over ``node`` first).
        """
        order = zero_after(after)
        for flat in held:
            zero = zero_after(flat)
            order = zero if order is None else order + zero
        wires, secondaries = [], []
        for plan, layout, source in zip(self.plans, self.layouts, sources):
            with jax.named_scope(f"gather_{layout.name}"):
                source_i = _at(source, i)
                if plan.secondary_bits is not None:
                    source_i = secondary_payload(plan, source_i, order)
                    secondaries.append(source_i)
                wires.append(gather_payload(plan.resident(), source_i, order))
        return tuple(wires), tuple(secondaries)

    def call(self, consts: tuple, h: Any, others_i: Any, flats: tuple) -> tuple[Any, Any]:
        """One layer: ``fn`` on its input ``h``, other leaves and gathered flats."""
        return self.fn(h, others_i, flats, *consts)

    def run(self, consts: tuple, h: Any, others_i: Any, flats: tuple, keep: bool):
        """:meth:`call`, and with ``keep`` its :class:`Linearized` VJP (else ``None``)."""
        if not keep:
            return self.call(consts, h, others_i, flats), None
        return linearize(self.call, consts, h, others_i, flats, drop=flats)

    def resident(self) -> "_Stack":
        """This stack with every unit gathering a source that already is its secondary."""
        return dataclasses.replace(self, plans=tuple(p.resident() for p in self.plans))

    def resident_sources(self, sources: tuple, secondaries: tuple) -> tuple:
        """``sources`` with each stacked secondary the forward formed (``_Stack.gather``)
        in place of its unit's primary payload: what :meth:`resident` gathers."""
        formed = iter(secondaries)
        return tuple(next(formed) if plan.secondary_bits is not None else source
                     for plan, source in zip(self.plans, sources))

    def decode(self, wires: tuple) -> tuple:
        """Each unit's ``(U,)`` flat parameters in the compute dtype from its gathered payload."""
        flats = []
        for plan, layout, wire in zip(self.plans, self.layouts, wires):
            with jax.named_scope(f"decode_{layout.name}"):
                flats.append(decode_payload(plan, wire))
        return tuple(flats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _prefetched(stack: _Stack, consts: tuple, carry: Any, others: tuple, sources: tuple,
                sinks: tuple) -> tuple[Any, Any]:
    del sinks  # only carry the gradients
    out, ys, *_ = _forward(stack, consts, carry, others, sources, keep=False)
    return out, ys


def _forward(stack, consts, carry, others, sources, keep):
    """Layers ``0 .. L-1``, each gathered one iteration ahead.

    Returns the last carry, the stacked ``ys``, the carries into layers
    ``1 .. L-1`` (stacked, the residuals of the backward pass), the
    stacked hpZ secondaries formed on the way (``_Stack.gather``) and, with
    ``keep``, the layers' :class:`Linearized` VJPs (else ``None``): layers
    ``0 .. L-2``'s stacked and layer ``L-1``'s, traced outside the loop.
    """
    n = stack.length

    def step(state, i):
        h, wires = state
        flats = stack.decode(wires)
        # waits for this layer's input and the carried layer's read, not its compute
        ahead, secondaries = stack.gather(sources, i + 1, after=h, held=flats)
        (h_out, y), lin = stack.run(consts, h, _at(others, i), flats, keep)
        return (h_out, ahead), (h_out, y, secondaries, lin)

    wires, first = stack.gather(sources, 0, after=carry)
    (h, wires), (inputs, ys, secondaries, lins) = jax.lax.scan(
        step, (carry, wires), jnp.arange(n - 1))
    flats = _read_after(stack.decode(wires), h)  # not sliced before layer n-2 is done
    (h_out, y), lin = stack.run(consts, h, _at(others, n - 1), flats, keep)
    return (h_out, _append(ys, y), inputs, _prepend(first, secondaries),
            (lins, lin) if keep else None)


def _prefetched_fwd(stack, consts, carry, others, sources, sinks):
    keep = stack.plans[0].keep_activations
    out, ys, inputs, secondaries, lins = _forward(stack, consts, carry, others, sources, keep)
    sources = stack.resident_sources(sources, secondaries)  # the backward gathers in the node
    return (out, ys), (consts, carry, others, sources, sinks, inputs, lins)


def _prefetched_bwd(stack, residuals, cotangents):
    consts, carry, others, sources, sinks, inputs, lins = residuals
    ct_out, ct_ys = cotangents
    n = stack.length
    stack = stack.resident()

    def layer_vjp(i, h, flats, ct_h, consts, lin):
        primals = (consts, h, _at(others, i), flats)
        ct = (ct_h, _at_cotangent(ct_ys, i))
        if lin is None:  # recompute the layer's forward
            _, vjp = jax.vjp(stack.call, *primals)
            d_consts, d_h, d_x, d_flats = vjp(ct)
        else:  # the forward kept its VJP
            d_consts, d_h, d_x, d_flats = pull_back(lin, primals, ct)
        return _floats_only(d_consts), d_h, _floats_only(d_x), d_flats

    def settle(sink_grads, pending, i):
        grads = tuple(map(reduce_gradient, stack.plans, pending))
        return tuple(map(lambda g, gi: _set_row(g, i, gi), sink_grads, grads))

    def step(state, i, lin=None):  # i = L-1 .. 1
        ct_h, wires, d_consts, sink_grads, consts, pending = state
        flats = stack.decode(wires)
        if pending is not None:  # layer i + 1's gradient, reduced while layer i's VJP runs
            sink_grads = settle(sink_grads, pending, i + 1)
        # waits for the incoming cotangent and the carried layer's read, not the VJP
        ahead, _ = stack.gather(sources, i - 1, after=ct_h, held=flats)
        dc, d_h, d_x, d_flats = layer_vjp(i, _at(inputs, i - 1), flats, ct_h, consts, lin)
        # the constants pass on tied to d_h: a carry XLA cannot forward as loop-invariant
        consts = tie_after(consts, zero_after(d_h))
        return (d_h, ahead, _add(d_consts, dc), sink_grads, consts, d_flats), d_x

    wires, _ = stack.gather(sources, n - 1, after=(ct_out, ct_ys))
    # the gradients' zeros wait for the cotangent too: built before the forward, a
    # broadcast of a constant would stay alive across it
    after = zero_after((ct_out, ct_ys))
    state = (ct_out, wires, _zeros(_floats_only(consts)), tie_after(_zeros(sinks), after),
             consts, None)
    lin_last = None
    if lins is not None:  # layer L-1's kept VJP was traced outside the forward's loop
        lins, lin_last = lins
    state, d_x_last = step(state, n - 1, lin_last)  # nothing pending yet
    state, d_xs = jax.lax.scan(
        lambda state, i: step(state, i, _at(lins, i)), state, jnp.arange(1, n - 1), reverse=True)
    d_xs = _append(d_xs, d_x_last)
    ct_h, wires, d_consts, sink_grads, consts, pending = state
    flats = _read_after(stack.decode(wires), ct_h)  # not sliced before layer 1's VJP
    sink_grads = settle(sink_grads, pending, 1)
    dc, d_carry, d_x, d_flats = layer_vjp(0, carry, flats, ct_h, consts, _at(lins, 0))
    sink_grads = settle(sink_grads, d_flats, 0)
    return _add(d_consts, dc), d_carry, _prepend(d_x, d_xs), None, sink_grads


_prefetched.defvjp(_prefetched_fwd, _prefetched_bwd)


def _read_after(flats: tuple, deps: Any) -> tuple:
    """A layer's ``(U,)`` flats, unchanged in value, read only once ``deps`` (its input) exist.

    For the layers computed outside a loop: otherwise XLA may slice a layer's
    weights out of its flat as soon as it is gathered, a layer ahead (with
    ``L = 2`` both loops have one iteration and are inlined: every layer).
    """
    return tie_after(flats, zero_after(deps))


# ---------------------------------------------------------------- pytree helpers
def _is_unit(x: Any) -> bool:
    return isinstance(x, Unit)


def _identity(fn: Callable) -> Callable:
    return fn


def _length(leaves: list) -> int:
    """The common leading axis ``L`` of the stacked leaves (units: their sinks)."""
    arrays = [x.sink if _is_unit(x) else x for x in leaves]
    lengths = {np.shape(a)[0] if np.ndim(a) else 0 for a in arrays}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(
            "scan_layers needs every leaf of `stacked` to have the same leading layer axis "
            f"L >= 1; got leading axes {sorted(lengths)}"
        )
    return lengths.pop()


def _at(tree: Any, i: Any) -> Any:
    """Row ``i`` (a traced or static index) of every leaf."""
    return jax.tree.map(lambda a: a[i], tree)


def _at_cotangent(tree: Any, i: Any) -> Any:
    """Row ``i`` of stacked cotangents; integer outputs' (``float0``) rows built, not indexed."""
    def row(a):
        if a.dtype == jax.dtypes.float0:
            return np.zeros(a.shape[1:], jax.dtypes.float0)
        return a[i]

    return jax.tree.map(row, tree)


def _append(ys: Any, y: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), ys, y)


def _prepend(y: Any, ys: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), y, ys)


def _set_row(stacked: jax.Array, i: Any, row: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(stacked, row.astype(stacked.dtype), i, 0)


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _floats_only(tree: Any) -> Any:
    """``tree`` with non-float leaves (integer inputs' ``float0`` cotangents) as ``None``."""
    return jax.tree.map(
        lambda x: x if jnp.issubdtype(x.dtype, jnp.inexact) else None, tree
    )


def _zeros(tree: Any) -> Any:
    """Zeros of each leaf's shape, dtype and varying mesh axes (a scan carry's start)."""
    def zeros(x):
        z = jnp.zeros(x.shape, x.dtype)
        vary = tuple(sorted(varying_axes(x) - varying_axes(z)))
        return jax.lax.pcast(z, vary, to="varying") if vary else z

    return jax.tree.map(zeros, tree)
