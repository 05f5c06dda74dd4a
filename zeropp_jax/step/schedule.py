"""The qgZ schedule: which optimizer steps cross nodes compressed.

One object decides it for the library (:meth:`Trainer.step
<zeropp_jax.step.trainer.Trainer.step>`) and the command line alike.  A step
runs the full-precision variant

* during the warm-up (the first ``qgz_warmup_steps`` steps);
* with ``qgz_refresh_every = N`` (1-bit Adam), on every ``N``-th step after
  the warm-up, which refreshes Adam's second moment;
* with ``qgz_min_grad_rms = x`` (the gate), while the previous step's
  gradient RMS (``QgzState.grad_rms`` in the train state) is below ``x``;

and the compressed variant otherwise.  The step number and the warm-up and
refresh rules are known on the host (:class:`HostSteps` keeps the step number
of the states a trainer returns); only the gate needs a value from the device,
and it is read only when the gate is what decides.  So choosing the variant of
step ``n + 1`` does not wait for step ``n`` to finish.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from zeropp_jax.config import ZeroConfig


@dataclasses.dataclass(frozen=True)
class QgzSchedule:
    """The qgZ schedule of one trainer (static: built from its config).

    Attributes:
      active: whether qgZ compresses at all (on, and more than one node).
      warmup_steps: full-precision steps before compression starts.
      refresh_every: every this many steps after the warm-up one step runs
        at full precision (0: never).
      min_grad_rms: compress only while the previous step's gradient RMS is
        at least this (0: no gate).
    """

    active: bool
    warmup_steps: int = 0
    refresh_every: int = 0
    min_grad_rms: float = 0.0

    @classmethod
    def from_config(cls, config: ZeroConfig, nodes: int) -> "QgzSchedule":
        return cls(
            active=config.qgz != "off" and nodes > 1,
            warmup_steps=config.qgz_warmup_steps,
            refresh_every=config.qgz_refresh_every,
            min_grad_rms=config.qgz_min_grad_rms,
        )

    @property
    def is_static(self) -> bool:
        """Whether every step takes the same variant."""
        return not self.active or (
            self.warmup_steps == 0 and self.min_grad_rms == 0 and not self.refresh_every
        )

    def forced(self, compress: Any) -> bool:
        """``compress`` (a trainer's ``step(compress=...)``) as a bool, checked.

        Raises:
          ValueError: for ``compress=True`` where qgZ is not active
            (``qgz="off"``, or one node): there is no cross-node reduction to
            compress, and forcing one would quantize without error feedback
            (one node) or fail to build (hpZ without qgZ).
        """
        if compress and not self.active:
            raise ValueError(
                "compress=True forces qgZ's compressed cross-node reduction, but qgZ is not "
                "active on this trainer: it compresses only with qgz '1bit', 'int8' or "
                "'int4' on more than one node; pass compress=None (the schedule) or False"
            )
        return bool(compress)

    def variants_from(self, step: int, grad_rms: Any = float("inf")) -> tuple[bool, ...]:
        """The variants (``compress`` values) steps ``step, step + 1, ...`` can take.

        The variant of step ``step`` comes first (:meth:`compress_at` with
        ``grad_rms``, the state's ``opt_state.qgz.grad_rms``: read only where
        the gate decides), then the other where a later step may take it:
        during the warm-up, with a refresh, or with the gate.
        """
        if self.is_static:
            return (self.active,)
        first = self.compress_at(step, grad_rms)
        switches = step < self.warmup_steps or self.refresh_every or self.min_grad_rms > 0
        return (first, not first) if switches else (first,)

    def compress_at(self, step: Any, grad_rms: Any) -> bool:
        """Whether step ``step`` (0-based) reduces compressed.

        Args:
          step: the number of steps taken before this one: a Python int, or
            the state's int32 scalar (read from the device only when the
            schedule is not static).
          grad_rms: the previous step's gradient RMS (the state's
            ``opt_state.qgz.grad_rms``, ``inf`` before the first step): a
            float or a device scalar, read only when the gate decides.
        """
        if self.is_static:
            return self.active
        step = int(step)
        if step < self.warmup_steps:
            return False
        n = self.refresh_every
        if n and (step - self.warmup_steps + 1) % n == 0:
            return False
        return not (self.min_grad_rms > 0 and float(grad_rms) < self.min_grad_rms)


class HostSteps:
    """The step number of the last state a trainer returned, kept on the host.

    Reading ``int(state.step)`` before every step would wait for the previous
    step to finish and so stop asynchronous dispatch. The trainer records the
    (host-known) step number of the state it returns, keyed by the identity of
    that state's ``step`` array (held weakly: no buffer is kept alive), and
    :meth:`get` answers only for that very array. A state the trainer did not
    return (restored from a checkpoint, rebuilt from host copies, built by
    hand) is unknown here, so its step is read from the device once. Arrays
    are immutable, so the answer is always ``int(state.step)``.
    """

    def __init__(self):
        self._last = None  # (weakref to a step array, its value)

    def get(self, step_array: Any) -> int | None:
        """The step number of ``step_array`` if it is the one recorded, else ``None``."""
        if self._last is not None and self._last[0]() is step_array:
            return self._last[1]
        return None

    def record(self, step_array: Any, step: int) -> None:
        """Records that ``step_array`` (an int32 scalar ``jax.Array``) holds ``step``."""
        self._last = (weakref.ref(step_array), step)
