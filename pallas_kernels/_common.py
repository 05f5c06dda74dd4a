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
axis: the int32 codes ``(tb, block)`` are viewed as
``(tb, block // per_byte, per_byte)`` (a reshape in the kernel, or the
split layout of ``KernelConfig.split_bytes``) and a byte is
``sum(part << shift)`` over that axis (the parts occupy disjoint bits, so
the sum never carries). Decoding broadcasts each byte against an ``iota``
of positions along that axis. All of it is plain ``jnp`` that lowers on
Triton and runs in interpret mode.

Per-block scales, and in split tiles the packed units, keep the rank of the
element tile (``(tb, 1)``, ``(tb, 1, 1)``, ``(tb, units, 1)``: :func:`per_block`,
:func:`unit_view`), in the arrays the kernels read and write as well: on
Triton, adding or dropping an axis of a loaded tile inside a kernel can send
it through shared memory, and a split kernel then has no reshape at all.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.config import KernelConfig, default_config, is_pow2
from pallas_kernels.references import quantization
from pallas_kernels.references.quantization import Quantized

# ---------------------------------------------------------------------------
# Argument checks (trace time; ValueError with a hint). The kernels take the
# reference's (pallas_kernels.references.quantization: check_bits with the
# kernel's widths, check_n, check_float_input, check_quantized), and its
# block check with their own rule added (check_block below).
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


def check_block(block) -> int:
    """``block`` as an int: the reference's (an int, a positive multiple of 8)
    that is also a power of two, since Triton tiles are; else ValueError
    (for an int of 8 or more, naming the powers of two around it)."""
    if isinstance(block, (int, np.integer)) and not isinstance(block, bool) and block >= 8 \
            and not is_pow2(int(block)):
        lower = 1 << (int(block).bit_length() - 1)
        raise ValueError(
            f"the Pallas kernels need block to be a power of two >= 8 (Triton tiles are powers "
            f"of two), got {block!r}; try {lower} or {2 * lower}, or the jnp reference "
            "(pallas_kernels.references.quantization) for other block sizes."
        )
    return quantization.check_block(block)


def get_config(config: KernelConfig | None, kernel: str, bits: int) -> KernelConfig:
    """``config``, or the kernel's measured default (:func:`~pallas_kernels.config.default_config`)."""
    if config is None:
        return default_config(kernel, bits)
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


def per_block(n: int, rank: int) -> tuple[int, ...]:
    """``(n, 1, ..., 1)``: ``n`` per-block values in a tile of ``rank`` axes.

    Scales (and, in split tiles, packed units) keep the rank of the element
    tile they belong to, with size-1 axes where the tile has elements: a
    kernel's reductions leave them in that shape (``keepdims``) and decoding
    broadcasts them from it, so no value changes shape inside a kernel. On
    Triton a reshape that adds or drops an axis can move a tile through
    shared memory; arrays of this shape outside the kernel are free reshapes.
    """
    return (n,) + (1,) * (rank - 1)


def quantized_outputs(nb: int, tb: int, bits: int, block: int, scale_dtype, like: jax.Array,
                      rank: int = 2):
    """``(out_shape, out_specs)`` of a kernel that writes a ``Quantized``.

    ``rank`` is that of the kernel's element tile (:func:`element_tile`): 2
    for ``(tb, block)``, 3 for split tiles. Wire values ``(nb, block * bits //
    8)`` (int8 for bits 8, else uint8; ``(nb, bytes, 1)`` for split tiles,
    as :func:`pack_codes` packs them) and scales :func:`per_block` ``(nb,
    1[, 1])``, ``tb`` blocks per program, varying like ``like``. Kernels with
    more outputs append theirs to both tuples.
    """
    bpb = bytes_per_block(bits, block)
    value_dtype = jnp.int8 if bits == 8 else jnp.uint8
    values = (nb, bpb, 1) if rank == 3 else (nb, bpb)
    scales = per_block(nb, rank)
    out_shape = (out_struct(values, value_dtype, like), out_struct(scales, scale_dtype, like))
    out_specs = (
        pl.BlockSpec((tb, *values[1:]), index_map(len(values))),
        pl.BlockSpec(per_block(tb, rank), index_map(rank)),
    )
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


def minor_iota(shape: tuple[int, ...]) -> jax.Array:
    """int32 ``0, 1, ...`` along the last axis of ``shape``, broadcast."""
    return lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)


def split_elements(x: jax.Array, bits: int) -> jax.Array:
    """A tile of elements ``(tb, block)`` as ``(tb, block * bits // 8, 8 // bits)``.

    The elements that share a byte on their own minor axis. A tile that is
    already split (``KernelConfig.split_bytes``: the ref is 3-D) is returned
    as it is; bits=8 tiles stay 2-D.
    """
    if bits == 8 or x.ndim == 3:
        return x
    per_byte = 8 // bits
    tb, block = x.shape
    return x.reshape(tb, block // per_byte, per_byte)


def row_reduce(fn, x: jax.Array) -> jax.Array:
    """``fn`` (``jnp.max`` or ``jnp.sum``) over every axis but the first, keepdims.

    One block per tile row, 2-D ``(tb, block)`` or split 3-D; reduced one
    axis at a time (Triton reduces along one axis per op), innermost first.
    Returns ``(tb, 1)`` or ``(tb, 1, 1)``.
    """
    for axis in range(x.ndim - 1, 0, -1):
        x = fn(x, axis=axis, keepdims=True)
    return x


def pack_codes(parts: jax.Array, bits: int) -> jax.Array:
    """Packs int32 ``parts`` in ``[0, 2**bits)`` into uint8 bytes.

    ``parts``: ``(tb, block)``, packed to ``(tb, block * bits // 8)``; or
    already split ``(tb, bytes, 8 // bits)`` (:func:`split_elements`), packed
    to ``(tb, bytes, 1)`` in the tile's rank (:func:`per_block`). Element
    ``per_byte * i + j`` goes to bits ``[bits*j, bits*(j+1))`` of byte ``i``:
    low nibble first for bits=4, bit ``j`` for bits=1, as in the reference's
    layouts.
    """
    grouped = split_elements(parts, bits)
    shifted = grouped << (minor_iota(grouped.shape) * bits)
    return jnp.sum(shifted, axis=-1, keepdims=parts.ndim == 3).astype(jnp.uint8)


def decode_tile(values: jax.Array, scales: jax.Array, bits: int, shape: tuple[int, ...],
                decode: str = "convert") -> jax.Array:
    """Dequantizes one tile in float32, exactly as the reference does.

    Args:
      values: the tile's wire values, int8 ``(tb, block)`` for bits=8, uint8
        ``(tb, block // 2)`` for bits=4, uint8 ``(tb, block // 8)`` for bits=1,
        or for bits 4 and 1 the same bytes as uint32 words
        (:func:`packed_units`; little-endian, so element ``j`` of a word is
        element ``j`` of its four bytes in order); for split tiles
        ``(tb, units, 1)`` (:func:`unit_view`).
      scales: float32 ``(tb, 1)``, or ``(tb, 1, 1)`` for split tiles
        (:func:`per_block`).
      bits: 8, 4 or 1.
      shape: the output tile's shape, ``(tb, block)`` or split
        ``(tb, units, elements per unit)``; with split values and scales in
        that rank, decoding is broadcasting alone (no reshape in the kernel).
      decode: ``KernelConfig.decode``: codes to float32 by the int-to-float
        conversion (``"convert"``) or by their bits (``"bits"``:
        :func:`int8_to_float_bits`, :func:`nibble_to_float_bits`); the same
        values.

    Returns:
      float32 ``shape``: ``code * scale`` (bits 8 and 4) or ``+-scale``
      (bits 1).

    Decoding is integer work per element and chunk (``dequantize_sum``
    decodes ``k`` chunks per output element), so each code is extracted in
    as few operations as possible: with ``"convert"`` a nibble is shifted to
    the top of an int32 and arithmetically back (extracted and sign-extended
    in two shifts); a bit is tested against a constant per position.
    """
    if bits == 8:
        if decode == "bits":
            return int8_to_float_bits(values) * scales
        return values.astype(jnp.float32) * scales
    unit_bits = 8 * values.dtype.itemsize  # bytes, or 32-bit words (packed_units)
    per_unit = unit_bits // bits
    tb, units = values.shape[:2]
    if unit_bits == 32:
        b = lax.bitcast_convert_type(values, jnp.int32)
    else:
        b = values.astype(jnp.int32)
    b = b.reshape(tb, units, 1)  # no-op for split tiles
    position = minor_iota((tb, units, per_unit))  # element j of its byte or word
    s = scales.reshape(tb, 1, 1)  # no-op for split tiles
    if bits == 4 and decode == "bits":
        out = nibble_to_float_bits(b, position) * s
    elif bits == 4:
        code = (b << (28 - 4 * position)) >> 28  # nibble j, two's complement
        out = code.astype(jnp.float32) * s
    else:
        out = jnp.where((b & (1 << position)) != 0, s, -s)
    return out.reshape(shape)


# float32 fields: an exponent e is stored as e + 127 above 23 mantissa bits. From
# 2**e to 2**(e+1), consecutive float32 are 2**(e-23) apart, so an integer u <
# 2**23 in the mantissa of 2**e reads 2**e + u * 2**(e-23), exactly.
_FLOAT32_EXPONENT_BIAS = 127
_FLOAT32_MANTISSA_BITS = 23
_TWO_POW_23_BITS = (_FLOAT32_EXPONENT_BIAS + _FLOAT32_MANTISSA_BITS) << _FLOAT32_MANTISSA_BITS


def int8_to_float_bits(values: jax.Array) -> jax.Array:
    """int8 codes as float32, exactly, without an int-to-float conversion.

    ``code + 128`` in ``[0, 256)`` added to the bits of ``2**23`` is the
    float32 ``2**23 + 128 + code``; subtracting ``2**23 + 128`` (exact: both
    are integers below ``2**24``) leaves ``code``.
    """
    biased = values.astype(jnp.int32) + (_TWO_POW_23_BITS + 128)
    return lax.bitcast_convert_type(biased, jnp.float32) - np.float32(2**23 + 128)


def nibble_to_float_bits(b: jax.Array, position: jax.Array) -> jax.Array:
    """Nibble ``position`` of int32 ``b`` as its two's complement code in float32, exactly.

    Without an int-to-float conversion, and without a shift per nibble:
    nibble ``j`` of the low half-word sits at bits ``4j`` (``j < 4``).
    Masked in place, with its sign bit flipped, it is ``u * 2**(4j)`` where
    ``u = code + 8`` is in ``[0, 16)``; as the mantissa of the float32 with
    exponent ``23 - 4j`` (whose mantissa step is ``2**-4j``) it reads
    ``2**(23-4j) + u``, and subtracting ``2**(23-4j) + 8`` leaves ``code``
    (exact: integers below ``2**24``). The high half-word's nibbles
    (``j >= 4``) are first shifted down by 16, once per word. One bitwise
    expression and one subtraction per nibble; Triton keeps ``position``'s
    constants in the instructions (one tile axis is the nibble's position).

    Args:
      b: int32 bytes or words, broadcastable against ``position``.
      position: int32 in ``[0, 8)``: which nibble of ``b``, low first.
    """
    j = position % 4
    half = jnp.where(position >= 4, b >> 16, b)
    exponent = (_FLOAT32_EXPONENT_BIAS + _FLOAT32_MANTISSA_BITS - 4 * j) << _FLOAT32_MANTISSA_BITS
    biased = (half & (0xF << (4 * j))) ^ (exponent | (8 << (4 * j)))
    origin = lax.bitcast_convert_type(exponent, jnp.float32) + 8
    return lax.bitcast_convert_type(biased, jnp.float32) - origin


# ---------------------------------------------------------------------------
# Element views: the (tb, block) or split (tb, units, per_unit) tiles.
# ---------------------------------------------------------------------------


def packed_units(values: jax.Array, bits: int) -> jax.Array:
    """Wire values ``(..., bytes)`` as the widest units the decoding kernels load.

    For bits 4 and 1 with ``bytes % 4 == 0``: uint32 ``(..., bytes // 4)``,
    the same memory (a free bitcast), so a kernel loads four bytes per
    element of its tile instead of one; otherwise ``values`` unchanged.
    """
    if bits == 8 or values.shape[-1] % 4:
        return values
    words = values.reshape(*values.shape[:-1], values.shape[-1] // 4, 4)
    return lax.bitcast_convert_type(words, jnp.uint32)


def unit_view(units: jax.Array, out_tile: tuple[int, ...]) -> tuple[jax.Array, tuple[int, ...]]:
    """``(view, tile)``: packed units ``(..., nb, n_units)`` for a decoding kernel's spec.

    For a split ``out_tile`` (3 axes) the units are viewed ``(..., nb,
    n_units, 1)`` (a free reshape), in the rank of the elements they decode
    to (:func:`per_block`); otherwise unchanged. ``tile`` is the units'
    block shape for ``out_tile[0]`` blocks per program.
    """
    if len(out_tile) == 3:
        units = units.reshape(*units.shape, 1)
        return units, (out_tile[0], units.shape[-2], 1)
    return units, (out_tile[0], units.shape[-1])


def element_tile(tb: int, block: int, bits: int, config: KernelConfig,
                 unit_bits: int = 8) -> tuple[int, ...]:
    """Shape of one tile of elements: ``(tb, block)``, or split when configured.

    Split (``config.split_bytes`` and bits < 8): ``(tb, block * bits //
    unit_bits, unit_bits // bits)``, the same memory, the elements of one
    packed byte (or 32-bit word, ``unit_bits=32``) on the minor axis.
    """
    if bits == 8 or not config.split_bytes:
        return (tb, block)
    return (tb, block * bits // unit_bits, unit_bits // bits)


def element_view(x: jax.Array, nb: int, block: int, bits: int, config: KernelConfig):
    """``(x_view, spec)``: a flat-blocked ``x`` (``nb * block`` elements) and its tile spec.

    ``x_view`` is ``(nb, block)`` or split ``(nb, bytes, per_byte)`` (a free
    reshape); ``spec`` is the ``BlockSpec`` of a tile of ``tb`` blocks.
    """
    tb = tile_blocks(nb, block, config.tile_elems)
    shape = element_tile(tb, block, bits, config)
    view = x.reshape(nb, *shape[1:])
    return view, pl.BlockSpec(shape, index_map(len(shape)))
