"""Checkpoints of a ZeRO-3 / ZeRO++ train state: save, resume, re-mesh, export.

:class:`Checkpointer` saves the whole :class:`~zeropp_jax.step.trainer.TrainState`
with Orbax: the parameter shards, the optimizer state (including the qgZ
error-feedback carry and the last gradient RMS), the step, and a JSON
description of what was saved (format version, config, mesh, per-unit
layout, whatever the caller adds, e.g. the model config and the seed).  One
checkpoint is one directory ``DIR/<step>`` with three Orbax items::

  DIR/<step>/params     the unit dict: float32 (padded,) / (L, padded)
  DIR/<step>/opt_state  ZeroOptState(inner, qgz=QgzState(carry, grad_rms))
  DIR/<step>/meta       JSON (see :func:`describe_checkpoint`)

Every process writes its own shards (Orbax, OCDBT); a save is atomic: it is
written under ``DIR/<step>.orbax-checkpoint-tmp*`` and renamed to
``DIR/<step>`` only once complete, so a save that is killed half-way leaves
the previous checkpoints as they were and is never listed (its temporary
directory is removed by the next :class:`Checkpointer` on ``DIR``, before
its first save).  With ``async_save``
the step loop only waits for the device-to-host copy; the write runs in the
background.

Restore onto another mesh.  A unit's flat vector is padded to a multiple of
``devices * align``, so shapes depend on the mesh and the config.  Restore
reads each leaf in the way its shapes allow:

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
  warning; a checkpoint without a carry starts the new one at zeros.

Host memory of the conversion path: every process reads the *full* leaves
it converts (e.g. params + Adam ``mu`` + ``nu`` = 3x the float32 model, plus
``nodes``x the model for the carry) and holds them while placing the new
shards, about twice that at the peak.

Bad input.  A checkpoint whose units (names, numel, leaves) or optimizer
state do not match the trainer raises :class:`CheckpointMismatchError`
naming the step directory and the difference.  An unreadable checkpoint
(missing files, corrupted data) raises :class:`CheckpointError` naming it;
when no step is asked for, the newest *readable* checkpoint is used instead,
with a warning naming the bad one, which is renamed to ``<step>.corrupt`` so
later saves of those step numbers are possible.

Export.  :func:`export_params` writes the full, unpadded parameters (each
leaf in its original dtype) as one msgpack file that needs neither this
library nor the model code::

  import flax.serialization
  with open("params.msgpack", "rb") as f:
      data = f.read()
  params = flax.serialization.msgpack_restore(data)  # nested dict of numpy arrays
  # or, to get the original container types back from a template pytree:
  params = flax.serialization.from_bytes(template_params, data)

The tree is the parameters' ``flax.serialization.to_state_dict`` form: dicts
stay dicts with ``str`` keys (Flax parameters come back exactly), lists and
tuples become dicts keyed ``"0"``, ``"1"``, ..., named fields are keyed by
name.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.layout import ParamLayout, UnitLayout, join_units
from zeropp_jax.mesh import mesh_shape
from zeropp_jax.step.trainer import Trainer, TrainState, ZeroOptState

FORMAT = "zeropp_jax.checkpoint"
FORMAT_VERSION = 1

_PARAMS = "params"
_OPT = "opt_state"
_META = "meta"
_CARRY = ("qgz", "carry")
_CORRUPT_SUFFIX = ".corrupt"

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint is missing files, corrupted, or not a zeropp_jax checkpoint."""


class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint that does not fit the trainer (model or optimizer)."""


# --------------------------------------------------------------- metadata
def _key_name(key: Any) -> str:
    """A key path entry as Orbax and ``flax.serialization`` name it."""
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    raise TypeError(f"unsupported pytree key {key!r} ({type(key).__name__})")


def _flat_with_keys(tree: Any) -> dict[tuple[str, ...], Any]:
    """``{("inner", "1", "0", "mu", "blocks"): leaf, ...}`` in tree order."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(_key_name(k) for k in path): leaf for path, leaf in leaves}


def _unit_leaf_keys(unit) -> list[list[str]]:
    """State-dict key path of each leaf inside its unit, in tree order."""
    skeleton = jax.tree_util.tree_unflatten(unit.treedef, list(range(len(unit.leaves))))
    return [list(k) for k in _flat_with_keys(skeleton)]


def layout_to_json(layout: ParamLayout) -> dict:
    """The parameter layout as plain data (enough to unpad without the model)."""
    units = []
    for u in layout.units:
        leaves = [
            {
                "path": spec.path,
                "keys": keys,
                "shape": list(spec.shape),
                "dtype": np.dtype(spec.dtype).name,
                "offset": spec.offset,
                "size": spec.size,
            }
            for spec, keys in zip(u.leaves, _unit_leaf_keys(u))
        ]
        units.append({
            "name": u.name, "numel": u.numel, "padded": u.padded, "stack": u.stack,
            "leaves": leaves,
        })
    return {"whole_model": layout.whole_model, "n_devices": layout.n_devices, "units": units}


def describe_checkpoint(trainer: Trainer, step: int, extra_metadata: Mapping | None = None) -> dict:
    """The JSON stored with a checkpoint.

    Args:
      trainer: the trainer the state belongs to.
      step: the optimizer step of the state.
      extra_metadata: JSON-serializable caller data (model config, seed,
        data position, ...), stored under ``"extra"``.

    Returns:
      A dict with ``format``, ``version``, ``step``, ``mesh``,
      ``process_count``, ``config``, ``error_feedback``, ``layout`` (see
      :func:`layout_to_json`), ``extra``, ``time`` and library versions.
    """
    nodes, local = mesh_shape(trainer.mesh)
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": int(step),
        "mesh": {"node": nodes, "local": local},
        "process_count": jax.process_count(),
        "config": trainer.config.describe(),
        "qgz_active": trainer.qgz_active,
        "error_feedback": trainer.error_feedback,
        "layout": layout_to_json(trainer.layout),
        "extra": dict(extra_metadata or {}),
        "time": time.time(),
        "versions": {"jax": jax.__version__, "orbax": getattr(ocp, "__version__", "?")},
    }
    try:
        json.dumps(meta)
    except TypeError as e:
        raise ValueError(f"extra_metadata must be JSON-serializable: {e}") from None
    return meta


def params_shapes(layout: ParamLayout) -> Any:
    """The full parameter pytree as ``jax.ShapeDtypeStruct`` leaves."""
    trees = {}
    for u in layout.units:
        lead = () if u.stack is None else (u.stack,)
        leaves = [jax.ShapeDtypeStruct(lead + s.shape, s.dtype) for s in u.leaves]
        trees[u.name] = jax.tree_util.tree_unflatten(u.treedef, leaves)
    return join_units(trees, layout)


def _global_shape(unit_json: dict) -> tuple[int, ...]:
    lead = () if unit_json["stack"] is None else (unit_json["stack"],)
    return lead + (unit_json["padded"],)


def _check_layout(saved: dict, layout: ParamLayout, where: str) -> None:
    """Raises :class:`CheckpointMismatchError` unless the models agree."""
    current = layout_to_json(layout)
    old = {u["name"]: u for u in saved["units"]}
    new = {u["name"]: u for u in current["units"]}
    if list(old) != list(new):
        missing, unexpected = sorted(set(new) - set(old)), sorted(set(old) - set(new))
        raise CheckpointMismatchError(
            f"{where}: the checkpoint's parameter units {list(old)} do not match the "
            f"trainer's {list(new)} (missing in the checkpoint: {missing}, not in the "
            f"model: {unexpected}); was it written for another model?"
        )
    if saved["whole_model"] != current["whole_model"]:
        raise CheckpointMismatchError(
            f"{where}: the checkpoint was written with per_layer="
            f"{not saved['whole_model']}, the trainer uses per_layer={not current['whole_model']}"
        )
    for name, u in new.items():
        o = old[name]
        if (o["numel"], o["stack"]) != (u["numel"], u["stack"]):
            raise CheckpointMismatchError(
                f"{where}: unit {name!r} has {o['numel']} parameters per layer x "
                f"{o['stack'] or 1} layers in the checkpoint but {u['numel']} x "
                f"{u['stack'] or 1} in the trainer's model"
            )
        for lo, ln in zip(o["leaves"], u["leaves"]):
            if (lo["path"], lo["shape"]) != (ln["path"], ln["shape"]):
                raise CheckpointMismatchError(
                    f"{where}: unit {name!r}: checkpoint leaf {lo['path']} {tuple(lo['shape'])} "
                    f"does not match the model's leaf {ln['path']} {tuple(ln['shape'])}"
                )
        if len(o["leaves"]) != len(u["leaves"]):
            raise CheckpointMismatchError(
                f"{where}: unit {name!r} has {len(o['leaves'])} leaves in the checkpoint "
                f"but {len(u['leaves'])} in the model"
            )


# -------------------------------------------------------------- re-padding
def _repack(x: np.ndarray, old: dict, new: UnitLayout, dtype: Any) -> np.ndarray:
    """Moves every leaf from its offset in the stored layout to the trainer's.

    Args:
      x: ``(..., old padded)`` host array of one unit.
      old: the unit's stored layout (:func:`layout_to_json`).
      new: the trainer's :class:`~zeropp_jax.layout.UnitLayout` (its
        padding, and its leaf offsets when qwZ aligns leaves, may differ).

    Returns:
      ``(..., new.padded)`` in ``dtype``, zeros outside the leaves.
    """
    out = np.zeros(x.shape[:-1] + (new.padded,), dtype)
    for lo, spec in zip(old["leaves"], new.leaves):
        out[..., spec.offset:spec.offset + spec.size] = x[..., lo["offset"]:lo["offset"] + spec.size]
    return out


def _same_layout(old: dict, new: UnitLayout) -> bool:
    """Whether a stored unit can be read as it is (same padding and offsets)."""
    return old["padded"] == new.padded and [lo["offset"] for lo in old["leaves"]] == [
        spec.offset for spec in new.leaves
    ]


def _read_as_stored(args: dict, key: tuple[str, ...], tgt: jax.ShapeDtypeStruct):
    """Orbax reads ``key`` straight onto the target sharding; returns its maker."""
    args[key] = ocp.ArrayRestoreArgs(sharding=tgt.sharding, global_shape=tgt.shape, dtype=tgt.dtype)
    return lambda values: values[key]


def _place(host: np.ndarray, target: jax.ShapeDtypeStruct) -> jax.Array:
    """Host array (the same on every process) -> global array on the target sharding."""
    host = np.asarray(host, target.dtype)
    if host.shape != target.shape:
        raise AssertionError(f"internal error: {host.shape} != {target.shape}")
    return jax.make_array_from_callback(target.shape, target.sharding, lambda idx: host[idx])


def _abstract_state(trainer: Trainer) -> TrainState:
    """The trainer's state shapes with concrete shardings on its mesh."""
    abstract = trainer.abstract_state(params_shapes(trainer.layout))

    def concrete(x):
        spec = getattr(x.sharding, "spec", None) or P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(trainer.mesh, spec))

    return jax.tree.map(concrete, abstract)


# ----------------------------------------------------------- checkpointer
class Checkpointer:
    """Saves and restores a trainer's :class:`~zeropp_jax.step.trainer.TrainState`.

    Every process of a multi-process run creates one on the same directory
    (a shared file system) and calls the same methods.

    Args:
      directory: where step directories are written (created if missing).
      max_to_keep: keep the newest this many checkpoints (``None``: all).
      async_save: write in a background thread; the caller only waits for
        the device-to-host copy. Call :meth:`wait` or :meth:`close` before
        reading the files or exiting.
      read_only: open an existing directory without writing to it.

    Example::

      with Checkpointer("ckpt", max_to_keep=3) as ckpt:
          if ckpt.latest_step() is None:
              state = trainer.init(params)
          else:
              state = ckpt.restore(trainer)  # the newest readable one, any mesh
          for step in range(int(state.step), steps):
              state, metrics = trainer.step(state, batches.batch_at(step))
              if (step + 1) % 100 == 0:
                  ckpt.save(step + 1, state, trainer, {"seed": 0})
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        read_only: bool = False,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.read_only = read_only
        if read_only and not os.path.isdir(self.directory):
            raise FileNotFoundError(f"checkpoint directory {self.directory} does not exist")
        if not read_only and os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ValueError(f"checkpoint directory {self.directory} is a file")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            create=not read_only,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=_item_handlers()
        )

    # ------------------------------------------------------------- basics
    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def all_steps(self) -> list[int]:
        """Steps with a committed checkpoint directory, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step whose checkpoint looks complete, or ``None``.

        The check is cheap (metadata readable, items present); a checkpoint
        whose array data is corrupted is only found by :meth:`restore`.
        """
        for step in reversed(self.all_steps()):
            try:
                self._check_files(step)
                return step
            except CheckpointError:
                continue
        return None

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(int(step)))

    def wait(self) -> None:
        """Blocks until a pending async save is written and committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's resources."""
        self._manager.close()

    # --------------------------------------------------------------- save
    def save(
        self,
        step: int,
        state: TrainState,
        trainer: Trainer,
        extra_metadata: Mapping | None = None,
    ) -> None:
        """Saves ``state`` as checkpoint ``step`` (asynchronously if enabled).

        Returns once the arrays are copied off the devices, so the caller may
        donate ``state`` to the next step right away.

        Args:
          step: the state's step (``state.step``); directory name.
          state: the train state (not modified).
          trainer: the trainer that owns it (for the layout and config).
          extra_metadata: JSON-serializable data stored with the checkpoint.

        Raises:
          ValueError: if ``step`` does not match ``state.step`` or is not
            newer than the newest checkpoint in the directory.
        """
        if self.read_only:
            raise ValueError(f"{self.directory} was opened read_only")
        step = int(step)
        if int(state.step) != step:
            raise ValueError(f"save(step={step}) but the state is at step {int(state.step)}")
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"{self.directory} already holds a checkpoint at step {latest} >= {step}; "
                "resume from it, or save into another directory"
            )
        meta = describe_checkpoint(trainer, step, extra_metadata)
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(**{
                _PARAMS: ocp.args.PyTreeSave(state.params),
                _OPT: ocp.args.PyTreeSave(state.opt_state),
                _META: ocp.args.JsonSave(meta),
            }),
            force=True,
        )
        if not saved:
            raise RuntimeError(f"Orbax declined to save step {step} in {self.directory}")

    # ------------------------------------------------------------ metadata
    def metadata(self, step: int | None = None) -> dict:
        """The JSON stored with checkpoint ``step`` (default: the newest)."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        self._require_step(step)
        return self._read_meta(step)

    def _require_step(self, step: int) -> None:
        if step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory} "
                f"(available: {self.all_steps() or 'none'})"
            )

    def _read_meta(self, step: int) -> dict:
        path = os.path.join(self.step_path(step), _META)
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()})
            )[_META]
        except Exception as e:  # noqa: BLE001 - any read failure means unreadable
            raise CheckpointError(
                f"checkpoint step {step}: cannot read its metadata {path} "
                f"({type(e).__name__}: {e}); the checkpoint is incomplete or corrupted"
            ) from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(
                f"checkpoint step {step}: {path} is not {FORMAT} metadata"
            )
        if meta.get("version") != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint step {step}: format version {meta.get('version')} in {path}; "
                f"this zeropp_jax reads version {FORMAT_VERSION}"
            )
        if meta.get("step") != step:
            raise CheckpointError(
                f"checkpoint step {step}: {path} says step {meta.get('step')}"
            )
        return meta

    def _item_trees(self, step: int) -> dict[str, Any]:
        """Orbax's stored metadata tree (shapes, dtypes) of each array item."""
        try:
            items = self._manager.item_metadata(step)
            trees = {name: items[name].tree for name in (_PARAMS, _OPT)}
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"checkpoint step {step} in {self.step_path(step)}: cannot read the "
                f"array metadata of its params/opt_state ({type(e).__name__}: {e}); "
                "the checkpoint is incomplete or corrupted"
            ) from e
        return trees

    def _check_files(self, step: int) -> dict:
        meta = self._read_meta(step)
        self._item_trees(step)
        return meta

    # ------------------------------------------------------------ restore
    def restore(self, trainer: Trainer, step: int | None = None) -> TrainState:
        """Restores a state for ``trainer`` (any mesh; see the module doc).

        Args:
          trainer: the trainer to continue with; its mesh and config may
            differ from the ones that wrote the checkpoint, its model and
            optimizer may not.
          step: the step to restore; ``None``: the newest readable one.

        Returns:
          The :class:`TrainState`, sharded for ``trainer``.

        Raises:
          FileNotFoundError: no checkpoint (or not ``step``) in the directory.
          CheckpointMismatchError: the checkpoint does not fit the trainer.
          CheckpointError: ``step`` (or every checkpoint) is unreadable.
        """
        return self.restore_with_metadata(trainer, step)[0]

    def restore_with_metadata(
        self, trainer: Trainer, step: int | None = None
    ) -> tuple[TrainState, dict]:
        """Like :meth:`restore`, also returning the checkpoint's JSON metadata."""
        self.wait()
        return self._newest_good(step, lambda s: self._restore_step(trainer, s))

    def read_params(self, step: int | None = None) -> tuple[dict, dict]:
        """Reads the stored (padded) parameter units to host numpy.

        Returns:
          ``(units, metadata)``: unit name -> float32 ``([L,] padded)``.
        """
        self.wait()

        def read(s):
            meta = self._check_files(s)
            tree = self._item_trees(s)[_PARAMS]
            args = {k: _NUMPY for k in _flat_with_keys(tree)}
            values = self._read(s, {_PARAMS: (tree, args)})[_PARAMS]
            return values, meta

        return self._newest_good(step, read, quarantine=False)

    def _newest_good(self, step: int | None, fn, *, quarantine: bool = True):
        if step is not None:
            self._require_step(int(step))
            return fn(int(step))
        steps = list(reversed(self.all_steps()))
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        bad: list[tuple[int, Exception]] = []
        for s in steps:
            try:
                result = fn(s)
            except CheckpointMismatchError:
                raise
            except CheckpointError as e:
                warnings.warn(
                    f"skipping unreadable checkpoint {self.step_path(s)}: {e}", stacklevel=3
                )
                bad.append((s, e))
                continue
            if bad and quarantine and not self.read_only:
                self._quarantine([b for b, _ in bad])
            return result
        raise CheckpointError(
            f"no readable checkpoint in {self.directory}: "
            + "; ".join(f"step {s}: {e}" for s, e in bad)
        )

    def _quarantine(self, steps: list[int]) -> None:
        """Renames unreadable step directories so Orbax no longer lists them."""
        if jax.process_index() == 0:
            for s in steps:
                src = self.step_path(s)
                dst = src + _CORRUPT_SUFFIX
                n = 1
                while os.path.exists(dst):
                    dst = f"{src}{_CORRUPT_SUFFIX}{n}"
                    n += 1
                os.rename(src, dst)
                warnings.warn(f"moved unreadable checkpoint {src} to {dst}", stacklevel=4)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("zeropp_checkpoint_quarantine")
        self._manager.reload()

    def _read(self, step: int, restore_args: dict) -> dict:
        """Reads array items; ``restore_args``: item -> (stored tree, keyed args)."""
        composite = {}
        for name, (stored_tree, keyed) in restore_args.items():
            item, args = _restore_item_and_args(stored_tree, keyed)
            composite[name] = ocp.args.PyTreeRestore(item=item, restore_args=args)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**composite))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"checkpoint step {step}: cannot read the arrays under "
                f"{self.step_path(step)} ({type(e).__name__}: {e}); the checkpoint "
                "is incomplete or corrupted"
            ) from e

    def _restore_step(self, trainer: Trainer, step: int) -> tuple[TrainState, dict]:
        where = f"checkpoint {self.step_path(step)}"
        meta = self._check_files(step)
        _check_layout(meta["layout"], trainer.layout, where)
        _check_qgz_target(meta, trainer, where)
        stored = self._item_trees(step)
        target = _abstract_state(trainer)
        plan = _Plan(meta, trainer, where)
        params_args, params_fill = plan.item(
            _flat_with_keys(stored[_PARAMS]), _flat_with_keys(target.params), params=True
        )
        opt_args, opt_fill = plan.item(
            _flat_with_keys(stored[_OPT]), _flat_with_keys(target.opt_state), params=False
        )
        if plan.dropped_carry:
            _warn_dropped_carry(meta, trainer, where)
        values = self._read(step, {
            _PARAMS: (stored[_PARAMS], params_args),
            _OPT: (stored[_OPT], opt_args),
        })
        params = params_fill(_flat_with_keys(values[_PARAMS]))
        opt_state = opt_fill(_flat_with_keys(values[_OPT]))
        step_array = _place(np.asarray(step, np.int32), target.step)
        state = TrainState(
            step_array,
            jax.tree_util.tree_unflatten(jax.tree.structure(target.params), params),
            jax.tree_util.tree_unflatten(jax.tree.structure(target.opt_state), opt_state),
        )
        if not isinstance(state.opt_state, ZeroOptState):
            raise AssertionError("internal error: restored opt_state is not a ZeroOptState")
        return state, meta


def _item_handlers() -> dict:
    return {
        _PARAMS: ocp.PyTreeCheckpointHandler(),
        _OPT: ocp.PyTreeCheckpointHandler(),
        _META: ocp.JsonCheckpointHandler(),
    }


_NUMPY = ocp.RestoreArgs(restore_type=np.ndarray)


def _restore_item_and_args(stored_tree: Any, keyed: dict[tuple[str, ...], Any]):
    """Orbax ``item`` and ``restore_args`` shaped like the stored tree.

    ``keyed`` maps each stored leaf's key to its restore args, or to ``None``
    to skip reading it (the leaf comes back as a placeholder).
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(stored_tree)
    items, args = [], []
    for path, leaf in leaves:
        a = keyed[tuple(_key_name(k) for k in path)]
        items.append(ocp.PLACEHOLDER if a is None else leaf)
        args.append(ocp.PLACEHOLDER if a is None else a)
    return (
        jax.tree_util.tree_unflatten(treedef, items),
        jax.tree_util.tree_unflatten(treedef, args),
    )


def _check_qgz_target(meta: dict, trainer: Trainer, where: str) -> None:
    """1-bit Adam's state (``m``, ``v``, carries) is not optax's: refuse a switch."""
    stored = meta["config"].get("qgz_target", "gradient")  # written before the field
    wanted = trainer.config.qgz_target
    if stored != wanted:
        raise CheckpointMismatchError(
            f"{where} was written with qgz_target={stored!r} (preset "
            f"{meta['config'].get('preset')!r}) and the trainer has qgz_target={wanted!r}: "
            "their optimizer states differ (1-bit Adam's per-node m and v and two carries vs "
            f"an optax state). Build the trainer with qgz_target={stored!r} "
            f"(--qgz-target {stored}); the presets qgz and zeropp meant qgz_target='gradient' "
            "before they ran 1-bit Adam"
        )


class _Plan:
    """How each target leaf is made from the stored leaves of one checkpoint."""

    def __init__(self, meta: dict, trainer: Trainer, where: str):
        self.where = where
        self.old_units = {u["name"]: u for u in meta["layout"]["units"]}
        self.new_units = {u.name: u for u in trainer.layout.units}
        self.old_nodes = int(meta["mesh"]["node"])
        self.old_mesh = f"{meta['mesh']['node']}x{meta['mesh']['local']}"
        self.dropped_carry = False

    def _unit_of(self, key: tuple[str, ...], stored_shape, target_shape):
        """The unit a parameter-shaped leaf belongs to, else ``None``."""
        name = key[-1] if key else None
        if name not in self.new_units:
            return None
        old, new = self.old_units[name], self.new_units[name]
        if tuple(stored_shape) == _global_shape(old) and tuple(target_shape) == new.global_shape:
            return name
        return None

    def _per_node_unit_of(self, key, stored_shape, target_shape):
        """The unit of a ``(nodes, [L,] padded)`` leaf under a unit's name, else ``None``."""
        name = key[-1] if key else None
        if name not in self.new_units or len(stored_shape) < 2:
            return None
        old, new = self.old_units[name], self.new_units[name]
        if (tuple(stored_shape[1:]) == _global_shape(old) and stored_shape[0] == self.old_nodes
                and tuple(target_shape[1:]) == new.global_shape):
            return name
        return None

    def _per_node_maker(self, key, unit, tgt, args):
        old, new = self.old_units[unit], self.new_units[unit]
        src_nodes, new_nodes = self.old_nodes, tgt.shape[0]
        if src_nodes != new_nodes:
            raise CheckpointMismatchError(
                f"{self.where}: {'/'.join(key)} holds one row per node ({src_nodes} in the "
                f"checkpoint, mesh {self.old_mesh}); the trainer has {new_nodes} nodes. "
                "1-bit Adam's per-node state restores onto the same node count only"
            )
        if _same_layout(old, new):
            return _read_as_stored(args, key, tgt)
        args[key] = _NUMPY
        return lambda values: _place(_repack(np.asarray(values[key]), old, new, tgt.dtype), tgt)

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
        for key, tgt in target.items():
            name = "/".join(key)
            if not params and key[:2] == _CARRY:
                makers.append(self._carry_maker(key, tgt, stored, args))
                continue
            if key not in stored:
                raise CheckpointMismatchError(
                    f"{self.where}: the trainer's {what} leaf {name!r} {tgt.shape} is not in "
                    f"the checkpoint (stored: {sorted('/'.join(k) for k in stored)[:8]}...); "
                    "was it written with another optimizer?"
                )
            src = stored[key]
            per_node = self._per_node_unit_of(key, src.shape, tgt.shape)
            if per_node is not None:  # 1-bit Adam's m / v: one row per node
                makers.append(self._per_node_maker(key, per_node, tgt, args))
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
            args[key] = _NUMPY
            old_unit, new_unit = self.old_units[unit], self.new_units[unit]

            def make(values, key=key, tgt=tgt, old_unit=old_unit, new_unit=new_unit):
                return _place(_repack(values[key], old_unit, new_unit, tgt.dtype), tgt)

            makers.append(make)
        unused = [k for k in stored if k not in target and k not in carry_keys]
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

    def _carry_maker(self, key, tgt, stored, args):
        """The new qgZ carry of one unit from the stored one (see module doc)."""
        unit = key[-1]
        if key not in stored:
            log.info("%s: no qgZ carry for unit %r; starting it at zeros", self.where, unit)
            return lambda values: _place(np.zeros(tgt.shape, tgt.dtype), tgt)
        src = stored[key]
        old, new = self.old_units[unit], self.new_units[unit]
        expected = (self.old_nodes,) + _global_shape(old)
        if tuple(src.shape) != expected:
            raise CheckpointMismatchError(
                f"{self.where}: qgZ carry of unit {unit!r} has shape {tuple(src.shape)}, "
                f"expected {expected} for mesh {self.old_mesh}"
            )
        if tuple(src.shape) == tuple(tgt.shape) and _same_layout(old, new):
            return _read_as_stored(args, key, tgt)
        args[key] = _NUMPY
        new_nodes = tgt.shape[0]

        def make(values):
            carry = np.asarray(values[key], np.float32)
            if new_nodes == self.old_nodes:
                host = _repack(carry, old, new, tgt.dtype)
            else:
                total = carry.sum(axis=0, dtype=np.float64)
                host = np.zeros(tgt.shape, tgt.dtype)
                host[0] = _repack(total, old, new, tgt.dtype)
            return _place(host, tgt)

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
    log.warning(message)
    warnings.warn(message, stacklevel=4)


# ------------------------------------------------------------------ export
def _state_dict(units: Mapping[str, np.ndarray], layout_json: dict) -> dict:
    """Unpadded nested dict (``to_state_dict`` form) from padded host units."""
    tree: dict = {}
    for u in layout_json["units"]:
        flat = np.asarray(units[u["name"]])
        lead = () if u["stack"] is None else (u["stack"],)
        prefix = [] if layout_json["whole_model"] else [u["name"]]
        for leaf in u["leaves"]:
            x = flat[..., leaf["offset"]: leaf["offset"] + leaf["size"]]
            x = np.reshape(x, lead + tuple(leaf["shape"])).astype(jax.numpy.dtype(leaf["dtype"]))
            keys = prefix + leaf["keys"]
            if not keys:  # the whole model is a single array
                return x
            node = tree
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = x
    return tree


def _host_units(trainer: Trainer, state_or_params: Any) -> dict[str, np.ndarray]:
    flat = getattr(state_or_params, "params", state_or_params)
    replicated = jax.tree.map(lambda _: NamedSharding(trainer.mesh, P()), flat)
    with jax.set_mesh(trainer.mesh):
        full = jax.jit(lambda x: x, out_shardings=replicated)(flat)
    return {k: np.asarray(v.addressable_data(0)) for k, v in full.items()}


def export_params(
    source: Any,
    out_path: str | os.PathLike,
    *,
    step: int | None = None,
    trainer: Trainer | None = None,
) -> dict:
    """Writes the full, unpadded parameters as one msgpack file.

    Load it with plain Flax (see the module doc)::

      params = flax.serialization.msgpack_restore(open(out_path, "rb").read())

    Args:
      source: a checkpoint directory (no trainer or model code needed: the
        layout comes from the checkpoint's metadata), or a
        :class:`TrainState` / its ``params`` dict together with ``trainer``.
      out_path: the file to write (replaced atomically).
      step: the checkpoint step (default: the newest readable one); only
        with a directory.
      trainer: the trainer of an in-memory ``source``.

    Returns:
      ``{"path", "step", "params", "bytes"}``; ``step`` is ``None`` for an
      in-memory state.
    """
    import flax.serialization

    if isinstance(source, (str, os.PathLike)):
        if trainer is not None:
            raise ValueError("pass trainer only with an in-memory state, not a directory")
        ckpt = Checkpointer(source, read_only=True)
        try:
            units, meta = ckpt.read_params(step)
        finally:
            ckpt.close()
        layout_json, saved_step = meta["layout"], meta["step"]
    else:
        if trainer is None:
            raise ValueError("exporting an in-memory state needs its trainer")
        if step is not None:
            raise ValueError("step applies only to a checkpoint directory")
        units = _host_units(trainer, source)
        layout_json, saved_step = layout_to_json(trainer.layout), None
    tree = _state_dict(units, layout_json)
    data = flax.serialization.msgpack_serialize(tree)
    out_path = os.fspath(out_path)
    tmp = f"{out_path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out_path)
    count = sum(int(np.size(x)) for x in jax.tree.leaves(tree))
    return {"path": out_path, "step": saved_step, "params": count, "bytes": len(data)}
