"""GPU Pallas kernels for ZeRO++ quantization.

One file per op, each beside a pure-``jnp`` ``<op>_reference`` that defines
its numerics, serves as the fall-back where no GPU is present, and is what
the kernel tests compare against. The references, the wire format and its
numerics, live in :mod:`pallas_kernels.references` (``quantization``,
``packing``, ``dither``); ``zeropp_jax.wire`` re-exports them. This package
imports nothing from ``zeropp_jax``.

* :func:`quantize` / :func:`dequantize` (``quantize.py``): int8 / int4
  block-wise absmax (qwZ). References: :func:`quantize_reference`,
  :func:`dequantize_reference` (= :mod:`pallas_kernels.references.quantization`'s).
* :func:`compress_1bit_ef` (``onebit.py``): ``g + carry`` -> 1-bit signs,
  per-block mean-|x| scales and the new error-feedback carry, in one pass.
* :func:`quantize_dithered` (``dither.py``): unbiased 1-bit codes with
  subtractive dither (block absmax scales), in one pass. Reference:
  :func:`quantize_dithered_reference` (= :mod:`pallas_kernels.references.dither`'s).
* :func:`dequantize_sum` (``dequant_sum.py``): dequantize ``k`` received
  chunks (1, 4 or 8 bits) and sum them in float32, in one pass (qgZ).

Every op takes ``config: KernelConfig | None`` (tile sizes; ``None`` is
:func:`default_config` of that kernel and bit width, measured on a GPU) and
``interpret: bool``: ``interpret=True`` runs the kernel with Pallas'
interpreter on any backend (the CPU tests do this); ``interpret=False``
compiles it for the GPU (Triton lowering, see ``_backend.py``). Kernels need
``block`` to be a power of two; the references accept any multiple of 8.
"""

from pallas_kernels.config import DEFAULT_CONFIG
from pallas_kernels.config import KernelConfig
from pallas_kernels.config import default_config
from pallas_kernels.dequant_sum import dequantize_sum
from pallas_kernels.dequant_sum import dequantize_sum_reference
from pallas_kernels.dither import quantize_dithered
from pallas_kernels.dither import quantize_dithered_reference
from pallas_kernels.onebit import compress_1bit_ef
from pallas_kernels.onebit import compress_1bit_ef_reference
from pallas_kernels.quantize import dequantize
from pallas_kernels.quantize import dequantize_reference
from pallas_kernels.quantize import quantize
from pallas_kernels.quantize import quantize_reference

__all__ = [
    "KernelConfig",
    "DEFAULT_CONFIG",
    "default_config",
    "quantize",
    "quantize_reference",
    "dequantize",
    "dequantize_reference",
    "compress_1bit_ef",
    "compress_1bit_ef_reference",
    "dequantize_sum",
    "dequantize_sum_reference",
    "quantize_dithered",
    "quantize_dithered_reference",
]
