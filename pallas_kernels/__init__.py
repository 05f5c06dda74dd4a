"""GPU Pallas kernels for ZeRO++ quantization.

This package will hold the Pallas kernels, one file per op, each beside a
pure-``jnp`` ``<op>_reference`` that defines its numerics, serves as the CPU
fall-back and is what the kernel tests compare against. For now it only
re-exports the block-wise quantization reference from
:mod:`zeropp_jax.quantization`.
"""

from zeropp_jax.quantization import dequantize as dequantize_reference
from zeropp_jax.quantization import quantize as quantize_reference

__all__ = ["quantize_reference", "dequantize_reference"]
