"""Tuning knobs shared by the Pallas kernels (:class:`KernelConfig`)."""

from __future__ import annotations

import dataclasses

__all__ = ["KernelConfig", "DEFAULT_CONFIG", "DECODES", "DECODING_KERNELS", "KERNELS",
           "default_config"]


DECODES = ("convert", "bits")
"""``KernelConfig.decode``: integer codes to float32 by conversion, or by their bits."""
DECODING_KERNELS = ("dequantize", "dequantize_sum")
"""The kernels whose int8 / int4 decoding follows ``KernelConfig.decode``."""


def is_pow2(v) -> bool:
    """Whether ``v`` is a Python int (not a bool) that is a power of two (1, 2, 4, ...)."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch parameters of the quantization kernels.

    Every kernel tiles the flattened array ``(num_blocks, block)`` by whole
    quantization blocks: one program (a Triton program, i.e. one CTA) handles
    ``tile_blocks`` consecutive blocks, where ``tile_blocks`` is the largest
    power of two with ``tile_blocks * block <= tile_elems`` that divides
    ``num_blocks`` (so a tile never straddles the end of the array and no
    masking is needed). For full speed make ``num_blocks`` divisible by
    ``tile_elems // block``, e.g. by padding flat buffers to a multiple of
    ``tile_elems`` elements.

    Frozen and hashable, so it can be a static argument of ``jax.jit``.

    Attributes:
      tile_elems: elements of the (decoded) array per program; a power of two
        >= 8. A block larger than this gets one block per program.
      num_warps: warps per program (a power of two, 1..32).
      num_stages: Triton's software-pipelining depth for loads inside a
        loop (>= 1). The kernels here have no such loop (``dequantize_sum``
        unrolls its chunks), so it only matters to kernels that add one.
      split_bytes: for the packed formats (int4, 1 bit), view each tile of
        elements as ``(tile_blocks, bytes_per_block, elements_per_byte)``
        instead of ``(tile_blocks, block)``: the elements that share a byte
        sit on their own minor axis in memory order, so packing is a
        reduction over that axis and unpacking a broadcast against it, with
        no reshape inside the kernel (on Triton a reshape of a tile may move
        it through shared memory). Same results either way; int8 kernels
        ignore it.
      decode: how the decoding kernels (``dequantize``, ``dequantize_sum``
        at 4 and 8 bits) turn integer codes into float32: ``"convert"``
        with the GPU's int-to-float instruction, or ``"bits"`` by writing
        the code into the mantissa of a float32 constant and subtracting
        that constant (bitwise operations and one float subtraction, both
        exact: :func:`pallas_kernels._common.decode_tile`). Conversions
        issue at 16 per clock per SM on Hopper against 128 float adds, and
        ``dequantize_sum`` converts ``k`` codes per output element; which is
        faster is the GPU sweep's to say. The same values either way; the
        other kernels ignore it.

    Example:
      >>> cfg = KernelConfig(tile_elems=16384, num_warps=8)
      >>> q = quantize(x, bits=8, block=256, config=cfg)  # doctest: +SKIP
    """

    tile_elems: int = 8192
    num_warps: int = 4
    num_stages: int = 2
    split_bytes: bool = False
    decode: str = "convert"

    def __post_init__(self):
        if not is_pow2(self.tile_elems) or self.tile_elems < 8:
            raise ValueError(
                f"tile_elems must be a power of two >= 8 (Triton tiles are powers of two), "
                f"got {self.tile_elems!r}; try 8192."
            )
        if not is_pow2(self.num_warps) or self.num_warps > 32:
            raise ValueError(
                f"num_warps must be a power of two in [1, 32], got {self.num_warps!r}; try 4 or 8."
            )
        if (
            not isinstance(self.num_stages, int)
            or isinstance(self.num_stages, bool)
            or self.num_stages < 1
        ):
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}.")
        if not isinstance(self.split_bytes, bool):
            raise ValueError(f"split_bytes must be True or False, got {self.split_bytes!r}.")
        if self.decode not in DECODES:
            raise ValueError(f"decode must be one of {DECODES}, got {self.decode!r}.")


DEFAULT_CONFIG = KernelConfig()

KERNELS = ("quantize", "dequantize", "compress_1bit_ef", "quantize_dithered", "dequantize_sum")
"""The kernels that take a ``config``, by function name."""

# Per kernel and bit width: the launch configuration that a sweep of
# benchmarks/gpu_kernels.py measured fastest on the GPU (benchmarks/RESULTS.md
# names the run). Kernels and widths not listed use DEFAULT_CONFIG.
_MEASURED_DEFAULTS = {
    ("quantize", 8): KernelConfig(tile_elems=2048, num_warps=8),
    ("quantize", 4): KernelConfig(tile_elems=2048, num_warps=8),
    ("dequantize", 8): KernelConfig(tile_elems=2048, num_warps=4),
    ("dequantize", 4): KernelConfig(tile_elems=1024, num_warps=2),
    ("compress_1bit_ef", 1): KernelConfig(tile_elems=1024, num_warps=8),
    ("quantize_dithered", 1): KernelConfig(tile_elems=8192, num_warps=8, split_bytes=True),
    ("dequantize_sum", 1): KernelConfig(tile_elems=2048, num_warps=1, split_bytes=True),
    ("dequantize_sum", 4): KernelConfig(tile_elems=1024, num_warps=1, split_bytes=True),
    ("dequantize_sum", 8): KernelConfig(tile_elems=512, num_warps=4),
}


def default_config(kernel: str, bits: int) -> KernelConfig:
    """The configuration a kernel uses when called with ``config=None``.

    Args:
      kernel: one of :data:`KERNELS`.
      bits: the wire width the call uses (1, 4 or 8).

    Returns:
      The measured best :class:`KernelConfig` for that kernel and width, or
      :data:`DEFAULT_CONFIG` where none was measured.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}.")
    return _MEASURED_DEFAULTS.get((kernel, bits), DEFAULT_CONFIG)
