"""The one place that names the GPU Pallas backend and its quirks.

Which backend, and why
----------------------
``pl.pallas_call`` lowers to Mosaic GPU by default on NVIDIA GPUs. These
kernels ask for **Triton** instead, by passing ``pltriton.CompilerParams``
(which selects Triton whatever ``jax_pallas_use_mosaic_gpu`` says), because
they are written in plain ``jnp`` and need what Mosaic GPU's ``pallas_call``
lowering of plain ``jnp`` does not provide:

* per-row reductions of a tile (one scale per quantization block) and
  reductions over a small minor axis (2 nibbles -> a byte, 8 signs -> a
  byte): that lowering puts arrays in the ``WG_STRIDED`` layout, where it
  reduces only over *all* axes;
* reshapes of tiled layouts along the minor axis and strided ref slices;
* ``jnp.isfinite`` and scale tiles of fewer than 128 elements.

Expressing the kernels for Mosaic GPU needs hand-picked
``plgpu.Layout.TILED`` register layouts and ``plgpu.load`` (``plgpu.kernel``
style), which do not run in interpret mode on CPU. The Triton lowering of
every kernel is checked on CPU by cross-lowering for ``cuda``
(``test_kernels_lower_for_gpu``); ``benchmarks/gpu_check.sh`` compiles and
runs them on a GPU. The Triton backend is deprecated since jax 0.11: when it
is removed, this module and the kernels' in-tile reductions and packing are
what change (``plgpu.kernel`` with explicit ``TILED`` layouts).

Triton quirks handled here
--------------------------
* Float32 ``/`` lowers to ``arith.divf``, which Triton's NVIDIA backend
  emits as ``div.full.f32`` (an approximation, up to 2 ulp off), whereas XLA
  (the reference) divides with IEEE round-to-nearest. :func:`div_rn` emits
  ``div.rn.f32`` through inline PTX so codes and scales match the reference.
* Triton's ``max`` reduction is NaN-ignoring (``maxnumf``); the kernels
  detect non-finite blocks separately and never rely on NaN propagation.
* Triton has no lowering for ``lax.round``; :func:`round_half_even` emits
  ``cvt.rni.f32.f32`` (round to the nearest integer, ties to even: one
  instruction, the same result as ``jnp.round``).
* Triton loads and stores blocks without bounds masks: tiles must divide the
  array exactly (``_common.tile_blocks``), and every block dimension must be
  a power of two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.config import KernelConfig

__all__ = ["BACKEND", "compiler_params", "div_rn", "round_half_even"]

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


def round_half_even(v: jax.Array, *, interpret: bool) -> jax.Array:
    """float32 ``v`` rounded to the nearest integer, ties to even (``jnp.round``).

    Args:
      v: float32 array.
      interpret: True in interpret mode, where ``jnp.round`` lowers.

    Returns:
      float32, integral values.
    """
    if interpret:
        return jnp.round(v)
    [out] = pltriton.elementwise_inline_asm(
        "cvt.rni.f32.f32 $0, $1;",
        args=[v],
        constraints="=f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, jnp.float32)],
    )
    return out
