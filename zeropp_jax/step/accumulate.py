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

from zeropp_jax.layout import join_units
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


def accumulate(
    geo: StepGeometry, loss_fn: Callable[[Any, Any], jax.Array], params: dict, batch: Any
) -> tuple[dict, jax.Array]:
    """Gradients of all ``grad_accum`` micro-batches, summed (inside shard_map).

    Args:
      geo: the step geometry.
      loss_fn: ``loss_fn(params, micro_batch) -> scalar`` (the user's).
      params: name -> float32 ``([L,] U / D)`` primary shard.
      batch: pytree of ``(B / D, ...)`` arrays.

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

    def loss_of_sinks(sinks, micro_batch):
        handles = {u.name: Unit(sources[u.name], sinks[u.name], u, geo.plan) for u in units}
        tree = join_units(handles, geo.layout)
        if geo.layout.whole_model:
            tree = gather(tree)
        loss = loss_fn(tree, micro_batch)
        if jnp.shape(loss) != ():
            raise ValueError(f"loss_fn must return a scalar, got shape {jnp.shape(loss)}")
        return loss.astype(jnp.float32)

    def micro_step(acc, micro_batch):
        loss, g = jax.value_and_grad(loss_of_sinks)(sinks0, micro_batch)
        return jax.tree.map(jnp.add, acc, g), loss

    micro_batches = jax.tree.map(
        lambda x: jnp.reshape(x, (accum, x.shape[0] // accum) + x.shape[1:]), batch
    )
    return jax.lax.scan(micro_step, sinks0, micro_batches)
