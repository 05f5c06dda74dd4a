"""The step's geometry: what a mesh, a layout and a config fix before any data.

:class:`StepGeometry` is computed once per trainer and read by everything
inside the step: device counts, the compute dtype, the quantization kernels,
the gather plan of every unit and the ``PartitionSpec`` of every state
leaf.  It holds no arrays and no mutable state.

State layouts (``U`` = a unit's padded length, ``[L,]`` its layer axis if
stacked; ``D = nodes * local``):

* parameters (and optax state over them, and 1-bit Adam's receiver carry):
  float32 ``([L,] U)`` sharded ``P([None,] ("local", "node"))``, a
  ``U / D`` shard per device (:meth:`StepGeometry.shard_specs`);
* per-node arrays (qgZ's sender carry, 1-bit Adam's ``m`` and ``v``, and
  the parameters with ``node_replicated``): float32 ``(nodes, [L,] U)``
  sharded ``P("node", [None,] "local")``: row ``n`` is node ``n``'s copy,
  split over ``local`` (the rows of ``m``, ``v`` and node-replicated
  parameters are equal);
* the batch: leading axis split over ``("node", "local")``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.config import ZeroConfig
from zeropp_jax.layout import ParamLayout, UnitLayout
from zeropp_jax.mesh import LOCAL, NODE, SHARD_AXES, mesh_shape
from zeropp_jax.step.plan import GatherPlan
from zeropp_jax.wire import collectives, quantization
from zeropp_jax.wire.kernels import Kernels, select

DATA_AXES = (NODE, LOCAL)


class IdleOnMeshWarning(UserWarning):
    """A feature the config switches on that the trainer's mesh leaves idle."""


@dataclasses.dataclass(frozen=True)
class StepGeometry:
    """Mesh, layout and config of one trainer, and everything derived from them.

    Attributes:
      mesh: the ``(node, local)`` mesh.
      config: the :class:`~zeropp_jax.config.ZeroConfig`.
      layout: the :class:`~zeropp_jax.layout.ParamLayout` of the units.
    """

    mesh: jax.sharding.Mesh
    config: ZeroConfig
    layout: ParamLayout

    # ------------------------------------------------------------ sizes
    @property
    def nodes(self) -> int:
        return mesh_shape(self.mesh)[0]

    @property
    def local(self) -> int:
        return mesh_shape(self.mesh)[1]

    @property
    def n_devices(self) -> int:
        return self.nodes * self.local

    @property
    def platform(self) -> str:
        return self.mesh.devices.flat[0].platform

    @property
    def one_step_in_flight(self) -> bool:
        """Whether :meth:`~zeropp_jax.Trainer.step` waits for its input state
        before dispatching.

        With hundreds of steps queued by asynchronous dispatch and no result
        read back, XLA:CPU aborted in a collective's rendezvous, on the
        simulated multi-device CPU mesh (``tests/test_train.py``). So on the
        CPU backend with several devices a step starts only after the
        previous one finished. On GPUs nothing waits.
        """
        return self.mesh.size > 1 and self.platform == "cpu"

    @property
    def compute_dtype(self) -> Any:
        return self.config.resolved_compute_dtype(self.platform)

    @property
    def kernels(self) -> Kernels:
        """The quantization kernels the step uses (reported in ``describe()``)."""
        device = self.mesh.devices.flat[0]
        rocm = "rocm" in f"{device.client.platform} {device.client.platform_version}".lower()
        return select(self.config.implementation, "rocm" if rocm else self.platform)

    @property
    def qgz_active(self) -> bool:
        """qgZ compresses only where something crosses nodes."""
        return self.config.qgz != "off" and self.nodes > 1

    @property
    def error_feedback(self) -> bool:
        return self.qgz_active and self.config.qgz_error_feedback

    @property
    def gathered_share(self) -> bool:
        """1-bit Adam's momentum codes reach every node in one all-gather (``qgz_share``).

        ``"auto"`` gathers where that moves no more bytes than the two hops,
        ``nodes - 1 <= 2 (nodes - 1) / nodes``: with two nodes (or one).
        """
        share = self.config.qgz_share
        return share == "gather" or (share == "auto" and self.nodes <= 2)

    @property
    def receiver_carry(self) -> bool:
        """1-bit Adam keeps a receiver carry: error feedback on the two hops' second one."""
        return self.error_feedback and not self.gathered_share

    @property
    def check_vma(self) -> bool:
        """shard_map's varying-axes check: on, except under the Pallas interpreter.

        JAX's Pallas *interpreter* evaluates kernel bodies with invariant
        constants next to varying blocks and fails the check ("Primitive div
        requires varying manual axes to match"); compiled kernels and the
        XLA path keep it on.
        """
        return self.kernels.name != "pallas-interpret"

    @property
    def decoded_secondary(self) -> bool:
        """hpZ's secondary partition holds decoded parameters (``hpz_secondary``):
        qwZ's codes cross nodes once per step, the per-layer gathers carry the
        compute dtype."""
        cfg = self.config
        return cfg.hpz and bool(cfg.qwz_bits) and cfg.hpz_secondary == "decoded"

    @functools.cached_property
    def plan(self) -> GatherPlan:
        """How every unit is gathered and its gradient reduced."""
        cfg = self.config
        return GatherPlan(
            gather_axes=(LOCAL,) if cfg.hpz or cfg.node_replicated else SHARD_AXES,
            reduce_axes=(LOCAL,) if cfg.hierarchical_grads else SHARD_AXES,
            bits=0 if self.decoded_secondary else cfg.qwz_bits,
            block=cfg.qwz_block,
            scale_dtype=cfg.scale_dtype,
            compute_dtype=self.compute_dtype,
            reduce_dtype=cfg.reduce_dtype or self.compute_dtype,
            kernels=self.kernels,
            # XLA:CPU widens 2-byte float reductions to float32 on the wire
            sum_bits=self.mesh.devices.flat[0].platform == "cpu",
            two_level=cfg.hierarchical_collectives,
            prefetch=cfg.prefetch and self.n_devices > 1,
            keep_activations=cfg.keep_activations,
        )

    def forms_secondary_per_layer(self, unit: UnitLayout) -> bool:
        """hpZ's secondary of ``unit`` is formed layer by layer in the forward, where
        :func:`layer_by_layer` under prefetch: :func:`~zeropp_jax.step.prefetch.scan_layers`
        gathers each layer's over ``node`` one layer ahead, behind the previous layer's
        compute, and keeps it for the backward, instead of the whole unit's up front, which
        nothing can hide (``lax.scan(zp.layer(...))``, ``nn.scan``: in each layer's forward).
        """
        cfg, plan = self.config, self.plan
        return cfg.hpz and not cfg.node_replicated and plan.prefetch and layer_by_layer(self, unit)

    def plan_of(self, unit: UnitLayout, sum_axes: tuple = ()) -> GatherPlan:
        """:attr:`plan`, forming the secondary per layer where :meth:`forms_secondary_per_layer`,
        reducing over all devices in two levels where not :func:`node_level_once`, and
        all-reducing over ``sum_axes`` where :func:`layer_by_layer` (``GatherPlan.sum_axes``)."""
        plan = self.secondary_plan if self.forms_secondary_per_layer(unit) else self.plan
        if self.config.hierarchical_grads and not node_level_once(self, unit):
            plan = dataclasses.replace(plan, reduce_axes=SHARD_AXES, two_level=True)
        if sum_axes and layer_by_layer(self, unit):
            plan = dataclasses.replace(plan, sum_axes=tuple(sum_axes))
        return plan

    @functools.cached_property
    def secondary_plan(self) -> GatherPlan:
        """:attr:`plan` whose source is the primary payload (qwZ's ``qwz_bits``
        codes, or the compute dtype): what forms hpZ's secondary partition
        (:func:`~zeropp_jax.step.gather.secondary_payload`)."""
        return dataclasses.replace(self.plan, secondary_bits=self.config.qwz_bits)

    # ------------------------------------------------------------ specs
    def shard_specs(self, axes: Any = SHARD_AXES) -> dict:
        """Unit name -> spec of a ``([L,] U)`` array split over all devices."""
        return {
            u.name: P(None, axes) if u.stack is not None else P(axes)
            for u in self.layout.units
        }

    def param_specs(self) -> dict:
        """Unit name -> spec of the master parameters: per node with
        ``node_replicated`` (``(nodes, [L,] U)``), else split over all devices."""
        return self.per_node_specs() if self.config.node_replicated else self.shard_specs()

    def per_node_specs(self) -> dict:
        """Unit name -> spec of a per-node ``(nodes, [L,] U)`` array."""
        return {
            u.name: P(NODE, None, LOCAL) if u.stack is not None else P(NODE, LOCAL)
            for u in self.layout.units
        }

    def carry_specs(self) -> dict:
        """qgZ's sender carry: per node with error feedback, else nothing."""
        return self.per_node_specs() if self.error_feedback else {}

    def batch_specs(self, batch: Any) -> Any:
        return jax.tree.map(lambda _: P(DATA_AXES), batch)

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def param_shardings(self) -> dict:
        return jax.tree.map(self.sharding, self.param_specs())

    def place_params(self, flat: dict) -> dict:
        """Master parameters from full flat units ``([L,] U)`` (under ``jit``).

        Split over all devices, or with ``node_replicated`` one equal row
        per node, ``(nodes, [L,] U)``, each split over ``local``.
        """
        if self.config.node_replicated:
            flat = {n: jnp.broadcast_to(x, (self.nodes,) + x.shape) for n, x in flat.items()}
        return jax.sharding.reshard(flat, self.param_shardings)

    @property
    def batch_sharding(self) -> NamedSharding:
        return self.sharding(P(DATA_AXES))

    def zeros(self, specs: dict, *, per_node: bool = False) -> dict:
        """float32 zeros for each unit in ``specs``, placed with that spec.

        Shaped ``([L,] U)``, or ``(nodes, [L,] U)`` with ``per_node``.
        """
        lead = (self.nodes,) if per_node else ()
        units = {u.name: u for u in self.layout.units}
        return {
            name: jax.sharding.reshard(
                jnp.zeros(lead + units[name].global_shape, jnp.float32), self.sharding(spec)
            )
            for name, spec in specs.items()
        }

    def memory_per_device(self) -> dict:
        """Bytes each device holds per ZeRO++ structure (from the layout).

        ``gather_source`` is what the per-layer gathers send, prepared once
        per step (:func:`~zeropp_jax.step.accumulate.unit_source`): this
        device's shard cast to the compute dtype (nothing extra when that is
        float32) or quantized with qwZ; with hpZ the node's copy of the
        model, sharded over ``local`` only (in the compute dtype unless
        ``hpz_secondary="quantized"``). ``master_params`` is ``1/local``
        of the float32 model with ``node_replicated``. ``grad_accumulator``
        holds gradients between the backward and the cross-node reduction:
        ``1/local`` of a unit reduced once per step (:func:`node_level_once`),
        ``1/(nodes*local)`` otherwise (in :func:`sink_dtype`). ``qgz_carry``: the error-feedback
        carry (``1/local`` of the model, float32; with 1-bit Adam the sender
        carry of the momentum).
        """
        cfg, units = self.config, self.layout.units
        padded = self.layout.padded_numel
        per_local = padded // self.local
        in_node = cfg.hpz or cfg.node_replicated
        source = per_local if in_node else padded // self.n_devices
        if self.plan.bits:
            source_bytes = quantization.wire_bytes(
                source, bits=cfg.qwz_bits, block=cfg.qwz_block, scale_dtype=cfg.scale_dtype
            )
        elif cfg.hpz or jnp.dtype(self.compute_dtype) != jnp.dtype(jnp.float32):
            source_bytes = source * jnp.dtype(self.compute_dtype).itemsize
        else:
            source_bytes = 0  # the float32 master shard is sent as it is
        accumulator = sum(  # node-partial where the node level runs once per step
            u.padded * (u.stack or 1) * jnp.dtype(sink_dtype(self, u)).itemsize
            // (self.local if node_level_once(self, u) else self.n_devices) for u in units)
        return {
            "master_params": 4 * (per_local if cfg.node_replicated else padded // self.n_devices),
            "gather_source": source_bytes,
            "grad_accumulator": accumulator,
            "qgz_carry": 4 * per_local if self.error_feedback else 0,
        }

    # ------------------------------------------------- inside shard_map
    def shard_mask(self, unit: UnitLayout, width: int) -> jax.Array:
        """bool ``(width,)``: real entries of this device's ``U / D`` shard."""
        return padding_mask(unit, collectives.axes_index(SHARD_AXES), width)


# Flat offsets from this many elements on do not fit int32 (units of 2.1B+
# parameters, e.g. a whole model under per_layer=False).
_INT32_LIMIT = 2**31


def padding_mask(unit: UnitLayout, shard_index: jax.Array, shard_size: int) -> jax.Array:
    """Boolean ``(shard_size,)``: which elements of a shard hold real values.

    Args:
      unit: the unit.
      shard_index: index of the shard along the flat vector (traced scalar).
      shard_size: elements per shard.
    """
    j = jnp.arange(shard_size)
    mask = jnp.zeros((shard_size,), bool)
    if unit.padded < _INT32_LIMIT:  # flat offsets fit int32
        index = j + shard_index * shard_size
        for start, end in unit.ranges:  # one range unless leaves are aligned
            mask = mask | ((index >= start) & (index < end))
        return mask
    # Element j of shard i is at i * shard_size + j, compared with each range
    # through (quotient, remainder) by shard_size: no flat offset is formed.
    # (Only here: the same mask built this way for every unit compiles into
    # other fusions, and the recorded losses would move in their last bits.)
    for start, end in unit.ranges:  # one range unless leaves are aligned
        (q0, r0), (q1, r1) = divmod(start, shard_size), divmod(end, shard_size)
        after_start = (shard_index > q0) | ((shard_index == q0) & (j >= r0))
        before_end = (shard_index < q1) | ((shard_index == q1) & (j < r1))
        mask = mask | (after_start & before_end)
    return mask


def node_level_once(geo: StepGeometry, unit: UnitLayout) -> bool:
    """``unit``'s gradient is reduced over ``local`` per layer and crosses
    nodes once per optimizer step, after the backward (qgZ's compression,
    hpZ's saving under gradient accumulation).

    hpZ alone reduces a stack (``L >= 2``) under one micro-batch over both
    axes per layer, in two levels, in the backward, where compute can hide
    it: the same bytes. An unstacked unit's gradient is complete only at the
    backward's end, and one used twice (a tied embedding) would cross nodes
    twice, so it crosses once.
    """
    cfg = geo.config
    return cfg.hierarchical_grads and (cfg.qgz != "off" or not layer_by_layer(geo, unit))


# Backends whose XLA widens 2-byte floats to float32 around an in-place update:
# a bfloat16 sink would be converted whole, both ways, at every layer's write.
WIDENS_HALF_FLOATS = frozenset({"cpu"})


def sink_dtype(geo: StepGeometry, unit: UnitLayout) -> Any:
    """The dtype ``unit``'s gradient sink holds (:class:`~zeropp_jax.step.gather.Unit`).

    A stack's rows under one micro-batch, reduced per layer over every
    device (not :func:`node_level_once`), are each written once with the
    reduced gradient, which arrives in the compute dtype: a sink in that
    dtype holds the same values at half the bytes of float32 (as plain JAX's
    gradients of parameters cast to bfloat16). Summed micro-batches, a
    node-partial gradient and unstacked units (a tied embedding is used
    twice) keep float32, and so does every sink on a backend in
    :data:`WIDENS_HALF_FLOATS`. A stack the loss runs twice in one step
    would sum its two gradients in the compute dtype.
    """
    cfg = geo.config
    if (cfg.grad_accum == 1 and unit.stack is not None and not node_level_once(geo, unit)
            and geo.platform not in WIDENS_HALF_FLOATS):
        return geo.compute_dtype
    return jnp.float32


def layer_by_layer(geo: StepGeometry, unit: UnitLayout) -> bool:
    """One micro-batch and a stack of ``L >= 2`` layers: ``unit``'s
    cross-node gradient traffic can run per layer in the backward (hpZ's
    reduce-scatter; 1-bit Adam's full-precision all-reduce)."""
    return geo.config.grad_accum == 1 and (unit.stack or 0) >= 2


def idle_features(config: ZeroConfig, nodes: int, local: int) -> list[str]:
    """The features ``config`` switches on that a ``nodes x local`` mesh gives
    nothing to do, by name: ``"hpz_one_device_per_node"`` (its secondary
    partition is the whole model on every device), ``"hpz_one_node"`` (a
    second copy of the master shards), ``"qgz_one_node"`` (nothing crosses
    nodes). :func:`idle_on_mesh` and the command line word them."""
    out = []
    if config.hpz and local == 1 and nodes > 1:
        out.append("hpz_one_device_per_node")
    if config.hpz and nodes == 1:
        out.append("hpz_one_node")
    if config.qgz != "off" and nodes == 1:
        out.append("qgz_one_node")
    return out


def idle_on_mesh(geo: StepGeometry) -> list[str]:
    """What ``geo``'s config switches on that its mesh gives nothing to do
    (:func:`idle_features`; ``make_trainer`` warns of each, as an
    :class:`IdleOnMeshWarning`)."""
    said = {
        "qgz_one_node": f"qgZ ({geo.config.qgz}) compresses only what crosses nodes, and this "
                        "mesh has one node: no step is compressed (a mesh of 2 or more nodes "
                        "uses it; qgz='off' says so)",
        "hpz_one_node": "hpZ keeps the per-layer gathers inside a node, and this mesh has one "
                        "node, where they are anyway: its secondary partition only adds a copy "
                        "of the master shards (hpz=False saves it)",
        "hpz_one_device_per_node": "hpZ's secondary partition is split over the devices of a "
                                   "node, and this mesh has one device per node: it is the whole "
                                   "model on every device (hpz=False saves that memory; a mesh "
                                   "with local >= 2 splits it)",
    }
    idle = idle_features(geo.config, geo.nodes, geo.local)
    return [message for name, message in said.items() if name in idle]


def check_kernel_blocks(geo: StepGeometry) -> None:
    """Raises ``ValueError`` if the step's Pallas kernels would get a qwZ or qgZ
    block that is not a power of two (the XLA kernels take any multiple of 8).
    Only the blocks of features that are on are checked."""
    if geo.kernels.name == "xla":
        return
    for name, block in geo.config.quantization_blocks().items():
        if block & (block - 1):
            raise ValueError(
                f"the Pallas kernels need power-of-two blocks, but {name}={block}; "
                "use a power of two or implementation='xla'"
            )
