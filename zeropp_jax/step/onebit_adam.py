"""1-bit Adam inside ZeRO-3: qgZ's error feedback on the momentum.

With ``ZeroConfig(qgz_target="momentum")`` the quantity that crosses nodes
compressed is Adam's momentum, not the gradient (Tang et al., 2021, "1-bit
Adam"). The trainer owns the optimizer then: pass :func:`onebit_adam` to
:func:`zeropp_jax.make_trainer`. Per optimizer step, with ``g_n`` node ``n``'s
mean gradient (reduced over ``local`` at full precision):

* warm-up (full precision, the first ``qgz_warmup_steps`` steps): ``g_n`` is
  all-reduced over ``node``, clipped by the global norm, and Adam runs as
  usual (``m`` and ``v`` both update);
* compressed: Adam's second moment ``v`` is frozen (its bias correction
  too; ``qgz_refresh_every = N`` runs every ``N``-th step after the warm-up
  at full precision, which updates ``v`` as an average over time, decayed by
  ``b2**k`` after ``k`` frozen steps, and re-expresses the carries in the
  new ``d``), so ``d = sqrt(v_hat) + eps`` is a fixed per-coordinate scale and the
  momentum recursion holds for ``u = m / d``, the update direction. Node
  ``n`` forms its own ``b1 * u + (1 - b1) * clip_n * g_n / d`` around the
  shared ``u`` (``clip_n`` from node ``n``'s own gradient norm, the only norm
  known before the exchange), compresses it plus its sender carry, and the
  chunks are summed over nodes as in gradient qgZ
  (:func:`zeropp_jax.wire.qgz.cross_node_reduce`); each receiver averages its
  chunk, compresses it once more with its receiver carry, and all nodes
  gather those codes (:func:`zeropp_jax.wire.qgz.cross_node_share`), so every
  node holds the same new ``u`` (stored as ``m = u * d``) and steps
  ``p -= lr * u / (1 - b1**t)``.

Compressing ``u`` rather than ``m`` (1-bit Adam's paper compresses ``m``)
puts the code's error, one magnitude per block, in units of the update:
compressing ``m``, a coordinate whose ``v`` is tiny receives the block's
magnitude and steps by about ``lr * |m_block| / eps``, without bound (in the
example GPT the attention key biases: softmax ignores them, their gradient
is ~1e-12, rounding noise).

Both carries are optimizer state: what the two compressions lose is added to
the next step's momentum, nothing is lost, only deferred. Measured on the
example GPT (``benchmarks/onebit_adam_probe.py`` and ``benchmarks/RESULTS.md``):
the carry on the momentum costs about as much as freezing ``v`` alone, while
the carry on the gradient with ``v`` still updating (``qgz_target=
"gradient"``) is several times worse at the same warm-up.

Layouts (``U`` = a unit's padded length, ``[L,]`` its layer axis if stacked):
``m`` and ``v`` are float32 ``(nodes, [L,] U)`` sharded
``P("node", [None,] "local")``: every node keeps its own copy of the whole
unit (the rows are equal: each node decodes the same codes, and warm-up
steps all-reduce the gradient), since it needs all of its ``local`` slice to
form its own momentum; the receiver carry is sharded like the parameters,
``P([None,] ("local", "node"))``; the sender carry is
:class:`zeropp_jax.wire.qgz.QgzState`'s, ``P("node", [None,] "local")``.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Union

import jax
import jax.numpy as jnp

Schedule = Callable[[jax.Array], jax.Array]


class OneBitAdam(NamedTuple):
    """Hyperparameters of 1-bit Adam (build with :func:`onebit_adam`).

    Attributes:
      learning_rate: a float or an optax-style schedule ``count -> lr``
        (called with the number of steps taken so far, like optax).
      b1, b2, eps: Adam's, as in ``optax.adam`` (``eps`` outside the root).
      clip_norm: clip the gradient to this global norm (node-wise on
        compressed steps); ``None`` does not clip.
    """

    learning_rate: Union[float, Schedule]
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float | None = None

    def lr_at(self, count: jax.Array) -> jax.Array:
        """The learning rate of the step taken after ``count`` steps."""
        if callable(self.learning_rate):
            return jnp.asarray(self.learning_rate(count), jnp.float32)
        return jnp.asarray(self.learning_rate, jnp.float32)

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
) -> OneBitAdam:
    """The optimizer for ``ZeroConfig(qgz_target="momentum")``.

    Example::

      config = zp.ZeroConfig.from_preset("zeropp")  # qgz_target="momentum"
      trainer = zp.make_trainer(loss, zp.onebit_adam(3e-3, clip_norm=1.0),
                                params, mesh=mesh, config=config)

    Raises:
      ValueError: for a non-positive learning rate or ``eps``, ``b1``/``b2``
        outside ``[0, 1)``, or a non-positive ``clip_norm``.
    """
    if not callable(learning_rate) and not (
        isinstance(learning_rate, (int, float)) and learning_rate > 0 and math.isfinite(learning_rate)
    ):
        raise ValueError(f"learning_rate must be a positive float or a schedule, got {learning_rate!r}")
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0 or None (no clipping), got {clip_norm!r}")
    return OneBitAdam(learning_rate, float(b1), float(b2), float(eps),
                      None if clip_norm is None else float(clip_norm))


class OneBitAdamState(NamedTuple):
    """1-bit Adam's state (in :class:`zeropp_jax.step.trainer.ZeroOptState` ``.inner``).

    Attributes:
      count: int32 ``()``, steps taken.
      v_count: int32 ``()``, the step count at ``v``'s last update (a
        full-precision step): ``v`` averages over that much time, so its bias
        correction is ``1 - b2**v_count``.
      m: dict unit -> float32 ``(nodes, [L,] U)``,
        ``P("node", [None,] "local")`` (one equal copy per node).
      v: dict unit -> float32 ``(nodes, [L,] U)``, like ``m``.
      receiver_carry: dict unit -> float32 ``([L,] U)`` sharded like the
        parameters (empty without error feedback): what the second
        compression lost.
    """

    count: jax.Array
    v_count: jax.Array
    m: dict
    v: dict
    receiver_carry: dict


def own_chunk(x: jax.Array, axis: str) -> jax.Array:
    """This device's chunk of ``x`` ``(..., r)`` split ``axis_size`` ways on the last axis.

    The chunk a tiled reduce-scatter over ``axis`` would keep: ``(..., r / k)``.
    Runs inside shard_map; reads ``axis``'s index, moves nothing.
    """
    k = jax.lax.axis_size(axis)
    if k == 1:
        return x
    chunks = jnp.reshape(x, x.shape[:-1] + (k, x.shape[-1] // k))
    return jax.lax.dynamic_index_in_dim(chunks, jax.lax.axis_index(axis), axis=-2, keepdims=False)


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
