"""The one place that names the GPU Pallas backend and its quirks.

Which backend, and why
----------------------
Since jax 0.10 ``pl.pallas_call`` lowers to **Mosaic GPU** by default on
NVIDIA GPUs, and jax 0.11 deprecates the Triton backend. These kernels
nevertheless ask for **Triton**, by passing ``pltriton.CompilerParams``
(which selects Triton whatever ``jax_pallas_use_mosaic_gpu`` says):

* The kernels need per-row reductions of a tile (one scale per quantization
  block) and reductions over a small minor axis (2 nibbles -> a byte, 8 signs
  -> a byte). Mosaic GPU's ``pallas_call`` lowering of plain ``jnp`` code puts
  arrays in the ``WG_STRIDED`` layout, where it only reduces over *all* axes
  ("No support for axes yet"), and it neither reshapes tiled layouts along
  the minor axis nor slices refs with a stride. Expressing these kernels for
  Mosaic GPU needs hand-picked ``plgpu.Layout.TILED`` register layouts and
  ``plgpu.load`` (``plgpu.kernel`` style), which do not run in interpret mode
  on CPU. Checked with jax 0.10.2 by cross-lowering for ``cuda`` on a CPU
  machine (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``):
  the Mosaic GPU lowering of the 8-bit kernel fails on ``jnp.isfinite``
  (no ``is_finite`` rule) and, without it, on the per-block ``max`` ("No
  support for axes yet"); the dequantize kernel fails on its 32-element
  scale tile ("must have a number of elements that is a multiple of 128").
  The Triton lowering of every kernel here succeeds (the tests check this on
  CPU, see ``test_kernels_lower_for_gpu``).
* ``pl.pallas_call`` for Mosaic GPU itself already warns (jax 0.10.2) that it
  is deprecated in favour of ``plgpu.kernel``.

So Triton is the only backend on which these plain-``jnp`` kernels lower
today. The Pallas changelog for jax 0.11.0 says: "The Triton backend is
deprecated and will be removed in a future version of JAX. To keep using
Pallas on GPU, please migrate to the Mosaic GPU backend." When it is
removed, this module and the kernels' in-tile reductions and packing are
what change (``plgpu.kernel`` with explicit ``TILED`` layouts). NOT VERIFIED
HERE (no GPU in this session): that jax 0.11.x still accepts
``pltriton.CompilerParams`` on the GPU, and that the Triton IR compiles and
runs on the H200 with the results the tests expect;
``benchmarks/gpu_check.sh`` checks both.

Triton quirks handled here
--------------------------
* Float32 ``/`` lowers to ``arith.divf``, which Triton's NVIDIA backend
  emits as ``div.full.f32`` (an approximation, up to 2 ulp off), whereas XLA
  (the reference) divides with IEEE round-to-nearest. :func:`div_rn` emits
  ``div.rn.f32`` through inline PTX so codes and scales match the reference.
* Triton's ``max`` reduction is NaN-ignoring (``maxnumf``); the kernels
  detect non-finite blocks separately and never rely on NaN propagation.
* Triton has no lowering for ``lax.round``; see ``_common.round_half_even``.
* Triton loads and stores blocks without bounds masks: tiles must divide the
  array exactly (``_common.tile_blocks``), and every block dimension must be
  a power of two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.config import KernelConfig

__all__ = ["BACKEND", "compiler_params", "div_rn"]

BACKEND = "triton"


def compiler_params(config: KernelConfig):
    """The ``compiler_params`` passed to every ``pl.pallas_call`` here.

    Interpret mode ignores them; on GPU they select the Triton lowering.
    """
    return pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def div_rn(a: jax.Array, b: jax.Array, *, interpret: bool) -> jax.Array:
    """IEEE float32 division rounded to nearest even, as XLA does it.

    Args:
      a, b: float32 arrays of the same shape (broadcast first).
      interpret: True in interpret mode, where plain ``/`` already is IEEE.

    Returns:
      ``a / b`` correctly rounded, float32.
    """
    if interpret:
        return a / b
    [out] = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return out
