"""The gradient rule: qgZ on the gradient, then any optax optimizer.

Per optimizer step (:meth:`GradientRule.update`):

1. inside shard_map, the micro-batches' gradients are accumulated
   (:func:`~zeropp_jax.step.accumulate.accumulate`); with hierarchical
   gradients (hpZ or qgZ on) they are node-partial and are summed over
   ``node`` once, at full precision or compressed by qgZ with error
   feedback (:func:`~zeropp_jax.wire.qgz.cross_node_reduce`);
2. gradients are divided by ``devices * grad_accum`` (the exact
   data-parallel mean) and padding is zeroed;
3. outside shard_map, under the same ``jit``, the optax optimizer updates
   the float32 units: element-wise transforms stay local and global
   reductions (``clip_by_global_norm``) are partitioned by XLA, so they are
   exact.  It sees one flat vector per unit, not the original leaves.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zeropp_jax.step.accumulate import accumulate, square_sum_or_nan, step_metrics
from zeropp_jax.step.geometry import DATA_AXES, StepGeometry, node_level_once
from zeropp_jax.step.state_io import outline, scatter_opt_state, shaped_like
from zeropp_jax.step.leaf_masks import UnitLeaves, units_in_view
from zeropp_jax.step.state import TrainState, ZeroOptState, initial_qgz_state
from zeropp_jax.wire import dither
from zeropp_jax.wire.qgz import QgzState, cross_node_reduce
from zeropp_jax.mesh import LOCAL


@dataclasses.dataclass(frozen=True)
class GradientRule:
    """Update rule: qgZ-compressed gradients in front of an optax optimizer.

    Attributes:
      optimizer: any ``optax.GradientTransformation`` (run on the unit dict).
    """

    optimizer: optax.GradientTransformation

    def init(self, geo: StepGeometry, params: dict) -> ZeroOptState:
        """The optimizer state for float32 ``params`` (placed like the parameters)."""
        inner = _sharded_like_units(self.optimizer.init(params), params)
        return ZeroOptState(inner, initial_qgz_state(geo))

    def carried_over(self, geo: StepGeometry, opt_state: Any, params: Any,
                     reference: ZeroOptState, step: int) -> ZeroOptState:
        """``reference`` (this rule's state at step 0) with the optax state
        ``opt_state`` of ``optimizer`` over the model's ``params`` (from a loop
        of the user's own; ``None``: ``reference`` as it is) in place of the
        optimizer's: its trees over the parameters cut into unit shards
        (:func:`~zeropp_jax.step.state_io.scatter_opt_state`). ``step`` is not read."""
        if opt_state is None:
            return reference
        expected = jax.eval_shape(self.optimizer.init, params)
        if jax.tree.structure(opt_state) != jax.tree.structure(expected):
            over_params = shaped_like(params)
            raise ValueError(
                "opt_state is not in the form of this trainer's optimizer over these "
                f"parameters: optimizer.init(params) gives "
                f"{outline(expected, over_params, 'params')}, opt_state is "
                f"{outline(opt_state, over_params, 'params')} (params: a tree shaped like "
                "the parameters)")
        inner = scatter_opt_state(geo, opt_state, params, reference.inner)
        return ZeroOptState(inner, reference.qgz)

    def update(
        self, geo: StepGeometry, loss_fn: Callable, state: TrainState, batch: Any, *,
        compress: bool, key: jax.Array | None = None,
    ) -> tuple[TrainState, dict]:
        """One optimizer step (global, under ``jit``); see the module docstring."""
        param_specs, carry_specs = geo.param_specs(), geo.carry_specs()
        grads, carry, metrics = jax.shard_map(
            functools.partial(_reduced_gradients, geo, loss_fn, compress=compress),
            mesh=geo.mesh,
            in_specs=(param_specs, carry_specs, geo.batch_specs(batch), P(), P()),
            out_specs=(param_specs, carry_specs, P()),
            check_vma=geo.check_vma,
        )(state.params, state.opt_state.qgz.carry, batch, state.step, key)  # key: an argument,
        # not closed over (a key placed on the mesh cannot be, on its explicit axes)
        with jax.named_scope("optimizer"):
            params, inner = _optimizer_step(self.optimizer, geo, grads,
                                            state.opt_state.inner, state.params)
        # a non-finite step's RMS (NaN) would open qgz_min_grad_rms's gate
        grad_rms = jnp.where(jnp.isnan(metrics["grad_rms"]), state.opt_state.qgz.grad_rms,
                             metrics["grad_rms"])
        qgz = QgzState(carry=carry, grad_rms=grad_rms)
        return TrainState(state.step + 1, params, ZeroOptState(inner, qgz)), metrics

    def extra_memory(self, geo: StepGeometry) -> int:
        """Bytes per device of state beyond the optimizer's own (none)."""
        return 0


def _sharded_like_units(inner: Any, params: dict) -> Any:
    """``inner`` with each replicated leaf shaped like a unit, or like one
    with leading axes (L-BFGS's history ``(K, [L,] U)``, which optax builds
    with ``jnp.zeros(shape)``, not ``zeros_like``), sharded as the unit is
    (its leading axes replicated): not a whole copy of the model per device.
    Runs under ``jit`` on the mesh; other leaves are left as they are."""
    def place(path, x):
        name = getattr(path[-1], "key", None) if path else None
        p = params.get(name) if isinstance(name, str) else None
        if p is None or x.ndim < p.ndim or x.shape[x.ndim - p.ndim:] != p.shape:
            return x
        if any(jax.typeof(x).sharding.spec):  # already placed (zeros_like follows the unit)
            return x
        spec = (None,) * (x.ndim - p.ndim) + tuple(jax.typeof(p).sharding.spec)
        return jax.sharding.reshard(x, P(*spec))

    return jax.tree_util.tree_map_with_path(place, inner)


def _optimizer_step(optimizer: optax.GradientTransformation, geo: StepGeometry,
                    grads: dict, inner: Any, params: dict) -> tuple[dict, Any]:
    """``optimizer``'s update applied: new ``(params, inner)``, each placed as it came.

    Runs with the mesh's axes (explicit: :func:`~zeropp_jax.mesh.mesh_shape`
    refuses others) turned automatic (``jax.sharding.auto_axes``): an
    optimizer that takes inner products or reshapes a unit
    (``optax.tree.vdot`` in prodigy, D-Adaptation, L-BFGS, mechanize) leaves
    XLA to choose where to reduce, which an explicitly sharded operand would
    refuse. Element-wise optimizers (Adam and most others) compile to the
    same program either way. The update is traced in view of the units
    (:func:`~zeropp_jax.step.leaf_masks.units_in_view`), for per-leaf masks
    (:func:`zeropp_jax.masked`).
    """
    units = UnitLeaves.of(geo.layout)

    def step(grads, inner, params):
        with units_in_view(units):
            updates, inner = optimizer.update(grads, inner, params)
        return optax.apply_updates(params, updates), inner

    placed = jax.tree.map(lambda x: jax.typeof(x).sharding.spec, (params, inner))
    return jax.sharding.auto_axes(step, axes=geo.mesh.axis_names, out_sharding=placed)(
        grads, inner, params)


def _reduced_gradients(
    geo: StepGeometry, loss_fn: Callable, params: dict, carry: dict, batch: Any,
    step: jax.Array, key: jax.Array | None, *, compress: bool,
) -> tuple[dict, dict, dict]:
    """The mean gradient's shard on each device (inside shard_map).

    Args:
      geo: the step geometry.
      loss_fn: the user's loss.
      params: name -> float32 ``([L,] U / D)`` primary shard.
      carry: name -> float32 ``(1, [L,] U / local)`` sender carry, or empty.
      batch: pytree of ``(B / D, ...)`` arrays.
      step: int32 scalar optimizer step (replicated; it names the dither
        noise of ``qgz_code="dither"`` and the loss's keys).
      key: the trainer's key for the loss, or ``None``.

    Returns:
      ``(grads, carry, metrics)`` with grads shaped like ``params``; the
      carry is the old one where an element of the gradient is not finite
      (NaN or inf; ``metrics["grad_norm"]`` is NaN then). Only
      the cross-node reduction moves data over ``node``.
    """
    cfg = geo.config
    acc, outputs = accumulate(geo, loss_fn, params, batch, step=step, key=key)
    dithered = cfg.qgz_code == "dither"
    local_index = jax.lax.axis_index(LOCAL) if dithered else None

    grads, new_carry = {}, {}
    for unit_index, u in enumerate(geo.layout.units):
        g = acc[u.name]
        if node_level_once(geo, u):
            c = carry[u.name][0] if u.name in carry else None
            key = (  # only the dithered code draws noise
                dither.stream_key(cfg.qgz_seed, step, unit_index, local_index) if dithered else None
            )
            with jax.named_scope(f"cross_node_{u.name}"):
                g, c, _ = cross_node_reduce(
                    g, c, bits=cfg.qgz_bits, block=cfg.qgz_block, scale_dtype=cfg.scale_dtype,
                    reduce_dtype=geo.plan.reduce_dtype, compress=compress,
                    kernels=geo.kernels, code=cfg.qgz_code, key=key, sum_bits=geo.plan.sum_bits,
                )
            if c is not None:
                new_carry[u.name] = c[None]
        g = g / (geo.n_devices * cfg.grad_accum)
        grads[u.name] = jnp.where(geo.shard_mask(u, g.shape[-1]), g, 0.0)

    # A step with a NaN or inf in its gradient leaves the carries as they
    # were: what they hold is delivered by the next finite step, as when an
    # optimizer such as optax.apply_if_finite skips this one (a NaN carry
    # would poison every later step). The test is the optimizer's own, one
    # element at a time (finite elements whose squares pass float32 make the
    # norm inf, a step the optimizer still applies).
    sq = jax.lax.psum(square_sum_or_nan(grads.values()), DATA_AXES)
    finite = ~jnp.isnan(sq)
    new_carry = {name: jnp.where(finite, c, carry[name]) for name, c in new_carry.items()}
    return grads, new_carry, step_metrics(geo, outputs, sq, compress)
