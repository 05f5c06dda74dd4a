"""What the cost model is evaluated on: a GPU cluster and one step's workload.

:class:`Cluster` describes the hardware (nodes, GPUs per node, link bandwidths,
peak FLOP/s), :class:`Workload` what one optimizer step computes (model size,
tokens per GPU). Both are frozen and check their fields on construction.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = [
    "Cluster",
    "FLOPS_PER_PARAM_TOKEN",
    "V100_CLUSTER",
    "Workload",
]

# Forward (2), backward (4) and the forward recomputed by `layer` (2) FLOPs
# per parameter per token.
FLOPS_PER_PARAM_TOKEN = 8


def check(name: str, value: Any, ok: bool, want: str) -> None:
    """Raises ``ValueError("<name> must be <want>, got <value>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name} must be {want}, got {value!r}")


def check_positive(name: str, value: Any) -> None:
    """``value`` must be a positive finite int or float (not a bool)."""
    check(name, value, isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and value > 0, "a positive finite number")


def check_positive_int(name: str, value: Any) -> None:
    """``value`` must be a positive int (not a bool)."""
    check(name, value, isinstance(value, int) and not isinstance(value, bool) and value > 0,
          "a positive integer")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A GPU cluster.

    Attributes:
      nodes: number of nodes.
      gpus_per_node: GPUs per node (the mesh's ``local`` axis).
      intra_node_gbytes_per_s: NVLink bandwidth one GPU receives at, GB/s.
      inter_node_gbits_per_s: inter-node bandwidth of one node (all its NICs
        together), Gb/s — the unit the ZeRO++ paper quotes.
      peak_tflops: dense 16-bit peak of one GPU, TFLOP/s.
      efficiency: fraction of the peak the model's math reaches (0, 1].
    """

    nodes: int
    gpus_per_node: int
    intra_node_gbytes_per_s: float
    inter_node_gbits_per_s: float
    peak_tflops: float
    efficiency: float = 0.4

    def __post_init__(self):
        check_positive_int("Cluster.nodes", self.nodes)
        check_positive_int("Cluster.gpus_per_node", self.gpus_per_node)
        check_positive("Cluster.intra_node_gbytes_per_s", self.intra_node_gbytes_per_s)
        check_positive("Cluster.inter_node_gbits_per_s", self.inter_node_gbits_per_s)
        check_positive("Cluster.peak_tflops", self.peak_tflops)
        check("Cluster.efficiency", self.efficiency,
              isinstance(self.efficiency, (int, float)) and 0 < self.efficiency <= 1,
              "in (0, 1]")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def replace(self, **changes) -> Cluster:
        return dataclasses.replace(self, **changes)


# The ZeRO++ paper's testbed: 48 nodes x 8 V100 (SXM2: 125 TFLOP/s fp16
# tensor-core peak, NVLink 2 at 150 GB/s per direction); inter-node bandwidth
# varied from 100 to 800 Gb/s per node. Efficiency 0.4 of peak is a typical
# model-FLOPs utilisation for multi-billion-parameter models on V100.
V100_CLUSTER = Cluster(
    nodes=48, gpus_per_node=8, intra_node_gbytes_per_s=150.0,
    inter_node_gbits_per_s=100.0, peak_tflops=125.0, efficiency=0.4,
)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one optimizer step computes.

    Attributes:
      params: model size in parameters.
      tokens_per_gpu: tokens each GPU processes per optimizer step.
      flops_per_token: model FLOPs per token (default ``8 * params``).
      float_bytes: bytes per element of full-precision payloads on the wire
        (2 for bf16/fp16 parameters and gradients, 4 for fp32).
    """

    params: float
    tokens_per_gpu: float
    flops_per_token: float | None = None
    float_bytes: int = 2

    def __post_init__(self):
        check_positive("Workload.params", self.params)
        check_positive("Workload.tokens_per_gpu", self.tokens_per_gpu)
        if self.flops_per_token is not None:
            check_positive("Workload.flops_per_token", self.flops_per_token)
        check("Workload.float_bytes", self.float_bytes, self.float_bytes in (2, 4), "2 or 4")

    @property
    def flops_per_gpu(self) -> float:
        per_token = self.flops_per_token or FLOPS_PER_PARAM_TOKEN * self.params
        return per_token * self.tokens_per_gpu
