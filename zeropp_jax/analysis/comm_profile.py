"""Communication profile of a compiled step: per-collective link bytes, ready to scale.

A :class:`CommProfile` holds, for every collective of one compiled train step
(the same HLO accounting as ``zeropp-comm``), the bytes it moves per step over
the inter-node and the intra-node links; :meth:`CommProfile.bytes_at` scales
them to a target model size and cluster for the cost model
(:mod:`zeropp_jax.analysis.cost_model`).

Byte accounting (per collective, per step, :func:`link_bytes`):

* Links are counted *hierarchically*, as a two-level algorithm moves data
  (exchange across nodes, then forward over NVLink; ZeRO++'s own design and
  NCCL's tree/CollNet/PXN paths): each distinct remote byte enters a node
  once (:func:`~zeropp_jax.analysis.collectives.two_level_bytes`, also
  ``zeropp-comm``'s headline). This is the least a node must receive. A flat
  ring over all ``N * L`` GPUs brings ``(NL - 1)/(NL)`` of the payload into
  every node instead of ``(N - 1)/N``: the same at the paper's 48 nodes (2%
  apart), up to twice as much on 2 nodes.
* Full-precision payloads are counted at ``Workload.float_bytes`` per element
  (2: bf16 on the wire). The profile is compiled on CPU, where XLA carries
  float collectives as f32 whatever the compute dtype; quantized codes and
  their scales move packed into bytes (named ``packed_bytes`` in the compiled
  program by :mod:`zeropp_jax.wire.collectives`) and keep their own widths.
* Scaling from the profile's ``(n0, l0)`` mesh and ``P0`` parameters to the
  target: inter-node bytes ``* (P / P0) * ((N-1)/N) / ((n0-1)/n0)``,
  intra-node bytes ``* (P / P0) * ((L-1)/L) / ((l0-1)/l0)``. Every ZeRO
  collective moves a fixed fraction of the model, which these factors carry
  to any mesh (see ``tests/test_cost_model.py`` for the check across meshes).
  One does not: 1-bit Adam's one-hop share (``qgz_share="gather"``) brings
  every other node's whole codes into each node, ``* (P / P0) * (N-1) /
  (n0-1)`` (``CollectiveCost.grows_with_nodes``).
"""

from __future__ import annotations

import dataclasses

from zeropp_jax.analysis import headline
from zeropp_jax.analysis.cluster import Cluster, Workload, check_positive_int
from zeropp_jax.analysis.collectives import link_bytes, payload_role
from zeropp_jax.analysis.comm_report import CommReport, comm_report
from zeropp_jax.analysis.hlo import dtype_bytes
from zeropp_jax.wire.collectives import EVERY_NODE_SCOPE

__all__ = [
    "CollectiveCost",
    "CommProfile",
    "example_trainer",
    "full_precision_share",
    "link_bytes",
    "profile_config",
    "profile_preset",
    "profile_report",
    "schedule_mean_profile",
]

def _check_profile_mesh(mesh_shape: tuple[int, int]) -> None:
    nodes, local = mesh_shape
    if nodes < 2:
        raise ValueError(
            f"a profile needs a mesh with at least 2 nodes (to see what crosses nodes), got "
            f"{nodes}x{local}; on a one-node machine compile it on simulated CPU devices "
            f"(JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8, mesh 2x4)")


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One collective of a profile: per-step link bytes on the profile's mesh.

    ``role`` is ``"packed"`` (a quantized payload's codes and scales as bytes),
    ``"float"`` (full precision: rescaled to ``Workload.float_bytes``),
    ``"metric"`` (a few scalars, not scaled with the model) or ``"other"``;
    ``element_bytes`` the compiled element width; ``per_layer``: it runs
    more than once per step (inside the layer loops: traffic that a
    prefetching runtime can overlap with the layers' compute); ``calls``:
    how many times it runs per step (its bytes are all of them together);
    ``grows_with_nodes``: each node takes every other node's whole payload,
    so its inter-node bytes scale as ``nodes - 1`` (module doc).
    """

    kind: str
    axis: str
    role: str
    dtype: str
    element_bytes: float
    inter_bytes_per_node: float
    intra_bytes_per_device: float
    op_name: str
    per_layer: bool = False
    calls: int = 1
    grows_with_nodes: bool = False


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
        check_positive_int("CommProfile.params", self.params)

    def bytes_at(self, cluster: Cluster, workload: Workload, *,
                 per_layer: bool | None = None) -> tuple[float, float]:
        """``(inter-node bytes per node, intra-node bytes per GPU)`` per step at scale.

        ``per_layer``: ``None`` counts every collective, ``True`` only the
        per-layer ones, ``False`` only those that run once per step.
        """
        inter = intra = 0.0
        for c, c_inter, c_intra in self.scaled(cluster, workload):
            if per_layer is None or c.per_layer == per_layer:
                inter, intra = inter + c_inter, intra + c_intra
        return inter, intra

    def scaled(self, cluster: Cluster, workload: Workload
               ) -> list[tuple[CollectiveCost, float, float]]:
        """Per collective, ``(collective, inter-node bytes per node, intra-node bytes
        per GPU)`` per step (all its calls) at scale (module doc)."""
        n0, l0 = self.mesh_shape
        size = workload.params / self.params
        f = lambda n: (n - 1) / n  # noqa: E731 - fraction of a gather held elsewhere
        inter_scale = size * f(cluster.nodes) / f(n0)
        intra_scale = size * (f(cluster.gpus_per_node) / f(l0) if l0 > 1 else 0.0)
        if l0 == 1 and cluster.gpus_per_node > 1:
            raise ValueError(
                "the profile was compiled with one device per node, so it has no intra-node "
                "collectives to scale; compile it with local >= 2")
        every_node_scale = size * (cluster.nodes - 1) / (n0 - 1)
        out = []
        for c in self.collectives:
            if c.role == "metric":
                out.append((c, c.inter_bytes_per_node, c.intra_bytes_per_device))
                continue
            width = workload.float_bytes / c.element_bytes if c.role == "float" else 1.0
            scale = every_node_scale if c.grows_with_nodes else inter_scale
            out.append((c, c.inter_bytes_per_node * width * scale,
                        c.intra_bytes_per_device * width * intra_scale))
        return out

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> CommProfile:
        return cls(
            label=d["label"], mesh_shape=tuple(d["mesh_shape"]), params=int(d["params"]),
            collectives=tuple(CollectiveCost(**c) for c in d["collectives"]),
        )


def profile_report(report: CommReport, *, params: int, gathered_share: bool,
                   label: str = "") -> CommProfile:
    """A :class:`CommProfile` from a communication report.

    Args:
      report: from :func:`zeropp_jax.analysis.comm_report.comm_report` on the compiled step.
      params: the compiled model's parameter count.
      label: a name for tables.
      gathered_share: whether the target takes 1-bit Adam's one-hop share
        too (its gather, marked ``EVERY_NODE_SCOPE``, then grows with the
        nodes): ``qgz_share="gather"``; ``False`` scales it as the two hops
        that replace it there (``"auto"`` beyond two nodes). No default: a
        profile of ``"auto"`` on two nodes gathers, and must say which.
    """
    costs = []
    for c in report.collectives:
        inter, intra = link_bytes(c, report.mesh_shape)
        widths = {dtype_bytes(t) for t in c.dtype.split("+")}
        role = payload_role(c)
        # Full-precision payloads are rescaled to the workload's width when
        # the profile is scaled; the rest count at the report's widths
        # (scales at the run's scale dtype).
        narrow = 1.0 if role == "float" else report.width_ratio(c)
        costs.append(CollectiveCost(
            kind=c.kind, axis=c.axis, role=role,
            dtype=c.dtype if role == "float" else report.wire_dtype(c),
            element_bytes=float(max(widths)) * narrow, inter_bytes_per_node=inter * narrow,
            intra_bytes_per_device=intra * narrow, op_name=c.op_name, per_layer=c.count > 1,
            calls=c.count,
            grows_with_nodes=gathered_share and f"/{EVERY_NODE_SCOPE}/" in c.op_name,
        ))
    return CommProfile(label=label, mesh_shape=tuple(report.mesh_shape), params=int(params),
                       collectives=tuple(costs))


def example_trainer(config, model, params_shapes, mesh):
    """The example GPT's trainer for ``config`` on ``mesh``: per-layer gathering
    over its stacked blocks, 1-bit Adam where ``config`` targets the momentum,
    optax Adam otherwise (the optimizer does not change what crosses the wire,
    only which one runs).

    Args:
      config: a :class:`zeropp_jax.ZeroConfig`.
      model: a :class:`zeropp_jax.models.gpt.GPTConfig`.
      params_shapes: the model's parameter shapes (``jax.eval_shape`` of its init).
      mesh: a ``(node, local)`` mesh.
    """
    import functools

    import optax

    import zeropp_jax as zp
    from zeropp_jax.models import gpt

    loss = functools.partial(gpt.loss_fn, cfg=model, gather=zp.gather, layer=zp.layer)
    optimizer = zp.onebit_adam(1e-3) if config.qgz_target == "momentum" else optax.adam(1e-3)
    return zp.make_trainer(loss, optimizer, params_shapes, mesh=mesh, config=config,
                           per_layer=True, stacked=("blocks",))


def profile_config(
    config,
    *,
    mesh=None,
    model=None,
    batch_size: int = 16,
    compress: bool | None = None,
    label: str = "",
    steps: int | None = None,
) -> CommProfile:
    """Compiles the example GPT's train step for ``config`` and profiles it.

    Args:
      config: a :class:`zeropp_jax.ZeroConfig`.
      mesh: a ``(node, local)`` mesh with at least 2 nodes (default:
        :func:`zeropp_jax.make_mesh` ``(2, 4)``; needs 8 devices, e.g.
        ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on CPU).
      model: a :class:`zeropp_jax.models.gpt.GPTConfig` (default: its defaults).
      batch_size: global batch of the compiled step (does not change the bytes).
      compress: which qgZ variant; default: the mean of the two as a run's
        schedule weights them (``steps``).
      label: name for tables.
      steps: the run the mean is taken over (every collective of both
        variants, weighted by how often it runs): ``None`` for the steady
        state after qgZ's warm-up, i.e. the compressed step, or for 1-bit
        Adam with ``qgz_refresh_every = N`` one refresh cycle (``N - 1``
        compressed steps and one full-precision step); a number for steps
        ``0 .. steps - 1``, the warm-up's full-precision steps included
        (:func:`~zeropp_jax.analysis.headline.full_precision_steps`).
    """
    import jax

    import zeropp_jax as zp
    from zeropp_jax.models import gpt

    mesh = zp.make_mesh(2, 4) if mesh is None else mesh
    model = gpt.GPTConfig() if model is None else model
    shapes = jax.eval_shape(lambda k: gpt.init_params(model, k), jax.random.key(0))
    trainer = example_trainer(config, model, shapes, mesh)
    _check_profile_mesh((trainer.nodes, trainer.local))
    batch = jax.ShapeDtypeStruct((batch_size, model.seq_len + 1), jax.numpy.int32)

    def profile(variant):
        compiled = trainer.compile_from_shapes(shapes, batch, compress=variant)
        report = comm_report(compiled, mesh_shape=(trainer.nodes, trainer.local))
        # Scale by the padded size: the compiled collectives move the padding
        # too, which vanishes (relative to the model) at the target's size.
        # qgz_share="auto" gathers on two nodes only, where its bytes equal
        # the two hops' it takes beyond: scaled as those.
        return profile_report(report, params=trainer.layout.padded_numel, label=label,
                              gathered_share=config.qgz_share == "gather")

    share = full_precision_share(config, trainer.nodes, steps)
    if compress is not None or not trainer.qgz_active or not share:
        return profile(compress)
    return schedule_mean_profile(profile(True), profile(False), share)


def full_precision_share(config, nodes: int, steps: int | None) -> float:
    """The fraction of steps that run a config's full-precision variant, on
    ``nodes`` nodes: over steps ``0 .. steps - 1`` (warm-up and refreshes),
    or with ``steps=None`` in the steady state after the warm-up (``1 / N``
    with a refresh every ``N`` steps, else 0). A gradient-RMS gate, which
    depends on the data, is not counted."""
    from zeropp_jax.step.schedule import QgzSchedule

    schedule = QgzSchedule.from_config(config, nodes)
    if not schedule.active:
        return 0.0
    if steps is None:
        return 1 / schedule.refresh_every if schedule.refresh_every else 0.0
    check_positive_int("steps", steps)
    return headline.full_precision_steps(schedule, steps) / steps


def schedule_mean_profile(compressed: CommProfile, full: CommProfile, share: float) -> CommProfile:
    """The mean step of a schedule: every collective of the compressed and the
    full-precision step's profiles, weighted by how often it runs (``share``
    of the steps at full precision); ``compressed``'s label and sizes."""
    weighted = [(c, 1 - share) for c in compressed.collectives]
    weighted += [(c, share) for c in full.collectives]
    return dataclasses.replace(compressed, collectives=tuple(
        dataclasses.replace(c, inter_bytes_per_node=w * c.inter_bytes_per_node,
                            intra_bytes_per_device=w * c.intra_bytes_per_device)
        for c, w in weighted))


def profile_preset(preset: str, *, label: str | None = None, **kwargs) -> CommProfile:
    """:func:`profile_config` for a preset plus :class:`~zeropp_jax.ZeroConfig` overrides.

    Example: ``profile_preset("zeropp", qgz="int4")``. Keyword arguments that
    :func:`profile_config` takes (``mesh``, ``model``, ``batch_size``,
    ``compress``, ``steps``) go there; the rest override the preset. The compute dtype
    defaults to float32 (what CPU runs; ``Workload.float_bytes`` sets the
    width on the target's wire).
    """
    import zeropp_jax as zp

    names = ("mesh", "model", "batch_size", "compress", "steps")
    step_args = {k: kwargs.pop(k) for k in names if k in kwargs}
    overrides = dict(kwargs)
    overrides.setdefault("compute_dtype", "float32")
    config = zp.ZeroConfig.from_preset(preset, **overrides)
    if label is None:
        label = preset + "".join(f" {k}={v}" for k, v in kwargs.items() if k != "compute_dtype")
    return profile_config(config, label=label, **step_args)

