"""``GatherPlan``: the static recipe of one unit's gather and gradient reduction.

Computed once per trainer (:class:`~zeropp_jax.step.geometry.StepGeometry`)
and carried as aux data by each :class:`~zeropp_jax.step.gather.Unit`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeropp_jax.wire.kernels import Kernels


@dataclasses.dataclass(frozen=True)
class GatherPlan:
    """Static recipe for one unit's gather and gradient reduction.

    Attributes:
      gather_axes: mesh axes of the per-layer all-gather (``("local",)`` with
        hpZ, else ``("local", "node")``).
      reduce_axes: mesh axes of the per-layer gradient reduce-scatter
        (``("local",)`` when the cross-node reduction runs once per step).
      bits: qwZ bits of the payload (0: none, the shard in the compute dtype).
      block: elements per qwZ scale.
      scale_dtype: dtype of qwZ scales on the wire.
      compute_dtype: dtype of the gathered parameters.
      reduce_dtype: dtype of the gradient reduce-scatter on the wire.
      sum_bits: reductions of a 2-byte float wire run as bits plus a local
        sum (on CPU: :func:`~zeropp_jax.wire.collectives.reduce_scatter`).
      sum_axes: mesh axes the reduced gradient is then all-reduced over,
        per layer (1-bit Adam's full-precision steps: ``("node",)``).
      kernels: the quantization kernels (XLA reference or Pallas).
      two_level: run both collectives one mesh axis at a time, so only
        one device per node talks to each other node
        (:func:`~zeropp_jax.wire.collectives.all_gather`).
      prefetch: :func:`~zeropp_jax.step.prefetch.scan_layers` gathers the next stacked
        layer while one computes (depth 1); off on one device (only copies there).
      secondary_bits: ``None``: the source is what the gather sends. An
        int: hpZ's secondary partition is formed layer by layer (stacked
        units under prefetch): the source is this device's primary payload
        (qwZ codes of that many bits, or 0: the compute dtype), and a
        layer's gather first all-gathers it over ``node`` into the layer's
        secondary (:func:`~zeropp_jax.step.gather.secondary_payload`),
        decoded there when ``bits`` is 0. :func:`~zeropp_jax.step.prefetch.scan_layers` does that once
        per layer, in the forward, and keeps the secondaries for the backward.
      keep_activations: a layer's forward saves its activations; its
        backward gathers the parameters again but recomputes only what was
        not saved (:mod:`~zeropp_jax.step.linearize`), else all of it.
    """

    gather_axes: tuple[str, ...]
    reduce_axes: tuple[str, ...]
    bits: int
    block: int
    scale_dtype: Any
    compute_dtype: Any
    reduce_dtype: Any
    kernels: Kernels
    sum_bits: bool = False
    sum_axes: tuple[str, ...] = ()
    two_level: bool = False
    prefetch: bool = True
    secondary_bits: int | None = None
    keep_activations: bool = False

    def resident(self) -> "GatherPlan":
        """This plan for a source that already is the secondary partition."""
        return dataclasses.replace(self, secondary_bits=None)
