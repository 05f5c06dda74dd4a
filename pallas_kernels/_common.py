"""Helpers shared by the kernels: argument checks, tiling, packing in a tile.

Layout used by every kernel. The wire format (see
:mod:`pallas_kernels.references.quantization`) works block-wise on the last axis and blocks
never straddle rows, so an array ``(..., n)`` is the same memory as
``(num_blocks, block)`` with ``num_blocks = prod(...) * n // block``: leading
dimensions and blocks are flattened into one axis by a free reshape, and a
kernel tile is ``(tile_blocks, block)``: whole blocks, one per tile row.
Float data is loaded and stored in that 2-D form (contiguous rows, wide
loads), and per-block scales are reductions over the tile's rows - the
same reduction, over the same axis, that the reference does.

Packing needs the elements that share a byte next to each other on a minor
axis: inside the kernel the int32 codes ``(tb, block)`` are reshaped to
``(tb, block // per_byte, per_byte)`` and a byte is ``sum(part << shift)``
over that axis (the parts occupy disjoint bits, so the sum never carries).
Unpacking broadcasts each byte against an ``iota`` of shifts and reshapes
back to ``(tb, block)``. All of it is plain ``jnp`` that lowers on Triton
and runs in interpret mode.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.config import DEFAULT_CONFIG, KernelConfig
from pallas_kernels.references.quantization import Quantized

# ---------------------------------------------------------------------------
# Argument checks (trace time; ValueError with a hint, like the reference).
# ---------------------------------------------------------------------------


def out_struct(shape: tuple[int, ...], dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` output type that varies over the mesh axes ``like`` does.

    Inside ``jax.shard_map`` (with ``check_vma``) Pallas needs every output to
    say over which manual axes it varies; outside, this is a plain struct. The
    attribute is ``manual_axis_type`` in JAX 0.10 and ``vma`` in older releases.
    """
    aval = jax.typeof(like)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)
    vma = getattr(aval, "vma", None)
    if vma:
        return jax.ShapeDtypeStruct(shape, dtype, vma=vma)
    return jax.ShapeDtypeStruct(shape, dtype)


def check_bits(bits, allowed) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or bits not in allowed:
        raise ValueError(f"bits must be one of {tuple(allowed)}, got {bits!r}.")
    return int(bits)


def check_block(block) -> int:
    if (
        isinstance(block, bool)
        or not isinstance(block, (int, np.integer))
        or block < 8
        or block & (block - 1)
    ):
        raise ValueError(
            f"the Pallas kernels need block to be a power of two >= 8 (Triton tiles are powers "
            f"of two), got {block!r}; use 64, 256, 2048, ... or the jnp reference "
            "(pallas_kernels.references.quantization) for other block sizes."
        )
    return int(block)


def check_float_input(x: jax.Array, what: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{what} must be a floating array, got dtype {x.dtype}; cast it first.")
    if x.ndim < 1:
        raise ValueError(f"{what} must have at least one axis (..., n), got a scalar.")


def check_n(n: int, block: int, what: str) -> None:
    if n % block:
        raise ValueError(
            f"the last axis of {what} has length {n}, not a multiple of block={block}; "
            f"pad it to {-(-n // block) * block}."
        )


def get_config(config: KernelConfig | None) -> KernelConfig:
    if config is None:
        return DEFAULT_CONFIG
    if not isinstance(config, KernelConfig):
        raise ValueError(f"config must be a pallas_kernels.KernelConfig, got {type(config)}.")
    return config


# ---------------------------------------------------------------------------
# Tiling.
# ---------------------------------------------------------------------------


def tile_blocks(num_blocks: int, block: int, tile_elems: int) -> int:
    """Blocks per program: the largest power of two that fits and divides.

    ``tile_blocks * block <= max(tile_elems, block)`` and ``num_blocks %
    tile_blocks == 0``, so tiles cover the array exactly (Triton does not
    mask out-of-bounds block accesses).
    """
    tb = max(1, tile_elems // block)
    tb = 1 << (tb.bit_length() - 1)
    while num_blocks % tb:
        tb //= 2
    return tb


def num_blocks(shape: tuple[int, ...], block: int) -> int:
    return math.prod(shape[:-1]) * (shape[-1] // block)


def bytes_per_block(bits: int, block: int) -> int:
    return block * bits // 8


def index_map(ndim: int):
    """``i -> (i, 0, ..., 0)``: tile ``i`` of an array of ``ndim`` axes."""
    return lambda i: (i,) + (0,) * (ndim - 1)


def quantized_outputs(nb: int, tb: int, bits: int, block: int, scale_dtype, like: jax.Array):
    """``(out_shape, out_specs)`` of a kernel that writes a ``Quantized``.

    Wire values ``(nb, block * bits // 8)`` (int8 for bits 8, else uint8) and
    scales ``(nb,)``, ``tb`` blocks per program, varying like ``like``.
    Kernels with more outputs append theirs to both tuples.
    """
    bpb = bytes_per_block(bits, block)
    value_dtype = jnp.int8 if bits == 8 else jnp.uint8
    out_shape = (out_struct((nb, bpb), value_dtype, like), out_struct((nb,), scale_dtype, like))
    out_specs = (pl.BlockSpec((tb, bpb), index_map(2)), pl.BlockSpec((tb,), index_map(1)))
    return out_shape, out_specs


def as_quantized(values: jax.Array, scales: jax.Array, shape: tuple[int, ...], bits: int,
                 block: int):
    """The kernel's ``(nb, ·)`` values and ``(nb,)`` scales as a ``Quantized`` of ``shape``."""
    lead, n = shape[:-1], shape[-1]
    return Quantized(
        values=values.reshape(*lead, n * bits // 8), scales=scales.reshape(*lead, n // block)
    )


# ---------------------------------------------------------------------------
# In-kernel arithmetic (plain jnp; runs in interpret mode and on Triton).
# ---------------------------------------------------------------------------


def round_half_even(v: jax.Array) -> jax.Array:
    """``jnp.round`` (half to even) for float32 ``|v| < 2**23``, from ``floor``.

    Triton has no lowering for ``lax.round``, and the add-and-subtract
    ``1.5 * 2**23`` trick is folded away by XLA's algebraic simplifier (so it
    would not round in interpret mode). ``f = floor(v)`` and ``d = v - f``
    are exact here; round up when ``d > 1/2``, or ``d == 1/2`` and ``f`` is
    odd.
    """
    f = jnp.floor(v)
    d = v - f
    f_odd = (f - 2.0 * jnp.floor(f * 0.5)) == 1.0
    up = (d > 0.5) | ((d == 0.5) & f_odd)
    return jnp.where(up, f + 1.0, f)


def minor_iota(shape: tuple[int, ...]) -> jax.Array:
    """int32 ``0, 1, ...`` along the last axis of ``shape``, broadcast."""
    return lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)


def pack_codes(parts: jax.Array, bits: int) -> jax.Array:
    """Packs int32 ``parts`` ``(tb, block)`` in ``[0, 2**bits)`` into uint8 ``(tb, block * bits // 8)``.

    Element ``per_byte * i + j`` goes to bits ``[bits*j, bits*(j+1))`` of
    byte ``i``: low nibble first for bits=4, bit ``j`` for bits=1, as in the
    reference's layouts.
    """
    per_byte = 8 // bits
    tb, block = parts.shape
    grouped = parts.reshape(tb, block // per_byte, per_byte)
    shifted = grouped << (minor_iota(grouped.shape) * bits)
    return jnp.sum(shifted, axis=-1).astype(jnp.uint8)


def unpack_codes(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of :func:`pack_codes`: uint8 ``(tb, bytes)`` -> int32 ``(tb, block)``."""
    per_byte = 8 // bits
    tb, nbytes = packed.shape
    shape = (tb, nbytes, per_byte)
    b = jnp.broadcast_to(packed.astype(jnp.int32).reshape(tb, nbytes, 1), shape)
    parts = (b >> (minor_iota(shape) * bits)) & ((1 << bits) - 1)
    return parts.reshape(tb, nbytes * per_byte)


def sign_extend_nibble(nib: jax.Array) -> jax.Array:
    """int32 nibble ``[0, 16)`` -> two's-complement value in ``[-8, 8)``."""
    return (nib ^ 8) - 8


def decode_tile(values: jax.Array, scales: jax.Array, bits: int) -> jax.Array:
    """Dequantizes one tile in float32, exactly as the reference does.

    Args:
      values: the tile's wire values, int8 ``(tb, block)`` for bits=8, uint8
        ``(tb, block // 2)`` for bits=4, uint8 ``(tb, block // 8)`` for bits=1.
      scales: float32 ``(tb,)``.
      bits: 8, 4 or 1.

    Returns:
      float32 ``(tb, block)``: ``code * scale`` (bits 8 and 4) or
      ``+-scale`` (bits 1).
    """
    s = scales.reshape(scales.shape[0], 1)
    if bits == 8:
        return values.astype(jnp.float32) * s
    parts = unpack_codes(values, bits)
    if bits == 4:
        return sign_extend_nibble(parts).astype(jnp.float32) * s
    return jnp.where(parts == 1, s, -s)
