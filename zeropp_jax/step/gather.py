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
``2L`` gathers of ZeRO-3).

Outside a ZeRO step (plain parameter dicts) ``gather`` is the identity, so
the same model code trains on one device unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from zeropp_jax.wire import collectives, quantization
from zeropp_jax.wire.kernels import Kernels
from zeropp_jax.layout import UnitLayout, unflatten_unit


@dataclasses.dataclass(frozen=True)
class GatherPlan:
    """Static recipe for one unit's gather and gradient reduction.

    Attributes:
      gather_axes: mesh axes of the per-layer all-gather (``("local",)`` with
        hpZ, else ``("local", "node")``).
      reduce_axes: mesh axes of the per-layer gradient reduce-scatter
        (``("local",)`` when the cross-node reduction runs once per step).
      bits: qwZ bits applied when the source is a float shard (0: none).
      block: elements per qwZ scale.
      scale_dtype: dtype of qwZ scales on the wire.
      compute_dtype: dtype of the gathered parameters.
      reduce_dtype: dtype of the gradient reduce-scatter on the wire.
      kernels: the quantization kernels (XLA reference or Pallas).
    """

    gather_axes: tuple[str, ...]
    reduce_axes: tuple[str, ...]
    bits: int
    block: int
    scale_dtype: Any
    compute_dtype: Any
    reduce_dtype: Any
    kernels: Kernels


@jax.tree_util.register_pytree_node_class
class Unit:
    """One layer's parameters as seen by the model inside the step.

    Children (sliced by ``lax.scan`` for stacked units):
      source: float ``(..., s)`` shard or a ``Quantized`` hpZ secondary.
      sink: float32 ``(..., r)`` zeros; its gradient is the layer's
        reduce-scattered gradient.
    Aux data: the unit's :class:`UnitLayout` and :class:`GatherPlan`.
    """

    def __init__(self, source: Any, sink: jax.Array, layout: UnitLayout, plan: GatherPlan):
        self.source = source
        self.sink = sink
        self.layout = layout
        self.plan = plan

    def tree_flatten(self):
        return (self.source, self.sink), (self.layout, self.plan)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def __repr__(self):
        return f"Unit({self.layout.name!r}, stack={self.layout.stack})"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_flat(plan: GatherPlan, source: Any, sink: jax.Array) -> jax.Array:
    del sink  # only carries the gradient
    if isinstance(source, quantization.Quantized):
        gathered = collectives.all_gather(source, plan.gather_axes)
        return plan.kernels.dequantize(
            gathered, bits=plan.bits, block=plan.block, dtype=plan.compute_dtype
        )
    return collectives.quantized_all_gather(
        source,
        plan.gather_axes,
        bits=plan.bits,
        block=plan.block,
        scale_dtype=plan.scale_dtype,
        out_dtype=plan.compute_dtype,
        kernels=plan.kernels,
    )


def _gather_fwd(plan, source, sink):
    return _gather_flat(plan, source, sink), None


def _gather_bwd(plan, _, cotangent):
    grad = collectives.reduce_scatter(cotangent, plan.reduce_axes, plan.reduce_dtype)
    return None, grad.astype(jnp.float32)


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
            flat = _gather_flat(x.plan, x.source, x.sink)
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
    * backward: the recomputation depends on the incoming cotangent, so it
      cannot be merged with the forward gather. ``jax.checkpoint`` relies on
      optimization barriers for this, which some XLA backends (CPU) drop
      before common-subexpression elimination.

    The dependency is an added ``0 * probe`` (guarded against non-finite
    probes): opaque to every compiler pass, and one element-wise add over
    the layer's shards.
    """

    @functools.wraps(fn)
    def wrapped(*args):
        converted, consts = jax.closure_convert(fn, *args)
        return _rematerialized(converted, tuple(consts), args)

    return wrapped


def _call_in_order(fn: Callable, consts: tuple, args: tuple) -> Any:
    activations = jax.tree.map(lambda x: None if _is_unit(x) else x, args, is_leaf=_is_unit)
    args = jax.tree.map(
        lambda x: Unit(_after(x.source, activations), x.sink, x.layout, x.plan)
        if _is_unit(x) else x,
        args,
        is_leaf=_is_unit,
    )
    return fn(*args, *consts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rematerialized(fn: Callable, consts: tuple, args: tuple) -> Any:
    return _call_in_order(fn, consts, args)


def _remat_fwd(fn, consts, args):
    return _call_in_order(fn, consts, args), (consts, args)


def _remat_bwd(fn, residuals, cotangent):
    consts, args = _after(residuals, cotangent)
    _, vjp = jax.vjp(lambda c, a: _call_in_order(fn, c, a), consts, args)
    return vjp(cotangent)


_rematerialized.defvjp(_remat_fwd, _remat_bwd)


def _after(tree: Any, deps: Any) -> Any:
    """Returns ``tree`` unchanged in value but computed after ``deps``."""
    probes = [
        x for x in jax.tree.leaves(deps)
        if hasattr(x, "dtype") and x.dtype != jnp.bool_ and x.size
        and (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer))
    ]
    if not probes:
        return tree
    probe = jnp.reshape(probes[0], (-1,))[0].astype(jnp.float32)
    zero = jnp.where(jnp.isfinite(probe), probe * 0.0, 0.0)
    zero_vma = _varying_axes(zero)

    def tie(x):
        if not hasattr(x, "dtype") or x.dtype == jnp.bool_ or not x.size:
            return x
        if not zero_vma <= _varying_axes(x):
            return x  # adding a varying zero would change x's type
        return x + zero.astype(x.dtype)

    return jax.tree.map(tie, tree)


def _varying_axes(x: jax.Array) -> frozenset:
    """Mesh axes over which ``x`` varies inside shard_map (JAX 0.10 and 0.11)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", frozenset()))
