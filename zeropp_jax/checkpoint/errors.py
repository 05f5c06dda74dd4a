"""The two errors a checkpoint raises: unreadable, or readable but not fitting."""

from __future__ import annotations

import functools


class CheckpointError(ValueError):
    """A checkpoint is missing files, corrupted, or not a zeropp_jax checkpoint."""


class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint that does not fit the trainer (model or optimizer)."""


class QgzTargetMismatchError(CheckpointMismatchError):
    """A checkpoint of the other ``qgz_target`` (1-bit Adam vs optax) that does not convert.

    ``stored_config``: the checkpoint's ``ZeroConfig.describe()``, from which a
    front end can name its own options for the checkpoint's optimizer.
    """

    def __init__(self, message: str, *, stored_config: dict):
        super().__init__(message)
        self.stored_config = stored_config

    def __reduce__(self):  # copy and pickle: the keyword-only field too
        return functools.partial(type(self), stored_config=self.stored_config), self.args


class NonFiniteStateError(ValueError):
    """A state to be saved holds ``inf`` or ``nan``: it is not written."""
