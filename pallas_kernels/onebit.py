"""1-bit gradient compression with error feedback in one pass (qgZ 1-bit).

Error feedback keeps what 1-bit quantization loses and adds it to the next
step's gradient::

    x         = g + carry                       # float32
    q         = quantize(x, bits=1, block)      # signs + mean|x| per block
    new_carry = x - dequantize(q)               # float32

The jnp version (:func:`compress_1bit_ef_reference`, written with
:mod:`pallas_kernels.references.quantization`) leaves XLA to decide how many passes this
takes; the kernel reads ``g`` and ``carry`` once and writes the packed signs,
the scales and the new carry once.

Numerics, as the reference: ``scale = sum(|x| / block)`` per block in
float32 (the division first, so a block of large finite values cannot
overflow), rounded to ``scale_dtype`` by
:func:`~pallas_kernels.references.quantization.stored_scale` (integer
arithmetic that no compiler elides: the carry uses the scale as stored); bit ``j`` of byte ``i`` is
``x[8i + j] >= 0`` (so ``-0.0`` counts as positive); a block holding inf or
NaN gets scale NaN, so its new carry is NaN too (the reference's behaviour:
a non-finite gradient poisons its block until the caller resets the carry;
so does a finite one whose ``x + carry`` passes float32's largest value,
about 3.4e38: the carry stays finite only while that sum does).

Summation order of the scale: ``block`` is a power of two, so ``|x| /
block`` is the exactly rounded ``|x| * 2**-k`` on every backend, but the
order in which the ``block`` terms are added is the compiler's: the
reference's ``jnp.sum`` over the block axis is reduced however XLA chooses
for the whole array (on CPU, jax 0.10.2 uses different orders for different
shapes, e.g. a YNNPACK fusion for large ones), the kernel's by XLA (interpret
mode) or Triton for one tile. The float32 scales can therefore differ in the
last bits - by at most ``2 * (block - 1)`` ulp-relative in theory, as all
terms are >= 0; a few ulp in practice - and are bit-identical whenever the
block sums are exact (e.g. small dyadic values). Signs never depend on the
order, and the new carry is always exactly ``x - (+-scale)`` with the
kernel's own scale.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _common
from pallas_kernels.config import KernelConfig
from pallas_kernels.references.quantization import (
    Quantized, check_float_input, check_n, check_scale_dtype, finite_blocks, stored_scale,
)
from pallas_kernels.references.quantization import dequantize as _dequantize
from pallas_kernels.references.quantization import quantize as _quantize

__all__ = ["compress_1bit_ef", "compress_1bit_ef_kernel", "compress_1bit_ef_reference"]


def check_carry(g: jax.Array, carry: jax.Array) -> None:
    """An error-feedback carry is float32 with the gradient's shape (no broadcasting)."""
    if carry.dtype != jnp.float32 or carry.shape != g.shape:
        raise ValueError(
            f"carry must be float32 with the gradient's shape {g.shape}, got {carry.dtype} "
            f"{carry.shape}; start from jnp.zeros(g.shape, jnp.float32)."
        )


@functools.partial(jax.jit, static_argnames=("block", "scale_dtype"))
def compress_1bit_ef_reference(
    g: jax.typing.ArrayLike,
    carry: jax.typing.ArrayLike,
    *,
    block: int,
    scale_dtype=jnp.float32,
) -> tuple[Quantized, jax.Array]:
    """Pure-jnp 1-bit compression with error feedback (the kernel's spec).

    Args:
      g: floating gradient ``(..., n)``; ``n % block == 0``.
      carry: float32 error-feedback carry, same shape as ``g``.
      block: elements per scale (a multiple of 8).
      scale_dtype: float32 or bfloat16.

    Returns:
      ``(q, new_carry)``: ``q = quantize(g + carry, bits=1, ...)`` and
      ``new_carry = (g + carry) - dequantize(q)``, float32 ``(..., n)``.
    """
    g, carry = jnp.asarray(g), jnp.asarray(carry)
    check_carry(g, carry)
    x = g.astype(jnp.float32) + carry.astype(jnp.float32)
    q = _quantize(x, bits=1, block=block, scale_dtype=scale_dtype)
    return q, x - _dequantize(q, bits=1, block=block, dtype=jnp.float32)


def compress_1bit_ef_kernel(
    g_ref, carry_ref, values_ref, scales_ref, new_carry_ref, *, block, scale_dtype
):
    """One tile: ``g``, ``carry`` ``(tb, block)`` -> signs, scales, new carry."""
    x = g_ref[...].astype(jnp.float32) + carry_ref[...]  # (tb, block) or split
    finite = finite_blocks(x, block_axes=x.ndim - 1)  # not by max: Triton's drops NaN
    # 1/block is a power of two: the product is the exactly rounded quotient,
    # like the reference's |x| / block, with no division instruction.
    scale = _common.row_reduce(jnp.sum, jnp.abs(x) * (1.0 / block))  # (tb, 1[, 1])
    s = jnp.where(finite, stored_scale(scale, scale_dtype), jnp.nan)  # as the reference
    positive = x >= 0
    values_ref[...] = _common.pack_codes(positive.astype(jnp.int32), 1)
    scales_ref[...] = s.astype(scale_dtype)  # (tb, 1[, 1]), per_block
    new_carry_ref[...] = x - jnp.where(positive, s, -s)


@functools.partial(jax.jit, static_argnames=("block", "scale_dtype", "config", "interpret"))
def compress_1bit_ef(
    g: jax.typing.ArrayLike,
    carry: jax.typing.ArrayLike,
    *,
    block: int,
    scale_dtype=jnp.float32,
    config: KernelConfig | None = None,
    interpret: bool = False,
) -> tuple[Quantized, jax.Array]:
    """1-bit quantization of ``g + carry`` with error feedback (Pallas kernel).

    Same results as :func:`compress_1bit_ef_reference` (bit-identical signs;
    scales and carry see the module docstring on summation order).

    Args:
      g: floating gradient ``(..., n)`` (float32, bfloat16, float16);
        ``n % block == 0``.
      carry: float32 carry of the same shape (zeros at the first step).
      block: elements per scale; a power of two >= 8.
      scale_dtype: float32 (default) or bfloat16.
      config: tile sizes and launch parameters; ``None`` for the default.
      interpret: run in Pallas interpret mode instead of compiling for GPU.

    Returns:
      ``(Quantized(values, scales), new_carry)``: values uint8
      ``(..., n // 8)``, scales ``scale_dtype`` ``(..., n // block)``,
      new_carry float32 ``(..., n)``.

    Example:
      >>> carry = jnp.zeros(g.shape, jnp.float32)  # doctest: +SKIP
      >>> q, carry = compress_1bit_ef(g, carry, block=256)  # doctest: +SKIP
    """
    block = _common.check_block(block)
    scale_dtype = check_scale_dtype(scale_dtype)
    config = _common.get_config(config, "compress_1bit_ef", 1)
    g, carry = check_float_input(g, "g"), jnp.asarray(carry)
    check_carry(g, carry)
    check_n(g.shape[-1], block, "g")
    nb = _common.num_blocks(g.shape, block)
    if nb == 0:
        return compress_1bit_ef_reference(g, carry, block=block, scale_dtype=scale_dtype)

    tb = _common.tile_blocks(nb, block, config.tile_elems)
    g_view, spec = _common.element_view(g, nb, block, 1, config)  # free reshapes
    carry_view, _ = _common.element_view(carry, nb, block, 1, config)
    out_shape, out_specs = _common.quantized_outputs(nb, tb, 1, block, scale_dtype, g,
                                                     g_view.ndim)
    values, scales, new_carry = pl.pallas_call(
        functools.partial(compress_1bit_ef_kernel, block=block, scale_dtype=scale_dtype),
        out_shape=(*out_shape, _common.out_struct(carry_view.shape, jnp.float32, g)),
        grid=(nb // tb,),
        in_specs=[spec, spec],
        out_specs=(*out_specs, spec),
        compiler_params=_backend.compiler_params(config),
        cost_estimate=pl.CostEstimate(
            flops=6 * g.size,
            transcendentals=0,
            bytes_accessed=g.size * (g.dtype.itemsize + 8) + nb * (block // 8 + scale_dtype.itemsize),
        ),
        interpret=interpret,
        name="compress_1bit_ef",
    )(g_view, carry_view)
    return _common.as_quantized(values, scales, g.shape, 1, block), new_carry.reshape(g.shape)
