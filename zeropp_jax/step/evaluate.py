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
from zeropp_jax.step.geometry import DATA_AXES, StepGeometry


def evaluate(geo: StepGeometry, loss_fn: Callable[..., jax.Array], params: dict, batch: Any,
             step: jax.Array, first_row: Any = 0, *, key: jax.Array | None,
             per_row: bool = False) -> dict:
    """The mean loss of a global batch (global, under ``jit``; one ``shard_map``).

    Args:
      geo: the step geometry.
      loss_fn: the trainer's loss (as :func:`~zeropp_jax.step.accumulate.accumulate`'s).
      params: the state's master parameters (``TrainState.params``).
      batch: the global batch, placed like a step's (``P(("node", "local"))``).
      step: int32 ``()``, the state's step (the loss's keys, with ``key``).
      first_row: int32 ``()``, the batch's first row in the rows evaluated
        (a tail's keys are those of its rows, not of the head's).
      key: ``None``, or the trainer's key: the loss gets the keys a step at
        this state would draw (:func:`~zeropp_jax.step.accumulate.micro_batch_key`).
      per_row: return each micro-batch's loss unaveraged (for a batch of
        ``devices x grad_accum`` rows: each row's, in row order).

    Returns:
      ``{"loss": float32 ()}`` (the mean over ``grad_accum`` micro-batches and
      every device, as a step's), and ``"aux"`` (each leaf averaged the same
      way) when the loss returns one; with ``per_row`` each float32
      ``(devices * grad_accum,)``, split ``P(("node", "local"))``. Mesh axes:
      the gathers' (``local``, and ``node`` without hpZ), then a ``pmean``
      over both (none with ``per_row``).
    """
    def local(params, batch, step, first_row, key):
        if geo.config.node_replicated:  # this node's copy: (1, [L,] U / local)
            params = {name: p[0] for name, p in params.items()}
        accum = geo.config.grad_accum
        sinks, loss_of_sinks = loss_on_units(geo, loss_fn, params)

        def one(inputs):
            micro_batch, index = inputs
            micro_key = None if key is None else micro_batch_key_at(
                key, step, batch, accum, index, first_row)
            return LossOutputs(*loss_of_sinks(sinks, micro_batch, micro_key))

        outputs = jax.lax.map(one, (split_micro_batches(batch, accum), jnp.arange(accum)))
        if per_row:
            aux = {"aux": outputs.aux} if jax.tree.leaves(outputs.aux) else {}
            return {"loss": outputs.losses, **aux}
        return mean_outputs(outputs)

    return jax.shard_map(
        local, mesh=geo.mesh,
        in_specs=(geo.param_specs(), geo.batch_specs(batch), P(), P(), P()),
        out_specs=P(DATA_AXES) if per_row else P(), check_vma=geo.check_vma,
    )(params, batch, step, jnp.asarray(first_row, jnp.int32), key)


def mean_over_parts(parts: list[tuple[dict, int, bool]]) -> dict:
    """The mean over the rows of several evaluations' outputs (each row weighing the same).

    Args:
      parts: ``(outputs, rows, per_row)``: a mean over ``rows`` rows
        (:func:`evaluate`'s), or with ``per_row`` its rows' own values, of which
        the first ``rows`` count (a tail padded by
        :func:`~zeropp_jax.step.batch.split_rows`).

    Returns:
      The outputs' structure (``{"loss"}``, ``"aux"``), each leaf float32 ``()``:
      a single part as it is, several weighed by their rows.
    """
    if len(parts) == 1 and not parts[0][2]:
        return parts[0][0]
    total = sum(rows for _, rows, _ in parts)

    def weighed(x, rows, per_row):
        if per_row:  # the first rows (x is split over the mesh: masked, not sliced)
            return jnp.sum(jnp.where(jnp.arange(x.shape[0]) < rows, x, 0))
        return x * rows

    return jax.tree.map(lambda *xs: sum(weighed(x, rows, per_row) for x, (_, rows, per_row)
                                        in zip(xs, parts)) / total, *[out for out, _, _ in parts])
