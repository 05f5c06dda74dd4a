"""Checkpoints of a ZeRO-3 / ZeRO++ train state: save, resume, re-mesh, export.

:class:`Checkpointer` saves the whole :class:`~zeropp_jax.step.state.TrainState`
with Orbax: the parameter shards, the optimizer state (including the qgZ
error-feedback carry and the last gradient RMS), the step, and a JSON
description of what was saved (format version, config, mesh, per-unit
layout, whatever the caller adds, e.g. the model config and the seed).  One
checkpoint is one directory ``DIR/<step>`` with three Orbax items::

  DIR/<step>/params     the unit dict: float32 (padded,) / (L, padded)
  DIR/<step>/opt_state  ZeroOptState(inner, qgz=QgzState(carry, grad_rms))
  DIR/<step>/meta       JSON (see metadata.describe_checkpoint)

Every process writes its own shards (Orbax, OCDBT); a save is atomic: it is
written under ``DIR/<step>.orbax-checkpoint-tmp*`` and renamed to
``DIR/<step>`` only once complete, so a save that is killed half-way leaves
the previous checkpoints as they were and is never listed (its temporary
directory is removed by the next :class:`Checkpointer` opened on ``DIR``
for writing, when it is opened).  With ``async_save`` the step loop only waits for the
device-to-host copy; the write runs in the background.

Restore works onto another mesh, process count or config (same model and
optimizer): each leaf is read as stored, or re-padded on the host, or (the
qgZ carry) summed over nodes; see :mod:`~zeropp_jax.checkpoint.remesh`.
1-bit Adam's state (``qgz_target="momentum"``) and optax Adam's convert
into each other on restore, announced with a warning; see
:mod:`~zeropp_jax.checkpoint.convert`.

Bad input.  A checkpoint whose units (names, numel, leaves) or optimizer
state do not match the trainer raises :class:`CheckpointMismatchError`
naming the step directory and the difference.  An unreadable checkpoint
(missing files, corrupted data, arrays that do not match the checksums
saved with them: :mod:`~zeropp_jax.checkpoint.checksum`) raises
:class:`CheckpointError` naming it;
when no step is asked for, the newest *readable* checkpoint is used instead,
with a warning naming the bad one, which is renamed to ``<step>.corrupt`` so
later saves of those step numbers are possible.  A state holding ``inf`` or
``nan`` is never saved (:class:`NonFiniteStateError`).

Export.  :func:`export_params` writes the full, unpadded parameters (each
leaf in its original dtype) as one msgpack file that needs neither this
library nor the model code; see :mod:`~zeropp_jax.checkpoint.export`.

Modules, in reading order:

* ``checkpointer``: the :class:`Checkpointer` (save, list, restore, quarantine);
* ``storage``: the three Orbax items of one step directory;
* ``metadata``: the JSON description and the checks that a trainer fits it;
* ``remesh``: the restore plan (re-padding, the carry over another node count);
* ``convert``: 1-bit Adam's optimizer state as optax Adam's, and back;
* ``checksum``: the arrays' checksums; the finite-state check of a save;
* ``export``: the full parameters as one msgpack file;
* ``errors``: :class:`CheckpointError`, :class:`CheckpointMismatchError`,
  :class:`NonFiniteStateError`.
"""

from zeropp_jax.checkpoint.checkpointer import Checkpointer as Checkpointer
from zeropp_jax.checkpoint.errors import CheckpointError as CheckpointError
from zeropp_jax.checkpoint.errors import CheckpointMismatchError as CheckpointMismatchError
from zeropp_jax.checkpoint.errors import NonFiniteStateError as NonFiniteStateError
from zeropp_jax.checkpoint.export import export_params as export_params

__all__ = [
    "Checkpointer",
    "CheckpointError",
    "CheckpointMismatchError",
    "NonFiniteStateError",
    "export_params",
]
