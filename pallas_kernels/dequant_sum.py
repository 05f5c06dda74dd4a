"""Dequantize ``k`` received chunks and sum them in one pass (qgZ reduce).

After the all-to-all of qgZ each device holds ``k`` quantized chunks of the
same slice of the gradient, one from each sender: ``q.values`` is
``(..., k, bytes)`` and ``q.scales`` is ``(..., k, m // block)``. The reduced
slice is ``sum_c dequantize(chunk_c)`` in float32. The jnp version
(:func:`dequantize_sum_reference`) leaves XLA to fuse the decoding into the
sum; the kernel reads each chunk's packed bytes and scales once and writes
only the float32 sum.

Summation order (the float32 result depends on it): for every element, both
the kernel and the reference compute

    ((0 + d_0) + d_1) + ... + d_{k-1},   d_c = chunk c dequantized

sequentially in chunk (sender) order, starting from +0.0. The reference is
``jnp.sum(dequantize(q, dtype=float32), axis=-2)`` with that order written
out as a chain of adds: ``jnp.sum`` leaves the order to XLA, which picks it
per shape (on CPU, jax 0.10.2 reduces the chunk axis sequentially for some
shapes and hands others to a YNNPACK fusion with another order), so with
``jnp.sum`` no kernel could match it to the last ulp; XLA never reorders an
explicit chain of float adds. What the compilers may still do is contract
``acc + code * scale`` into one fused multiply-add (XLA on CPU does, in some
fusions and not others; Triton does by default): for bits 4 and 8 kernel
and reference can therefore differ by the rounding of those products, at
most ``k * eps * sum_c |d_c|`` per element. For bits 1 (``d_c = +-scale``,
no product) the results are bit-identical everywhere, and so they are for
bits 4 and 8 whenever the products and partial sums are exact.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _common
from pallas_kernels.config import KernelConfig
from pallas_kernels.references.quantization import Quantized, check_bits, check_block
from pallas_kernels.references.quantization import check_quantized, ordered_chunk_sum
from pallas_kernels.references.quantization import dequantize as _dequantize

__all__ = ["dequantize_sum", "dequantize_sum_kernel", "dequantize_sum_reference"]

_BITS = (1, 4, 8)


@functools.partial(jax.jit, static_argnames=("bits", "block"))
def dequantize_sum_reference(q: Quantized, *, bits: int, block: int) -> jax.Array:
    """Pure-jnp spec: ``jnp.sum(dequantize(q, dtype=float32), axis=-2)`` in chunk order.

    The sum over the chunk axis is written as ``((0 + d_0) + d_1) + ...``
    so that its order is defined on every backend (see the module docstring).

    Args:
      q: ``Quantized`` with values ``(..., k, m * bits // 8)`` and scales
        ``(..., k, m // block)``: ``k`` chunks of ``m`` elements.
      bits: 1, 4 or 8.
      block: elements per scale (a multiple of 8).

    Returns:
      float32 ``(..., m)``.
    """
    check_quantized(q, bits=check_bits(bits), block=check_block(block), dtype=jnp.float32,
                    chunk_axis=True)
    return ordered_chunk_sum(_dequantize(q, bits=bits, block=block, dtype=jnp.float32))


def dequantize_sum_kernel(values_ref, scales_ref, out_ref, *, bits, k, decode="convert"):
    """One tile: ``k`` chunks of codes and scales (``decode_tile``'s, per chunk) -> their sum."""

    # Sequential in chunk order from +0.0, as the reference. Unrolled (k is
    # static, the number of senders): the k loads are independent, so the GPU
    # can have them all in flight at once, where a loop would wait for each.
    acc = jnp.zeros(out_ref.shape, jnp.float32)
    for c in range(k):
        scales = scales_ref[c].astype(jnp.float32)
        acc = acc + _common.decode_tile(values_ref[c], scales, bits, out_ref.shape, decode)
    out_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("bits", "block", "config", "interpret"))
def dequantize_sum(
    q: Quantized,
    *,
    bits: int,
    block: int,
    config: KernelConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Dequantizes ``k`` chunks and sums them over the chunk axis (Pallas kernel).

    Same result as :func:`dequantize_sum_reference` (see the module docstring
    for the summation order).

    Args:
      q: ``Quantized`` with values ``(..., k, m * bits // 8)`` (int8 for
        bits=8, uint8 otherwise) and scales ``(..., k, m // block)`` (float32
        or bfloat16): ``k`` chunks of ``m`` elements, e.g. one per sender.
      bits: 1, 4 or 8.
      block: elements per scale; a power of two >= 8.
      config: tile sizes and launch parameters; ``None`` for the default.
        ``tile_elems`` counts output elements per program.
      interpret: run in Pallas interpret mode instead of compiling for GPU.

    Returns:
      float32 ``(..., m)``.

    Example:
      >>> # recv_values (k, m // 8) uint8, recv_scales (k, m // 256) float32
      >>> q = Quantized(values=recv_values, scales=recv_scales)  # doctest: +SKIP
      >>> g_slice = dequantize_sum(q, bits=1, block=256)  # (m,) float32  # doctest: +SKIP
    """
    bits = check_bits(bits, _BITS)
    block = _common.check_block(block)
    config = _common.get_config(config, "dequantize_sum", bits)
    values, scales, _ = check_quantized(q, bits=bits, block=block, dtype=jnp.float32,
                                        chunk_axis=True)
    *lead, k, nbytes = values.shape
    lead = tuple(lead)
    m = nbytes * 8 // bits
    nb = m // block
    rows = math.prod(lead)
    if rows * k * nb == 0:
        return dequantize_sum_reference(q, bits=bits, block=block)

    tb = _common.tile_blocks(nb, block, config.tile_elems)
    bpb = _common.bytes_per_block(bits, block)
    units = _common.packed_units(values.reshape(rows, k, nb, bpb), bits)  # bytes or words
    out_tile = _common.element_tile(tb, block, bits, config, 8 * units.dtype.itemsize)
    units, unit_tile = _common.unit_view(units, out_tile)  # free reshape
    rank = len(out_tile)
    zeros = (0,) * (rank - 1)
    chunks = lambda r, j: (r, 0, j, *zeros)  # noqa: E731  all k chunks of tile j of row r
    out = pl.pallas_call(
        functools.partial(dequantize_sum_kernel, bits=bits, k=k, decode=config.decode),
        out_shape=_common.out_struct((rows, nb, *out_tile[1:]), jnp.float32, values),
        grid=(rows, nb // tb),
        in_specs=[
            pl.BlockSpec((pl.squeezed, k, *unit_tile), chunks),
            pl.BlockSpec((pl.squeezed, k, *_common.per_block(tb, rank)), chunks),
        ],
        out_specs=pl.BlockSpec((pl.squeezed, *out_tile), lambda r, j: (r, j, *zeros)),
        compiler_params=_backend.compiler_params(config),
        cost_estimate=pl.CostEstimate(
            flops=3 * rows * k * m,
            transcendentals=0,
            bytes_accessed=rows * (k * nb * (bpb + scales.dtype.itemsize) + 4 * m),
        ),
        interpret=interpret,
        name=f"dequantize_sum_{bits}bit",
    )(units, scales.reshape(rows, k, *_common.per_block(nb, rank)))
    return out.reshape(*lead, m)
