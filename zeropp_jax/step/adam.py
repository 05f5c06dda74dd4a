"""1-bit Adam's hyperparameters and Adam's arithmetic (no collectives).

:func:`onebit_adam` builds :class:`OneBitAdam`, the optimizer argument of
:func:`zeropp_jax.make_trainer` for ``ZeroConfig(qgz_target="momentum")``;
the functions below are Adam's moments, denominator, step and the bound
on its update that :mod:`zeropp_jax.step.onebit_adam` runs inside
shard_map. Every function is element-wise on float32 arrays of any shape.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from zeropp_jax.config_checks import is_real

Schedule = Callable[[jax.Array], jax.Array]


class OneBitAdam(NamedTuple):
    """Hyperparameters of 1-bit Adam (build with :func:`onebit_adam`).

    Attributes:
      learning_rate: a float or an optax-style schedule ``count -> lr``
        (called with the number of steps taken so far, like optax).
      b1, b2, eps: Adam's, as in ``optax.adam`` (``eps`` outside the root).
      clip_norm: clip the gradient to this global norm (node-wise on
        compressed steps); ``None`` does not clip.
      skip_non_finite: a step whose reduced gradient holds a NaN or an inf
        changes nothing (parameters, moments, carries, ``count``), as
        ``optax.apply_if_finite`` skips one; ``metrics["skipped"]`` is 1
        then. Unlike it there is no ``max_consecutive_errors`` and no
        counter in the state: every such step is skipped, and only
        ``metrics["skipped"]`` (and the NaN loss) shows it. The qgZ
        schedule counts skipped steps (the host counts steps without
        waiting for the device): a skipped warm-up step is not made up.
        ``False``: such a step turns the moments, carries and parameters
        NaN, as ``optax.adam`` does.
    """

    learning_rate: Union[float, Schedule]
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float | None = None
    skip_non_finite: bool = False

    def lr_at(self, count: jax.Array) -> jax.Array:
        """The learning rate of the step taken after ``count`` steps."""
        if callable(self.learning_rate):
            return jnp.asarray(self.learning_rate(count), jnp.float32)
        return jnp.asarray(self.learning_rate, jnp.float32)

    def update_bound(self, count: jax.Array) -> jax.Array:
        """The largest ``|m / (sqrt(v_hat) + eps)|`` Adam itself reaches at step ``count``.

        With ``m_t = (1 - b1) sum_i b1**(t-i) g_i`` and ``v_t = (1 - b2) sum_i
        b2**(t-i) g_i**2``, Cauchy-Schwarz gives ``|m_t| < B sqrt(v_t)``,
        ``B = (1 - b1) / sqrt((1 - b2) (1 - b1**2 / b2))``, for every gradient
        sequence, and ``v_hat = v_t / (1 - b2**t)``: so ``|m_t| / sqrt(v_hat)
        < B sqrt(1 - b2**t)`` (``B`` = 7.27 at ``b1 = 0.9, b2 = 0.999``; the
        bound is 2.25 at step 101, 5.8 at step 1000). float32 ``()``; ``inf``
        where ``b1**2 >= b2`` (no such bound).

        Args:
          count: int32 ``()``, the steps taken including this one.
        """
        if self.b1**2 >= self.b2:
            return jnp.asarray(jnp.inf, jnp.float32)
        bound = (1.0 - self.b1) / math.sqrt((1.0 - self.b2) * (1.0 - self.b1**2 / self.b2))
        # 1 - b2**t as -expm1(t log b2): exact to float32 where 1 - b2**t would cancel
        return bound * jnp.sqrt(-jnp.expm1(count.astype(jnp.float32) * math.log(self.b2)))

    def clip_scale(self, sq_norm: jax.Array) -> jax.Array:
        """``min(1, clip_norm / norm)`` from a squared norm (1 without clipping)."""
        if self.clip_norm is None:
            return jnp.ones((), jnp.float32)
        norm = jnp.sqrt(sq_norm)
        return jnp.minimum(1.0, self.clip_norm / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))


def onebit_adam(
    learning_rate: Union[float, Schedule],
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    clip_norm: float | None = None,
    skip_non_finite: bool = False,
) -> OneBitAdam:
    """The optimizer for ``ZeroConfig(qgz_target="momentum")``.

    Example::

      config = zp.ZeroConfig.from_preset("zeropp")  # qgz_target="momentum"
      trainer = zp.make_trainer(loss, zp.onebit_adam(3e-3, clip_norm=1.0),
                                params, mesh=mesh, config=config)

    ``skip_non_finite=True`` skips a step whose gradient holds a NaN or an
    inf (on any device) as ``optax.apply_if_finite`` does, without its
    limit on consecutive skips (see :class:`OneBitAdam`): nothing of the
    state moves, and the step's ``metrics["skipped"]`` is 1.

    Raises:
      ValueError: for a learning rate, ``eps`` or ``clip_norm`` that is not
        a finite number > 0, or ``b1``/``b2`` outside ``[0, 1)``. Numbers
        may be Python, NumPy or 0-d JAX scalars (not a ``bool`` or a string).
      TypeError: for a ``skip_non_finite`` that is not a ``bool``.
    """
    if not callable(learning_rate):
        learning_rate = _positive_number("learning_rate", learning_rate,
                                         "a finite number > 0 or a schedule")
    b1, b2 = (_number(name, value, "in [0, 1)", lambda x: 0.0 <= x < 1.0)
              for name, value in (("b1", b1), ("b2", b2)))
    eps = _positive_number("eps", eps, "a finite number > 0")
    if clip_norm is not None:
        clip_norm = _positive_number("clip_norm", clip_norm, "a finite number > 0, or None (no clipping)")
    if not isinstance(skip_non_finite, (bool, np.bool_)):
        raise TypeError(f"skip_non_finite must be True or False, got {skip_non_finite!r}")
    return OneBitAdam(learning_rate, b1, b2, eps, clip_norm, bool(skip_non_finite))


def _number(name: str, value: Any, rule: str, holds: Callable[[float], bool]) -> float:
    """``value`` as a float if it is a real scalar (:func:`~zeropp_jax.config_checks.is_real`,
    or a 0-d NumPy or JAX array of one) for which ``holds``; else ValueError."""
    scalar = value.item() if isinstance(value, (np.ndarray, jax.Array)) and not value.ndim else value
    if not is_real(scalar) or not holds(float(scalar)):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    return float(scalar)


def _positive_number(name: str, value: Any, rule: str) -> float:
    """``value`` as a float if it is a finite real scalar > 0; else ValueError."""
    return _number(name, value, rule, lambda x: 0.0 < x < math.inf)


def next_momentum(m: jax.Array, g: jax.Array, b1: float) -> jax.Array:
    """Adam's first moment: ``b1 * m + (1 - b1) * g`` (float32, any shape)."""
    return b1 * m + (1.0 - b1) * g


def next_second_moment(v: jax.Array, g: jax.Array, b2: float | jax.Array) -> jax.Array:
    """Adam's second moment: ``b2 * v + (1 - b2) * g**2`` (``b2**k`` after ``k`` steps frozen)."""
    return b2 * v + (1.0 - b2) * jnp.square(g)


def preconditioner(v: jax.Array, v_count: jax.Array, hyper: OneBitAdam) -> jax.Array:
    """Adam's denominator ``sqrt(v / (1 - b2**v_count)) + eps`` (float32, like ``v``)."""
    tv = jnp.maximum(v_count, 1).astype(jnp.float32)
    return jnp.sqrt(v / (1.0 - hyper.b2**tv)) + hyper.eps


def adam_step(
    p: jax.Array, m: jax.Array, v: jax.Array, *, count: jax.Array, v_count: jax.Array, hyper: OneBitAdam
) -> jax.Array:
    """New parameters ``p - lr * m_hat / (sqrt(v_hat) + eps)`` (float32, same shape).

    ``count`` is the number of steps including this one (``m``'s bias
    correction), ``v_count`` the step of ``v``'s last update; the rate is
    the schedule's at ``count - 1``, as in optax.
    """
    t = count.astype(jnp.float32)
    m_hat = m / (1.0 - hyper.b1**t)
    return p - hyper.lr_at(count - 1) * m_hat / preconditioner(v, v_count, hyper)
