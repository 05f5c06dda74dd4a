"""Gradients of one optimizer step: all micro-batches, summed (inside shard_map).

The loss is differentiated with respect to each unit's gradient *sink*
(:class:`~zeropp_jax.step.gather.Unit`): every ``gather`` the model makes is
an all-gather whose backward is a reduce-scatter into the sink, so the sum
over micro-batches never holds a full gradient.  With hpZ each unit's source
is the node's secondary partition, built here once per step from the primary
shards: the only parameter traffic across nodes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from zeropp_jax.layout import REMAINDER, join_units
from zeropp_jax.mesh import NODE
from zeropp_jax.step.gather import Unit, gather
from zeropp_jax.step.geometry import DATA_AXES, StepGeometry
from zeropp_jax.wire import collectives


def hpz_secondary(geo: StepGeometry, primary: jax.Array) -> Any:
    """hpZ: this node's partition, the primary shards all-gathered over ``node``.

    Args:
      geo: the step geometry.
      primary: float32 ``([L,] U / D)``.

    Returns:
      ``([L,] U / local)`` in the compute dtype, or a ``Quantized`` pair
      when qwZ is on (the refresh crosses nodes quantized).
    """
    cfg = geo.config
    if cfg.qwz_bits:
        q = geo.kernels.quantize(
            primary, bits=cfg.qwz_bits, block=cfg.qwz_block, scale_dtype=cfg.scale_dtype
        )
        return collectives.all_gather(q, (NODE,))
    return collectives.all_gather(primary.astype(geo.compute_dtype), (NODE,))


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
    *, step: jax.Array | None = None, key: jax.Array | None = None,
) -> tuple[dict, jax.Array]:
    """Gradients of all ``grad_accum`` micro-batches, summed (inside shard_map).

    Args:
      geo: the step geometry.
      loss_fn: ``loss_fn(params, micro_batch) -> scalar`` (the user's).
      params: name -> float32 ``([L,] U / D)`` primary shard.
      batch: pytree of ``(B / D, ...)`` arrays.
      step: int32 scalar, the optimizer step (needed with ``key``).
      key: ``None``, or the trainer's key: then ``loss_fn(params,
        micro_batch, k)`` gets :func:`micro_batch_key`'s ``k``.

    Returns:
      ``(acc, losses)``: name -> float32 summed gradient, the node-partial
      ``([L,] U / local)`` with hierarchical gradients (reduced over
      ``local`` only), else the ``([L,] U / D)`` shard summed over all
      devices; and the float32 ``(grad_accum,)`` micro-batch losses of this
      device.

    Raises:
      ValueError: if ``loss_fn`` does not return a scalar.
    """
    cfg = geo.config
    accum = cfg.grad_accum
    units = geo.layout.units

    sources = {}
    for u in units:
        if cfg.hpz:
            with jax.named_scope(f"hpz_secondary_{u.name}"):
                sources[u.name] = hpz_secondary(geo, params[u.name])
        else:
            sources[u.name] = params[u.name]

    def zero_sink(u):
        shard = params[u.name]
        width = u.padded // geo.local if cfg.hierarchical_grads else shard.shape[-1]
        zeros = jnp.zeros(shard.shape[:-1] + (width,), jnp.float32)
        return jax.lax.pcast(zeros, DATA_AXES, to="varying")

    sinks0 = {u.name: zero_sink(u) for u in units}

    def loss_of_sinks(sinks, micro_batch, micro_key):
        handles = {u.name: Unit(sources[u.name], sinks[u.name], u, geo.plan) for u in units}
        if geo.layout.paths:  # a wrap policy: the remainder is gathered once, whole
            handles[REMAINDER] = gather(handles[REMAINDER])
        tree = join_units(handles, geo.layout)
        if geo.layout.whole_model:
            tree = gather(tree)
        if micro_key is None:
            loss = loss_fn(tree, micro_batch)
        else:
            loss = loss_fn(tree, micro_batch, micro_key)
        if jnp.shape(loss) != ():
            raise ValueError(f"loss_fn must return a scalar, got shape {jnp.shape(loss)}")
        return loss.astype(jnp.float32)

    rows = jax.tree.leaves(batch)[0].shape[0]  # this device's rows, B / D

    def micro_step(acc, inputs):
        micro_batch, index = inputs
        micro_key = None
        if key is not None:
            first_row = collectives.axes_index(DATA_AXES) * rows + index * (rows // accum)
            micro_key = micro_batch_key(key, step, first_row)
        loss, g = jax.value_and_grad(loss_of_sinks)(sinks0, micro_batch, micro_key)
        return jax.tree.map(jnp.add, acc, g), loss

    micro_batches = jax.tree.map(
        lambda x: jnp.reshape(x, (accum, x.shape[0] // accum) + x.shape[1:]), batch
    )
    return jax.lax.scan(micro_step, sinks0, (micro_batches, jnp.arange(accum)))
