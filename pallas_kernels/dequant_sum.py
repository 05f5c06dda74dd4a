"""Dequantize ``k`` received chunks and sum them in one pass (qgZ reduce).

After the all-to-all of qgZ each device holds ``k`` quantized chunks of the
same slice of the gradient, one from each sender: ``q.values`` is
``(..., k, bytes)`` and ``q.scales`` is ``(..., k, m // block)``. The reduced
slice is ``sum_c dequantize(chunk_c)`` in float32. The jnp version
(:func:`dequantize_sum_reference`) may materialise the ``k`` dequantized
float32 chunks; the kernel reads each chunk's packed bytes and scales once
and writes only the float32 sum.

Summation order (the float32 result depends on it): for every element the
kernel computes ``((0 + d_0) + d_1) + ... + d_{k-1}`` where ``d_c`` is chunk
``c`` dequantized (``code * scale`` or ``+-scale``), i.e. sequentially in
chunk order starting from +0.0. XLA on CPU reduces the reference's ``k``
axis in that same order (checked by the tests, which compare bit for bit on
CPU). On GPU XLA may reduce the ``k`` axis in a tree and may fuse the
multiply into an FMA, so there kernel and reference agree to within the
rounding of a ``k``-term sum, not bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _common
from pallas_kernels.config import KernelConfig
from zeropp_jax.quantization import Quantized
from zeropp_jax.quantization import dequantize as _dequantize

__all__ = ["dequantize_sum", "dequantize_sum_kernel", "dequantize_sum_reference"]

_BITS = (1, 4, 8)


@functools.partial(jax.jit, static_argnames=("bits", "block"))
def dequantize_sum_reference(q: Quantized, *, bits: int, block: int) -> jax.Array:
    """Pure-jnp spec: ``jnp.sum(dequantize(q, dtype=float32), axis=-2)``.

    Args:
      q: ``Quantized`` with values ``(..., k, m * bits // 8)`` and scales
        ``(..., k, m // block)``: ``k`` chunks of ``m`` elements.
      bits: 1, 4 or 8.
      block: elements per scale.

    Returns:
      float32 ``(..., m)``.
    """
    return jnp.sum(_dequantize(q, bits=bits, block=block, dtype=jnp.float32), axis=-2)


def dequantize_sum_kernel(values_ref, scales_ref, out_ref, *, bits, k):
    """One tile: ``k`` chunks ``(k, tb, bytes)``, scales ``(k, tb)`` -> sum ``(tb, block)``."""

    def add_chunk(c, acc):
        return acc + _common.decode_tile(values_ref[c], scales_ref[c].astype(jnp.float32), bits)

    # Sequential in chunk order from +0.0, as XLA reduces the reference on CPU.
    out_ref[...] = lax.fori_loop(0, k, add_chunk, jnp.zeros(out_ref.shape, jnp.float32))


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
      >>> q = Quantized(values=recv_values, scales=recv_scales)  # (k, m // 8), (k, m // 256)  # doctest: +SKIP
      >>> g_slice = dequantize_sum(q, bits=1, block=256)  # (m,) float32  # doctest: +SKIP
    """
    bits = _common.check_bits(bits, _BITS)
    block = _common.check_block(block)
    config = _common.get_config(config)
    values, scales = jnp.asarray(q.values), jnp.asarray(q.scales)
    want = jnp.int8 if bits == 8 else jnp.uint8
    if values.dtype != want:
        raise ValueError(f"for bits={bits}, q.values must be {jnp.dtype(want)}, got {values.dtype}.")
    if values.ndim < 2:
        raise ValueError(
            f"q.values must be (..., k, bytes) with a chunk axis, got shape {values.shape}; "
            "add one with values[None] for a single chunk."
        )
    *lead, k, nbytes = values.shape
    lead = tuple(lead)
    m = nbytes * 8 // bits
    _common.check_n(m, block, "each dequantized chunk")
    nb = m // block
    if scales.shape != (*lead, k, nb) or not jnp.issubdtype(scales.dtype, jnp.floating):
        raise ValueError(
            f"q.scales must be floating {(*lead, k, nb)} for values {values.shape}, bits={bits}, "
            f"block={block}; got {scales.dtype} {scales.shape}."
        )
    rows = 1
    for d in lead:
        rows *= d
    if rows * k * nb == 0:
        return dequantize_sum_reference(q, bits=bits, block=block)

    tb = _common.tile_blocks(nb, block, config.tile_elems)
    bpb = _common.bytes_per_block(bits, block)
    out = pl.pallas_call(
        functools.partial(dequantize_sum_kernel, bits=bits, k=k),
        out_shape=jax.ShapeDtypeStruct((rows, nb, block), jnp.float32),
        grid=(rows, nb // tb),
        in_specs=[
            pl.BlockSpec((None, k, tb, bpb), lambda r, j: (r, 0, j, 0)),
            pl.BlockSpec((None, k, tb), lambda r, j: (r, 0, j)),
        ],
        out_specs=pl.BlockSpec((None, tb, block), lambda r, j: (r, j, 0)),
        compiler_params=_backend.compiler_params(config),
        cost_estimate=pl.CostEstimate(
            flops=3 * rows * k * m,
            transcendentals=0,
            bytes_accessed=rows * (k * nb * (bpb + scales.dtype.itemsize) + 4 * m),
        ),
        interpret=interpret,
        name=f"dequantize_sum_{bits}bit",
    )(values.reshape(rows, k, nb, bpb), scales.reshape(rows, k, nb))
    return out.reshape(*lead, m)
