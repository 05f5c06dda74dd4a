"""The :class:`Checkpointer`: save, list and restore the steps of one directory.

One checkpoint is one directory ``DIR/<step>`` with three Orbax items
(:mod:`~zeropp_jax.checkpoint.storage`).  A save is atomic; restore picks
the newest readable step and moves unreadable ones aside as
``<step>.corrupt``; the conversion onto another mesh is planned by
:mod:`~zeropp_jax.checkpoint.remesh`, that of 1-bit Adam's state into optax
Adam's (and back) by :mod:`~zeropp_jax.checkpoint.convert`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import threading
import warnings
import weakref
from typing import Callable, Mapping

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from zeropp_jax.checkpoint import checksum, keys, storage
from zeropp_jax.checkpoint.convert import converter_for
from zeropp_jax.checkpoint.errors import CheckpointError, CheckpointMismatchError
from zeropp_jax.checkpoint.metadata import describe_checkpoint
from zeropp_jax.checkpoint.remesh import plan_restore
from zeropp_jax.step.state import TrainState
from zeropp_jax.step.trainer import Trainer

_CORRUPT_SUFFIX = ".corrupt"


def _not_read_only_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Given directory is read only")


def _manager(directory: str, max_to_keep: int | None, async_save: bool,
             read_only: bool) -> ocp.CheckpointManager:
    """The Orbax manager of ``directory``. Read-only, it gets the options a
    read-only manager takes, so Orbax has none to warn about resetting, and
    its warning that the directory "is read only" (we opened it so) is dropped."""
    if not read_only:
        _remove_unfinished_saves(directory)
    with _quiet_read_only_warning():
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=False,  # done above
            read_only=read_only,
            create=not read_only,
        )
        manager = ocp.CheckpointManager(directory, options=options,
                                        item_handlers=storage.item_handlers())
    if async_save and not read_only:
        _finish_at_exit(manager)
    return manager


def _remove_unfinished_saves(directory: str) -> None:
    """Deletes the step directories a save that never finished left in
    ``directory`` (Orbax's temporary paths), on the first process, before
    returning. Orbax's own clean-up runs on a thread it starts with the
    manager and waits for only at the first save: a script that opened a
    directory and ended without saving met the interpreter's shutdown
    there, with a traceback."""
    if jax.process_index() == 0 and os.path.isdir(directory):
        for name in ocp.step.tmp_checkpoints(directory):
            shutil.rmtree(os.path.join(directory, name))


def _finish_at_exit(manager: ocp.CheckpointManager) -> None:
    """Has the interpreter's exit wait for ``manager``'s pending save.

    A script that saves and ends without :meth:`Checkpointer.wait` or
    ``close`` would otherwise lose the step: Orbax commits it on a thread
    pool that ``concurrent.futures`` shuts down at exit, before ``atexit``
    hooks run (the step stayed a ``*.orbax-checkpoint-tmp`` directory). The
    hook runs where ``concurrent.futures``' own does, in ``threading``'s exit
    (``threading._register_atexit``, the standard library's, since Python
    3.9), registered later, so it runs first. It holds the manager weakly.
    """
    ref = weakref.ref(manager)

    def finish():
        alive = ref()
        if alive is not None:
            alive.wait_until_finished()

    register = getattr(threading, "_register_atexit", None)
    if register is None:  # a Python without it: atexit runs after the pool is gone
        warnings.warn("this Python's threading has no _register_atexit: a save still "
                      "running at exit may be lost; call Checkpointer.wait() before exit",
                      stacklevel=3)
        atexit.register(finish)
    else:
        register(finish)


@contextlib.contextmanager
def _quiet_read_only_warning():
    """Drops Orbax's "Given directory is read only" warning (absl's logger)
    while a read-only manager is made: the caller asked for read-only."""
    logger = logging.getLogger("absl")
    logger.addFilter(_not_read_only_notice)
    try:
        yield
    finally:
        logger.removeFilter(_not_read_only_notice)


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
        self._manager = _manager(self.directory, max_to_keep, async_save, read_only)

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
        whose array data is corrupted is only found by :meth:`restore`. A
        newer step that fails it is skipped with a warning, as in :meth:`restore`.
        """
        return self._first_readable(self._check_files, stacklevel=3)[0]

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

        Checksums are stored and verified on restore; a non-finite state is
        never saved, so it cannot rotate finite checkpoints out.

        Raises:
          NonFiniteStateError: the parameters or the optimizer state are
            not finite (nothing is written).
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
        meta = describe_checkpoint(trainer, step, extra_metadata, state.opt_state.inner)
        stored = keys.to_data(state)  # a typed PRNG key (optax.add_noise) as its uint32 data
        trainer.wait_for_precompile()  # the checksums compile: not beside the worker
        with jax.set_mesh(trainer.mesh):  # whatever mesh the caller has set
            meta["checksums"] = checksum.checksums_of_finite(
                {storage.PARAMS: stored.params, storage.OPT: stored.opt_state}, f"step {step}")
        if not storage.save_items(self._manager, step, stored, meta):
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
        return storage.read_meta(self._manager, step, self.step_path(step))

    def _item_trees(self, step: int) -> dict:
        """Orbax's stored metadata tree (shapes, dtypes) of each array item."""
        return storage.read_item_trees(self._manager, step, self.step_path(step))

    def _check_files(self, step: int) -> dict:
        meta = self._read_meta(step)
        self._item_trees(step)
        return meta

    # ------------------------------------------------------------ restore
    def restore(self, trainer: Trainer, step: int | None = None) -> TrainState:
        """Restores a state for ``trainer`` (any mesh: :mod:`~zeropp_jax.checkpoint.remesh`).

        Args:
          trainer: the trainer to continue with; its mesh and config may
            differ from the ones that wrote the checkpoint, its model and
            optimizer may not (but 1-bit Adam <-> optax Adam converts).
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
        self, trainer: Trainer, step: int | None = None, *,
        check: Callable[[dict], None] | None = None,
    ) -> tuple[TrainState, dict]:
        """Like :meth:`restore`, also returning the checkpoint's JSON metadata.

        ``check(meta)`` runs once the arrays are read and verified, before the
        state is built (and a conversion announced); it may refuse the
        checkpoint by raising :class:`CheckpointMismatchError`."""
        self.wait()
        with jax.set_mesh(trainer.mesh):  # whatever mesh the caller has set
            return self._newest_good(step, lambda s: self._restore_step(trainer, s, check))

    def read_params(self, step: int | None = None) -> tuple[dict, dict]:
        """``(units, metadata)``: the stored (padded) units to host numpy, float32 ``([L,] padded)``."""
        self.wait()

        def read(s):
            meta = self._check_files(s)
            units = storage.read_to_host(self._manager, s, self.step_path(s), storage.PARAMS)
            checksum.verify(meta.get("checksums"), {storage.PARAMS: units},
                            f"checkpoint {self.step_path(s)}")
            return units, meta

        return self._newest_good(step, read, quarantine=False)

    def _newest_good(self, step: int | None, fn, *, quarantine: bool = True):
        if step is not None:
            self._require_step(int(step))
            return fn(int(step))
        if not self.all_steps():
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        step, result, bad = self._first_readable(fn, stacklevel=4)
        if step is None:
            raise CheckpointError(
                f"no readable checkpoint in {self.directory}: "
                + "; ".join(f"step {s}: {e}" for s, e in bad)
            )
        if bad and quarantine and not self.read_only:
            self._quarantine([b for b, _ in bad])
        return result

    def _first_readable(self, fn, *, stacklevel: int) -> tuple[int | None, object, list]:
        """``(step, fn(step), skipped)``: the newest step ``fn`` reads (``None``
        if none), each newer one warned of and in ``skipped`` as ``(step, error)``;
        a :class:`CheckpointMismatchError` (readable, not for this trainer) is raised."""
        skipped: list[tuple[int, Exception]] = []
        for s in reversed(self.all_steps()):
            try:
                return s, fn(s), skipped
            except CheckpointMismatchError:
                raise
            except CheckpointError as e:
                warnings.warn(f"skipping unreadable checkpoint {self.step_path(s)}: {e}",
                              stacklevel=stacklevel)
                skipped.append((s, e))
        return None, None, skipped

    def _quarantine(self, steps: list[int]) -> None:
        """Renames unreadable step directories so Orbax no longer lists them."""
        if jax.process_index() == 0:
            for s in steps:
                _set_aside(self.step_path(s))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("zeropp_checkpoint_quarantine")
        self._manager.reload()

    def _restore_step(self, trainer: Trainer, step: int, check=None) -> tuple[TrainState, dict]:
        meta, stored, path = self._check_files(step), self._item_trees(step), self.step_path(step)
        where = f"checkpoint {path}"
        restore_args, build = plan_restore(meta, stored, trainer, where,
                                           converter_for(meta, trainer, where))
        values = storage.read_arrays(self._manager, step, path, restore_args)
        checksum.verify(meta.get("checksums"), values, f"checkpoint {path}")
        if check is not None:
            check(meta)
        return build(values, step), meta


def _set_aside(src: str) -> None:
    """Renames an unreadable step directory ``src`` to ``src.corrupt`` (or ``.corruptN``)."""
    dst = src + _CORRUPT_SUFFIX
    n = 1
    while os.path.exists(dst):
        dst = f"{src}{_CORRUPT_SUFFIX}{n}"
        n += 1
    os.rename(src, dst)
    warnings.warn(f"moved unreadable checkpoint {src} to {dst}", stacklevel=5)
