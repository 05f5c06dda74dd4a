"""Checkpoints of a train state: save and restore (onto any mesh), export.

See :mod:`zeropp_jax.checkpoint.checkpointer` for the format.
"""

from zeropp_jax.checkpoint.checkpointer import CheckpointError as CheckpointError
from zeropp_jax.checkpoint.checkpointer import CheckpointMismatchError as CheckpointMismatchError
from zeropp_jax.checkpoint.checkpointer import Checkpointer as Checkpointer
from zeropp_jax.checkpoint.checkpointer import export_params as export_params
