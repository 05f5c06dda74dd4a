"""Unbiased 1-bit codes with subtractive dither, in one pass (qgZ ``dither``).

The code is :mod:`pallas_kernels.references.dither`'s: per block
``s = max|x|`` (rounded up to ``scale_dtype``), bit ``x + s * xi >= 0``,
packed eight per byte. The reference (:func:`quantize_dithered_reference`) is
that module's :func:`~pallas_kernels.references.dither.quantize_dithered`;
the kernel reads ``x`` and the dither ``xi`` once and writes the packed bits
and scales once. A block maximum is exact in any order, so scales are
bit-identical to the reference on every backend, and so are the bits unless
a compiler contracts ``x + s * xi`` into a fused multiply-add and the sum
lies within one rounding of zero (the bit is then either, and the receiver
decodes what was sent). The scale is computed by the reference's own
:func:`~pallas_kernels.references.dither.block_scales`: a block holding NaN
or inf gets scale NaN, found with ``isfinite``, not by relying on the max.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _common
from pallas_kernels.config import KernelConfig
from pallas_kernels.references.dither import block_scales, check_dither_input
from pallas_kernels.references.dither import quantize_dithered as quantize_dithered_reference
from pallas_kernels.references.quantization import Quantized, check_n, check_scale_dtype

__all__ = ["quantize_dithered", "quantize_dithered_kernel", "quantize_dithered_reference"]


def quantize_dithered_kernel(x_ref, xi_ref, values_ref, scales_ref, *, scale_dtype):
    """One tile: ``x``, ``xi`` ``(tb, block)`` -> packed bits, scales."""
    x = x_ref[...].astype(jnp.float32)  # (tb, block) or split (tb, bytes, 8)
    scale = block_scales(x, scale_dtype, block_axes=x.ndim - 1)  # the reference's own function
    s = scale.astype(jnp.float32)
    bits = x + s * xi_ref[...] >= 0
    values_ref[...] = _common.pack_codes(bits.astype(jnp.int32), 1)
    scales_ref[...] = scale  # (tb, 1[, 1]), per_block


@functools.partial(jax.jit, static_argnames=("block", "scale_dtype", "config", "interpret"))
def quantize_dithered(
    x: jax.typing.ArrayLike,
    xi: jax.typing.ArrayLike,
    *,
    block: int,
    scale_dtype=jnp.float32,
    config: KernelConfig | None = None,
    interpret: bool = False,
) -> Quantized:
    """Unbiased 1-bit codes of ``x`` (Pallas kernel; same results as the reference).

    Args:
      x: floating ``(..., n)`` (float32, bfloat16, float16); ``n % block == 0``.
      xi: float32 dither of ``x``'s shape (:func:`zeropp_jax.wire.dither.uniform_noise`).
      block: elements per scale; a power of two >= 8.
      scale_dtype: float32 (default) or bfloat16.
      config: tile sizes and launch parameters; ``None`` for the default.
      interpret: run in Pallas interpret mode instead of compiling for GPU.

    Returns:
      ``Quantized``: uint8 ``(..., n // 8)`` packed bits and ``scale_dtype``
      ``(..., n // block)`` block absmax.
    """
    block = _common.check_block(block)
    scale_dtype = check_scale_dtype(scale_dtype)
    config = _common.get_config(config, "quantize_dithered", 1)
    x, xi = check_dither_input(x, xi)
    check_n(x.shape[-1], block, "x")
    nb = _common.num_blocks(x.shape, block)
    if nb == 0:
        return quantize_dithered_reference(x, xi, block=block, scale_dtype=scale_dtype)

    tb = _common.tile_blocks(nb, block, config.tile_elems)
    x_view, spec = _common.element_view(x, nb, block, 1, config)  # free reshapes
    xi_view, _ = _common.element_view(xi, nb, block, 1, config)
    out_shape, out_specs = _common.quantized_outputs(nb, tb, 1, block, scale_dtype, x,
                                                     x_view.ndim)
    values, scales = pl.pallas_call(
        functools.partial(quantize_dithered_kernel, scale_dtype=scale_dtype),
        out_shape=out_shape,
        grid=(nb // tb,),
        in_specs=[spec, spec],
        out_specs=out_specs,
        compiler_params=_backend.compiler_params(config),
        cost_estimate=pl.CostEstimate(
            flops=4 * x.size,
            transcendentals=0,
            bytes_accessed=x.size * (x.dtype.itemsize + 4) + nb * (block // 8 + scale_dtype.itemsize),
        ),
        interpret=interpret,
        name="quantize_dithered",
    )(x_view, xi_view)
    return _common.as_quantized(values, scales, x.shape, 1, block)
