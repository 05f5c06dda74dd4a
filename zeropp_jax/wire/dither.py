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
larger than the scaled sign's error, but white and unbiased; on the example
GPT with Adam, without error feedback, it trains within 1% of full precision
on seed 0 (+0.37%) but not on seeds 1 and 2 (+1.15%, +3.67%;
benchmarks/RESULTS.md), where the scaled sign with error feedback lags by 8%.
Error feedback cannot be combined with it: the fed-back error is as large as
the scale, which grows with the carry (in a simulator of qgZ the carry
reached 10x the gradient, benchmarks/RESULTS.md); :class:`zeropp_jax.ZeroConfig`
refuses that combination.

Both functions work on the last axis of ``(..., n)`` arrays, ``n`` a multiple
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

from zeropp_jax.wire import quantization
from zeropp_jax.wire.quantization import Quantized

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
    """A uint32 key from integers (Python ints or int scalars, traced or not).

    ``stream_key(seed, step, unit, local)`` names one device's noise for one
    step; different tuples give unrelated streams. Python ints are taken
    modulo ``2**32``.
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


def block_scales(xb: jax.Array, scale_dtype) -> jax.Array:
    """Scales of float32 blocks ``(..., block)``: ``(..., 1)`` in ``scale_dtype``.

    The block's max|x|, rounded *up* to ``scale_dtype`` so that ``|x| <= s``
    holds for the scale the receiver sees, or NaN if the block holds inf or
    NaN. Plain ``jnp`` that the Pallas kernel calls too: non-finite values
    are found with ``isfinite`` (GPU max reductions may drop NaN), and the
    bfloat16 round-up is integer arithmetic on the float32 bits (Triton has
    no bfloat16 ``nextafter``): adding ``0xFFFF`` and clearing the low 16 bits
    is the ceiling on bfloat16's grid for a finite value >= 0.
    """
    bad = jnp.max(jnp.where(jnp.isfinite(xb), 0, 1), axis=-1, keepdims=True)
    absmax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    if jnp.dtype(scale_dtype) == jnp.dtype(jnp.bfloat16):
        bits = jax.lax.bitcast_convert_type(absmax, jnp.uint32)
        bits = (bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000)
        absmax = jax.lax.bitcast_convert_type(bits, jnp.float32)  # exact in bfloat16
    return jnp.where(bad == 0, absmax, jnp.nan).astype(scale_dtype)


def check_dither_input(x, xi):
    """``(x, xi)`` as arrays: ``x`` floating ``(..., n)``, ``xi`` float32 of its shape.

    Shared by the reference and the Pallas kernel; raises ValueError otherwise.
    """
    x, xi = jnp.asarray(x), jnp.asarray(xi)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 1:
        raise ValueError(f"x must be a floating array (..., n), got {x.dtype} {x.shape}.")
    if xi.dtype != jnp.float32 or xi.shape != x.shape:
        raise ValueError(
            f"xi must be float32 with x's shape {x.shape} (from uniform_noise), "
            f"got {xi.dtype} {xi.shape}."
        )
    return x, xi


@functools.partial(jax.jit, static_argnames=("block", "scale_dtype"))
def quantize_dithered(
    x: jax.typing.ArrayLike, xi: jax.typing.ArrayLike, *, block: int, scale_dtype=jnp.float32
) -> Quantized:
    """Unbiased 1-bit codes of ``x`` (the reference; see the module docstring).

    Args:
      x: floating ``(..., n)``, computed in float32.
      xi: float32 ``(..., n)`` dither from :func:`uniform_noise`.
      block: elements per scale (a multiple of 8).
      scale_dtype: float32 or bfloat16.

    Returns:
      ``Quantized``: uint8 ``(..., n // 8)`` packed bits, ``scale_dtype``
      ``(..., n // block)`` block absmax.
    """
    x, xi = check_dither_input(x, xi)
    block = quantization._check_block(block)
    quantization._check_n(x.shape[-1], block)
    scale_dtype = quantization.check_scale_dtype(scale_dtype)
    lead, n = x.shape[:-1], x.shape[-1]
    xb = x.astype(jnp.float32).reshape(*lead, n // block, block)
    scale = block_scales(xb, scale_dtype)  # (..., nb, 1)
    bits = xb + scale.astype(jnp.float32) * xi.reshape(xb.shape) >= 0
    values = quantization.pack_bits(bits).reshape(*lead, n // 8)
    return Quantized(values=values, scales=scale[..., 0])


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
    values, scales, dtype = quantization.check_quantized(q, bits=1, block=block, dtype=dtype)
    lead, n = values.shape[:-1], values.shape[-1] * 8
    xi = jnp.asarray(xi)
    if xi.dtype != jnp.float32 or xi.shape != (*lead, n):
        raise ValueError(f"xi must be float32 {(*lead, n)}, got {xi.dtype} {xi.shape}.")
    signs = quantization.unpack_bits(values).reshape(*lead, n // block, block)
    s = scales.astype(jnp.float32)[..., None]
    out = s * (jnp.where(signs, 1.0, -1.0) - xi.reshape(signs.shape))
    return out.reshape(*lead, n).astype(dtype)
