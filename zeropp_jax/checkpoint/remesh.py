"""The restore plan: how each leaf of a trainer's state is made from a checkpoint.

A unit's flat vector is padded to a multiple of ``devices * align``, so
shapes depend on the mesh and the config.  Restore reads each leaf in the
way its shapes allow:

* same shapes (same mesh; also ``2x4 -> 1x8 / 4x2`` when the padding and
  the carry agree; also another process count): Orbax reads straight into
  the target shardings, no host round trip;
* parameter-shaped leaves (``params`` and every optimizer-state leaf under a
  unit's name with the unit's stored shape: Adam's ``mu`` / ``nu``, ...)
  whose padding or leaf offsets differ (another mesh; qwZ on one side only,
  which aligns leaves to its block): read to host numpy, every leaf moved
  from its stored offset to the trainer's, placed on the new mesh;
* the qgZ carry ``(nodes, [L,] padded)``: row ``n`` is node ``n``'s deferred
  gradient and only the sum over nodes matters, so with another node count
  the rows are summed (nothing is lost) into the new node 0's row, zeros
  elsewhere; with the same node count each row is re-padded.  A trainer
  without error feedback (qgZ off, or a single node) drops the carry, with a
  warning; a checkpoint without a carry starts the new one at zeros;
* leaves with one equal row per node, ``(nodes, [L,] padded)`` (1-bit
  Adam's ``m`` / ``v``: every node decodes the same codes; node-replicated
  parameters): row 0, re-padded, copied onto the trainer's node count, or
  made the parameter-shaped leaf of a trainer without node replication (and
  back).

The optimizer state of another optimizer (1-bit Adam <-> optax Adam) is
planned by :mod:`~zeropp_jax.checkpoint.convert` through ``convert_opt``,
with :func:`repack` and :func:`place`.

Host memory of the conversion path: every process reads the *full* leaves
it converts (e.g. params + Adam ``mu`` + ``nu`` = 3x the float32 model, plus
``nodes``x the model for the carry) and holds them while placing the new
shards, about twice that at the peak.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from zeropp_jax.checkpoint import keys
from zeropp_jax.checkpoint.errors import CheckpointMismatchError
from zeropp_jax.checkpoint.metadata import (
    check_layout,
    check_optimizer,
    check_qgz_target,
    flat_with_keys,
    unit_from_json,
)
from zeropp_jax.checkpoint.storage import NUMPY, OPT, PARAMS
from zeropp_jax.layout import UnitLayout, params_shapes
from zeropp_jax.step.state import TrainState, ZeroOptState
from zeropp_jax.step.trainer import Trainer

_CARRY = ("qgz", "carry")
_RECEIVER = ("inner", "receiver_carry")  # 1-bit Adam's second hop (two-hop share only)

log = logging.getLogger(__name__)


def plan_restore(
    meta: dict, stored: dict[str, Any], trainer: Trainer, where: str,
    convert_opt: Callable | None = None,
) -> tuple[dict, Callable[[dict, int], TrainState]]:
    """Checks that a checkpoint fits ``trainer`` and plans how to read it.

    Args:
      meta: the checkpoint's JSON metadata.
      stored: Orbax's stored metadata tree of each array item
        (:func:`~zeropp_jax.checkpoint.storage.read_item_trees`).
      trainer: the trainer to restore for (any mesh and config).
      where: names the checkpoint in error messages.
      convert_opt: plans the optimizer state when it is another optimizer's
        (:func:`~zeropp_jax.checkpoint.convert.converter_for`):
        ``convert_opt(plan, stored, target, target_tree)`` with the stored
        and target leaves by key, returning ``(args, fill)`` like
        :meth:`_Plan.item`; ``None``: the optimizers must be the same.

    Returns:
      ``(restore_args, build)``: ``restore_args`` for
      :func:`~zeropp_jax.checkpoint.storage.read_arrays`, and
      ``build(values, step)`` making the :class:`TrainState` on the
      trainer's mesh from what it read.

    Raises:
      CheckpointMismatchError: the checkpoint does not fit the trainer.
    """
    check_layout(meta["layout"], trainer.layout, where)
    if convert_opt is None:
        check_qgz_target(meta, trainer, where)
    with_keys = _abstract_state(trainer)
    target = keys.data_like(with_keys)  # typed PRNG keys are stored as their data
    if convert_opt is None:
        check_optimizer(meta, trainer, with_keys.opt_state.inner, where)
    plan = _Plan(meta, trainer, where)
    params_args, params_fill = plan.item(
        flat_with_keys(stored[PARAMS]), flat_with_keys(target.params), params=True
    )
    if convert_opt is None:
        stored_opt = flat_with_keys(stored[OPT])
        opt_args, opt_fill = plan.item(
            stored_opt, _keyed_as_stored(flat_with_keys(target.opt_state), stored_opt),
            params=False,
        )
    else:
        opt_args, opt_fill = convert_opt(
            plan, flat_with_keys(stored[OPT]), flat_with_keys(target.opt_state), target.opt_state
        )

    def build(values: dict, step: int) -> TrainState:
        if plan.dropped_carry:  # announced with the state, once it is read and checked
            _warn_dropped_carry(meta, trainer, where)
        params = params_fill(flat_with_keys(values[PARAMS]))
        opt_state = opt_fill(flat_with_keys(values[OPT]))
        step_array = place(np.asarray(step, np.int32), target.step)
        state = TrainState(
            step_array,
            jax.tree_util.tree_unflatten(jax.tree.structure(target.params), params),
            jax.tree_util.tree_unflatten(jax.tree.structure(target.opt_state), opt_state),
        )
        if not isinstance(state.opt_state, ZeroOptState):
            raise AssertionError("internal error: restored opt_state is not a ZeroOptState")
        return keys.from_data(state, with_keys)

    restore_args = {PARAMS: (stored[PARAMS], params_args), OPT: (stored[OPT], opt_args)}
    return restore_args, build


# -------------------------------------------------------------- re-padding
def repack(x: np.ndarray, old: UnitLayout, new: UnitLayout, dtype: Any) -> np.ndarray:
    """Moves every leaf from its offset in the stored layout to the trainer's.

    Args:
      x: ``(..., old.padded)`` host array of one unit.
      old: the unit's stored layout (:func:`unit_from_json`).
      new: the trainer's layout of the unit (its padding, and its leaf
        offsets when qwZ aligns leaves, may differ).

    Returns:
      ``(..., new.padded)`` in ``dtype``, zeros outside the leaves.
    """
    out = np.zeros(x.shape[:-1] + (new.padded,), dtype)
    for lo, spec in zip(old.leaves, new.leaves):
        out[..., spec.offset:spec.offset + spec.size] = x[..., lo.offset:lo.offset + spec.size]
    return out


def _same_layout(old: UnitLayout, new: UnitLayout) -> bool:
    """Whether a stored unit can be read as it is (same padding and offsets)."""
    return old.padded == new.padded and [lo.offset for lo in old.leaves] == [
        spec.offset for spec in new.leaves
    ]


def _read_as_stored(args: dict, key: tuple[str, ...], tgt: jax.ShapeDtypeStruct):
    """Orbax reads ``key`` straight onto the target sharding; returns its maker."""
    args[key] = ocp.ArrayRestoreArgs(sharding=tgt.sharding, global_shape=tgt.shape, dtype=tgt.dtype)
    return lambda values: values[key]


def place(host: np.ndarray, target: jax.ShapeDtypeStruct) -> jax.Array:
    """Host array (the same on every process) -> global array on the target sharding."""
    host = np.asarray(host, target.dtype)
    if host.shape != target.shape:
        raise AssertionError(f"internal error: {host.shape} != {target.shape}")
    return jax.make_array_from_callback(target.shape, target.sharding, lambda idx: host[idx])


def _keyed_as_stored(target: dict, stored: dict) -> dict:
    """The trainer's optimizer leaves (key -> leaf, in tree order) keyed as
    the checkpoint keys them where the two optax states nest their chains
    otherwise (``chain(clip, adam)`` against ``adam``: ``inner/1/0/mu/...``
    against ``inner/0/mu/...``, which :func:`check_optimizer` allowed).

    Only the optax state's keys (under ``inner``) are paired: each less the
    all-digit parts before its last (tuple positions; a unit's name, last,
    is kept whatever it is) must name one leaf on each side. Otherwise the
    keys stay, and :meth:`_Plan.item` names the leaf it cannot find."""
    def inner(keys):
        return [k for k in keys if k[:1] == ("inner",)]

    if all(k in stored for k in inner(target)):
        return target

    def bare(key):
        return tuple(p for p in key[:-1] if not p.isdigit()) + key[-1:]

    ours = {bare(k): k for k in inner(target)}
    theirs = {bare(k): k for k in inner(stored)}
    if len(ours) != len(inner(target)) or len(theirs) != len(inner(stored)) \
            or set(ours) != set(theirs):
        return target
    return {theirs[bare(k)] if k[:1] == ("inner",) else k: leaf for k, leaf in target.items()}


def _abstract_state(trainer: Trainer) -> TrainState:
    """The trainer's state shapes with concrete shardings on its mesh."""
    return trainer.abstract_state(params_shapes(trainer.layout))


# -------------------------------------------------------------------- plan
class _Plan:
    """How each target leaf is made from the stored leaves of one checkpoint."""

    def __init__(self, meta: dict, trainer: Trainer, where: str):
        self.where = where
        self.old_units = {u["name"]: unit_from_json(u) for u in meta["layout"]["units"]}
        self.new_units = {u.name: u for u in trainer.layout.units}
        self.old_nodes = int(meta["mesh"]["node"])
        self.old_mesh = f"{meta['mesh']['node']}x{meta['mesh']['local']}"
        self.dropped_carry = False
        # which leaves hold one equal row per node, on each side
        self.old_config = {"node_replicated": bool(meta["config"].get("node_replicated", False)),
                           "qgz_target": meta["config"].get("qgz_target", "gradient")}
        self.new_config = {"node_replicated": trainer.config.node_replicated,
                           "qgz_target": trainer.config.qgz_target}

    def _unit_of(self, key: tuple[str, ...], stored_shape, target_shape):
        """The unit a unit-shaped leaf ``(..., [L,] U)`` belongs to (the same
        leading axes on both sides: an optimizer's history of K gradients,
        say), else ``None``."""
        name = key[-1] if key else None
        if name not in self.new_units:
            return None
        old, new = self.old_units[name], self.new_units[name]
        n = len(old.global_shape)
        stored_shape, target_shape = tuple(stored_shape), tuple(target_shape)
        if (len(stored_shape) == len(target_shape) >= n and stored_shape[-n:] == old.global_shape
                and target_shape[-n:] == new.global_shape and stored_shape[:-n] == target_shape[:-n]):
            return name
        return None

    @staticmethod
    def _per_node(key: tuple[str, ...], params: bool, config: dict) -> bool:
        """Whether ``key`` holds one equal row per node under ``config``: node-replicated
        parameters, or 1-bit Adam's ``m`` / ``v`` (by name, never by shape alone)."""
        if params:
            return config["node_replicated"]
        return config["qgz_target"] == "momentum" and key[:2] in (("inner", "m"), ("inner", "v"))

    def _rows_of(self, key, stored_shape, target_shape, params: bool):
        """``(unit, stored per node, target per node)`` for a leaf under a unit's
        name that has one equal row per node on either side (1-bit Adam's
        ``m`` / ``v``, node-replicated parameters), else ``None``."""
        name = key[-1] if key else None
        if name not in self.new_units:
            return None
        old, new = self.old_units[name], self.new_units[name]
        src_rows = (self._per_node(key, params, self.old_config) and len(stored_shape) >= 2
                    and stored_shape[0] == self.old_nodes
                    and tuple(stored_shape[1:]) == old.global_shape)
        tgt_rows = (self._per_node(key, params, self.new_config) and len(target_shape) >= 2
                    and tuple(target_shape[1:]) == new.global_shape)
        src_flat = tuple(stored_shape) == old.global_shape
        tgt_flat = tuple(target_shape) == new.global_shape
        if (src_rows or tgt_rows) and (src_rows or src_flat) and (tgt_rows or tgt_flat):
            return name, src_rows, tgt_rows
        return None

    def _rows_maker(self, key, rows, tgt, args):
        """A leaf whose rows are equal copies (one per node): row 0 re-padded,
        then copied onto the trainer's node count (or kept as one shard)."""
        unit, src_rows, tgt_rows = rows
        old, new = self.old_units[unit], self.new_units[unit]
        if src_rows and tgt_rows and self.old_nodes == tgt.shape[0] and _same_layout(old, new):
            return _read_as_stored(args, key, tgt)
        args[key] = NUMPY

        def make(values):
            x = np.asarray(values[key])
            host = repack(x[0] if src_rows else x, old, new, tgt.dtype)
            return place(np.broadcast_to(host, tgt.shape) if tgt_rows else host, tgt)

        return make

    def item(self, stored: dict, target: dict, *, params: bool):
        """Restore args per stored key, and a function making the target leaves.

        Returns:
          ``(args, fill)``: ``args`` maps every stored key to Orbax restore
          args; ``fill(values)`` maps the restored values (by key) to the
          target leaves in tree order.
        """
        what = "parameter" if params else "optimizer state"
        args: dict[tuple[str, ...], Any] = {}
        makers = []
        carry_keys = [k for k in stored if k[:2] == _CARRY] if not params else []
        # a receiver carry the trainer has no place for joins the sender carry
        fold = {k[-1]: k for k in stored if k[:2] == _RECEIVER and k not in target}
        for key, tgt in target.items():
            name = "/".join(key)
            if not params and key[:2] == _CARRY:
                makers.append(self._carry_maker(key, tgt, stored, args, fold.pop(key[-1], None)))
                continue
            if key[:2] == _RECEIVER and key not in stored:  # nothing deferred on that hop
                makers.append(lambda values, tgt=tgt: place(np.zeros(tgt.shape, tgt.dtype), tgt))
                continue
            if key not in stored:
                raise CheckpointMismatchError(
                    f"{self.where}: the trainer's {what} leaf {name!r} {tgt.shape} is not in "
                    f"the checkpoint (stored: {sorted('/'.join(k) for k in stored)[:8]}...); "
                    "was it written with another optimizer?"
                )
            src = stored[key]
            rows = self._rows_of(key, src.shape, tgt.shape, params)
            if rows is not None:  # one equal row per node on either side
                makers.append(self._rows_maker(key, rows, tgt, args))
                continue
            unit = self._unit_of(key, src.shape, tgt.shape)
            same = unit is None or _same_layout(self.old_units[unit], self.new_units[unit])
            if tuple(src.shape) == tuple(tgt.shape) and same:
                makers.append(_read_as_stored(args, key, tgt))
                continue
            if unit is None:
                raise CheckpointMismatchError(
                    f"{self.where}: {what} leaf {name!r} has shape {tuple(src.shape)} in the "
                    f"checkpoint (mesh {self.old_mesh}) but the trainer expects {tgt.shape}, "
                    "and it is not a unit-shaped leaf that could be re-padded; was it "
                    "written with another optimizer?"
                )
            args[key] = NUMPY
            old_unit, new_unit = self.old_units[unit], self.new_units[unit]

            def make(values, key=key, tgt=tgt, old_unit=old_unit, new_unit=new_unit):
                return place(repack(values[key], old_unit, new_unit, tgt.dtype), tgt)

            makers.append(make)
        unused = [k for k in stored if k not in target and k not in carry_keys
                  and k[:2] != _RECEIVER]
        if fold:  # no sender carry to join: the trainer has no error feedback
            carry_keys += list(fold.values())
        if unused:
            raise CheckpointMismatchError(
                f"{self.where}: the checkpoint has {what} leaves the trainer does not: "
                f"{['/'.join(k) for k in unused][:8]}; was it written with another optimizer?"
            )
        for k in carry_keys:
            if k not in args:  # the trainer has no carry: do not read it
                args[k] = None
                self.dropped_carry = True

        def fill(values):
            return [make(values) for make in makers]

        return args, fill

    def _carry_maker(self, key, tgt, stored, args, receiver=None):
        """The new qgZ carry of one unit from the stored one (see module doc).

        ``receiver``: the stored key of 1-bit Adam's receiver carry of this
        unit when the trainer has none (it gathers every node's codes): the
        exchange delivers the mean over nodes of the sender carries, so it
        is added to every row.
        """
        unit = key[-1]
        if key not in stored:
            if receiver is not None:
                raise CheckpointMismatchError(
                    f"{self.where}: unit {unit!r} has a receiver carry but no sender carry")
            log.info("%s: no qgZ carry for unit %r; starting it at zeros", self.where, unit)
            return lambda values: place(np.zeros(tgt.shape, tgt.dtype), tgt)
        src = stored[key]
        old, new = self.old_units[unit], self.new_units[unit]
        expected = (self.old_nodes,) + old.global_shape
        if tuple(src.shape) != expected:
            raise CheckpointMismatchError(
                f"{self.where}: qgZ carry of unit {unit!r} has shape {tuple(src.shape)}, "
                f"expected {expected} for mesh {self.old_mesh}"
            )
        if receiver is None and tuple(src.shape) == tuple(tgt.shape) and _same_layout(old, new):
            return _read_as_stored(args, key, tgt)
        args[key] = NUMPY
        if receiver is not None:
            args[receiver] = NUMPY
        new_nodes = tgt.shape[0]

        def make(values):
            carry = np.asarray(values[key], np.float64)
            if new_nodes == self.old_nodes:
                rows = repack(carry, old, new, np.float64)
            else:  # only the rows' sum matters: into row 0
                rows = np.zeros(tgt.shape, np.float64)
                rows[0] = repack(carry.sum(axis=0), old, new, np.float64)
            if receiver is not None:
                rows += repack(np.asarray(values[receiver], np.float64), old, new, np.float64)[None]
            return place(rows.astype(tgt.dtype), tgt)

        return make


def _warn_dropped_carry(meta: dict, trainer: Trainer, where: str) -> None:
    if trainer.config.qgz == "off":
        why = "its config has qgz='off'"
    elif not trainer.qgz_active:
        why = f"its mesh {trainer.nodes}x{trainer.local} has a single node (nothing crosses nodes)"
    else:
        why = "its config has qgz_error_feedback=False"
    message = (
        f"{where}: DROPPING the qgZ error-feedback carry (gradient that compression "
        f"deferred on mesh {meta['mesh']['node']}x{meta['mesh']['local']}): the new "
        f"trainer has no error feedback because {why}. Training continues, but the "
        "deferred gradient is lost."
    )
    # stacklevel 6: Checkpointer.restore_with_metadata (which restore() calls),
    # above _newest_good's loop over steps, _restore_step and build.
    warnings.warn(message, stacklevel=6)
