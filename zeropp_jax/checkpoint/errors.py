"""The two errors a checkpoint raises: unreadable, or readable but not fitting."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing files, corrupted, or not a zeropp_jax checkpoint."""


class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint that does not fit the trainer (model or optimizer)."""


class NonFiniteStateError(ValueError):
    """A state to be saved holds ``inf`` or ``nan``: it is not written."""
