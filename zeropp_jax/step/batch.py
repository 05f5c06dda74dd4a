"""Placing a batch on the mesh: any pytree of arrays, checked leaf by leaf.

A batch is a pytree whose leaves share a leading (row) axis: numpy arrays,
``jax.Array``s (on any device or with any sharding), or nested Python lists
of numbers (a list of numbers is one leaf; a tuple, dict or list of arrays
is a container).  Every leaf is split over all devices along that axis
(``P(("node", "local"))``); a leaf already placed that way is used as it is,
anything else is copied there.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding


def _nearest_multiples(rows: int, multiple: int) -> str:
    """``'8 or 16'``: the multiples of ``multiple`` around ``rows`` (at least one)."""
    below = rows // multiple * multiple
    return f"{below} or {below + multiple}" if below else f"{multiple}"


def _is_list_data(x: Any) -> bool:
    """A (nested) Python list of numbers: one array, not a pytree of scalars."""
    if not isinstance(x, list) or not x:
        return False
    return all(isinstance(e, (bool, int, float)) or _is_list_data(e) for e in x)


def _describe(path) -> str:
    return "batch" + jax.tree_util.keystr(path) if path else "batch"


def _as_array(path, x) -> Any:
    """``x`` as an array (numpy for lists; a ``jax.ShapeDtypeStruct`` kept),
    or a ValueError naming the leaf."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        arr = x
    else:
        try:
            arr = np.asarray(x)
        except ValueError as e:  # ragged nested lists
            raise ValueError(f"{_describe(path)} is not a rectangular array: {e}") from None
    if not (jnp.issubdtype(arr.dtype, jnp.number) or jnp.issubdtype(arr.dtype, jnp.bool_)):
        raise ValueError(
            f"{_describe(path)} has dtype {arr.dtype}; batch leaves must be numeric or bool "
            "arrays (tokenize text before batching)"
        )
    if len(arr.shape) == 0:
        raise ValueError(
            f"{_describe(path)} is a scalar; every batch leaf needs a leading batch axis "
            "(shape (B, ...)); close over constants in loss_fn instead"
        )
    return arr


def place_batch(batch: Any, sharding: NamedSharding, *, per_step: int, n_devices: int,
                grad_accum: int) -> Any:
    """The batch as global ``jax.Array``s sharded ``sharding`` (rows over all devices).

    Args:
      batch: pytree of arrays with leading axis ``B`` (the global batch); on
        a multi-process run each process passes its own ``B / processes``
        rows as host data, or global ``jax.Array``s. A ``jax.ShapeDtypeStruct``
        leaf (the global shape) comes back as one with ``sharding``.
      sharding: the batch sharding (``P(("node", "local"))``).
      per_step: ``n_devices * grad_accum``: ``B`` must be a multiple.
      n_devices, grad_accum: for the error message.

    Raises:
      ValueError: naming the leaf, for an empty batch, a scalar or
        non-numeric leaf, leaves with different row counts, or a row count
        that does not split into ``devices x grad_accum``.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch, is_leaf=_is_list_data)
    if not flat:
        raise ValueError("the batch has no arrays; pass a pytree of arrays with a leading batch axis")
    n_proc = jax.process_count()
    arrays = [(path, _as_array(path, x)) for path, x in flat]
    rows = {}
    for path, arr in arrays:
        is_global = isinstance(arr, jax.ShapeDtypeStruct) or (
            isinstance(arr, jax.Array) and n_proc > 1 and not arr.is_fully_addressable)
        rows[_describe(path)] = arr.shape[0] * (1 if is_global or n_proc == 1 else n_proc)
    if len(set(rows.values())) > 1:
        listed = ", ".join(f"{k}: {v}" for k, v in rows.items())
        raise ValueError(f"batch leaves must share their leading (row) axis; got {listed}")
    global_b = next(iter(rows.values()))
    if not global_b:
        raise ValueError(f"the batch has 0 rows; a step takes a multiple of devices x grad_accum "
                         f"= {n_devices} x {grad_accum} = {per_step} rows")
    if global_b % per_step:
        raise ValueError(
            f"batch size {global_b} must be divisible by devices x grad_accum "
            f"= {n_devices} x {grad_accum} = {per_step}: "
            f"{_nearest_multiples(global_b, per_step)} rows would do"
        )

    def put(arr):
        if isinstance(arr, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=sharding)
        if isinstance(arr, jax.Array):
            if arr.sharding == sharding:
                return arr
            if n_proc == 1 or not arr.is_fully_addressable:
                return jax.device_put(arr, sharding)
            arr = np.asarray(arr)
        if n_proc == 1:
            return jax.device_put(arr, sharding)
        return jax.make_array_from_process_local_data(sharding, arr, (global_b,) + arr.shape[1:])

    return jax.tree_util.tree_unflatten(treedef, [put(arr) for _, arr in arrays])


class RowPart(NamedTuple):
    """A part of an evaluation's batch (:func:`split_rows`).

    Attributes:
      batch: the part's rows (a multiple of ``devices x grad_accum``, or
        the batch as given, for :func:`place_batch` to place or refuse).
      rows: how many of them count (0 for a batch as given: one part, its
        own mean).
      first_row: the part's first row in the whole batch.
      padded: a tail of fewer rows padded to ``devices x grad_accum`` (one
        row a micro-batch: each row's loss is read alone).
    """

    batch: Any
    rows: int
    first_row: int
    padded: bool


def split_rows(batch: Any, per_step: int) -> list[RowPart]:
    """``batch`` cut where its rows stop dividing into ``per_step``, for an evaluation.

    Returns the whole batch where its row count divides into ``per_step``;
    otherwise the largest such head, if any, and the remaining ``r < per_step``
    rows padded to ``per_step`` with copies of their last row (each device's
    micro-batch then holds one row, and only the first ``r`` count), both on
    the host. A multi-process batch, or one :func:`place_batch` would
    refuse (leaves of different row counts, a scalar, no rows, ragged lists),
    is returned whole, for :func:`place_batch` to place or refuse, naming the leaf.
    """
    flat, treedef = jax.tree_util.tree_flatten(batch, is_leaf=_is_list_data)
    shapes = {np.shape(x)[:1] if isinstance(x, jax.Array) else _rows_of(x) for x in flat}
    if jax.process_count() > 1 or len(shapes) != 1 or () in shapes or None in shapes:
        return [RowPart(batch, 0, 0, False)]
    rows = shapes.pop()[0]
    head, tail = rows - rows % per_step, rows % per_step
    if not tail:
        return [RowPart(batch, rows, 0, False)]
    arrays = [np.asarray(x) for x in flat]  # on the host: a placed array slices no other way

    def pad(x):  # the tail's rows, then its last row repeated: per_step rows
        return np.concatenate([x[head:], np.repeat(x[-1:], per_step - tail, axis=0)])

    def part(rows):
        return jax.tree_util.tree_unflatten(treedef, rows)

    tail_part = RowPart(part([pad(x) for x in arrays]), tail, head, True)
    return ([RowPart(part([x[:head] for x in arrays]), head, 0, False)] if head else []) + [tail_part]


def _rows_of(x: Any) -> tuple | None:
    """``x``'s leading axis as ``(rows,)`` (``()`` for a scalar), ``None`` for a ragged list."""
    try:
        return np.shape(x)[:1]
    except ValueError:
        return None


def global_batch_size_check(batch_size: int, n_devices: int, grad_accum: int) -> None:
    """Raises a clear error if a batch does not split over the devices."""
    if batch_size < 1 or batch_size % (n_devices * grad_accum):
        raise ValueError(
            f"batch size {batch_size} must be a positive multiple of devices x "
            f"grad_accum = {n_devices} x {grad_accum} = {n_devices * grad_accum}"
        )
