"""Block-wise int8 / int4 quantize and dequantize as Pallas kernels (qwZ).

Numerics are those of :func:`pallas_kernels.references.quantization.quantize` /
:func:`~pallas_kernels.references.quantization.dequantize` (the references, re-exported here
as ``quantize_reference`` / ``dequantize_reference``), bit for bit:

* per block: ``absmax = max|x|`` (float32), ``scale = absmax * INV_QMAX``
  (one multiply by ``float32(1 / qmax)``) rounded to ``scale_dtype`` by
  :func:`~pallas_kernels.references.quantization.stored_scale`; a block
  holding inf or NaN gets scale NaN and codes 0; a block whose stored scale
  is 0 gets codes 0;
* ``code = clip(round_half_even(x * (1 / scale_as_stored)), -qmax, qmax)``,
  one IEEE division per block and a multiply per element;
* bits=8: int8 codes; bits=4: two's-complement nibbles, element ``2i`` in the
  low nibble of byte ``i``;
* dequantize: ``code * scale`` in float32, cast once to ``dtype``.

One program handles ``tile_blocks`` whole blocks (see
:class:`~pallas_kernels.KernelConfig`): it reads the tile once, reduces each
block to its scale, and writes codes and scales - one pass over the data
(read ``x``, write values + scales), where the jnp reference is left to XLA's
fusion decisions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _common
from pallas_kernels.config import KernelConfig
from pallas_kernels.references import quantization
from pallas_kernels.references.quantization import (
    QMAX, Quantized, check_bits, check_float_input, check_n, check_scale_dtype, finite_blocks,
    stored_scale,
)
from pallas_kernels.references.quantization import dequantize as dequantize_reference
from pallas_kernels.references.quantization import quantize as quantize_reference

__all__ = [
    "quantize",
    "quantize_kernel",
    "quantize_reference",
    "dequantize",
    "dequantize_kernel",
    "dequantize_reference",
]

_BITS = (8, 4)


def quantize_kernel(x_ref, values_ref, scales_ref, *, bits, scale_dtype, interpret):
    """One tile: ``x`` ``(tb, block)`` (or split) -> codes, scales ``(tb, 1)`` (or split)."""
    qmax = QMAX[bits]  # the reference's, as is INV_QMAX below
    x = x_ref[...].astype(jnp.float32)  # exact up-cast, as the reference
    # Not by max propagating NaN (Triton's max ignores NaN): any inf/NaN marks the block.
    finite = finite_blocks(x, block_axes=x.ndim - 1)  # (tb, 1) or (tb, 1, 1)
    absmax = _common.row_reduce(jnp.max, jnp.abs(x))  # (tb, 1) or (tb, 1, 1)
    # The reference's scale: one multiply by float32(1 / qmax), rounded on
    # scale_dtype's grid by integer arithmetic (portable on every backend).
    s = stored_scale(absmax * quantization.INV_QMAX[bits], scale_dtype)
    s = jnp.where(finite, s, jnp.nan)  # codes come from the scale as stored
    usable = finite & (s > 0)
    safe_s = jnp.where(usable, s, 1.0)
    inv_s = _backend.div_rn(jnp.ones_like(safe_s), safe_s, interpret=interpret)  # per block
    usable = usable & jnp.isfinite(inv_s)  # as the reference: tiny scales send zeros
    codes = _backend.round_half_even(x * inv_s, interpret=interpret)
    codes = jnp.clip(codes, -qmax, qmax)
    codes = jnp.where(usable, codes, 0.0).astype(jnp.int32)
    if bits == 8:
        values_ref[...] = codes.astype(jnp.int8)
    else:
        values_ref[...] = _common.pack_codes(codes & 0xF, bits)
    scales_ref[...] = s.astype(scale_dtype)  # (tb, 1[, 1]), per_block


@functools.partial(
    jax.jit, static_argnames=("bits", "block", "scale_dtype", "config", "interpret")
)
def quantize(
    x: jax.typing.ArrayLike,
    *,
    bits: int,
    block: int,
    scale_dtype=jnp.float32,
    config: KernelConfig | None = None,
    interpret: bool = False,
) -> Quantized:
    """Quantizes ``x`` block-wise along its last axis (Pallas kernel).

    Same contract and bit-identical results as
    :func:`pallas_kernels.references.quantization.quantize` for ``bits`` 8 and 4.

    Args:
      x: floating array ``(..., n)`` (float32, bfloat16, float16);
        ``n % block == 0``.
      bits: 8 (int8 codes) or 4 (packed int4 codes).
      block: elements per scale; a power of two >= 8.
      scale_dtype: float32 (default) or bfloat16.
      config: tile sizes and launch parameters; ``None`` for the default.
      interpret: run the kernel in Pallas interpret mode (any backend, slow);
        False compiles it for the GPU.

    Returns:
      ``Quantized(values, scales)``: values int8 ``(..., n)`` (bits=8) or
      uint8 ``(..., n // 2)`` (bits=4); scales ``scale_dtype`` ``(..., n // block)``.

    Example:
      >>> q = quantize(x, bits=8, block=256)  # doctest: +SKIP
      >>> x_hat = dequantize(q, bits=8, block=256, dtype=jnp.bfloat16)  # doctest: +SKIP
    """
    bits = check_bits(bits, _BITS)
    block = _common.check_block(block)
    scale_dtype = check_scale_dtype(scale_dtype)
    config = _common.get_config(config, "quantize", bits)
    x = check_float_input(x, "x")
    check_n(x.shape[-1], block, "x")
    nb = _common.num_blocks(x.shape, block)
    if nb == 0:
        return quantize_reference(x, bits=bits, block=block, scale_dtype=scale_dtype)

    tb = _common.tile_blocks(nb, block, config.tile_elems)
    bpb = _common.bytes_per_block(bits, block)
    kernel = functools.partial(
        quantize_kernel, bits=bits, scale_dtype=scale_dtype, interpret=interpret
    )
    x_view, x_spec = _common.element_view(x, nb, block, bits, config)  # free reshape
    out_shape, out_specs = _common.quantized_outputs(nb, tb, bits, block, scale_dtype, x,
                                                     x_view.ndim)
    values, scales = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(nb // tb,),
        in_specs=[x_spec],
        out_specs=out_specs,
        compiler_params=_backend.compiler_params(config),
        cost_estimate=pl.CostEstimate(
            flops=8 * x.size,
            transcendentals=0,
            bytes_accessed=x.size * x.dtype.itemsize + nb * (bpb + scale_dtype.itemsize),
        ),
        interpret=interpret,
        name=f"quantize_int{bits}",
    )(x_view)
    return _common.as_quantized(values, scales, x.shape, bits, block)


def dequantize_kernel(values_ref, scales_ref, out_ref, *, bits, decode="convert"):
    """One tile: codes ``(tb, bytes)``, scales ``(tb, 1)`` -> ``(tb, block)`` (or all split)."""
    x = _common.decode_tile(values_ref[...], scales_ref[...].astype(jnp.float32), bits,
                            out_ref.shape, decode)
    out_ref[...] = x.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bits", "block", "dtype", "config", "interpret"))
def dequantize(
    q: Quantized,
    *,
    bits: int,
    block: int,
    dtype=jnp.float32,
    config: KernelConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Inverse of :func:`quantize` (Pallas kernel).

    Bit-identical to :func:`pallas_kernels.references.quantization.dequantize` for ``bits``
    8 and 4.

    Args:
      q: ``Quantized`` from :func:`quantize` (or the reference) with the same
        ``bits`` and ``block``.
      bits: 8 or 4.
      block: elements per scale; a power of two >= 8.
      dtype: floating output dtype; the product is float32, cast once.
      config: tile sizes and launch parameters; ``None`` for the default.
      interpret: run in Pallas interpret mode instead of compiling for GPU.

    Returns:
      ``dtype`` array ``(..., n)``.
    """
    bits = check_bits(bits, _BITS)
    block = _common.check_block(block)
    config = _common.get_config(config, "dequantize", bits)
    values, scales, dtype = quantization.check_quantized(q, bits=bits, block=block, dtype=dtype)
    n = values.shape[-1] * 8 // bits
    lead = values.shape[:-1]
    nb = _common.num_blocks((*lead, n), block)
    if nb == 0:
        return dequantize_reference(q, bits=bits, block=block, dtype=dtype)

    tb = _common.tile_blocks(nb, block, config.tile_elems)
    bpb = _common.bytes_per_block(bits, block)
    units = _common.packed_units(values.reshape(nb, bpb), bits)  # bytes or uint32 words
    out_tile = _common.element_tile(tb, block, bits, config, 8 * units.dtype.itemsize)
    units, unit_tile = _common.unit_view(units, out_tile)  # free reshape
    rank = len(out_tile)
    out = pl.pallas_call(
        functools.partial(dequantize_kernel, bits=bits, decode=config.decode),
        out_shape=_common.out_struct((nb, *out_tile[1:]), dtype, values),
        grid=(nb // tb,),
        in_specs=[
            pl.BlockSpec(unit_tile, _common.index_map(units.ndim)),
            pl.BlockSpec(_common.per_block(tb, rank), _common.index_map(rank)),
        ],
        out_specs=pl.BlockSpec(out_tile, _common.index_map(len(out_tile))),
        compiler_params=_backend.compiler_params(config),
        cost_estimate=pl.CostEstimate(
            flops=2 * nb * block,
            transcendentals=0,
            bytes_accessed=nb * (bpb + scales.dtype.itemsize + block * dtype.itemsize),
        ),
        interpret=interpret,
        name=f"dequantize_int{bits}",
    )(units, scales.reshape(_common.per_block(nb, rank)))
    return out.reshape(*lead, n)
