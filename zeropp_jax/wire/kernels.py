"""Which quantization kernels the step uses: the XLA reference or Pallas.

The five operations on the compression hot path (quantize, dequantize, 1-bit
compress with fused error feedback, the dithered 1-bit code, dequantize-and-sum
of received chunks) exist twice: as plain ``jnp`` references (the source of
truth, fused by XLA; :mod:`pallas_kernels.references`, re-exported by
:mod:`zeropp_jax.wire.quantization` and :mod:`zeropp_jax.wire.dither`) and as
Pallas kernels in :mod:`pallas_kernels`. The
receive side of the dithered code (regenerate each sender's dither, decode,
sum) is ``jnp`` in both sets: it is one elementwise fusion for XLA. The
Pallas sender kernel takes the dither as an input array, so on that path the
noise is written and read once (8 bytes per element) where XLA fuses the hash
into the quantization.
:func:`select` picks one set from the config's ``implementation``:

* ``"auto"``: Pallas on GPU, except that a gathered layer's qwZ codes are
  decoded by the XLA reference where the layer uses them
  (:attr:`Kernels.layer_decode`), XLA elsewhere;
* ``"xla"``: the references everywhere;
* ``"pallas"``: the kernels; on a backend without Pallas GPU lowering they
  run in Pallas' interpreter (slow, for testing), which the name reports.

The choice is never silent: :attr:`Kernels.name` goes into the trainer's
description and metrics header. :meth:`Kernels.quantize` and
:meth:`Kernels.dequantize` at 1 bit are the XLA reference in every set: the
step encodes 1 bit through :meth:`Kernels.compress_1bit_ef` or
:meth:`Kernels.quantize_dithered` (kernels in the Pallas set), and decodes
1-bit rows it received (the Hadamard code's) with the reference, one
elementwise fusion for XLA.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

import pallas_kernels
from zeropp_jax.wire import dither, quantization
from zeropp_jax.wire.quantization import Quantized


@dataclasses.dataclass(frozen=True)
class Kernels:
    """One implementation of the compression operations (hashable, static).

    Attributes:
      name: ``"xla"``, ``"pallas"`` or ``"pallas-interpret"``.
      xla_layer_decode: a gathered layer's parameters are decoded by the XLA
        reference (:attr:`layer_decode`).
    """

    name: str
    xla_layer_decode: bool = False

    @property
    def label(self) -> str:
        """What runs, for reports: ``name``, and ``+xla-layer-decode``."""
        return self.name + ("+xla-layer-decode" if self.xla_layer_decode else "")

    @property
    def layer_decode(self) -> "Kernels":
        """The kernels that decode a gathered layer where its compute uses it.

        With ``xla_layer_decode`` the XLA reference: XLA fuses it into the
        slicing of the layer's weights out of the flat layer, so each weight is
        written once, from the codes; a Pallas call writes the flat layer first,
        which is then sliced (4 bytes more per parameter and gather at bfloat16).
        In a 1.2B step on one H200 (``benchmarks/RESULTS.md``, stop 16) qwz with
        the XLA kernels ran 1.2% over zero3 and with Pallas 2.5%, though Pallas
        quantizes 1.7x faster. Decodes that fill a buffer (hpZ's secondary) and
        every other operation keep these kernels.
        """
        return XLA if self.xla_layer_decode else self

    @property
    def _pallas(self) -> bool:
        return self.name.startswith("pallas")

    @property
    def _interpret(self) -> bool:
        return self.name == "pallas-interpret"

    def quantize(self, x: jax.Array, *, bits: int, block: int, scale_dtype: Any) -> Quantized:
        """Block-wise ``bits``-bit codes and scales of ``x`` ``(..., n)`` (1 bit: XLA)."""
        if self._pallas and bits in (4, 8):
            return pallas_kernels.quantize(
                x, bits=bits, block=block, scale_dtype=scale_dtype, interpret=self._interpret
            )
        return quantization.quantize(x, bits=bits, block=block, scale_dtype=scale_dtype)

    def dequantize(self, q: Quantized, *, bits: int, block: int, dtype: Any) -> jax.Array:
        """Values ``(..., n)`` in ``dtype`` from codes and scales (1 bit: XLA)."""
        if self._pallas and bits in (4, 8):
            return pallas_kernels.dequantize(
                q, bits=bits, block=block, dtype=dtype, interpret=self._interpret
            )
        return quantization.dequantize(q, bits=bits, block=block, dtype=dtype)

    def compress_1bit_ef(
        self, g: jax.Array, carry: jax.Array, *, block: int, scale_dtype: Any
    ) -> tuple[Quantized, jax.Array]:
        """``x = g + carry`` -> (1-bit ``Quantized``, new carry ``x - deq``)."""
        if self._pallas:
            return pallas_kernels.compress_1bit_ef(
                g, carry, block=block, scale_dtype=scale_dtype, interpret=self._interpret
            )
        return pallas_kernels.compress_1bit_ef_reference(
            g, carry, block=block, scale_dtype=scale_dtype)

    def quantize_dithered(
        self, x: jax.Array, xi: jax.Array, *, block: int, scale_dtype: Any
    ) -> Quantized:
        """Unbiased 1-bit codes of ``x`` with dither ``xi`` (:mod:`zeropp_jax.wire.dither`)."""
        if self._pallas:
            return pallas_kernels.quantize_dithered(
                x, xi, block=block, scale_dtype=scale_dtype, interpret=self._interpret
            )
        return dither.quantize_dithered(x, xi, block=block, scale_dtype=scale_dtype)

    def dequantize_sum(self, q: Quantized, *, bits: int, block: int) -> jax.Array:
        """float32 ``(..., m)``: the ``k`` chunks of ``q`` ``(..., k, ·)`` summed."""
        if self._pallas:
            return pallas_kernels.dequantize_sum(
                q, bits=bits, block=block, interpret=self._interpret
            )
        return pallas_kernels.dequantize_sum_reference(q, bits=bits, block=block)


XLA = Kernels("xla")


def select(implementation: str, platform: str) -> Kernels:
    """The kernels for ``implementation`` on a ``platform`` ("gpu": an NVIDIA GPU,
    "rocm", "cpu", ...): the Pallas kernels are NVIDIA's (Triton, inline PTX)."""
    if implementation == "pallas" and platform == "rocm":
        raise ValueError("the Pallas kernels are written for NVIDIA GPUs (Triton with inline "
                         "PTX); on a ROCm GPU use implementation='auto' or 'xla'")
    if implementation == "xla" or (implementation == "auto" and platform != "gpu"):
        return XLA
    if implementation == "auto":  # on a GPU
        return Kernels("pallas", xla_layer_decode=True)
    if implementation == "pallas":
        return Kernels("pallas" if platform == "gpu" else "pallas-interpret")
    raise ValueError(
        f"implementation must be 'auto', 'xla' or 'pallas', got {implementation!r}"
    )
