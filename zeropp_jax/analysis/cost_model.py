"""Cluster cost model: predicted time per step and throughput of a preset at scale.

Users decide whether compression pays on *their* cluster. This module takes
the bytes each collective of a compiled train step moves (the same HLO
accounting as ``zeropp-comm``), scales them to a target model size and
cluster, adds the model's FLOPs, and predicts the time per optimizer step:

* ``compute_s = flops_per_token * tokens_per_gpu / (peak * efficiency)``;
* ``inter_node_s = inter-node bytes per node / inter-node bandwidth per node``;
* ``intra_node_s = intra-node bytes per GPU / intra-node bandwidth per GPU``;
* without overlap the step takes the sum; with perfect compute/communication
  overlap the slowest of the three (the two links are separate resources).

Byte accounting (per collective, per step):

* Links are counted *hierarchically*, as a two-level algorithm moves data
  (exchange across nodes, then forward over NVLink; ZeRO++'s own design and
  NCCL's tree/CollNet/PXN paths): each distinct remote byte enters a node
  once. For a collective whose group has ``m`` members on a node, ``k``
  nodes and ``size`` members in all, with per-device operand ``I`` and result
  ``O``: all-gather brings ``(size - m) * O / size`` into the node, and each
  device takes ``(size-1)/size`` of ``O`` minus its share of the node's
  remote bytes over NVLink; reduce-scatter needs ``(k - 1) * m * I / size``
  (remote partial sums of the node's chunks); all-reduce both; all-to-all
  cannot be merged (``m * (size - m) * I / size``). This is the least a
  node must receive. A flat ring over all ``N * L`` GPUs brings
  ``(NL - 1)/(NL)`` of the payload into every node instead of
  ``(N - 1)/N``: the same at the paper's 48 nodes (2% apart), up to twice as
  much on 2 nodes. ``zeropp-comm``'s per-node figure counts every device's
  transfer separately (a flat implementation): ``local`` times the
  hierarchical volume for groups spanning ``node`` and ``local``.
* Full-precision payloads are counted at ``Workload.float_bytes`` per element
  (2: bf16 on the wire). The profile is compiled on CPU, where XLA carries
  float collectives as f32 whatever the compute dtype; quantized codes and
  their scales (named ``quantized_codes`` / ``quantized_scales`` in the
  compiled program by :mod:`zeropp_jax.wire.collectives`) keep their own widths.
* Scaling from the profile's ``(n0, l0)`` mesh and ``P0`` parameters to the
  target: inter-node bytes ``* (P / P0) * ((N-1)/N) / ((n0-1)/n0)``,
  intra-node bytes ``* (P / P0) * ((L-1)/L) / ((l0-1)/l0)``. Every ZeRO
  collective moves a fixed fraction of the model, which these factors carry
  to any mesh (see ``tests/test_cost_model.py`` for the check across meshes).

Not modelled: quantization kernels' time, latency terms (large models at
1-2k tokens per GPU move hundreds of MB per collective), attention FLOPs
(``flops_per_token`` defaults to ``8 * params``: forward, backward and the
forward recomputed by :func:`zeropp_jax.layer`), pipeline bubbles of the
prefetch. :data:`PUBLISHED` holds the ZeRO++ paper's results this model is
checked against (:func:`compare_published`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from zeropp_jax.wire.collectives import CODES_SCOPE, SCALES_SCOPE
from zeropp_jax.analysis.comm_report import Collective, CommReport, add_permute_bytes, dtype_bytes

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
# All-reduces of at most this many bytes per device carry step metrics (the
# loss, the gradient norm: a few scalars; ZeRO never all-reduces parameters
# or gradients), whose size does not grow with the model; they are counted as
# compiled, never scaled.
METRIC_BYTES = 64
# Forward (2), backward (4) and the forward recomputed by `layer` (2) FLOPs
# per parameter per token.
FLOPS_PER_PARAM_TOKEN = 8


def _check(name: str, value: Any, ok: bool, want: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {want}, got {value!r}")


def _positive(name: str, value: Any) -> None:
    _check(name, value, isinstance(value, (int, float)) and not isinstance(value, bool)
           and math.isfinite(value) and value > 0, "a positive finite number")


def _positive_int(name: str, value: Any) -> None:
    _check(name, value, isinstance(value, int) and not isinstance(value, bool) and value > 0,
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
        _positive_int("Cluster.nodes", self.nodes)
        _positive_int("Cluster.gpus_per_node", self.gpus_per_node)
        _positive("Cluster.intra_node_gbytes_per_s", self.intra_node_gbytes_per_s)
        _positive("Cluster.inter_node_gbits_per_s", self.inter_node_gbits_per_s)
        _positive("Cluster.peak_tflops", self.peak_tflops)
        _check("Cluster.efficiency", self.efficiency,
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
        _positive("Workload.params", self.params)
        _positive("Workload.tokens_per_gpu", self.tokens_per_gpu)
        if self.flops_per_token is not None:
            _positive("Workload.flops_per_token", self.flops_per_token)
        _check("Workload.float_bytes", self.float_bytes, self.float_bytes in (2, 4), "2 or 4")

    @property
    def flops_per_gpu(self) -> float:
        per_token = self.flops_per_token or FLOPS_PER_PARAM_TOKEN * self.params
        return per_token * self.tokens_per_gpu


# ----------------------------------------------------------------------------
# Profiles: per-collective bytes of one compiled step
# ----------------------------------------------------------------------------


def _check_profile_mesh(mesh_shape: tuple[int, int]) -> None:
    nodes, local = mesh_shape
    if nodes < 2:
        raise ValueError(
            f"a profile needs a mesh with at least 2 nodes (to see what crosses nodes), got "
            f"{nodes}x{local}; on a one-node machine compile it on simulated CPU devices "
            f"(JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8, mesh 2x4)")


def _role(c: Collective) -> str:
    if f"/{SCALES_SCOPE}/" in c.op_name:
        return "scales"
    if f"/{CODES_SCOPE}/" in c.op_name:
        return "codes"
    if c.kind == "all-reduce" and max(c.operand_bytes, c.result_bytes) <= METRIC_BYTES:
        return "metric"
    if c.dtype in ("f32", "bf16", "f16", "f64"):
        return "float"
    return "other"


def link_bytes(c: Collective, mesh_shape: tuple[int, int]) -> tuple[float, float]:
    """Hierarchical link bytes of one collective, per step.

    Args:
      c: a collective from :func:`zeropp_jax.analysis.comm_report.comm_report`.
      mesh_shape: ``(nodes, local)`` of the compiled program.

    Returns:
      ``(inter, intra)``: bytes entering one node over its inter-node link
      and bytes one device receives over intra-node links, max over nodes /
      devices, multiplied by the collective's executions per step.
    """
    nodes, local = mesh_shape
    inter = [0.0] * nodes
    intra = [0.0] * (nodes * local)
    I, O = float(c.operand_bytes), float(c.result_bytes)
    if c.kind == "collective-permute":  # one source per byte: no merging possible
        add_permute_bytes(c.replica_groups, I, local, inter, intra)
    else:
        for group in c.replica_groups:
            size = len(group)
            if size < 2:
                continue
            by_node: dict[int, list[int]] = {}
            for d in group:
                by_node.setdefault(d // local, []).append(d)
            k = len(by_node)
            for n, members in by_node.items():
                m = len(members)
                ag_in = (size - m) * O / size  # all-gather: remote chunks, once per node
                rs_in = (k - 1) * m * I / size  # reduce-scatter: remote partial sums
                a2a_in = m * (size - m) * I / size
                node_in = {"all-gather": ag_in, "reduce-scatter": rs_in,
                           "all-reduce": rs_in + (size - m) * I / size,
                           "all-to-all": a2a_in}[c.kind]
                inter[n] += node_in
                # Per device over NVLink: everything it needs (or must hand
                # on) except its share of what the node's link carries.
                own_share = (size - m) / (size * m)
                dev = {"all-gather": O * ((size - 1) / size - own_share),
                       "reduce-scatter": I * ((size - 1) / size - own_share),
                       "all-reduce": 2 * I * ((size - 1) / size - own_share),
                       "all-to-all": (m - 1) * I / size}[c.kind]
                for d in members:
                    intra[d] += dev
    return max(inter) * c.count, max(intra) * c.count


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One collective of a profile: per-step link bytes on the profile's mesh.

    ``role`` is ``"codes"``, ``"scales"`` (of a quantized payload),
    ``"float"`` (full precision: rescaled to ``Workload.float_bytes``),
    ``"metric"`` (a few scalars, not scaled with the model) or ``"other"``;
    ``element_bytes`` the compiled element width.
    """

    kind: str
    axis: str
    role: str
    dtype: str
    element_bytes: float
    inter_bytes_per_node: float
    intra_bytes_per_device: float
    op_name: str


@dataclasses.dataclass(frozen=True)
class CommProfile:
    """Per-collective bytes of a compiled step, ready to scale.

    Attributes:
      label: what was compiled (e.g. the preset).
      mesh_shape: ``(nodes, local)`` it was compiled for (``nodes >= 2``).
      params: the compiled model's parameter count, padding included (what
        the collectives move; the target's padding is negligible).
      collectives: one :class:`CollectiveCost` per collective.
    """

    label: str
    mesh_shape: tuple[int, int]
    params: int
    collectives: tuple[CollectiveCost, ...]

    def __post_init__(self):
        _check_profile_mesh(self.mesh_shape)
        _positive_int("CommProfile.params", self.params)

    def bytes_at(self, cluster: Cluster, workload: Workload) -> tuple[float, float]:
        """``(inter-node bytes per node, intra-node bytes per GPU)`` per step at scale."""
        n0, l0 = self.mesh_shape
        size = workload.params / self.params
        f = lambda n: (n - 1) / n  # noqa: E731 - fraction of a gather held elsewhere
        inter_scale = size * f(cluster.nodes) / f(n0)
        intra_scale = size * (f(cluster.gpus_per_node) / f(l0) if l0 > 1 else 0.0)
        if l0 == 1 and cluster.gpus_per_node > 1:
            raise ValueError(
                "the profile was compiled with one device per node, so it has no intra-node "
                "collectives to scale; compile it with local >= 2")
        inter = intra = 0.0
        for c in self.collectives:
            if c.role == "metric":
                inter += c.inter_bytes_per_node
                intra += c.intra_bytes_per_device
                continue
            width = workload.float_bytes / c.element_bytes if c.role == "float" else 1.0
            inter += c.inter_bytes_per_node * width * inter_scale
            intra += c.intra_bytes_per_device * width * intra_scale
        return inter, intra

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> CommProfile:
        return cls(
            label=d["label"], mesh_shape=tuple(d["mesh_shape"]), params=int(d["params"]),
            collectives=tuple(CollectiveCost(**c) for c in d["collectives"]),
        )


def profile_report(report: CommReport, *, params: int, label: str = "") -> CommProfile:
    """A :class:`CommProfile` from a communication report.

    Args:
      report: from :func:`zeropp_jax.analysis.comm_report.comm_report` on the compiled step.
      params: the compiled model's parameter count.
      label: a name for tables.
    """
    costs = []
    for c in report.collectives:
        inter, intra = link_bytes(c, report.mesh_shape)
        widths = {dtype_bytes(t) for t in c.dtype.split("+")}
        costs.append(CollectiveCost(
            kind=c.kind, axis=c.axis, role=_role(c), dtype=c.dtype,
            element_bytes=float(max(widths)), inter_bytes_per_node=inter,
            intra_bytes_per_device=intra, op_name=c.op_name,
        ))
    return CommProfile(label=label, mesh_shape=tuple(report.mesh_shape), params=int(params),
                       collectives=tuple(costs))


def profile_config(
    config,
    *,
    mesh=None,
    model=None,
    batch_size: int = 16,
    compress: bool | None = None,
    label: str = "",
) -> CommProfile:
    """Compiles the example GPT's train step for ``config`` and profiles it.

    Args:
      config: a :class:`zeropp_jax.ZeroConfig`.
      mesh: a ``(node, local)`` mesh with at least 2 nodes (default:
        :func:`zeropp_jax.make_mesh` ``(2, 4)``; needs 8 devices, e.g.
        ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on CPU).
      model: a :class:`zeropp_jax.models.gpt.GPTConfig` (default: its defaults).
      batch_size: global batch of the compiled step (does not change the bytes).
      compress: which qgZ variant; default: the steady state after the
        warm-up, i.e. the compressed step, or for 1-bit Adam with
        ``qgz_refresh_every = N`` the mean over one refresh cycle (``N - 1``
        compressed steps and one full-precision step: every collective of
        both, weighted by how often it runs).
      label: name for tables.
    """
    import functools

    import jax
    import optax

    import zeropp_jax as zp
    from zeropp_jax.analysis.comm_report import comm_report
    from zeropp_jax.models import gpt

    mesh = zp.make_mesh(2, 4) if mesh is None else mesh
    model = gpt.GPTConfig() if model is None else model
    shapes = jax.eval_shape(lambda k: gpt.init_params(model, k), jax.random.key(0))
    loss = functools.partial(gpt.loss_fn, cfg=model, gather=zp.gather, layer=zp.layer)
    # The optimizer does not change what crosses the wire, only which one runs.
    optimizer = zp.onebit_adam(1e-3) if config.qgz_target == "momentum" else optax.adam(1e-3)
    trainer = zp.make_trainer(loss, optimizer, shapes, mesh=mesh, config=config,
                              per_layer=True, stacked=("blocks",))
    _check_profile_mesh((trainer.nodes, trainer.local))
    batch = jax.ShapeDtypeStruct((batch_size, model.seq_len + 1), jax.numpy.int32)

    def profile(variant):
        compiled = trainer.compile_from_shapes(shapes, batch, compress=variant)
        report = comm_report(compiled, mesh_shape=(trainer.nodes, trainer.local))
        # Scale by the padded size: the compiled collectives move the padding
        # too, which vanishes (relative to the model) at the target's size.
        return profile_report(report, params=trainer.layout.padded_numel, label=label)

    every = config.qgz_refresh_every
    if compress is not None or not (trainer.qgz_active and every):
        return profile(compress)
    compressed, full = profile(True), profile(False)
    weighted = [(c, (every - 1) / every) for c in compressed.collectives]
    weighted += [(c, 1 / every) for c in full.collectives]
    return dataclasses.replace(compressed, collectives=tuple(
        dataclasses.replace(c, inter_bytes_per_node=w * c.inter_bytes_per_node,
                            intra_bytes_per_device=w * c.intra_bytes_per_device)
        for c, w in weighted))


def profile_preset(preset: str, *, label: str | None = None, **kwargs) -> CommProfile:
    """:func:`profile_config` for a preset plus :class:`~zeropp_jax.ZeroConfig` overrides.

    Example: ``profile_preset("zeropp", qgz="int4")``. Keyword arguments that
    :func:`profile_config` takes (``mesh``, ``model``, ``batch_size``,
    ``compress``) go there; the rest override the preset. The compute dtype
    defaults to float32 (what CPU runs; ``Workload.float_bytes`` sets the
    width on the target's wire).
    """
    import zeropp_jax as zp

    names = ("mesh", "model", "batch_size", "compress")
    step_args = {k: kwargs.pop(k) for k in names if k in kwargs}
    overrides = dict(kwargs)
    overrides.setdefault("compute_dtype", "float32")
    config = zp.ZeroConfig.from_preset(preset, **overrides)
    if label is None:
        label = preset + "".join(f" {k}={v}" for k, v in kwargs.items() if k != "compute_dtype")
    return profile_config(config, label=label, **step_args)


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
# 18B and 138B models on 48 nodes x 8 V100, as summarised in
# ../shared/reference/anchors.md: at 100 Gb/s "up to 2.2x, about 2x on
# average" (we compare with the average); at 400 Gb/s +28-36% with 1k tokens
# per GPU and +24-29% with 2k; ZeRO++ at 200 Gb/s matched ZeRO-3 at 800 Gb/s.
PUBLISHED = (
    PublishedPoint("100 Gb/s, 1k tokens/GPU", 100, 100, 1024, 2.0, 2.0),
    PublishedPoint("400 Gb/s, 1k tokens/GPU", 400, 400, 1024, 1.28, 1.36),
    PublishedPoint("400 Gb/s, 2k tokens/GPU", 400, 400, 2048, 1.24, 1.29),
    PublishedPoint("ZeRO++ 200 Gb/s vs ZeRO-3 800 Gb/s", 200, 800, 1024, 1.0, 1.0),
)
PUBLISHED_MODEL_SIZES = (18e9, 138e9)
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
        ``zeropp`` preset with ``qgz="int4"``: DeepSpeed's qgZ is int4).
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
