"""The sender of the unbiased 1-bit code with subtractive dither (qgZ ``dither``).

Same wire format as the 1-bit scaled sign of
:mod:`pallas_kernels.references.quantization` (one bit per value, packed as
:func:`~pallas_kernels.references.packing.pack_bits`, plus one scale per
block), but an unbiased code::

    s     = max|x| over the block            (rounded up to scale_dtype)
    bit   = x + s * xi >= 0                  (sender, this module)
    value = s * (+1 if bit else -1) - s * xi (receiver)

with ``xi`` float32 dither uniform on ``(-1, 1)``, one per element, that both
ends regenerate from a shared key; the noise, the receiver and why the code is
unbiased are in :mod:`zeropp_jax.wire.dither`. This module is the reference
of the Pallas kernel :func:`pallas_kernels.quantize_dithered`, which calls
:func:`block_scales` itself. It imports nothing from ``zeropp_jax``.

Works on the last axis of ``(..., n)`` arrays, ``n`` a multiple of ``block``,
``block`` a multiple of 8. A block of zeros gets scale 0; a block holding inf
or NaN gets scale NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.references.packing import pack_bits
from pallas_kernels.references.quantization import (
    Quantized, check_block, check_float_input, check_n, check_scale_dtype, finite_blocks,
)

__all__ = ["block_scales", "check_dither_input", "quantize_dithered"]


def block_scales(xb: jax.Array, scale_dtype, block_axes: int = 1) -> jax.Array:
    """Scales of float32 blocks ``(..., block)``: ``(..., 1)`` in ``scale_dtype``.

    ``block_axes``: how many trailing axes make one block (1 here; the
    kernel's split tiles ``(tb, bytes, 8)`` have 2, reduced one at a time).

    The block's max|x|, rounded *up* to ``scale_dtype`` so that ``|x| <= s``
    holds for the scale the receiver sees, or NaN if the block holds inf or
    NaN. A finite block whose max|x| lies above ``scale_dtype``'s largest
    finite value (bfloat16 rounds up past 3.39e38) gets an infinite scale
    and decodes to +-inf; so may a float32 scale above about 1.7e38, where
    the receiver's ``s * (+-1 - xi)`` overflows. Plain ``jnp`` that the
    Pallas kernel calls too: non-finite blocks are found by
    :func:`~pallas_kernels.references.quantization.finite_blocks` (GPU max
    reductions may drop NaN), and the bfloat16 round-up is integer
    arithmetic on the float32 bits (Triton has no bfloat16 ``nextafter``):
    adding ``0xFFFF`` and clearing the low 16 bits is the ceiling on
    bfloat16's grid for a finite value >= 0.
    """
    finite = finite_blocks(xb, block_axes)
    absmax = jnp.abs(xb)
    for axis in range(-1, -1 - block_axes, -1):
        absmax = jnp.max(absmax, axis=axis, keepdims=True)
    if jnp.dtype(scale_dtype) == jnp.dtype(jnp.bfloat16):
        bits = jax.lax.bitcast_convert_type(absmax, jnp.uint32)
        bits = (bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000)
        absmax = jax.lax.bitcast_convert_type(bits, jnp.float32)  # exact in bfloat16
    return jnp.where(finite, absmax, jnp.nan).astype(scale_dtype)


def check_dither_input(x, xi):
    """``(x, xi)`` as arrays: ``x`` floating ``(..., n)``, ``xi`` float32 of its shape.

    Shared by the reference and the Pallas kernel; raises ValueError otherwise.
    """
    x, xi = check_float_input(x, "x"), jnp.asarray(xi)
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
      xi: float32 ``(..., n)`` dither, uniform on ``(-1, 1)``
        (:func:`zeropp_jax.wire.dither.uniform_noise`).
      block: elements per scale (a multiple of 8).
      scale_dtype: float32 or bfloat16.

    Returns:
      ``Quantized``: uint8 ``(..., n // 8)`` packed bits, ``scale_dtype``
      ``(..., n // block)`` block absmax.
    """
    x, xi = check_dither_input(x, xi)
    block = check_block(block)
    check_n(x.shape[-1], block)
    scale_dtype = check_scale_dtype(scale_dtype)
    lead, n = x.shape[:-1], x.shape[-1]
    xb = x.astype(jnp.float32).reshape(*lead, n // block, block)
    scale = block_scales(xb, scale_dtype)  # (..., nb, 1)
    bits = xb + scale.astype(jnp.float32) * xi.reshape(xb.shape) >= 0
    values = pack_bits(bits).reshape(*lead, n // 8)
    return Quantized(values=values, scales=scale[..., 0])
