"""Bit packing of the wire format: int4 nibbles two per byte, signs eight per byte.

Pure ``jnp`` along the last axis, any leading dimensions. The layouts are
those of :mod:`pallas_kernels.references.quantization` (the wire format):
two's-complement nibbles, element ``2i`` in the low nibble of byte ``i``;
signs with element ``8i+j`` in bit ``j`` of byte ``i``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["pack_int4", "unpack_int4", "pack_bits", "unpack_bits"]


@jax.jit
def pack_int4(codes: jax.typing.ArrayLike) -> jax.Array:
    """Packs signed 4-bit codes two per byte along the last axis.

    Element ``2i`` goes to the low nibble and ``2i+1`` to the high nibble of
    byte ``i``, each as a two's-complement nibble (``-1 -> 0xF``,
    ``-8 -> 0x8``). Codes outside ``[-8, 7]`` keep only their low 4 bits.

    Args:
      codes: integer array ``(..., m)`` with ``m`` even, values in ``[-8, 7]``.

    Returns:
      uint8 array ``(..., m // 2)``.

    Example:
      >>> pack_int4(jnp.array([1, -2], jnp.int8))  # [0xE1]
      Array([225], dtype=uint8)
    """
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise ValueError(f"pack_int4 expects integer codes, got dtype {codes.dtype}.")
    if codes.ndim < 1 or codes.shape[-1] % 2 != 0:
        raise ValueError(
            f"pack_int4 needs an even-length last axis, got shape {codes.shape}; pad by one code."
        )
    # int8 -> uint8 by bit pattern, so negative codes become two's-complement nibbles.
    u = jax.lax.bitcast_convert_type(codes.astype(jnp.int8), jnp.uint8)
    u = u.reshape(*u.shape[:-1], u.shape[-1] // 2, 2)
    low = u[..., 0] & np.uint8(0x0F)
    high = (u[..., 1] & np.uint8(0x0F)) << np.uint8(4)
    return low | high


@jax.jit
def unpack_int4(packed: jax.typing.ArrayLike) -> jax.Array:
    """Inverse of :func:`pack_int4`.

    Args:
      packed: uint8 array ``(..., m)``.

    Returns:
      int8 array ``(..., 2 * m)`` with values in ``[-8, 7]``.
    """
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"unpack_int4 expects uint8 bytes, got dtype {packed.dtype}.")
    if packed.ndim < 1:
        raise ValueError("unpack_int4 expects at least one axis, got a scalar.")
    # Move each nibble to the top of an int8, then an arithmetic shift sign-extends it.
    low = jax.lax.bitcast_convert_type(packed << np.uint8(4), jnp.int8) >> np.int8(4)
    high = jax.lax.bitcast_convert_type(packed & np.uint8(0xF0), jnp.int8) >> np.int8(4)
    out = jnp.stack([low, high], axis=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@jax.jit
def pack_bits(bits_bool: jax.typing.ArrayLike) -> jax.Array:
    """Packs booleans eight per byte along the last axis.

    Element ``8i+j`` goes to bit ``j`` (``1 << j``) of byte ``i``, i.e.
    ``np.packbits(..., bitorder="little")``.

    Args:
      bits_bool: bool array ``(..., m)`` with ``m % 8 == 0`` (nonzero numbers
        count as True).

    Returns:
      uint8 array ``(..., m // 8)``.

    Example:
      >>> pack_bits(jnp.array([1, 0, 0, 0, 0, 0, 0, 1], bool))  # [0x81]
      Array([129], dtype=uint8)
    """
    b = jnp.asarray(bits_bool)
    if b.ndim < 1 or b.shape[-1] % 8 != 0:
        raise ValueError(
            f"pack_bits needs a last axis whose length is a multiple of 8, got shape {b.shape}."
        )
    b = b.astype(jnp.bool_).astype(jnp.uint8)
    b = b.reshape(*b.shape[:-1], b.shape[-1] // 8, 8)
    weights = jnp.left_shift(jnp.uint8(1), jnp.arange(8, dtype=jnp.uint8))  # 1, 2, 4, ..., 128
    weights = weights.reshape((1,) * (b.ndim - 1) + (8,))  # explicit rank: promotion is "raise"
    # Each bit has its own position, so the sum never carries.
    return jnp.sum(b * weights, axis=-1, dtype=jnp.uint8)


@jax.jit
def unpack_bits(packed: jax.typing.ArrayLike) -> jax.Array:
    """Inverse of :func:`pack_bits`.

    Args:
      packed: uint8 array ``(..., m)``.

    Returns:
      bool array ``(..., 8 * m)``.
    """
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"unpack_bits expects uint8 bytes, got dtype {packed.dtype}.")
    if packed.ndim < 1:
        raise ValueError("unpack_bits expects at least one axis, got a scalar.")
    shifts = jnp.arange(8, dtype=jnp.uint8).reshape((1,) * packed.ndim + (8,))
    b = (packed[..., None] >> shifts) & np.uint8(1)
    return b.astype(jnp.bool_).reshape(*packed.shape[:-1], packed.shape[-1] * 8)
