"""Cluster cost model: predicted time per step and throughput of a preset at scale.

Users decide whether compression pays on *their* cluster. This module takes
the bytes each collective of a compiled train step moves (a
:class:`~zeropp_jax.analysis.comm_profile.CommProfile`: the same HLO
accounting as ``zeropp-comm``, counted hierarchically), scales them to a
target model size and :class:`~zeropp_jax.analysis.cluster.Cluster`, adds the
model's FLOPs, and predicts the time per optimizer step:

* ``compute_s = flops_per_token * tokens_per_gpu / (peak * efficiency)``;
* ``inter_node_s = inter-node bytes per node / inter-node bandwidth per node``;
* ``intra_node_s = intra-node bytes per GPU / intra-node bandwidth per GPU``;
* without overlap the step takes the sum; with perfect compute/communication
  overlap the slowest of the three (the two links are separate resources).

How bytes are counted and scaled is explained in
:mod:`zeropp_jax.analysis.comm_profile`.

Not modelled: quantization kernels' time, latency terms (large models at
1-2k tokens per GPU move hundreds of MB per collective), attention FLOPs
(``flops_per_token`` defaults to ``8 * params``: forward, backward and the
forward recomputed by :func:`zeropp_jax.layer`), pipeline bubbles of the
prefetch. :data:`PUBLISHED` holds the ZeRO++ paper's results this model is
checked against (:func:`compare_published`).

This module is the public entry point: it also re-exports the cluster and
profile names (``cm.Cluster``, ``cm.profile_preset``, ...) so that
``from zeropp_jax.analysis import cost_model as cm`` is all a user needs.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from zeropp_jax.analysis.cluster import V100_CLUSTER, Cluster, Workload
from zeropp_jax.analysis.comm_profile import (
    CollectiveCost,
    CommProfile,
    link_bytes,
    profile_config,
    profile_preset,
    profile_report,
)

__all__ = [
    "Cluster",
    "CollectiveCost",
    "CommProfile",
    "PUBLISHED",
    "Prediction",
    "PublishedPoint",
    "V100_CLUSTER",
    "Workload",
    "compare_published",
    "link_bytes",
    "predict",
    "profile_config",
    "profile_preset",
    "profile_report",
]

GBIT = 1e9 / 8  # bytes per second in one Gb/s
GBYTE = 1e9
TERA = 1e12


# ----------------------------------------------------------------------------
# Prediction
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted cost of one optimizer step (seconds, bytes, per-GPU rates)."""

    label: str
    compute_s: float
    inter_node_s: float
    intra_node_s: float
    inter_node_bytes: float
    intra_node_bytes: float
    step_s_serial: float
    step_s_overlap: float
    tokens_per_s_serial: float
    tokens_per_s_overlap: float
    tflops_per_gpu_serial: float
    tflops_per_gpu_overlap: float


def predict(profile: CommProfile, cluster: Cluster, workload: Workload) -> Prediction:
    """Time per step and throughput of ``profile``'s step on ``cluster``.

    Returns:
      A :class:`Prediction`; throughput is tokens per second over the whole
      cluster, TFLOP/s per GPU counts model FLOPs (``flops_per_token``).

    Example:
      >>> zeropp = profile_preset("zeropp", qgz="int4")   # 8 devices (CPU ok)
      >>> p = predict(zeropp, V100_CLUSTER, Workload(params=18e9, tokens_per_gpu=1024))
      >>> p.step_s_serial, p.tokens_per_s_serial
    """
    inter, intra = profile.bytes_at(cluster, workload)
    compute = workload.flops_per_gpu / (cluster.peak_tflops * TERA * cluster.efficiency)
    t_inter = inter / (cluster.inter_node_gbits_per_s * GBIT)
    t_intra = intra / (cluster.intra_node_gbytes_per_s * GBYTE)
    serial = compute + t_inter + t_intra
    overlap = max(compute, t_inter, t_intra)
    tokens = workload.tokens_per_gpu * cluster.gpus
    return Prediction(
        label=profile.label, compute_s=compute, inter_node_s=t_inter, intra_node_s=t_intra,
        inter_node_bytes=inter, intra_node_bytes=intra,
        step_s_serial=serial, step_s_overlap=overlap,
        tokens_per_s_serial=tokens / serial, tokens_per_s_overlap=tokens / overlap,
        tflops_per_gpu_serial=workload.flops_per_gpu / serial / TERA,
        tflops_per_gpu_overlap=workload.flops_per_gpu / overlap / TERA,
    )


# ----------------------------------------------------------------------------
# Published results
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PublishedPoint:
    """One published ZeRO++ vs ZeRO-3 throughput ratio.

    ``ratio`` = ZeRO++ throughput at ``zeropp_gbits`` / ZeRO-3 throughput at
    ``zero3_gbits`` (Gb/s per node), on :data:`V100_CLUSTER` (384 GPUs) with
    ``tokens_per_gpu`` tokens per GPU per step; ``low``/``high`` the
    published range.
    """

    name: str
    zeropp_gbits: float
    zero3_gbits: float
    tokens_per_gpu: int
    low: float
    high: float

    @property
    def ratio(self) -> float:
        return (self.low + self.high) / 2


# DeepSpeed's ZeRO++ results (arXiv 2306.10209 and the DeepSpeed blog),
# 18B and 138B models on 48 nodes x 8 V100 (sources: benchmarks/RESULTS.md):
# at 100 Gb/s "up to 2.2x, about 2x on average" (we compare with the
# average); at 400 Gb/s +28-36% with 1k tokens per GPU and +24-29% with 2k;
# ZeRO++ at 200 Gb/s matched ZeRO-3 at 800 Gb/s.
PUBLISHED = (
    PublishedPoint("100 Gb/s, 1k tokens/GPU", 100, 100, 1024, 2.0, 2.0),
    PublishedPoint("400 Gb/s, 1k tokens/GPU", 400, 400, 1024, 1.28, 1.36),
    PublishedPoint("400 Gb/s, 2k tokens/GPU", 400, 400, 2048, 1.24, 1.29),
    PublishedPoint("ZeRO++ 200 Gb/s vs ZeRO-3 800 Gb/s", 200, 800, 1024, 1.0, 1.0),
)
PUBLISHED_MODEL_SIZES = (18e9, 138e9)
# ZeRO++ as published and as DeepSpeed runs it: the zeropp preset's qwZ and
# hpZ with int4 gradients (DeepSpeed's qgZ) and float32 scales, compressed
# from the first step (DeepSpeed's zero_quantized_gradients has no warm-up),
# so a run's mean step is its compressed step.
PUBLISHED_ZEROPP = dict(qgz="int4", qgz_target="gradient", scale_dtype="float32",
                        qgz_warmup_steps=0)
# How far a prediction may land from the published ratio (relative).
PUBLISHED_TOLERANCE = 0.25


def compare_published(
    zero3: CommProfile,
    zeropp: CommProfile,
    *,
    cluster: Cluster = V100_CLUSTER,
    model_sizes: Sequence[float] = PUBLISHED_MODEL_SIZES,
    points: Sequence[PublishedPoint] = PUBLISHED,
) -> list[dict]:
    """Predicted vs published ZeRO++/ZeRO-3 throughput ratios.

    Args:
      zero3, zeropp: profiles of the two steps (for the paper's ZeRO++, the
        ``zeropp`` preset with :data:`PUBLISHED_ZEROPP`: DeepSpeed's qgZ is int4).
      cluster: the testbed (its inter-node bandwidth is set per point).

    Returns:
      One row per (point, model size): ``point``, ``params``, ``published``
      (the midpoint), ``low``, ``high``, ``serial`` and ``overlap`` (predicted
      ratios without / with compute-communication overlap) and
      ``serial_error`` (relative distance of ``serial`` from ``published``).
    """
    rows = []
    for p in points:
        for size in model_sizes:
            work = Workload(params=size, tokens_per_gpu=p.tokens_per_gpu)
            a = predict(zeropp, cluster.replace(inter_node_gbits_per_s=p.zeropp_gbits), work)
            b = predict(zero3, cluster.replace(inter_node_gbits_per_s=p.zero3_gbits), work)
            serial = b.step_s_serial / a.step_s_serial
            overlap = b.step_s_overlap / a.step_s_overlap
            rows.append({
                "point": p.name, "params": size, "published": p.ratio, "low": p.low,
                "high": p.high, "serial": serial, "overlap": overlap,
                "serial_error": serial / p.ratio - 1, "overlap_error": overlap / p.ratio - 1,
            })
    return rows
