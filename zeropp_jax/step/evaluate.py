"""The loss at the current parameters, without an update: what an eval loop needs.

The model runs as in a step (the same per-layer gathers, qwZ's codes and
hpZ's secondary included, so the loss is the one the step's forward sees),
with no gradient and nothing written back.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zeropp_jax.step.accumulate import (
    LossOutputs,
    loss_on_units,
    mean_outputs,
    micro_batch_key_at,
    split_micro_batches,
)
from zeropp_jax.step.geometry import StepGeometry


def evaluate(geo: StepGeometry, loss_fn: Callable[..., jax.Array], params: dict, batch: Any,
             step: jax.Array, *, key: jax.Array | None) -> dict:
    """The mean loss of a global batch (global, under ``jit``; one ``shard_map``).

    Args:
      geo: the step geometry.
      loss_fn: the trainer's loss (as :func:`~zeropp_jax.step.accumulate.accumulate`'s).
      params: the state's master parameters (``TrainState.params``).
      batch: the global batch, placed like a step's (``P(("node", "local"))``).
      step: int32 ``()``, the state's step (the loss's keys, with ``key``).
      key: ``None``, or the trainer's key: the loss gets the keys a step at
        this state would draw (:func:`~zeropp_jax.step.accumulate.micro_batch_key`).

    Returns:
      ``{"loss": float32 ()}`` (the mean over ``grad_accum`` micro-batches and
      every device, as a step's), and ``"aux"`` (each leaf averaged the same
      way) when the loss returns one. Mesh axes: the gathers' (``local``,
      and ``node`` without hpZ), then a ``pmean`` over both.
    """
    def local(params, batch, step, key):
        if geo.config.node_replicated:  # this node's copy: (1, [L,] U / local)
            params = {name: p[0] for name, p in params.items()}
        accum = geo.config.grad_accum
        sinks, loss_of_sinks = loss_on_units(geo, loss_fn, params)

        def one(inputs):
            micro_batch, index = inputs
            micro_key = None if key is None else micro_batch_key_at(key, step, batch, accum, index)
            return LossOutputs(*loss_of_sinks(sinks, micro_batch, micro_key))

        return mean_outputs(jax.lax.map(one, (split_micro_batches(batch, accum), jnp.arange(accum))))

    return jax.shard_map(
        local, mesh=geo.mesh,
        in_specs=(geo.param_specs(), geo.batch_specs(batch), P(), P()),
        out_specs=P(), check_vma=geo.check_vma,
    )(params, batch, step, key)
