"""Block-wise quantization of parameters (qwZ) and gradients (qgZ): the wire format.

The format and its exact numerics (int8 / int4 absmax, 1-bit scaled sign, one
float32 or bfloat16 scale per block of ``block`` elements on the last axis)
are defined in pure ``jnp`` by :mod:`pallas_kernels.references.quantization`
and :mod:`pallas_kernels.references.packing`, beside the Pallas kernels that
are checked against them; read that module's docstring for the layouts, the
rounding and the handling of zero and non-finite blocks. This module
re-exports them under the names the library uses and adds the reporting
helpers :func:`wire_bytes` and :func:`quantization_error`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.references.packing import pack_bits as pack_bits
from pallas_kernels.references.packing import pack_int4 as pack_int4
from pallas_kernels.references.packing import unpack_bits as unpack_bits
from pallas_kernels.references.packing import unpack_int4 as unpack_int4
from pallas_kernels.references.quantization import Quantized as Quantized
from pallas_kernels.references.quantization import check_bits as check_bits
from pallas_kernels.references.quantization import check_block as check_block
from pallas_kernels.references.quantization import check_n as check_n
from pallas_kernels.references.quantization import check_quantized as check_quantized
from pallas_kernels.references.quantization import check_scale_dtype as check_scale_dtype
from pallas_kernels.references.quantization import dequantize as dequantize
from pallas_kernels.references.quantization import ordered_chunk_sum as ordered_chunk_sum
from pallas_kernels.references.quantization import quantize as quantize

__all__ = [
    "Quantized",
    "quantize",
    "dequantize",
    "pack_int4",
    "unpack_int4",
    "pack_bits",
    "unpack_bits",
    "wire_bytes",
    "ordered_chunk_sum",
    "quantization_error",
    "check_scale_dtype",
    "check_quantized",
]


def wire_bytes(n: int, *, bits: int, block: int, scale_dtype=jnp.float32) -> int:
    """Bytes on the wire (values + scales) for ``n`` quantized elements.

    Args:
      n: number of elements, a multiple of ``block``.
      bits: 8, 4 or 1.
      block: elements per scale.
      scale_dtype: float32 or bfloat16.

    Returns:
      ``n * bits / 8 + (n / block) * itemsize(scale_dtype)``.

    Example:
      >>> wire_bytes(4096, bits=8, block=256)  # 4096 + 16 * 4
      4160
    """
    bits = check_bits(bits)
    block = check_block(block)
    scale_dtype = check_scale_dtype(scale_dtype)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}.")
    check_n(int(n), block, what="the array")
    return int(n) * bits // 8 + (int(n) // block) * scale_dtype.itemsize


@functools.partial(jax.jit, static_argnames=("bits", "block", "scale_dtype"))
def quantization_error(
    x: jax.typing.ArrayLike, *, bits: int, block: int, scale_dtype=jnp.float32
) -> dict[str, jax.Array]:
    """Round-trip error of :func:`quantize` / :func:`dequantize` on ``x``.

    Args:
      x: floating array ``(..., n)``.
      bits, block, scale_dtype: as in :func:`quantize`.

    Returns:
      ``{"relative_l2_error": ||x - x_hat|| / ||x||, "max_abs_error":
      max|x - x_hat|}``, float32 scalars computed against ``x`` in float32
      (the relative error is 0 when ``x`` is all zeros). Use ``float(...)``
      for reports.
    """
    x = jnp.asarray(x)
    q = quantize(x, bits=bits, block=block, scale_dtype=scale_dtype)
    x32 = x.astype(jnp.float32)
    err = dequantize(q, bits=bits, block=block, dtype=jnp.float32) - x32
    # Norms of x and err divided by x's largest magnitude first, so that
    # squares of values near float32's ends neither overflow nor flush to 0.
    unit = jnp.max(jnp.abs(x32), initial=0.0)
    unit = jnp.where(unit > 0, unit, 1.0)
    err_norm = jnp.sqrt(jnp.sum(jnp.square(err / unit)))
    x_norm = jnp.sqrt(jnp.sum(jnp.square(x32 / unit)))
    rel = jnp.where(x_norm > 0, err_norm / jnp.where(x_norm > 0, x_norm, 1.0), err_norm * unit)
    max_abs = jnp.max(jnp.abs(err), initial=0.0)
    return {"relative_l2_error": rel, "max_abs_error": max_abs}

