"""What crosses the wire: collectives, quantization codes and their kernels.

* :mod:`~zeropp_jax.wire.collectives`: all-gather / reduce-scatter /
  all-to-all over mesh axes, carrying quantized payloads as codes + scales.
* :mod:`~zeropp_jax.wire.quantization`: block-wise int8 / int4 / 1-bit codes
  (the ``jnp`` references).
* :mod:`~zeropp_jax.wire.dither`: the unbiased dithered 1-bit code.
* :mod:`~zeropp_jax.wire.qgz`: the once-per-step cross-node reduction with
  error feedback.
* :mod:`~zeropp_jax.wire.kernels`: which implementation (XLA or Pallas) runs
  the quantization operations.
"""
