"""The pure-``jnp`` references of the kernels: the wire format and its numerics.

The source of truth for every kernel in :mod:`pallas_kernels` (the kernels
are tested against these, bit for bit where the module docstrings say so)
and the XLA fall-back where no GPU is present. ``zeropp_jax.wire`` re-exports
them; nothing here imports ``zeropp_jax``.

* :mod:`~pallas_kernels.references.quantization`: the ``Quantized`` payload,
  block-wise int8 / int4 / 1-bit ``quantize`` / ``dequantize``, the argument
  checks and the chunk-ordered sum of qgZ receivers.
* :mod:`~pallas_kernels.references.packing`: int4 nibbles and signs packed
  into bytes.
* :mod:`~pallas_kernels.references.dither`: the sender of the unbiased
  dithered 1-bit code.
"""
