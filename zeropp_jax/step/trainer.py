"""The train-step transform: ``(loss_fn, optimizer) -> init, step``.

:func:`make_trainer` turns a loss function and an optimizer into a
:class:`Trainer` whose ``init`` shards a full parameter pytree into float32
ZeRO-3 units and whose ``step`` is one ``jax.jit(jax.shard_map(...))`` over
the ``(node, local)`` mesh, with the state donated.

One step, reading down:

1. :meth:`Trainer.step` picks the compiled variant (compressed or full
   precision) from the qgZ schedule (:mod:`~zeropp_jax.step.schedule`) and
   places a host batch on the mesh;
2. the variant runs the update rule's ``update``: the gradient rule
   (:mod:`~zeropp_jax.step.gradient_rule`: qgZ on gradients, then any optax
   optimizer) or 1-bit Adam (:mod:`~zeropp_jax.step.onebit_adam`: qgZ on
   Adam's momentum);
3. both rules accumulate the micro-batches' gradients the same way
   (:mod:`~zeropp_jax.step.accumulate`): hpZ's secondary partition (stacked
   layers': a layer at a time in the forward), then per-layer gathers
   (:mod:`~zeropp_jax.step.gather`) whose backward is a reduce-scatter, then
   the once-per-step cross-node exchange (:mod:`~zeropp_jax.wire.qgz`).

Sizes, specs and plans come from one frozen
:class:`~zeropp_jax.step.geometry.StepGeometry`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zeropp_jax.config import ZeroConfig
from zeropp_jax.config_checks import is_int
from zeropp_jax.layout import build_layout, params_shapes
from zeropp_jax.mesh import mesh_shape
from zeropp_jax.step.accumulate import check_loss_arguments
from zeropp_jax.step.compiling import CompileAhead, StepCompiling
# global_batch_size_check: re-exported (the CLI imports it from here).
from zeropp_jax.step.batch import global_batch_size_check, place_batch, split_rows  # noqa: F401
from zeropp_jax.step.evaluate import evaluate, mean_over_parts
from zeropp_jax.step.geometry import (
    IdleOnMeshWarning, StepGeometry, check_kernel_blocks, idle_on_mesh,
)
from zeropp_jax.step.adam import OneBitAdam
from zeropp_jax.step.rules import UpdateRule, check_leaf_uniform, rule_for
from zeropp_jax.step.schedule import HostSteps, QgzSchedule
from zeropp_jax.step.state import TrainState, ZeroOptState, check_state, steps_taken
from zeropp_jax.step import state_io
from zeropp_jax.step import wrap as wrap_policy

__all__ = ["Trainer", "TrainState", "ZeroOptState", "make_trainer"]


@dataclasses.dataclass(frozen=True)
class Trainer(StepCompiling):
    """A ZeRO-3 / ZeRO++ train step. Build it with :func:`make_trainer`.

    Attributes:
      loss_fn: ``loss_fn(params, batch) -> scalar`` or ``(scalar, aux)`` (the local
        mean over this device's micro-batch). With per-layer gathering ``params``
        holds :class:`~zeropp_jax.step.gather.Unit` handles the model passes
        to ``gather``; otherwise plain parameters.
      rule: the update rule (:class:`UpdateRule`).
      geometry: mesh, config and layout, and what they fix.
      key: ``None``, or the PRNG key the loss's keys derive from: then
        ``loss_fn(params, batch, key)`` gets a key of its own per step,
        micro-batch and device (:func:`~zeropp_jax.step.accumulate.micro_batch_key`).

    Besides its compiled programs (``jax.jit``'s caches), a trainer keeps the
    step number of the last state it returned (``HostSteps``) and the compiles
    :meth:`precompile` started in the background (``CompileAhead``): a
    method that may compile waits for them first (one compile at a time).
    """

    loss_fn: Callable[..., jax.Array]
    rule: UpdateRule
    geometry: StepGeometry
    key: Any = None
    _host_steps: HostSteps = dataclasses.field(
        default_factory=HostSteps, init=False, repr=False, compare=False)
    _ahead: CompileAhead = dataclasses.field(  # precompile(background=True)'s compiles
        default_factory=CompileAhead, init=False, repr=False, compare=False)

    # ------------------------------------------------------- what it is
    mesh = property(lambda self: self.geometry.mesh)
    config = property(lambda self: self.geometry.config)
    layout = property(lambda self: self.geometry.layout)
    nodes = property(lambda self: self.geometry.nodes)
    local = property(lambda self: self.geometry.local)
    n_devices = property(lambda self: self.geometry.n_devices)
    compute_dtype = property(lambda self: self.geometry.compute_dtype)
    qgz_active = property(lambda self: self.geometry.qgz_active)
    error_feedback = property(lambda self: self.geometry.error_feedback)
    param_shardings = property(lambda self: self.geometry.param_shardings)
    batch_sharding = property(lambda self: self.geometry.batch_sharding)
    kernels = property(lambda self: self.geometry.kernels)  # the quantization kernels
    optimizer = property(lambda self: self.rule.optimizer)  # optax's, or OneBitAdam

    @functools.cached_property
    def schedule(self) -> QgzSchedule:
        """The qgZ schedule (which steps run compressed)."""
        return QgzSchedule.from_config(self.config, self.nodes)

    # ------------------------------------------------------------ init
    def init(self, params: Any, *, opt_state: Any = None, step: int = 0) -> TrainState:
        """The sharded :class:`TrainState` of the full parameters ``params`` (the
        trainer's structure; any float dtypes, stored as float32), the optimizer
        initialized. To go on from a loop of your own: its ``opt_state``, the
        trainer's optimizer's over ``params`` (for :func:`~zeropp_jax.onebit_adam`
        an ``optax.adam`` one), cut into shards (``rule.carried_over``;
        ``ValueError`` for another form), and ``step``, the steps taken."""
        step = steps_taken(step)
        self._ahead.wait()
        state = self._start(state_io.scatter_tree(self.geometry, params), step)
        return state._replace(opt_state=self.rule.carried_over(
            self.geometry, opt_state, params, state.opt_state, step))

    def init_from(self, init_fn: Callable[..., Any], *args: Any,
                  progress: bool = False) -> TrainState:
        """:meth:`init` of ``init_fn(*args)``, without the whole model on any device.

        Each unit is drawn already split over the devices (a stacked unit a
        few layers per device at a time, another whole for a moment:
        :func:`~zeropp_jax.step.state_io.shard_init`), so a model split into
        units (``wrap=``, ``per_layer=True``) larger than one device trains;
        the values equal ``init(jax.jit(init_fn)(*args))``'s bit for bit.
        ``init_fn`` (traced once) returns the parameters the trainer was built
        for, e.g. ``lambda key: model.init(key, x)["params"]``; ``progress``
        shows a bar over the units (a compile a stacked unit or small group).
        """
        self._ahead.wait()
        return self._start(state_io.shard_init(self.geometry, init_fn, args, progress=progress))

    def _start(self, flat: dict, step: int = 0) -> TrainState:
        with jax.set_mesh(self.mesh):
            state = self._init_opt(flat, step)
        self._host_steps.record(state.step, step)
        return state

    @functools.cached_property
    def _init_opt(self) -> Callable:  # the step static: no transfer of a host int
        return jax.jit(lambda flat, step: TrainState(jnp.asarray(step, jnp.int32), flat,
                                                     self.rule.init(self.geometry, flat)),
                       static_argnums=1)

    def abstract_state(self, params_shapes: Any) -> TrainState:
        """The state's shapes and a real state's shardings (so JAX's caches serve its step)."""
        with jax.set_mesh(self.mesh):  # shapes made under another mesh: without its shardings
            shapes = jax.eval_shape(lambda p: self._init_opt(
                state_io.placed_units(self.geometry, p), 0), state_io.unsharded(params_shapes))
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=(
            self.geometry.sharding(s.sharding.spec if s.sharding else P()))), shapes)

    # ------------------------------------------------------------ step
    def step(self, state: TrainState, batch: Any, *, compress: bool | None = None):
        """One optimizer step (``grad_accum`` micro-batches).

        Args:
          state: the current state (donated: do not use it afterwards).
          batch: the global batch (see :meth:`shard_batch`; placed there
            unless already sharded over all devices).
          compress: ``None`` follows :attr:`schedule` at the state's step,
            known on the host for states this trainer returned
            (:class:`~zeropp_jax.step.schedule.HostSteps`), else read once;
            only a gradient-RMS gate reads the device every step. ``False``
            forces the full-precision variant, ``True`` the compressed one
            (``ValueError`` where qgZ is not active: :meth:`QgzSchedule.forced
            <zeropp_jax.step.schedule.QgzSchedule.forced>`).

        Returns:
          ``(new_state, metrics)``: scalars ``loss``, ``grad_norm``, ``grad_rms``, ``compressed``
          (0/1), 1-bit Adam's ``bounded`` and ``skipped`` (0/1, with ``skip_non_finite``); ``aux``.
        """
        check_state(state, self._state_form, "step")
        step = self._host_steps.get(state.step)
        if compress is None:
            if step is None and not self.schedule.is_static:
                step = int(state.step)
            compress = self.schedule.compress_at(step, state.opt_state.qgz.grad_rms)
        compress = self.schedule.forced(compress)
        batch = self.shard_batch(batch)  # no copy for a batch already placed
        if self.geometry.one_step_in_flight:
            jax.block_until_ready(state)
        self._ahead.wait(compress)
        with jax.set_mesh(self.mesh):
            state, metrics = self._step_variants[compress](state, batch)
        if step is not None:
            self._host_steps.record(state.step, step + 1)
        return state, metrics

    @functools.cached_property
    def _step_variants(self) -> dict[bool, Callable]:
        """The compressed and full-precision steps (each jitted lazily; the state is donated)."""
        def update(state: TrainState, batch: Any, *, compress: bool):
            return self.rule.update(self.geometry, self.loss_fn, state, batch,
                                    compress=compress, key=self.key)

        return {
            compress: jax.jit(functools.partial(update, compress=compress), donate_argnums=0)
            for compress in (True, False)
        }

    def evaluate(self, state: TrainState, batch: Any) -> dict:
        """The loss of ``batch`` at ``state``'s parameters, with no update (an eval step).

        The model runs as in :meth:`step`'s forward (the same gathers, qwZ
        codes included; ``grad_accum`` micro-batches; a loss taking a key
        gets the keys a step at this state would draw). ``state`` is not
        consumed. Returns ``{"loss"}`` (and ``"aux"``), averaged as a step's.
        Any number of rows (one process): rows past the largest multiple of
        ``devices x grad_accum`` run one to a micro-batch in a second program
        (:func:`~zeropp_jax.step.batch.split_rows`), each row weighing as one
        of the rest (each row's mean, for a loss that is a mean over rows;
        with a key, each tail row the key of a micro-batch starting at it).
        """
        check_state(state, self._state_form, "evaluate")
        self._ahead.wait()
        parts = split_rows(batch, self.n_devices * self.config.grad_accum)
        with jax.set_mesh(self.mesh):
            return mean_over_parts([(self._evaluate[p.padded](
                state.params, self.shard_batch(p.batch), state.step, p.first_row), p.rows, p.padded)
                for p in parts])

    @functools.cached_property
    def _evaluate(self) -> dict[bool, Callable]:  # the key closed over, as the step's
        return {per_row: jax.jit(functools.partial(
            evaluate, self.geometry, self.loss_fn, key=self.key, per_row=per_row))
            for per_row in (False, True)}

    @functools.cached_property
    def _state_form(self) -> tuple:
        """The tree structure and leaf shapes of this trainer's states."""
        state = self.abstract_state(params_shapes(self.layout))
        return jax.tree.structure(state), [x.shape for x in jax.tree.leaves(state)], self.mesh

    def shard_batch(self, batch: Any) -> Any:
        """Places a global batch on the mesh, split over all devices.

        Args:
          batch: pytree of numpy arrays, ``jax.Array``s (any device or
            sharding) or lists of numbers, with leading axis ``B`` (the
            global batch); on a multi-process run, each process passes only
            its own ``B / process_count`` rows of host data.

        Raises:
          ValueError: naming the leaf, if ``B`` does not divide into
            ``devices * grad_accum``, leaves disagree on ``B``, or a leaf is
            a scalar or not numeric (:func:`~zeropp_jax.step.batch.place_batch`).
        """
        return place_batch(
            batch, self.batch_sharding, per_step=self.n_devices * self.config.grad_accum,
            n_devices=self.n_devices, grad_accum=self.config.grad_accum,
        )

    # ---------------------------------------------------------- export
    def gather_params(self, state_or_params: Any, dtype: Any = "original") -> Any:
        """The full, unpadded parameters as a host (numpy) pytree, in their
        original structure and leaf dtypes, on every process (a collective:
        on several processes, every one calls it).

        Args:
          state_or_params: a :class:`TrainState`, its ``params`` dict, or an
            optax state's entry placed like it (Adam's ``mu``).
          dtype: ``"original"``, ``None`` to keep float32 (a moment's), or a
            dtype for every leaf. ``ValueError`` for another ``dtype``, or
            arrays not placed like the master parameters.
        """
        if isinstance(state_or_params, TrainState):
            check_state(state_or_params, self._state_form, "gather_params", placed=False)
            state_or_params = state_or_params.params
        self._ahead.wait()
        return state_io.gather_tree(self.geometry, state_or_params, dtype)

    def memory_per_device(self) -> dict:
        """Bytes each device holds per ZeRO++ structure (from the layout):
        :meth:`StepGeometry.memory_per_device
        <zeropp_jax.step.geometry.StepGeometry.memory_per_device>`, and
        ``onebit_adam_extra``, the rule's state beyond optax Adam's
        (:meth:`~zeropp_jax.step.onebit_adam.OneBitAdamRule.extra_memory`)."""
        return {
            **self.geometry.memory_per_device(),
            "onebit_adam_extra": self.rule.extra_memory(self.geometry),
        }

    def describe(self) -> dict:
        """What runs where: plain data for reports and metrics files."""
        return {
            "memory_per_device": self.memory_per_device(),
            "mesh": {"node": self.nodes, "local": self.local},
            "config": self.config.describe(),
            "compute_dtype": jnp.dtype(self.compute_dtype).name,
            "kernels": self.kernels.label,
            "qgz_active": self.qgz_active,
            "units": len(self.layout.units),
            "per_layer": not self.layout.whole_model,
            "params": self.layout.numel,
            "padded_params": self.layout.padded_numel,
            "largest_unit": self.layout.largest_unit_numel,
        }



def make_trainer(
    loss_fn: Callable[[Any, Any], jax.Array],
    optimizer: optax.GradientTransformation | OneBitAdam,
    params: Any,
    *,
    mesh: jax.sharding.Mesh,
    config: ZeroConfig | None = None,
    per_layer: bool = False,
    stacked: Sequence[str] = (),
    rng: int | jax.Array | None = None,
    wrap: Sequence[type] = (),
    example_batch: Any = None,
    check_optimizer: bool = True,
) -> Trainer:
    """Builds a ZeRO-3 / ZeRO++ :class:`Trainer`.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over the
        micro-batch it is given, or ``-> (scalar, aux)`` (metrics["aux"]).
      optimizer: an optax ``GradientTransformation`` that treats every
        parameter leaf alike (it runs on flat units), per-leaf masks and labels
        through :func:`zeropp_jax.masked` / ``multi_transform`` / ``adamw``
        (optax's own are refused: :func:`~zeropp_jax.step.rules.check_leaf_uniform`);
        with ``config.qgz_target="momentum"``, :func:`zeropp_jax.onebit_adam`.
      params: the parameter pytree, or its shapes (``jax.eval_shape``).
      mesh: a ``(node, local)`` mesh from :func:`zeropp_jax.make_mesh`.
      config: a :class:`ZeroConfig` (default: ``zero3``). The model computes in
        its ``compute_dtype`` (default: bfloat16 on a GPU, float32 elsewhere)
        over float32 master shards, whatever the parameters' dtype.
      per_layer: ``True`` if ``loss_fn`` gathers each top-level entry of
        ``params`` itself with :func:`zeropp_jax.gather` (inside
        :func:`zeropp_jax.layer`), like FSDP's wrap policy; ``False`` gathers
        the whole model before calling ``loss_fn`` with plain parameters (any
        Flax Linen or NNX model, unchanged).
      stacked: top-level keys of ``params`` whose leaves stack layers along
        axis 0 (for ``lax.scan``); each layer is gathered separately.
      rng: a seed or PRNG key for a loss that needs randomness (dropout):
        then the loss is called ``loss_fn(params, batch, key)`` with a fresh
        key per step, micro-batch and device, derived from ``rng``, the step
        and the micro-batch's first global row, so a resumed run draws the
        same keys. (A key closed over in ``loss_fn`` instead would draw the
        same dropout mask at every step.)
      wrap: a flax Linen or NNX module class or a tuple of them (a block):
        every instance ``loss_fn`` calls becomes its own unit, gathered when
        it is called and again in the backward; the other parameters are one
        unit gathered before the loss (:mod:`~zeropp_jax.step.wrap`;
        :mod:`~zeropp_jax.step.wrap_nnx` for an NNX model through
        :func:`zeropp_jax.nnx_loss`). The model and ``loss_fn`` are used
        unchanged.
      example_batch: with ``wrap``, a batch (or its shapes) ``loss_fn``
        accepts, traced once without running to find the wrapped modules.
      check_optimizer: run :func:`~zeropp_jax.step.rules.check_leaf_uniform`
        on an optax optimizer (a stand-in step; ``False`` skips it, e.g. for
        ``optax.add_noise``, whose per-leaf noise it cannot tell from a mask).

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
    config = ZeroConfig() if config is None else config
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a ZeroConfig, got {config!r}; for a preset pass "
                        "config=zeropp_jax.ZeroConfig.from_preset(name)")
    if example_batch is not None and not wrap:
        raise ValueError("example_batch= is only read with wrap= (to find the wrapped "
                         "modules); without wrap= leave it out")
    check_loss_arguments(loss_fn, takes_key=rng is not None)
    rule = rule_for(optimizer, config)
    nodes, local = mesh_shape(mesh)
    unit_paths = ()
    if not wrap:  # with wrap=, prepare refuses per_layer=
        wrap_policy.check_per_layer(loss_fn, per_layer)
    if wrap:
        loss_fn, unit_paths, stacked = wrap_policy.prepare(
            loss_fn, params, wrap, example_batch, per_layer=per_layer, stacked=stacked,
            rng=rng,
        )
    layout = build_layout(
        params,
        n_devices=nodes * local,
        align=config.alignment(),
        per_layer=per_layer,
        stacked=stacked,
        leaf_align=config.leaf_alignment(),
        units=unit_paths,
    )
    if check_optimizer and not isinstance(optimizer, OneBitAdam):
        check_leaf_uniform(optimizer, params, layout)
    geometry = StepGeometry(mesh, config, layout)
    for message in idle_on_mesh(geometry):
        warnings.warn(message, IdleOnMeshWarning, stacklevel=2)
    check_kernel_blocks(geometry)
    if rng is not None and not isinstance(rng, jax.Array):
        if not is_int(rng):
            raise ValueError(f"rng must be an integer seed or a PRNG key, got {rng!r}")
        rng = jax.random.key(int(rng))
    return Trainer(loss_fn, rule, geometry, rng)
