"""Gradients of one optimizer step: all micro-batches, summed (inside shard_map).

The loss is differentiated with respect to each unit's gradient *sink*
(:class:`~zeropp_jax.step.gather.Unit`): every ``gather`` the model makes is
an all-gather whose backward is a reduce-scatter into the sink, so the sum
over micro-batches never holds a full gradient.  Each unit's source, what its
gathers send, is prepared here once per step from the primary shard (cast,
or quantized with qwZ); with hpZ it is the node's secondary partition: the
only parameter traffic across nodes.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zeropp_jax.layout import REMAINDER, join_units
from zeropp_jax.nnx_model import RESEEDED_STREAMS, loss_mark
from zeropp_jax.step.gather import Unit, gather, secondary_payload, varying_axes
from zeropp_jax.step.geometry import DATA_AXES, StepGeometry, node_level_once, sink_dtype
from zeropp_jax.step.linen_writes import warn_of_writes
from zeropp_jax.wire import collectives


def check_loss_arguments(loss_fn: Callable, takes_key: bool) -> None:
    """Raises a TypeError now, naming ``rng=``, if ``loss_fn`` cannot be called
    as the step calls it: ``loss_fn(params, batch)``, or with ``takes_key``
    (``make_trainer`` given ``rng``) ``loss_fn(params, batch, key)``. A
    callable without a signature to read is left to the first step. Warns
    for a loss of :func:`~zeropp_jax.nnx_loss` with random streams to reseed
    but no key (every step would draw the same dropout masks)."""
    streams = loss_mark(loss_fn, RESEEDED_STREAMS)
    if streams and not takes_key:
        warnings.warn(
            f"the loss reseeds the model's random streams {list(streams)} from a key, but "
            "make_trainer has no rng=, so they keep the values they had when nnx_loss split "
            "the model: every step, micro-batch and device would draw the same dropout "
            "mask. Pass rng= (a seed or a key), or nnx_loss(..., streams=()) if the "
            "streams are meant to stay fixed", stacklevel=3)
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*(None,) * (3 if takes_key else 2))
    except TypeError as e:
        call = "loss_fn(params, batch, key)" if takes_key else "loss_fn(params, batch)"
        fix = ("make_trainer was given rng=, so the loss takes a PRNG key as a third "
               "argument: add one, or leave out rng=" if takes_key else
               "a loss that takes a PRNG key (dropout) gets it when make_trainer is given "
               "rng= (a seed or a key): pass one, or drop the key argument")
        raise TypeError(f"the train step calls {call}, which this loss_fn does not "
                        f"accept ({e}); {fix}") from None


def unit_source(geo: StepGeometry, primary: jax.Array, per_layer: bool = False) -> Any:
    """What a unit's per-layer gathers send, prepared once per step.

    The primary shard cast to the compute dtype, or quantized with qwZ
    (:func:`~zeropp_jax.wire.collectives.encode_for_gather`): parameters do
    not change within a step, so every gather of the step (forward and
    backward, every micro-batch) sends the same payload. With hpZ, the node's
    secondary partition: that payload all-gathered over ``node`` once, the
    only parameter traffic across nodes, and with qwZ decoded there once
    (unless ``hpz_secondary="quantized"``), so the gathers inside the node
    carry the compute dtype and nothing is dequantized per gather.

    Args:
      geo: the step geometry.
      primary: float32 ``([L,] U / D)``.
      per_layer: the unit's secondary is formed layer by layer
        (:meth:`StepGeometry.forms_secondary_per_layer`): the primary
        payload is returned, not gathered.

    Returns:
      ``([L,] U / D)`` (``([L,] U / local)`` with hpZ) in the compute dtype,
      or a ``Quantized`` pair of that length when ``geo.plan`` gathers qwZ
      codes. Mesh axes: ``node`` with hpZ (unless ``per_layer``), none
      otherwise.
    """
    cfg, plan = geo.config, geo.plan
    payload = collectives.encode_for_gather(
        primary, bits=cfg.qwz_bits, block=cfg.qwz_block, scale_dtype=cfg.scale_dtype,
        out_dtype=plan.compute_dtype, kernels=plan.kernels,
    )
    if cfg.hpz and not per_layer:  # the whole unit's secondary, up front
        payload = secondary_payload(geo.secondary_plan, payload)
    return payload


def micro_batch_key(key: jax.Array, step: jax.Array, first_row: jax.Array) -> jax.Array:
    """The key of one micro-batch: ``key`` folded with the step, then its first global row.

    Keys differ per step, micro-batch and device, are a pure function of the
    state (so a resumed run draws the same), and for a given global row do
    not depend on the mesh shape (only on the device count through the rows
    each micro-batch holds).
    """
    return jax.random.fold_in(jax.random.fold_in(key, step), first_row)


def accumulate(
    geo: StepGeometry, loss_fn: Callable[..., jax.Array], params: dict, batch: Any,
    *, step: jax.Array | None = None, key: jax.Array | None = None, sum_axes: tuple = (),
) -> tuple[dict, "LossOutputs"]:
    """Gradients of all ``grad_accum`` micro-batches, summed (inside shard_map).

    Args:
      geo: the step geometry.
      loss_fn: ``loss_fn(params, micro_batch) -> scalar`` or ``(scalar, aux)``
        (the user's; :func:`split_loss_output`).
      params: name -> float32 ``([L,] U / D)`` primary shard, or with
        ``node_replicated`` ``([L,] U / local)``: this device's ``local``
        slice of its node's copy (the master parameters ``(nodes, [L,] U)``,
        ``P("node", [None,] "local")``, with the node axis dropped).
      batch: pytree of ``(B / D, ...)`` arrays.
      step: int32 scalar, the optimizer step (needed with ``key``).
      key: ``None``, or the trainer's key: then ``loss_fn(params,
        micro_batch, k)`` gets :func:`micro_batch_key`'s ``k``.
      sum_axes: mesh axes each layer's reduced gradient is also all-reduced
        over, in the backward, where the unit's plan takes them
        (:meth:`~zeropp_jax.step.geometry.StepGeometry.plan_of`).

    Returns:
      ``(acc, outputs)``: name -> float32 summed gradient, the node-partial
      ``([L,] U / local)`` with hierarchical gradients (reduced over
      ``local`` only), else the ``([L,] U / D)`` shard summed over all
      devices; and this device's :class:`LossOutputs` of the micro-batches.

    Raises:
      ValueError: if ``loss_fn`` returns neither a scalar array nor a
        ``(scalar, aux)`` pair (:func:`split_loss_output`).
    """
    accum = geo.config.grad_accum
    sinks0, loss_of_sinks = loss_on_units(geo, loss_fn, params, sum_axes)

    def grads_of(micro_batch, index):
        micro_key = None if key is None else micro_batch_key_at(key, step, batch, accum, index)
        out, g = jax.value_and_grad(loss_of_sinks, has_aux=True)(sinks0, micro_batch, micro_key)
        return g, LossOutputs(*out)

    def micro_step(acc, inputs):
        g, out = grads_of(*inputs)
        return jax.tree.map(jnp.add, acc, g), out

    micro_batches = split_micro_batches(batch, accum)
    if accum == 1:  # no loop, and no zeros + gradient pass
        g, out = grads_of(jax.tree.map(lambda x: x[0], micro_batches), 0)
        return (jax.tree.map(lambda x: x.astype(jnp.float32), g),
                jax.tree.map(lambda x: x[None], out))
    return jax.lax.scan(micro_step, sinks0, (micro_batches, jnp.arange(accum)))


def loss_on_units(geo: StepGeometry, loss_fn: Callable[..., jax.Array], params: dict,
                  sum_axes: tuple = ()) -> tuple[dict, Callable]:
    """The loss as a function of the units' gradient sinks (inside shard_map).

    Args:
      geo, loss_fn, params, sum_axes: as :func:`accumulate`'s.

    Returns:
      ``(sinks0, loss_of_sinks)``: each unit's zero sink (what a gradient is
      taken with respect to), and ``loss_of_sinks(sinks, micro_batch,
      micro_key) -> (loss, aux)`` (:func:`split_loss_output`), which calls
      ``loss_fn`` on :class:`~zeropp_jax.step.gather.Unit` handles (or the
      gathered model) made from each unit's source, prepared here once.
    """
    units = geo.layout.units
    sources = {}
    for u in units:
        with jax.named_scope(f"unit_source_{u.name}"):
            sources[u.name] = unit_source(geo, params[u.name],
                                          per_layer=geo.forms_secondary_per_layer(u))

    def zero_sink(u):
        shard = params[u.name]
        width = u.padded // geo.local if node_level_once(geo, u) else shard.shape[-1]
        zeros = jnp.zeros(shard.shape[:-1] + (width,), sink_dtype(geo, u))
        return jax.lax.pcast(zeros, DATA_AXES, to="varying")

    sinks0 = {u.name: zero_sink(u) for u in units}

    def loss_of_sinks(sinks, micro_batch, micro_key):
        handles = {u.name: Unit(sources[u.name], sinks[u.name], u, geo.plan_of(u, sum_axes))
                   for u in units}
        if geo.layout.has_remainder:  # a wrap policy's remainder: gathered once, whole
            handles[REMAINDER] = gather(handles[REMAINDER])
        tree = join_units(handles, geo.layout)
        if geo.layout.whole_model:
            tree = gather(tree)
        keys = () if micro_key is None else (micro_key,)
        try:
            with warn_of_writes():  # a Linen apply with mutable collections: dropped
                return split_loss_output(loss_fn(tree, micro_batch, *keys))
        except NotImplementedError as e:  # JAX's advice names shard_map, which the user never calls
            if "Closing over inputs to shard_map" not in str(e):
                raise
            raise ValueError(
                "the loss closes over an array placed on the trainer's mesh (made under "
                "jax.set_mesh, or put there with a NamedSharding), which JAX cannot close "
                "over inside the step's shard_map: pass it in the batch, or close over a "
                "NumPy copy (np.asarray(x); a copy moved to one device with jax.device_put "
                f"is refused too). JAX said: {e}") from None

    return sinks0, loss_of_sinks


def split_micro_batches(batch: Any, accum: int) -> Any:
    """This device's ``(B / D, ...)`` leaves as ``(accum, B / D / accum, ...)``."""
    return jax.tree.map(lambda x: jnp.reshape(x, (accum, x.shape[0] // accum) + x.shape[1:]), batch)


def micro_batch_key_at(key: jax.Array, step: jax.Array, batch: Any, accum: int,
                       index: jax.Array, row_offset: Any = 0) -> jax.Array:
    """:func:`micro_batch_key` of micro-batch ``index`` of this device's
    ``batch`` (``(B / D, ...)`` leaves; inside shard_map: reads the device's
    index), its rows counted from ``row_offset`` (int32 ``()``: an evaluation's tail)."""
    rows = jax.tree.leaves(batch)[0].shape[0]
    first_row = row_offset + collectives.axes_index(DATA_AXES) * rows + index * (rows // accum)
    return micro_batch_key(key, step, first_row)


class LossOutputs(NamedTuple):
    """What the loss returned for each micro-batch, on this device.

    Attributes:
      losses: float32 ``(grad_accum,)``.
      aux: the loss's aux pytree (``{}`` without one), each leaf float32
        ``(grad_accum,)``.
    """

    losses: jax.Array
    aux: Any


def split_loss_output(out: Any) -> tuple[jax.Array, Any]:
    """``loss_fn``'s result as ``(float32 scalar loss, aux)``: a scalar array,
    or a ``(scalar, aux)`` tuple as ``jax.value_and_grad(has_aux=True)`` takes
    (aux: a pytree of real scalars, cast to float32, since the step reports
    their means; ``{}`` without one)."""
    aux = {}
    if isinstance(out, tuple) and len(out) == 2:
        out, aux = out
    if not isinstance(out, (jax.Array, np.ndarray, np.generic)):
        kind = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise ValueError(
            f"loss_fn must return a scalar array (the loss), or a (loss, aux) tuple; got {kind}")
    if jnp.shape(out) != ():
        raise ValueError(f"loss_fn must return a scalar, got shape {jnp.shape(out)}")
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(f"loss_fn returned a {out.dtype} loss; its gradient would be zero "
                         "(jax.grad refuses it): return a floating-point loss")

    def as_float(path, leaf):
        where = f"the loss's aux{jax.tree_util.keystr(path)}"
        try:
            leaf = jnp.asarray(leaf)
        except TypeError:
            raise ValueError(f"{where} is a {type(leaf).__name__}; aux leaves must be real "
                             "scalars (the step reports their means)") from None
        if not any(jnp.issubdtype(leaf.dtype, t) for t in (jnp.floating, jnp.integer, bool)):
            raise ValueError(f"{where} has dtype {leaf.dtype}; aux leaves must be real "
                             "scalars (the step reports their means in float32)")
        if leaf.shape != ():
            raise ValueError(
                f"{where} has shape {leaf.shape}; aux leaves must be scalars, which the step "
                "averages over micro-batches and devices (reduce it in the loss, e.g. with "
                "jnp.mean; outputs such as logits or batch statistics are not carried out)")
        return leaf.astype(jnp.float32)

    return out.astype(jnp.float32), jax.tree_util.tree_map_with_path(as_float, aux)


def over_devices(x: jax.Array, reduce: Callable = jax.lax.psum) -> jax.Array:
    """``reduce`` (``psum`` or ``pmean``) of ``x`` over every device (inside shard_map).

    ``x`` may vary over some data axes and not others (a loss's aux, a
    value already summed over ``local``): it is cast to varying first, so
    each device's copy counts once.
    """
    missing = tuple(a for a in DATA_AXES if a not in varying_axes(x))
    return reduce(jax.lax.pcast(x, missing, to="varying") if missing else x, DATA_AXES)


def square_sum_or_nan(grads: Iterable[jax.Array]) -> jax.Array:
    """float32 ``()``: the sum of the squares of the elements of ``grads``
    (this device's arrays), or NaN if one of them is NaN or inf.

    Of each device's shard of the reduced gradient (what the optimizer
    sees) and summed over devices, it is NaN exactly where an element of
    that gradient is NaN or inf (``optax.apply_if_finite``'s test, element
    by element), and inf where only the squares pass float32. Moves nothing.
    """
    grads = list(grads)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads]))
    return jnp.where(finite, sum(jnp.sum(jnp.square(g)) for g in grads), jnp.nan)


def step_metrics(geo: StepGeometry, outputs: LossOutputs, sq_norm: jax.Array,
                 compress: bool) -> dict:
    """The step's metrics (inside shard_map): replicated float32 / int32 scalars,
    and the loss's aux (each leaf averaged over micro-batches and devices).

    Args:
      geo: the step geometry.
      outputs: this device's :class:`LossOutputs`.
      sq_norm: the squared gradient norm, the same on every device.
      compress: whether this variant compresses (qgZ).
    """
    means = mean_outputs(outputs)
    out = {
        "loss": means.pop("loss"),
        "grad_norm": jnp.sqrt(sq_norm),
        "grad_rms": jnp.sqrt(sq_norm / float(geo.layout.numel)),  # numel may pass int32
        "compressed": jnp.asarray(int(compress and geo.qgz_active), jnp.int32),
    }
    return {**out, **means}


def mean_outputs(outputs: LossOutputs) -> dict:
    """``{"loss"}`` and, if the loss returns one, ``{"aux"}``: each averaged over
    the micro-batches, then over every device (inside shard_map)."""
    def mean(x):
        return over_devices(jnp.mean(x, axis=0), jax.lax.pmean)

    out = {"loss": mean(outputs.losses)}
    if jax.tree.leaves(outputs.aux):
        out["aux"] = jax.tree.map(mean, outputs.aux)
    return out
