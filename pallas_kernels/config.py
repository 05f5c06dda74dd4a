"""Tuning knobs shared by the Pallas kernels (:class:`KernelConfig`)."""

from __future__ import annotations

import dataclasses

__all__ = ["KernelConfig", "DEFAULT_CONFIG"]


def _is_pow2(v) -> bool:
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
      num_stages: software-pipelining depth the GPU compiler may use for
        the loads inside a program's loop (>= 1; only ``dequantize_sum``
        loops over its ``k`` chunks).

    Example:
      >>> cfg = KernelConfig(tile_elems=16384, num_warps=8)
      >>> q = quantize(x, bits=8, block=256, config=cfg)  # doctest: +SKIP
    """

    tile_elems: int = 8192
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not _is_pow2(self.tile_elems) or self.tile_elems < 8:
            raise ValueError(
                f"tile_elems must be a power of two >= 8 (Triton tiles are powers of two), "
                f"got {self.tile_elems!r}; try 8192."
            )
        if not _is_pow2(self.num_warps) or self.num_warps > 32:
            raise ValueError(
                f"num_warps must be a power of two in [1, 32], got {self.num_warps!r}; try 4 or 8."
            )
        if (
            not isinstance(self.num_stages, int)
            or isinstance(self.num_stages, bool)
            or self.num_stages < 1
        ):
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}.")


DEFAULT_CONFIG = KernelConfig()
