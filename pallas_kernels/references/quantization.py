"""Block-wise quantization in pure ``jnp``: the source of truth for the project.

ZeRO++ sends parameters (qwZ) and gradients (qgZ) over the wire in a few bits
per element plus one floating-point scale per block of ``block`` consecutive
elements. This module defines that wire format and its exact numerics; the GPU
Pallas kernels beside it in ``pallas_kernels`` are checked against it, and
:mod:`zeropp_jax.wire.quantization` re-exports it. It imports nothing from
``zeropp_jax``.

Everything works on the LAST axis of ``x`` (shape ``(..., n)``), with any
number of leading batch dimensions. ``n`` must be a multiple of ``block`` and
``block`` a multiple of 8, so a packed byte never straddles two blocks.

Schemes (computation is always in float32, whatever the input dtype; bfloat16
and float16 inputs are up-cast exactly, never reinterpreted):

* ``bits=8``: symmetric absmax. ``scale = max|x| * (1/127)`` per block (see
  "One scale on every backend" below),
  ``code = clip(round(x * (1 / scale)), -127, 127)`` (the reciprocal once per
  block) stored as int8 ``(..., n)``;
  ``dequant = code * scale``. The code -128 is never produced, so the range is
  symmetric.
* ``bits=4``: the same with ``qmax = 7``; codes in ``[-7, 7]`` are stored as
  **two's-complement nibbles**, two per byte: element ``2i`` in the low nibble
  and ``2i+1`` in the high nibble of byte ``i`` (uint8 ``(..., n // 2)``).
* ``bits=1``: scaled sign. ``scale = mean|x|`` per block (for a fixed sign
  pattern this is the scale minimising the L2 error), bit = 1 where
  ``x >= 0`` (so ``-0.0`` counts as positive) else 0, eight per byte with
  element ``8i+j`` in bit ``j`` (least significant first) of byte ``i`` (uint8
  ``(..., n // 8)``). ``dequant = +scale`` or ``-scale``.

One scale on every backend: the scale is ``max|x|`` times the float32
constant :data:`INV_QMAX` (``float32(1 / qmax)``), one correctly rounded
multiply, and a bfloat16 scale is rounded to nearest-even by integer
arithmetic on the float32 bits (:func:`stored_scale`). A division by the
constant ``qmax`` is not portable: XLA under ``jit`` rewrites ``x / 7.0`` into
``x * (1 / 7.0)`` (49 / 7 gives 7.000000476837158 there, on GPU and, in
recent versions, on CPU; 7.0 in numpy and in a GPU kernel's IEEE division),
and XLA on GPU may drop a float32 -> bfloat16
-> float32 round trip as "excess precision". Neither can change a multiply
or integer bit arithmetic, so the reference run by any backend and every
kernel agree bit for bit. Likewise codes multiply by the per-block
reciprocal ``1 / scale`` (one IEEE division per block), which is what XLA
makes of a division by a broadcast scale anyway.

Rounding is round-half-to-even (``jnp.round``, the IEEE default, which is what
``rint`` gives in a GPU kernel). Codes are computed from the scale
*as stored*: with ``scale_dtype=jnp.bfloat16`` the scale is rounded to
bfloat16 first, so the error bound below holds against the stored scale.

Error bound (bits 8 and 4): ``|x - dequant(quantize(x))| <= scale / 2`` per
element, up to float32 rounding. With a bfloat16 scale rounded down, the
largest element can land up to ``qmax * 2**-8`` steps (< 0.5) past ``qmax``;
it is clipped to ``qmax`` and the bound still holds.

Special values:

* A block of zeros gets scale 0 and dequantizes to exact zeros; the division
  is guarded, so no NaN appears.
* A block holding a non-finite value (inf or NaN) gets scale NaN and codes 0
  (at 1 bit the other elements keep their sign bits), so the whole
  dequantized block is NaN. A non-finite parameter or gradient is
  therefore reported downstream (e.g. by a loss-scaler's finiteness check)
  instead of being turned silently into finite garbage. Other blocks are
  unaffected.
* Scales are float32 or bfloat16 (both have float32's exponent range; a
  bfloat16 scale saturates at bfloat16's largest value, 3.39e38, rather than
  round to inf: :func:`stored_scale`).
  float16 scales are refused: they overflow for ``max|x| > 65504 * qmax``.
  A block whose scale underflows to zero, or is too small to have a finite
  reciprocal (``max|x|`` below about ``qmax * 2.9e-39``), dequantizes to
  zeros.
* Subnormal float32 values (below 1.18e-38) depend on the backend: one that
  flushes them to zero (XLA:CPU) sends a block with ``max|x|`` below about
  ``qmax * 1.18e-38`` as zeros, and codes a subnormal negative value as
  positive at 1 bit, where a GPU keeps them. Only blocks this close to zero
  differ between backends.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.references.packing import pack_bits, pack_int4, unpack_bits, unpack_int4

__all__ = [
    "Quantized",
    "quantize",
    "dequantize",
    "check_bits",
    "check_block",
    "check_scale_dtype",
    "check_n",
    "check_float_input",
    "check_quantized",
    "finite_blocks",
    "ordered_chunk_sum",
    "stored_scale",
    "QMAX",
    "INV_QMAX",
]

_VALID_BITS = (1, 4, 8)
QMAX = {8: 127, 4: 7}
"""The largest code per bit width of the absmax codes: codes lie in ``[-qmax, qmax]``."""
INV_QMAX = {bits: np.float32(1.0 / qmax) for bits, qmax in QMAX.items()}
"""``float32(1 / qmax)`` per bit width: ``scale = max|x| * INV_QMAX[bits]``."""
_VALID_SCALE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_F32_INF_BITS = np.uint32(0x7F800000)  # float32 +inf's bits
_BF16_MAX_BITS = np.uint32(0x7F7F0000)  # bfloat16's largest finite value, as float32 bits


class Quantized(NamedTuple):
    """A block-quantized array ``(..., n)`` as it travels on the wire.

    Plain data (a pytree): ``values`` and ``scales`` can be sent as two
    collectives. Decode with :func:`dequantize` using the same ``bits`` and
    ``block``; the layouts are given in the module docstring.
    """

    values: jax.Array  # (..., n) int8 if bits=8; (..., n//2) uint8 if bits=4; (..., n//8) uint8 if bits=1
    scales: jax.Array  # (..., n//block), scale_dtype (float32 or bfloat16)


# --------------------------------------------------------------------------
# Argument checks (run at trace time; all raise ValueError with a hint).
# --------------------------------------------------------------------------


def check_bits(bits, allowed: tuple[int, ...] = _VALID_BITS) -> int:
    """``bits`` as an int: one of ``allowed`` (1, 4 or 8; a kernel takes fewer), else ValueError."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or bits not in allowed:
        raise ValueError(f"bits must be one of {tuple(allowed)}, got {bits!r}.")
    return int(bits)


def check_block(block) -> int:
    """``block`` as an int: a positive multiple of 8, else ValueError."""
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise ValueError(
            f"block must be a Python int that is a positive multiple of 8 (e.g. 64, 256, 2048), "
            f"got {block!r}."
        )
    if block < 8 or block % 8 != 0:
        lower = max(8, (block // 8) * 8)
        raise ValueError(
            f"block must be a positive multiple of 8 (so packed bytes never straddle blocks), "
            f"got {block}; try {lower} or {lower + 8}."
        )
    return int(block)


def check_scale_dtype(scale_dtype) -> jnp.dtype:
    """The scale dtype as a ``jnp.dtype``: float32 or bfloat16, else ValueError."""
    try:
        dt = jnp.dtype(scale_dtype)
    except TypeError as e:
        raise ValueError(f"scale_dtype must be float32 or bfloat16, got {scale_dtype!r}.") from e
    if dt not in _VALID_SCALE_DTYPES:
        raise ValueError(
            f"scale_dtype must be float32 or bfloat16 (float32's exponent range), got {dt}; "
            "float16 scales overflow for large blocks and other types lose the error bound."
        )
    return dt


def check_n(n: int, block: int, what: str = "x") -> None:
    """ValueError unless the last-axis length ``n`` is a multiple of ``block``."""
    if n % block != 0:
        padded = -(-n // block) * block
        raise ValueError(
            f"the last axis of {what} has length n={n}, which is not a multiple of block={block}; "
            f"pad it to {padded} or choose a block that divides n."
        )


def check_float_input(x: jax.typing.ArrayLike, what: str = "x") -> jax.Array:
    """``x`` as an array: floating ``(..., n)`` (at least one axis), else a
    ValueError naming ``what``. Shared by the references and the kernels."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"{what} must be a floating array (float32, bfloat16 or float16), got dtype "
            f"{x.dtype}; cast it first."
        )
    if x.ndim < 1:
        raise ValueError(f"{what} must have at least one axis (..., n), got a scalar.")
    return x


def finite_blocks(xb: jax.Array, block_axes: int = 1) -> jax.Array:
    """bool ``(..., 1)``: whether each block of ``xb`` ``(..., block)`` holds no inf or NaN.

    ``block_axes``: how many trailing axes make one block (a kernel's split
    tiles ``(tb, bytes, per_byte)`` have 2), reduced one at a time, innermost
    first, with ``keepdims``. Plain ``jnp`` that the Pallas kernels call too:
    it counts non-finite elements with ``isfinite`` instead of relying on a
    max that propagates NaN (Triton's max ignores NaN).
    """
    bad = jnp.where(jnp.isfinite(xb), 0, 1)
    for axis in range(-1, -1 - block_axes, -1):
        bad = jnp.max(bad, axis=axis, keepdims=True)
    return bad == 0


def stored_scale(scale: jax.Array, scale_dtype) -> jax.Array:
    """float32 ``scale`` rounded to nearest-even on ``scale_dtype``'s grid, kept float32.

    For bfloat16 the rounding is integer arithmetic on the float32 bits
    (add ``0x7FFF`` plus the lowest kept bit, clear the low 16 bits), which no
    compiler can elide or reassociate, unlike a ``float32 -> bfloat16 ->
    float32`` round trip; the result converts to ``scale_dtype`` exactly.
    A finite value that would round past bfloat16's largest finite value
    (3.39e38; only a 1-bit block's ``mean|x|`` gets there) saturates to it,
    so a finite block keeps a finite scale (the conversion would give inf,
    and the block would decode to inf). Meant for ``scale >= 0``: callers
    replace non-finite blocks' scales afterwards (plain ``jnp``, also used
    inside the Pallas kernels).
    """
    if jnp.dtype(scale_dtype) != jnp.dtype(jnp.bfloat16):
        return scale
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    lsb = (bits >> 16) & jnp.uint32(1)
    rounded = (bits + jnp.uint32(0x7FFF) + lsb) & jnp.uint32(0xFFFF0000)
    overflowed = (bits < _F32_INF_BITS) & (rounded == _F32_INF_BITS)
    rounded = jnp.where(overflowed, _BF16_MAX_BITS, rounded)
    return jax.lax.bitcast_convert_type(rounded, jnp.float32)


# --------------------------------------------------------------------------
# Quantize / dequantize.
# --------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("bits", "block", "scale_dtype"))
def quantize(
    x: jax.typing.ArrayLike,
    *,
    bits: int,
    block: int,
    scale_dtype=jnp.float32,
) -> Quantized:
    """Quantizes ``x`` block-wise along its last axis.

    See the module docstring for the exact scheme, the nibble/bit layouts and
    the handling of zero and non-finite blocks.

    Args:
      x: floating array ``(..., n)`` (float32, bfloat16, float16, ...; the
        computation is done in float32). ``n % block == 0``.
      bits: 8 (int8 codes), 4 (packed int4 codes) or 1 (packed signs).
      block: elements per scale; a multiple of 8, at least 8.
      scale_dtype: float32 (default) or bfloat16.

    Returns:
      ``Quantized(values, scales)``: ``values`` is int8 ``(..., n)`` for
      bits=8, uint8 ``(..., n // 2)`` for bits=4, uint8 ``(..., n // 8)`` for
      bits=1; ``scales`` is ``scale_dtype`` ``(..., n // block)``.

    Example:
      >>> x = jnp.linspace(-1.0, 1.0, 256).reshape(2, 128)
      >>> q = quantize(x, bits=8, block=64)
      >>> q.values.shape, q.scales.shape
      ((2, 128), (2, 2))
      >>> x_hat = dequantize(q, bits=8, block=64, dtype=jnp.float32)
    """
    bits = check_bits(bits)
    block = check_block(block)
    scale_dtype = check_scale_dtype(scale_dtype)
    x = check_float_input(x)
    n = x.shape[-1]
    check_n(n, block)
    lead = x.shape[:-1]

    # Exact up-cast: bfloat16 and float16 are both subsets of float32.
    xb = x.astype(jnp.float32).reshape(*lead, n // block, block)
    absmax = jnp.max(jnp.abs(xb), axis=-1)  # (..., nb); NaN if the block has a NaN, inf if inf
    # XLA's max propagates NaN, so this is finite_blocks(xb) without a second
    # reduction (the kernels, on Triton, whose max drops NaN, call finite_blocks)
    finite = jnp.isfinite(absmax)

    if bits == 1:
        # Divide before summing so a block of large finite values cannot overflow.
        scale = stored_scale(jnp.sum(jnp.abs(xb) / block, axis=-1), scale_dtype)
        scale = jnp.where(finite, scale, jnp.nan).astype(scale_dtype)
        values = pack_bits(xb >= 0).reshape(*lead, n // 8)
        return Quantized(values=values, scales=scale)

    qmax = QMAX[bits]
    scale = jnp.where(finite, stored_scale(absmax * INV_QMAX[bits], scale_dtype), jnp.nan)
    # Codes come from the scale as stored (rounded to scale_dtype), so the
    # error bound holds against what the receiver sees.
    s = scale[..., None]
    scale = scale.astype(scale_dtype)
    usable = finite[..., None] & (s > 0)
    # One IEEE division per block, then a multiply per element: XLA rewrites
    # x / broadcast(s) into x * broadcast(1 / s) on its own, so the multiply
    # is what a compiled reference computes on every backend; written out,
    # the kernels can do the same.
    inv_s = 1.0 / jnp.where(usable, s, 1.0)  # zero blocks: avoid 1/0
    # A scale below 1 / float32 max (a block with max|x| under ~1e-38) has no
    # finite reciprocal: such a block is sent as zeros, like a zero scale.
    usable = usable & jnp.isfinite(inv_s)
    codes = jnp.clip(jnp.round(xb * inv_s), -qmax, qmax)
    # Non-finite blocks: codes 0 (NaN scale makes the block NaN on dequant);
    # underflowed scales: codes 0 (the block dequantizes to zeros).
    codes = jnp.where(usable, codes, 0.0).astype(jnp.int8).reshape(*lead, n)
    values = codes if bits == 8 else pack_int4(codes)
    return Quantized(values=values, scales=scale)


def check_quantized(q: Quantized, *, bits: int, block: int, dtype: Any,
                    chunk_axis: bool = False):
    """Validates a payload for dequantization (shared with the Pallas kernels).

    Args:
      q: the payload: values ``(..., bytes)``, scales ``(..., n // block)``.
      bits: 1, 4 or 8 (checked by the caller).
      block: elements per scale (checked by the caller).
      dtype: the floating output dtype.
      chunk_axis: ``q`` holds ``k`` chunks, values ``(..., k, bytes)`` and
        scales ``(..., k, m // block)``, summed over ``k`` by the qgZ
        receivers (:func:`ordered_chunk_sum`): the chunk axis is required.

    Returns:
      ``(values, scales, dtype)`` as arrays and a ``jnp.dtype``.

    Raises:
      ValueError: naming what does not match ``bits``, ``block`` or ``dtype``.
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dequantize needs a floating output dtype, got {dtype}.")
    values, scales = jnp.asarray(q.values), jnp.asarray(q.scales)
    want = jnp.int8 if bits == 8 else jnp.uint8
    if values.dtype != want:
        raise ValueError(
            f"for bits={bits}, q.values must be {jnp.dtype(want)}, got {values.dtype}; "
            "were bits passed the same as to quantize?"
        )
    if chunk_axis and values.ndim < 2:
        raise ValueError(
            f"q.values must be (..., k, bytes) with a chunk axis, got shape {values.shape}; "
            "add one with values[None] for a single chunk."
        )
    if values.ndim < 1:
        raise ValueError("q.values must have at least one axis, got a scalar.")
    if not jnp.issubdtype(scales.dtype, jnp.floating):
        raise ValueError(f"q.scales must be floating, got {scales.dtype}.")
    n = values.shape[-1] * (8 // bits)
    check_n(n, block, what="each dequantized chunk" if chunk_axis else "the dequantized array")
    lead = values.shape[:-1]
    if scales.shape != (*lead, n // block):
        raise ValueError(
            f"q.scales has shape {scales.shape} but values {values.shape} with bits={bits}, "
            f"block={block} need {(*lead, n // block)}; were bits and block the same as in quantize?"
        )
    return values, scales, dtype


@functools.partial(jax.jit, static_argnames=("bits", "block", "dtype"))
def dequantize(q: Quantized, *, bits: int, block: int, dtype) -> jax.Array:
    """Inverse of :func:`quantize`.

    Args:
      q: ``Quantized`` from :func:`quantize` with the same ``bits`` and
        ``block``.
      bits: 8, 4 or 1.
      block: elements per scale.
      dtype: floating output dtype (e.g. ``jnp.bfloat16``); the product is
        computed in float32 and cast once.

    Returns:
      ``dtype`` array ``(..., n)``. Blocks with a NaN scale are all NaN;
      blocks with a zero scale are all zeros.

    Example:
      >>> q = quantize(jnp.ones((4, 64)), bits=4, block=32)
      >>> dequantize(q, bits=4, block=32, dtype=jnp.bfloat16).shape
      (4, 64)
    """
    bits = check_bits(bits)
    block = check_block(block)
    values, scales, dtype = check_quantized(q, bits=bits, block=block, dtype=dtype)
    n = values.shape[-1] * (8 // bits)
    lead = values.shape[:-1]

    s = scales.astype(jnp.float32)[..., None]  # (..., nb, 1)
    if bits == 1:
        signs = unpack_bits(values).reshape(*lead, n // block, block)
        out = jnp.where(signs, s, -s)
    else:
        codes = values if bits == 8 else unpack_int4(values)
        out = codes.astype(jnp.float32).reshape(*lead, n // block, block) * s
    return out.reshape(*lead, n).astype(dtype)


def ordered_chunk_sum(d: jax.Array) -> jax.Array:
    """``sum(d, axis=-2)`` as the chain ``((0 + d_0) + d_1) + ...`` in chunk order.

    The summation order of every qgZ receiver (the references and the Pallas
    dequantize-and-sum kernel): ``jnp.sum`` leaves the order to XLA, a chain
    of adds fixes it on every backend. ``d``: decoded chunks ``(..., k, m)``
    -> ``(..., m)``, same dtype.
    """
    acc = jnp.zeros(d.shape[:-2] + d.shape[-1:], d.dtype)
    for c in range(d.shape[-2]):
        acc = acc + d[..., c, :]
    return acc
