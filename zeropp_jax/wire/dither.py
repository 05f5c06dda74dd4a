"""Unbiased 1-bit codes with subtractive dither (qgZ ``qgz_code="dither"``).

The default 1-bit code (:mod:`zeropp_jax.wire.quantization`, ``bits=1``) is a
scaled sign, ``mean|x| * sign(x)`` per block: the L2-best single scale, but
biased (a block's large values arrive shrunk, its small ones inflated), which
is why it is paired with error feedback. This module's code is **unbiased**
with the same wire format, one bit per value plus one scale per block (so the
same bytes at the same block size)::

    s     = max|x| over the block            (stored as float32 or bfloat16)
    bit   = x + s * xi >= 0                  (sender)
    value = s * (+1 if bit else -1) - s * xi (receiver)

with ``xi`` uniform on ``(-1, 1)``, one per element, from a counter-based hash
of a key both ends know (:func:`uniform_noise`), so no extra bytes travel.
For ``|x| <= s`` (always, up to the rounding of a bfloat16 scale, which is
rounded *up*) this is subtractive dither: ``value - x`` is uniform on
``(-s, s)`` and independent of ``x``, so ``E[value] = x``. The noise is
larger than the scaled sign's error, but white and unbiased; how the example
GPT trains with it, without error feedback and across seeds, is in
benchmarks/RESULTS.md. Error feedback cannot be combined with it: the
fed-back error is as large as the scale, which grows with the carry (measured:
benchmarks/RESULTS.md); :class:`zeropp_jax.ZeroConfig` refuses that
combination.

The sender, :func:`quantize_dithered` (with :func:`block_scales` and
:func:`check_dither_input`), is plain ``jnp`` in
:mod:`pallas_kernels.references.dither`, beside the Pallas kernel checked
against it, and re-exported here. This module adds the shared noise
(:func:`stream_key`, :func:`uniform_noise`, :func:`element_counters`) and the
receiver, :func:`dequantize_dithered`.

All functions work on the last axis of ``(..., n)`` arrays, ``n`` a multiple
of ``block``, ``block`` a multiple of 8; bits are packed as in
:func:`zeropp_jax.wire.quantization.pack_bits`. A block of zeros gives zeros; a
block holding inf or NaN gets scale NaN and decodes to NaN.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.references.dither import block_scales as block_scales
from pallas_kernels.references.dither import check_dither_input as check_dither_input
from pallas_kernels.references.dither import quantize_dithered as quantize_dithered
from pallas_kernels.references.packing import unpack_bits
from pallas_kernels.references.quantization import Quantized, check_block, check_quantized

__all__ = [
    "mix32", "stream_key", "uniform_noise", "element_counters", "block_scales", "check_dither_input",
    "quantize_dithered",
    "dequantize_dithered",
]

# lowbias32 (C. Wellons, "Hash function prospector"): a 32-bit integer
# finalizer whose output bits each flip with probability ~1/2 for any input
# bit flip. Plain uint32 arithmetic (wrapping multiply), so the same bits come
# out of XLA on any backend and of a Pallas kernel.
_MIX_SHIFTS = (16, 15, 16)
_MIX_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
# xi = (2u + 1 - 2**23) * 2**-23 with u the top 23 bits of the hash: odd
# multiples of 2**-23 in (-1, 1), symmetric about 0, exact in float32.
_NOISE_BITS = 23


def mix32(x: jax.Array) -> jax.Array:
    """The lowbias32 hash of a uint32 array (elementwise, same shape)."""
    x = jnp.asarray(x, jnp.uint32)
    x = x ^ (x >> _MIX_SHIFTS[0])
    x = x * jnp.uint32(_MIX_MULTIPLIERS[0])
    x = x ^ (x >> _MIX_SHIFTS[1])
    x = x * jnp.uint32(_MIX_MULTIPLIERS[1])
    return x ^ (x >> _MIX_SHIFTS[2])


def stream_key(*ids: Any) -> jax.Array:
    """uint32 keys from integers, elementwise over their broadcast shape.

    ``stream_key(seed, step, unit, local)`` names one device's noise for one
    step; different tuples give unrelated streams.

    Args:
      *ids: Python ints (taken modulo ``2**32``) or integer arrays, traced or
        not, of shapes that broadcast together: ``stream_key(key, senders)``
        with ``senders`` uint32 ``(nodes,)`` gives one key per sender.

    Returns:
      uint32 array of the ids' broadcast shape (``()`` for scalars).
    """
    key = jnp.uint32(0x9E3779B9)
    for i in ids:
        if isinstance(i, int):  # any Python int (a seed may be negative or > 2**31)
            i = np.uint32(i % 2**32)
        key = mix32(key ^ jnp.asarray(i).astype(jnp.uint32))
    return key


def uniform_noise(key: jax.Array, counter: jax.Array) -> jax.Array:
    """float32 noise uniform on ``(-1, 1)``, a pure function of ``(key, counter)``.

    Args:
      key: uint32 key (from :func:`stream_key`), broadcastable to ``counter``.
      counter: uint32 element indices.

    Returns:
      float32 array of ``counter``'s broadcast shape, values
      ``(2u + 1 - 2**23) / 2**23`` with ``u`` in ``[0, 2**23)``.
    """
    h = mix32(mix32(key) ^ jnp.asarray(counter, jnp.uint32))
    u = (h >> (32 - _NOISE_BITS)).astype(jnp.int32)
    return (2 * u + 1 - (1 << _NOISE_BITS)).astype(jnp.float32) * np.float32(2.0**-_NOISE_BITS)


def element_counters(shape: tuple[int, ...], row: jax.Array | None = None) -> jax.Array:
    """uint32 row-major element indices of ``shape``: the counters of :func:`uniform_noise`.

    With ``row=r`` (``shape`` a sender's ``(..., nodes, c)``): an array of
    ``shape`` whose ``[..., k, j]`` is the index of ``[..., r, j]``, i.e. what
    receiver ``r`` got from every sender ``k``.

    Indices wrap modulo 2**32 past 4G elements (about a 34B-parameter stacked
    unit on 8 devices per node): both ends wrap alike, so the exchange stays
    exact and unbiased, but noise values then repeat within a step.
    """
    index = jnp.zeros((), jnp.uint32)
    for axis, size in enumerate(shape):
        if row is not None and axis == len(shape) - 2:
            part = jnp.broadcast_to(jnp.asarray(row).astype(jnp.uint32), shape)
        else:
            part = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
        index = index * size + part
    return index


@functools.partial(jax.jit, static_argnames=("block", "dtype"))
def dequantize_dithered(
    q: Quantized, xi: jax.typing.ArrayLike, *, block: int, dtype=jnp.float32
) -> jax.Array:
    """Values ``s * (+-1 - xi)`` of :func:`quantize_dithered`'s codes.

    Args:
      q: ``Quantized`` from :func:`quantize_dithered` (bits 1).
      xi: the sender's float32 dither ``(..., n)``.
      block: elements per scale.
      dtype: floating output dtype (computed in float32, cast once).

    Returns:
      ``dtype`` ``(..., n)``.
    """
    block = check_block(block)
    values, scales, dtype = check_quantized(q, bits=1, block=block, dtype=dtype)
    lead, n = values.shape[:-1], values.shape[-1] * 8
    xi = jnp.asarray(xi)
    if xi.dtype != jnp.float32 or xi.shape != (*lead, n):
        raise ValueError(f"xi must be float32 {(*lead, n)}, got {xi.dtype} {xi.shape}.")
    signs = unpack_bits(values).reshape(*lead, n // block, block)
    s = scales.astype(jnp.float32)[..., None]
    out = s * (jnp.where(signs, 1.0, -1.0) - xi.reshape(signs.shape))
    return out.reshape(*lead, n).astype(dtype)
