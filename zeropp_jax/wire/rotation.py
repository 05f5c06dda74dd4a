"""A randomized Hadamard rotation of each quantization block (qgZ's ``"hadamard"`` code).

A block-wise scaled code (1-bit sign with one ``mean|x|`` per block, or int
absmax) errs most on the coordinates that stand out from their block: a
sign code sends every coordinate the block's mean magnitude, so one
coordinate three times larger than its neighbours is under-delivered every
step, and error feedback carries the difference until the block's scale
catches up. Rotating each block first, ``y = H (s * x)`` with ``H`` the
``block x block`` Walsh-Hadamard matrix and ``s`` a fixed pattern of random
signs, spreads every coordinate over the whole block, so the code's error
is spread evenly too; the receiver decodes ``y`` and rotates back,
``x = s * (H y) / block`` (``H H = block * I``). The rotation is
orthogonal up to the factor ``sqrt(block)``, so error feedback works the
same in either domain; callers keep their carries in the original one.

Each sending node rotates with its own sign pattern (``pattern`` = its
``node`` index): 1-bit Adam's nodes code vectors that are mostly the same
shared momentum, and with one pattern their codes would err alike, so the
mean over nodes would keep the whole error; with independent patterns only
the part every scaled-sign code shares, its shrinkage of ``x`` (``1 - 2/pi``
of the error's variance for Gaussian blocks), stays, and the rest averages
out over the nodes (two nodes: 0.83 of one node's error). A receiver
rotates each sender's codes back with that sender's pattern
(:func:`unrotate_rows`).

Both directions are exact in their arithmetic pattern (additions and
subtractions, then one multiplication by the power of two ``1 / block``), so
every node that rotates back the same codes gets the same bits: 1-bit
Adam's replicas stay identical.

Costs ``ceil(log2(block) / 2)`` passes of additions over the data each
way (:func:`_hadamard`), no bytes on the wire. Touches no mesh axis.

The sums reach ``block`` times a block's largest magnitude: blocks holding
values above about ``float32 max / block`` (2.66e36 for 128) overflow to
inf and decode to NaN. 1-bit Adam codes its update direction, held
within Adam's own bound (:meth:`zeropp_jax.step.adam.OneBitAdam.update_bound`,
below 7.3 at the default betas) plus what its carry defers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zeropp_jax.config_checks import is_int

# The sign pattern: the low bit of SplitMix64 of the position in the block
# (the same on every device, process and NumPy version; any fixed pattern
# that is not structured like H's rows works).
_SPLITMIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _check_block(n: int, block: int) -> None:
    if not is_int(block):
        raise ValueError(f"the Hadamard rotation needs an int block (a power of two >= 2), "
                         f"got {block!r}")
    if block < 2 or block & (block - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two block >= 2, got {block}")
    if n % block:
        raise ValueError(f"the last axis ({n}) must be a multiple of the block ({block})")


def random_signs(block: int, pattern: int = 0) -> np.ndarray:
    """The fixed ``(block,)`` float32 pattern number ``pattern`` of +-1 that the rotation applies first."""
    if pattern < 0:
        raise ValueError(f"pattern must be >= 0, got {pattern}")
    z = (np.arange(block, dtype=np.uint64) + np.uint64(pattern * block)
         + np.uint64(_SPLITMIX[0]))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_SPLITMIX[1])
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_SPLITMIX[2])
    bits = (z ^ (z >> np.uint64(31))) & np.uint64(1)
    return (1.0 - 2.0 * bits).astype(np.float32)


def _hadamard(x: jax.Array, block: int) -> jax.Array:
    """``H`` (unnormalized Walsh-Hadamard) applied to each ``block`` of the last axis.

    ``H = H_2 (x) ... (x) H_2``, one ``H_2`` per bit of the position in the
    block. Each pass applies ``H_4`` (or a last ``H_2``) to the two (one)
    most significant bits, reading contiguous quarters (halves) of the
    block, and writes them as the least significant ones: after the passes
    every bit has had its ``H_2`` and the order is back where it started.
    ``ceil(log2(block) / 2)`` passes over the data, not ``log2(block)``.
    """
    shape = x.shape
    y = jnp.reshape(x, (-1, block))
    remaining = block
    while remaining > 1:
        radix = 4 if remaining % 4 == 0 else 2
        parts = jnp.reshape(y, (-1, radix, block // radix))
        s = [parts[:, i, :] for i in range(radix)]
        if radix == 2:
            outs = [s[0] + s[1], s[0] - s[1]]
        else:  # the rows of H_4, each from two butterflies
            plus, minus = s[0] + s[1], s[0] - s[1]
            plus2, minus2 = s[2] + s[3], s[2] - s[3]
            outs = [plus + plus2, minus + minus2, plus - plus2, minus - minus2]
        y = jnp.reshape(jnp.stack(outs, axis=-1), (-1, block))
        remaining //= radix
    return jnp.reshape(y, shape)


def rotate(x: jax.Array, block: int, pattern: int | jax.Array = 0, patterns: int = 1) -> jax.Array:
    """``H (s * x)`` per block of the last axis: float32 ``(..., n)`` -> ``(..., n)``.

    ``n`` must be a multiple of ``block`` (a power of two). The result's
    norm is ``sqrt(block)`` times ``x``'s. ``s`` is sign pattern ``pattern``
    (an int, or a traced int32 scalar such as a ``node`` index, below
    ``patterns``).
    """
    x = jnp.asarray(x, jnp.float32)
    _check_block(x.shape[-1], block)
    return _hadamard(_times_signs(x, block, _pattern(block, pattern, patterns)), block)


def unrotate(y: jax.Array, block: int, pattern: int | jax.Array = 0, patterns: int = 1) -> jax.Array:
    """The inverse of :func:`rotate`: ``s * (H y) / block`` per block, float32 ``(..., n)``."""
    y = jnp.asarray(y, jnp.float32)
    _check_block(y.shape[-1], block)
    return _times_signs(_hadamard(y, block) * (1.0 / block), block,
                        _pattern(block, pattern, patterns))


def unrotate_rows(y: jax.Array, block: int) -> jax.Array:
    """:func:`unrotate` of each row ``i`` of float32 ``(..., k, n)`` with pattern ``i``.

    Row ``i`` holds what sender ``i`` (of ``k``) rotated with its own pattern.
    """
    y = jnp.asarray(y, jnp.float32)
    _check_block(y.shape[-1], block)
    table = _sign_table(block, y.shape[-2])  # (k, block)
    return _times_signs(_hadamard(y, block) * (1.0 / block), block, jnp.asarray(table[:, None, :]))


def _sign_table(block: int, patterns: int) -> np.ndarray:
    """Patterns ``0 .. patterns - 1`` of :func:`random_signs`: float32 ``(patterns, block)``."""
    return np.stack([random_signs(block, i) for i in range(patterns)])


def _pattern(block: int, pattern: int | jax.Array, patterns: int) -> jax.Array:
    """Sign pattern ``pattern`` of ``patterns``: float32 ``(block,)``."""
    if isinstance(pattern, (int, np.integer)):  # a traced pattern cannot be checked
        if not 0 <= pattern < patterns:
            raise ValueError(f"pattern must be in [0, {patterns}), got {pattern}")
        return jnp.asarray(random_signs(block, int(pattern)))
    return jnp.asarray(_sign_table(block, patterns))[pattern]


def _times_signs(x: jax.Array, block: int, signs: jax.Array) -> jax.Array:
    """``x (..., n)`` times ``signs`` (``(block,)``, or ``(k, 1, block)`` for rows) per block."""
    blocks = jnp.reshape(x, x.shape[:-1] + (x.shape[-1] // block, block))
    signs = jnp.reshape(signs, (1,) * (blocks.ndim - signs.ndim) + signs.shape)
    return jnp.reshape(blocks * signs, x.shape)
