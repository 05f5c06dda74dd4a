"""The train-step transform: ``(loss_fn, optax optimizer) -> init, step``.

``make_trainer`` turns a loss function and an optax optimizer into a
:class:`Trainer` whose ``init`` shards a full parameter pytree into float32
ZeRO-3 units and whose ``step`` is one ``jax.jit(jax.shard_map(...))`` over the
``(node, local)`` mesh, with the state donated.

Inside the shard_map, per optimizer step:

1. hpZ (optional): each node builds its secondary partition, the primary
   shards all-gathered over ``node`` (quantized with qwZ).  This is the only
   parameter traffic across nodes, and since it is rebuilt from the current
   primary at every step it can never be stale, also after a restore.
2. For each micro-batch, the loss is differentiated with respect to the
   units' gradient sinks: every ``gather`` the model makes is an all-gather
   (``local`` with hpZ, ``local`` and ``node`` otherwise) whose backward is a
   reduce-scatter (``local`` only when gradients are hierarchical).
3. Hierarchical gradients are summed over ``node`` once per step, at full
   precision or compressed by qgZ with error feedback (:mod:`zeropp_jax.wire.qgz`).
4. Gradients are divided by ``devices * grad_accum`` (the exact
   data-parallel mean) and padding is zeroed.

With ``qgz_target="momentum"`` steps 3-4 are replaced by 1-bit Adam
(:mod:`zeropp_jax.step.onebit_adam`), which runs inside the shard_map because its
exchange is of the momentum, not of the gradient; everything below applies
to the default ``qgz_target="gradient"``.

The optimizer then runs on the sharded float32 units under the same ``jit``;
element-wise transforms stay local and global reductions (e.g.
``clip_by_global_norm``) are partitioned by XLA, so they are exact.  The
optimizer sees one flat vector per unit, not the original leaves: per-leaf
masks or shape-dependent transforms (Adafactor) are not supported.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.wire import collectives, dither, quantization
from zeropp_jax.step import onebit_adam as momentum
from zeropp_jax.wire.kernels import Kernels, select
from zeropp_jax.config import ZeroConfig
from zeropp_jax.step.gather import GatherPlan, Unit, gather
from zeropp_jax.layout import (
    ParamLayout,
    build_layout,
    flatten_unit,
    join_units,
    padding_mask,
    split_units,
    unflatten_unit,
)
from zeropp_jax.mesh import LOCAL, NODE, SHARD_AXES, mesh_shape
from zeropp_jax.wire.qgz import QgzState, cross_node_reduce, cross_node_share

DATA_AXES = (NODE, LOCAL)


class ZeroOptState(NamedTuple):
    """Optimizer state: the user's optax state plus the qgZ state.

    Attributes:
      inner: the optax optimizer's state over the unit dict (float32 shards),
        or :class:`~zeropp_jax.step.onebit_adam.OneBitAdamState` with
        ``qgz_target="momentum"``.
      qgz: :class:`~zeropp_jax.wire.qgz.QgzState` (error-feedback carry: of the
        gradient, or the sender carry of the momentum).
    """

    inner: Any
    qgz: QgzState


class TrainState(NamedTuple):
    """Everything a step reads and writes; all leaves are sharded arrays.

    Attributes:
      step: int32 ``()``, optimizer steps taken.
      params: dict unit name -> float32 ``(padded,)`` or ``(L, padded)``
        master weights, sharded ``P([None,] ("local", "node"))``.
      opt_state: :class:`ZeroOptState`.
    """

    step: jax.Array
    params: dict
    opt_state: ZeroOptState


def _unit_spec(stacked: bool, axes: Any) -> P:
    return P(None, axes) if stacked else P(axes)


@dataclasses.dataclass(frozen=True)
class Trainer:
    """A ZeRO-3 / ZeRO++ train step. Build it with :func:`make_trainer`.

    Attributes:
      loss_fn: ``loss_fn(params, batch) -> float32 scalar`` (the local mean
        over this device's micro-batch). With per-layer gathering ``params``
        holds :class:`~zeropp_jax.step.gather.Unit` handles the model passes to
        ``gather``; otherwise plain parameters.
      optimizer: an ``optax.GradientTransformation``, or
        :class:`~zeropp_jax.step.onebit_adam.OneBitAdam` with
        ``qgz_target="momentum"``.
      mesh: the ``(node, local)`` mesh.
      config: the :class:`~zeropp_jax.config.ZeroConfig`.
      layout: the :class:`~zeropp_jax.layout.ParamLayout` of the units.
    """

    loss_fn: Callable[[Any, Any], jax.Array]
    optimizer: optax.GradientTransformation | momentum.OneBitAdam
    mesh: jax.sharding.Mesh
    config: ZeroConfig
    layout: ParamLayout

    # ----------------------------------------------------------------- shapes
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
    def compute_dtype(self) -> Any:
        platform = self.mesh.devices.flat[0].platform
        return self.config.resolved_compute_dtype(platform)

    @property
    def kernels(self) -> Kernels:
        """The quantization kernels this step uses (reported in describe())."""
        platform = self.mesh.devices.flat[0].platform
        return select(self.config.implementation, platform)

    @property
    def qgz_active(self) -> bool:
        """qgZ compresses only where something crosses nodes."""
        return self.config.qgz != "off" and self.nodes > 1

    @property
    def error_feedback(self) -> bool:
        return self.qgz_active and self.config.qgz_error_feedback

    @property
    def onebit_adam(self) -> bool:
        """Whether qgZ compresses Adam's momentum (the trainer runs 1-bit Adam)."""
        return self.config.qgz_target == "momentum"

    def _per_node_specs(self) -> dict:
        """``(nodes, [L,] padded)`` arrays: row ``n`` is node ``n``'s, split over ``local``."""
        return {
            u.name: P(NODE, None, LOCAL) if u.stack is not None else P(NODE, LOCAL)
            for u in self.layout.units
        }

    def _momentum_specs(self) -> dict:
        """1-bit Adam's ``m`` and ``v``: every node keeps its own copy of the whole unit.

        The copies are equal by construction (each node decodes the same
        codes), but the compiler cannot know that, so they are stored as the
        rows of a ``(nodes, [L,] padded)`` array.
        """
        return self._per_node_specs()

    def _receiver_carry_specs(self) -> dict:
        return self._param_specs() if self.error_feedback else {}

    def _param_specs(self, axes: Any = SHARD_AXES) -> dict:
        return {u.name: _unit_spec(u.stack is not None, axes) for u in self.layout.units}

    def _carry_specs(self) -> dict:
        return self._per_node_specs() if self.error_feedback else {}

    def _sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def param_shardings(self) -> dict:
        return jax.tree.map(self._sharding, self._param_specs())

    @property
    def batch_sharding(self) -> NamedSharding:
        return self._sharding(P(DATA_AXES))

    def _plan(self) -> GatherPlan:
        cfg = self.config
        reduce_dtype = cfg.reduce_dtype or self.compute_dtype
        return GatherPlan(
            gather_axes=(LOCAL,) if cfg.hpz else SHARD_AXES,
            reduce_axes=(LOCAL,) if cfg.hierarchical_grads else SHARD_AXES,
            bits=cfg.qwz_bits,
            block=cfg.qwz_block,
            scale_dtype=cfg.scale_dtype,
            compute_dtype=self.compute_dtype,
            reduce_dtype=reduce_dtype,
            kernels=self.kernels,
        )

    # ------------------------------------------------------------------ init
    def init(self, params: Any) -> TrainState:
        """Shards a full parameter pytree and initializes the optimizer.

        Args:
          params: the full parameters (any float dtypes; stored as float32),
            with the structure the trainer was built for.

        Returns:
          The sharded :class:`TrainState` at step 0.
        """
        _check_structure(params, self.layout)
        with jax.set_mesh(self.mesh):
            return self._init_jit(params)

    @functools.cached_property
    def _init_jit(self) -> Callable:
        def init(params):
            trees = split_units(params, self.layout)
            flat = {u.name: flatten_unit(trees[u.name], u) for u in self.layout.units}
            flat = jax.sharding.reshard(flat, self.param_shardings)
            return self._init_from_flat(flat)

        return jax.jit(init)

    def _init_from_flat(self, flat: dict) -> TrainState:
        if self.onebit_adam:
            def zeros(specs, per_node=False):
                lead = (self.nodes,) if per_node else ()
                return {
                    name: jax.sharding.reshard(
                        jnp.zeros(lead + flat[name].shape, jnp.float32), self._sharding(spec)
                    )
                    for name, spec in specs.items()
                }

            inner = momentum.OneBitAdamState(
                count=jnp.zeros((), jnp.int32),
                v_count=jnp.zeros((), jnp.int32),
                m=zeros(self._momentum_specs(), per_node=True),
                v=zeros(self._momentum_specs(), per_node=True),
                receiver_carry=zeros(self._receiver_carry_specs()),
            )
        else:
            inner = self.optimizer.init(flat)
        carry = {}
        if self.error_feedback:
            for u in self.layout.units:
                spec = self._carry_specs()[u.name]
                carry[u.name] = jax.sharding.reshard(
                    jnp.zeros((self.nodes,) + u.global_shape, jnp.float32),
                    self._sharding(spec),
                )
        qgz = QgzState(carry=carry, grad_rms=jnp.full((), jnp.inf, jnp.float32))
        return TrainState(jnp.zeros((), jnp.int32), flat, ZeroOptState(inner, qgz))

    # ------------------------------------------------------------------ step
    def shard_batch(self, batch: Any) -> Any:
        """Places a global host batch on the mesh, split over all devices.

        Args:
          batch: pytree of arrays with leading axis ``B`` (the global batch);
            on a multi-process run, each process passes only its own
            ``B / process_count`` rows.

        Raises:
          ValueError: if ``B`` does not divide into ``devices * grad_accum``.
        """
        n_proc = jax.process_count()
        per_step = self.n_devices * self.config.grad_accum

        def put(x):
            x = np.asarray(x)
            global_b = x.shape[0] * n_proc
            if x.ndim == 0 or global_b % per_step:
                raise ValueError(
                    f"batch size {global_b} must be divisible by devices x grad_accum "
                    f"= {self.n_devices} x {self.config.grad_accum} = {per_step}"
                )
            if n_proc == 1:
                return jax.device_put(x, self.batch_sharding)
            return jax.make_array_from_process_local_data(
                self.batch_sharding, x, (global_b,) + x.shape[1:]
            )

        return jax.tree.map(put, batch)

    def compress_at(self, step: int, grad_rms: float) -> bool:
        """The qgZ schedule: whether step ``step`` reduces compressed.

        Full precision for the first ``qgz_warmup_steps`` steps, and while the
        last step's gradient RMS is below ``qgz_min_grad_rms`` (if set); with
        ``qgz_refresh_every = N``, also every ``N``-th step after the warm-up.
        """
        cfg = self.config
        if not self.qgz_active or step < cfg.qgz_warmup_steps:
            return False
        n = cfg.qgz_refresh_every
        if n and (step - cfg.qgz_warmup_steps + 1) % n == 0:
            return False
        return not (cfg.qgz_min_grad_rms > 0 and grad_rms < cfg.qgz_min_grad_rms)

    def _schedule_is_static(self) -> bool:
        cfg = self.config
        return cfg.qgz_warmup_steps == 0 and cfg.qgz_min_grad_rms == 0 and not cfg.qgz_refresh_every

    def step(self, state: TrainState, batch: Any, *, compress: bool | None = None):
        """One optimizer step (``grad_accum`` micro-batches).

        Args:
          state: the current state (donated: do not use it afterwards).
          batch: the global batch, a pytree placed by :meth:`shard_batch` (a
            host array is placed automatically).
          compress: force the qgZ variant; ``None`` follows the schedule
            (which reads the step counter from the device only when a
            warm-up or gate is configured).

        Returns:
          ``(new_state, metrics)``: metrics is a dict of scalars ``loss``,
          ``grad_norm``, ``grad_rms`` and ``compressed`` (0 or 1).
        """
        if compress is None:
            if not self.qgz_active:
                compress = False
            elif self._schedule_is_static():
                compress = True
            else:
                compress = self.compress_at(
                    int(state.step), float(state.opt_state.qgz.grad_rms)
                )
        if any(not isinstance(x, jax.Array) for x in jax.tree.leaves(batch)):
            batch = self.shard_batch(batch)
        if self._one_step_in_flight:
            jax.block_until_ready(state)
        with jax.set_mesh(self.mesh):
            return self._step_variants[bool(compress)](state, batch)

    @functools.cached_property
    def _one_step_in_flight(self) -> bool:
        """Whether :meth:`step` waits for its input state before dispatching.

        With hundreds of steps queued by asynchronous dispatch and no result
        read back, XLA:CPU aborted in a collective's rendezvous ("Expected 8
        threads to join the rendezvous", after 40 s; the stuck threads sit in
        its thunk executor on the shared Eigen pool), reproducibly on the
        simulated 2x4 mesh (``tests/test_train.py``). So on the CPU backend
        with several devices a step starts only after the previous one
        finished. On GPUs nothing waits.
        """
        return self.mesh.size > 1 and self.mesh.devices.flat[0].platform == "cpu"

    @functools.cached_property
    def _step_variants(self) -> dict[bool, Callable]:
        """The two compiled step variants of the qgZ schedule (lazily jitted)."""
        return {
            compress: jax.jit(
                functools.partial(self._step_global, compress=compress), donate_argnums=0
            )
            for compress in (True, False)
        }

    def lower(self, state: Any, batch: Any, *, compress: bool | None = None):
        """Lowers the step (for the communication report), without running it.

        ``state`` and ``batch`` may be abstract (``jax.ShapeDtypeStruct`` with
        shardings, e.g. from :meth:`abstract_state`).
        """
        if compress is None:
            compress = self.qgz_active
        with jax.set_mesh(self.mesh):
            return self._step_variants[bool(compress)].lower(state, batch)

    def compile_from_shapes(self, params_shapes: Any, batch: Any, *, compress: bool | None = None):
        """Compiles the step from shapes alone: nothing is allocated or run.

        Args:
          params_shapes: the full parameters' shapes and dtypes (e.g.
            ``jax.eval_shape`` of an init function).
          batch: the global batch's shapes and dtypes (a pytree of anything
            with ``.shape`` and ``.dtype``); placed like :meth:`shard_batch`.
          compress: the qgZ variant, as in :meth:`lower`.

        Returns:
          The compiled step (``.as_text()`` for the HLO, ``.memory_analysis()``).
        """
        state = self.abstract_state(params_shapes)
        batch = jax.tree.map(
            lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=self.batch_sharding), batch
        )
        return self.lower(state, batch, compress=compress).compile()

    def abstract_state(self, params_shapes: Any) -> TrainState:
        """The state's shapes, dtypes and shardings, computed without data."""
        with jax.set_mesh(self.mesh):
            return jax.eval_shape(self._init_jit, params_shapes)

    @property
    def _check_vma(self) -> bool:
        # JAX's Pallas *interpreter* evaluates kernel bodies with invariant
        # constants next to varying blocks and fails the varying-axes check
        # ("Primitive div requires varying manual axes to match"); compiled
        # kernels and the XLA path keep the check on.
        return self.kernels.name != "pallas-interpret"

    def _step_global(self, state: TrainState, batch: Any, *, compress: bool):
        if self.onebit_adam:
            return self._onebit_adam_global(state, batch, compress=compress)
        param_specs = self._param_specs()
        carry_specs = self._carry_specs()
        batch_specs = jax.tree.map(lambda _: P(DATA_AXES), batch)
        body = functools.partial(self._local_grads, compress=compress)
        check_vma = self._check_vma
        grads, carry, metrics = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(param_specs, carry_specs, batch_specs, P()),
            out_specs=(param_specs, carry_specs, P()),
            check_vma=check_vma,
        )(state.params, state.opt_state.qgz.carry, batch, state.step)
        with jax.named_scope("optimizer"):
            updates, inner = self.optimizer.update(
                grads, state.opt_state.inner, state.params
            )
            params = optax.apply_updates(state.params, updates)
        qgz = QgzState(carry=carry, grad_rms=metrics["grad_rms"])
        new_state = TrainState(state.step + 1, params, ZeroOptState(inner, qgz))
        return new_state, metrics

    def _local_grads(
        self, params: dict, carry: dict, batch: Any, step: jax.Array, *, compress: bool
    ):
        """Per-device body of the step (inside shard_map).

        Args:
          params: name -> float32 ``([L,] padded / D)`` primary shard.
          carry: name -> float32 ``(1, [L,] padded / local)`` or empty.
          batch: pytree of ``(B / D, ...)`` arrays.
          step: int32 scalar optimizer step (replicated; it names the dither
            noise of ``qgz_code="dither"``).

        Returns:
          ``(grads, carry, metrics)`` with grads shaped like ``params``.
        """
        cfg = self.config
        plan = self._plan()
        accum = cfg.grad_accum
        all_axes = (NODE, LOCAL)
        acc, losses = self._accumulate(params, batch)

        grads, new_carry = {}, {}
        dithered = cfg.qgz_code == "dither"
        local_index = jax.lax.axis_index(LOCAL) if dithered else None
        for unit_index, u in enumerate(self.layout.units):
            g = acc[u.name]
            if cfg.hierarchical_grads:
                c = carry[u.name][0] if u.name in carry else None
                key = (
                    dither.stream_key(cfg.qgz_seed, step, unit_index, local_index)
                    if dithered else None  # only the dithered code draws noise
                )
                with jax.named_scope(f"cross_node_{u.name}"):
                    g, c, _ = cross_node_reduce(
                        g,
                        c,
                        bits=cfg.qgz_bits,
                        block=cfg.qgz_block,
                        scale_dtype=cfg.scale_dtype,
                        reduce_dtype=plan.reduce_dtype,
                        compress=compress,
                        kernels=plan.kernels,
                        code=cfg.qgz_code,
                        key=key,
                    )
                if c is not None:
                    new_carry[u.name] = c[None]
            g = g / (self.n_devices * accum)
            shard_index = collectives.axes_index(SHARD_AXES)
            mask = padding_mask(u, shard_index, g.shape[-1])
            grads[u.name] = jnp.where(mask, g, 0.0)

        sq = sum(jnp.sum(jnp.square(g)) for g in grads.values())
        sq = jax.lax.psum(sq, all_axes)
        return grads, new_carry, self._metrics(losses, sq, compress)

    def _metrics(self, losses: jax.Array, sq_norm: jax.Array, compress: bool) -> dict:
        """The step's metrics (inside shard_map): replicated float32 / int32 scalars.

        ``sq_norm`` is the squared gradient norm, the same on every device.
        """
        return {
            "loss": jax.lax.pmean(jnp.mean(losses), (NODE, LOCAL)),
            "grad_norm": jnp.sqrt(sq_norm),
            "grad_rms": jnp.sqrt(sq_norm / self.layout.numel),
            "compressed": jnp.asarray(int(compress and self.qgz_active), jnp.int32),
        }

    # ------------------------------------------------------------ 1-bit Adam
    def _onebit_adam_global(self, state: TrainState, batch: Any, *, compress: bool):
        """The step with ``qgz_target="momentum"``: 1-bit Adam, all inside shard_map."""
        inner: momentum.OneBitAdamState = state.opt_state.inner
        param_specs = self._param_specs()
        m_specs = self._momentum_specs()
        recv_specs = self._receiver_carry_specs()
        carry_specs = self._carry_specs()
        batch_specs = jax.tree.map(lambda _: P(DATA_AXES), batch)
        body = functools.partial(self._onebit_adam_local, compress=compress)
        params, m, v, recv, carry, v_count, metrics = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(param_specs, m_specs, m_specs, recv_specs, carry_specs, batch_specs, P(), P()),
            out_specs=(param_specs, m_specs, m_specs, recv_specs, carry_specs, P(), P()),
            check_vma=self._check_vma,
        )(state.params, inner.m, inner.v, inner.receiver_carry, state.opt_state.qgz.carry,
          batch, inner.count, inner.v_count)
        inner = momentum.OneBitAdamState(inner.count + 1, v_count, m, v, recv)
        qgz = QgzState(carry=carry, grad_rms=metrics["grad_rms"])
        return TrainState(state.step + 1, params, ZeroOptState(inner, qgz)), metrics

    def _onebit_adam_local(
        self, params, m, v, recv, carry, batch, count, v_count, *, compress: bool
    ):
        """Per-device 1-bit Adam step (inside shard_map; see :mod:`zeropp_jax.step.onebit_adam`).

        Args:
          params, v, recv: name -> float32 ``([L,] padded / D)`` (``recv``
            empty without error feedback).
          m: name -> float32 ``(1, [L,] padded / local)``, this ``local``
            slice (the same on every node).
          carry: name -> float32 ``(1, [L,] padded / local)`` or empty.
          batch: pytree of ``(B / D, ...)`` arrays.
          count, v_count: int32 scalars (steps taken; the step count at
            ``v``'s last update).

        Returns:
          ``(params, m, v, recv, carry, v_count, metrics)``. Full-precision
          steps all-reduce gradients over ``node``; compressed steps move
          quantized momentum codes over ``node`` (an all-to-all and an
          all-gather). Everything else stays inside the node.
        """
        cfg = self.config
        hyper: momentum.OneBitAdam = self.optimizer
        plan = self._plan()
        acc, losses = self._accumulate(params, batch)
        compress = compress and self.qgz_active
        local_index = jax.lax.axis_index(LOCAL)
        shard_index = collectives.axes_index(SHARD_AXES)
        slice_masks = {
            u.name: padding_mask(u, local_index, u.padded // self.local) for u in self.layout.units
        }
        # Full precision: the mean gradient over all devices, on every node.
        # Compressed: this node's mean gradient (the nodes' average is the mean).
        if compress:
            scale = self.nodes / (self.n_devices * cfg.grad_accum)
            g = {name: a * scale for name, a in acc.items()}
        else:
            scale = 1.0 / (self.n_devices * cfg.grad_accum)
            with jax.named_scope("cross_node_all_reduce"):
                g = {
                    name: collectives.all_reduce(a, (NODE,), plan.reduce_dtype) * scale
                    for name, a in acc.items()
                }
        g = {name: jnp.where(slice_masks[name], x, 0.0) for name, x in g.items()}
        # This node's squared norm (compressed) or the global one (full precision).
        sq = jax.lax.psum(sum(jnp.sum(jnp.square(x)) for x in g.values()), LOCAL)
        clip = hyper.clip_scale(sq)

        new_params, new_m, new_v, new_recv, new_carry = {}, {}, {}, {}, {}
        t = count + 1
        new_v_count = v_count if compress else t  # the step of v's last update
        for u in self.layout.units:
            name = u.name
            m_slice, v_slice = m[name][0], v[name][0]
            if compress:
                # In the preconditioned space u = m / (sqrt(v_hat) + eps) (v is
                # frozen, so the momentum recursion is the same there): the
                # 1-bit code's shared block magnitude then errs in units of the
                # update, not of m, where a coordinate with a tiny v (a gradient
                # that is ~0, e.g. attention key biases) would turn the code's
                # error into an unbounded step.
                d = momentum.preconditioner(v_slice, v_count, hyper)
                local_u = momentum.next_momentum(m_slice / d, clip * g[name] / d, hyper.b1)
                c = carry[name][0] if name in carry else None
                with jax.named_scope(f"cross_node_{name}"):
                    summed, c, _ = cross_node_reduce(
                        local_u, c, bits=cfg.qgz_bits, block=cfg.qgz_block,
                        scale_dtype=cfg.scale_dtype, reduce_dtype=plan.reduce_dtype,
                        compress=True, kernels=plan.kernels,
                    )
                    shared, r = cross_node_share(
                        summed / self.nodes, recv.get(name), bits=cfg.qgz_bits,
                        block=cfg.qgz_block, scale_dtype=cfg.scale_dtype, kernels=plan.kernels,
                    )
                if c is not None:
                    new_carry[name], new_recv[name] = c[None], r
                m_slice = jnp.where(slice_masks[name], shared, 0.0) * d
            else:
                # exact, and the same on every node: all reduced the same gradient.
                # v is an average over time: a refresh after k compressed steps
                # decays it by b2**k.
                d_old = momentum.preconditioner(v_slice, v_count, hyper)
                b2_k = hyper.b2 ** (t - v_count).astype(jnp.float32)
                m_slice = momentum.next_momentum(m_slice, clip * g[name], hyper.b1)
                v_slice = momentum.next_second_moment(v_slice, clip * g[name], b2_k)
                if name in carry:
                    # the carries wait, re-expressed in the new update units
                    ratio = d_old / momentum.preconditioner(v_slice, t, hyper)
                    new_carry[name] = carry[name] * ratio[None]
                    new_recv[name] = recv[name] * momentum.own_chunk(ratio, NODE)
            new_m[name], new_v[name] = m_slice[None], v_slice[None]
            stepped = momentum.adam_step(
                params[name], momentum.own_chunk(m_slice, NODE), momentum.own_chunk(v_slice, NODE),
                count=t, v_count=new_v_count, hyper=hyper,
            )
            mask = padding_mask(u, shard_index, params[name].shape[-1])
            new_params[name] = jnp.where(mask, stepped, params[name])
        # Compressed steps report the root mean square over nodes of each node's
        # gradient norm (the global gradient is never formed there).
        sq_metric = jax.lax.pmean(sq, NODE) if compress else sq
        metrics = self._metrics(losses, sq_metric, compress)
        return new_params, new_m, new_v, new_recv, new_carry, new_v_count, metrics

    def _accumulate(self, params: dict, batch: Any) -> tuple[dict, jax.Array]:
        """Gradients of all micro-batches, summed (inside shard_map).

        Args:
          params: name -> float32 ``([L,] padded / D)`` primary shard.
          batch: pytree of ``(B / D, ...)`` arrays.

        Returns:
          ``(acc, losses)``: name -> float32 summed gradient, the node-partial
          ``([L,] padded / local)`` with hierarchical gradients, else the
          ``([L,] padded / D)`` shard summed over all devices; and the
          ``(grad_accum,)`` micro-batch losses of this device.
        """
        cfg = self.config
        plan = self._plan()
        accum = cfg.grad_accum
        all_axes = (NODE, LOCAL)

        sources = {}
        for u in self.layout.units:
            p = params[u.name]
            if cfg.hpz:
                with jax.named_scope(f"hpz_secondary_{u.name}"):
                    sources[u.name] = self._secondary(p)
            else:
                sources[u.name] = p

        def zero_sink(u):
            shard = params[u.name]
            width = u.padded // self.local if cfg.hierarchical_grads else shard.shape[-1]
            zeros = jnp.zeros(shard.shape[:-1] + (width,), jnp.float32)
            return jax.lax.pcast(zeros, all_axes, to="varying")

        sinks0 = {u.name: zero_sink(u) for u in self.layout.units}

        def loss_of_sinks(sinks, micro_batch):
            units = {
                u.name: Unit(sources[u.name], sinks[u.name], u, plan)
                for u in self.layout.units
            }
            tree = join_units(units, self.layout)
            if self.layout.whole_model:
                tree = gather(tree)
            loss = self.loss_fn(tree, micro_batch)
            if jnp.shape(loss) != ():
                raise ValueError(
                    f"loss_fn must return a scalar, got shape {jnp.shape(loss)}"
                )
            return loss.astype(jnp.float32)

        def micro_step(acc, micro_batch):
            loss, g = jax.value_and_grad(loss_of_sinks)(sinks0, micro_batch)
            return jax.tree.map(jnp.add, acc, g), loss

        micro_batches = jax.tree.map(
            lambda x: jnp.reshape(x, (accum, x.shape[0] // accum) + x.shape[1:]), batch
        )
        return jax.lax.scan(micro_step, sinks0, micro_batches)

    def _secondary(self, primary: jax.Array) -> Any:
        """hpZ: this node's partition, the primary shards gathered over node.

        Args:
          primary: float32 ``([L,] padded / D)``.

        Returns:
          ``([L,] padded / local)`` in the compute dtype, or a ``Quantized``
          pair when qwZ is on (the refresh crosses nodes quantized).
        """
        cfg = self.config
        if cfg.qwz_bits:
            q = self.kernels.quantize(
                primary, bits=cfg.qwz_bits, block=cfg.qwz_block, scale_dtype=cfg.scale_dtype
            )
            return collectives.all_gather(q, (NODE,))
        return collectives.all_gather(primary.astype(self.compute_dtype), (NODE,))

    # ---------------------------------------------------------------- export
    def gather_params(self, state_or_params: Any) -> Any:
        """The full, unpadded parameters as a host (numpy) pytree.

        Args:
          state_or_params: a :class:`TrainState` or its ``params`` dict.

        Returns:
          The parameter pytree in its original structure and leaf dtypes.
        """
        flat = getattr(state_or_params, "params", state_or_params)
        with jax.set_mesh(self.mesh):
            replicated = jax.jit(
                lambda x: x,
                out_shardings=jax.tree.map(lambda _: self._sharding(P()), flat),
            )(flat)
        trees = {}
        for u in self.layout.units:
            host = np.asarray(replicated[u.name].addressable_data(0))
            trees[u.name] = jax.tree.map(
                np.asarray, unflatten_unit(jnp.asarray(host), u, "original")
            )
        return join_units(trees, self.layout)

    def memory_per_device(self) -> dict:
        """Bytes each device holds per ZeRO++ structure (from the layout).

        ``hpz_secondary`` is hpZ's extra cost: the node's copy of the model,
        sharded over ``local`` only, built once per step. ``grad_accumulator``
        holds gradients between the backward and the cross-node reduction:
        ``1/local`` of the model with hierarchical gradients (hpZ or qgZ),
        ``1/(nodes*local)`` otherwise. ``qgz_carry`` is the error-feedback
        carry (``1/local`` of the model, float32; with
        ``qgz_target="momentum"`` the sender carry of the momentum).
        ``onebit_adam_extra``: see :meth:`_onebit_adam_extra_bytes`.
        """
        cfg = self.config
        padded = self.layout.padded_numel
        per_local = padded // self.local
        secondary = 0
        if cfg.hpz:
            if cfg.qwz_bits:
                secondary = quantization.wire_bytes(
                    per_local, bits=cfg.qwz_bits, block=cfg.qwz_block,
                    scale_dtype=cfg.scale_dtype,
                )
            else:
                secondary = per_local * jnp.dtype(self.compute_dtype).itemsize
        accumulator = 4 * (per_local if cfg.hierarchical_grads else padded // self.n_devices)
        return {
            "master_params": 4 * padded // self.n_devices,
            "hpz_secondary": secondary,
            "grad_accumulator": accumulator,
            "qgz_carry": 4 * per_local if self.error_feedback else 0,
            "onebit_adam_extra": self._onebit_adam_extra_bytes(),
        }

    def _onebit_adam_extra_bytes(self) -> int:
        """1-bit Adam's state beyond optax Adam's ``m`` and ``v`` shards.

        Its ``m`` and ``v`` are the node's copies of this device's ``local``
        slice (``1/local`` of the model each, not ``1/(nodes*local)``), plus
        the receiver carry (``1/(nodes*local)``, with error feedback).
        """
        if not self.onebit_adam:
            return 0
        padded = self.layout.padded_numel
        extra = 2 * (padded // self.local - padded // self.n_devices)
        if self.error_feedback:
            extra += padded // self.n_devices
        return 4 * extra

    def describe(self) -> dict:
        """What runs where: plain data for reports and metrics files."""
        return {
            "memory_per_device": self.memory_per_device(),
            "mesh": {"node": self.nodes, "local": self.local},
            "config": self.config.describe(),
            "compute_dtype": jnp.dtype(self.compute_dtype).name,
            "kernels": self.kernels.name,
            "qgz_active": self.qgz_active,
            "units": len(self.layout.units),
            "per_layer": not self.layout.whole_model,
            "params": self.layout.numel,
            "padded_params": self.layout.padded_numel,
            "largest_unit": self.layout.largest_unit_numel,
        }


def _check_structure(params: Any, layout: ParamLayout) -> None:
    trees = split_units(params, layout)
    for u in layout.units:
        leaves = jax.tree_util.tree_leaves(trees[u.name])
        structure = jax.tree_util.tree_structure(trees[u.name])
        if structure != u.treedef and u.stack is None:
            raise ValueError(
                f"parameters of unit {u.name!r} have structure {structure}, "
                f"expected {u.treedef}"
            )
        for spec, leaf in zip(u.leaves, leaves):
            shape = tuple(np.shape(leaf))
            expected = spec.shape if u.stack is None else (u.stack,) + spec.shape
            if shape != expected:
                raise ValueError(
                    f"parameter {u.name}{spec.path} has shape {shape}, expected "
                    f"{expected}"
                )


def make_trainer(
    loss_fn: Callable[[Any, Any], jax.Array],
    optimizer: optax.GradientTransformation | momentum.OneBitAdam,
    params: Any,
    *,
    mesh: jax.sharding.Mesh,
    config: ZeroConfig | None = None,
    per_layer: bool = False,
    stacked: Sequence[str] = (),
) -> Trainer:
    """Builds a ZeRO-3 / ZeRO++ :class:`Trainer`.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over the
        micro-batch it is given.
      optimizer: an optax ``GradientTransformation``; with
        ``config.qgz_target="momentum"``, :func:`zeropp_jax.onebit_adam`.
      params: the parameter pytree, or its shapes (``jax.eval_shape``).
      mesh: a ``(node, local)`` mesh from :func:`zeropp_jax.make_mesh`.
      config: a :class:`ZeroConfig` (default: ``zero3``).
      per_layer: ``True`` if ``loss_fn`` gathers each top-level entry of
        ``params`` itself with :func:`zeropp_jax.gather` (inside
        :func:`zeropp_jax.layer`), like FSDP's wrap policy; ``False`` gathers
        the whole model before calling ``loss_fn`` with plain parameters (any
        Flax Linen or NNX model, unchanged).
      stacked: top-level keys of ``params`` whose leaves stack layers along
        axis 0 (for ``lax.scan``); each layer is gathered separately.

    Returns:
      The :class:`Trainer`.

    Example::

      mesh = zeropp_jax.make_mesh(2, 4)
      trainer = zeropp_jax.make_trainer(
          loss, zeropp_jax.onebit_adam(1e-3, clip_norm=1.0), params, mesh=mesh,
          config=zeropp_jax.ZeroConfig.from_preset("zeropp"),  # 1-bit Adam
          per_layer=True, stacked=("blocks",))
      state = trainer.init(params)
      state, metrics = trainer.step(state, batch)
    """
    config = config or ZeroConfig()
    is_onebit = isinstance(optimizer, momentum.OneBitAdam)
    if config.qgz_target == "momentum" and not is_onebit:
        raise ValueError(
            "qgz_target='momentum' compresses Adam's momentum, so the trainer runs the "
            "optimizer itself: pass zeropp_jax.onebit_adam(learning_rate, ...) as the "
            f"optimizer (got {type(optimizer).__name__}), or use qgz_target='gradient' "
            "with any optax optimizer"
        )
    if is_onebit and config.qgz_target != "momentum":
        raise ValueError(
            "zeropp_jax.onebit_adam is the optimizer of qgz_target='momentum' (1-bit Adam); "
            f"the config has qgz_target={config.qgz_target!r}: set qgz_target='momentum' "
            "(with qgz on), or pass an optax optimizer such as optax.adam"
        )
    nodes, local = mesh_shape(mesh)
    layout = build_layout(
        params,
        n_devices=nodes * local,
        align=config.alignment(),
        per_layer=per_layer,
        stacked=stacked,
        leaf_align=config.leaf_alignment(),
    )
    trainer = Trainer(loss_fn, optimizer, mesh, config, layout)
    if trainer.kernels.name != "xla":
        for name in ("qwz_block", "qgz_block"):
            block = getattr(config, name)
            if block & (block - 1):
                raise ValueError(
                    f"the Pallas kernels need power-of-two blocks, but {name}={block}; "
                    "use a power of two or implementation='xla'"
                )
    return trainer


def global_batch_size_check(batch_size: int, n_devices: int, grad_accum: int) -> None:
    """Raises a clear error if a batch does not split over the devices."""
    if batch_size < 1 or batch_size % (n_devices * grad_accum):
        raise ValueError(
            f"batch size {batch_size} must be a positive multiple of devices x "
            f"grad_accum = {n_devices} x {grad_accum} = {n_devices * grad_accum}"
        )
