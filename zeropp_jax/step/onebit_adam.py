"""1-bit Adam inside ZeRO-3: qgZ's error feedback on the momentum.

With ``ZeroConfig(qgz_target="momentum")`` the quantity that crosses nodes
compressed is Adam's momentum, not the gradient (Tang et al., 2021, "1-bit
Adam"). The trainer owns the optimizer then: pass
:func:`zeropp_jax.step.adam.onebit_adam` to
:func:`zeropp_jax.make_trainer`, which runs :class:`OneBitAdamRule`: its
``init`` and ``update`` are at the end of this module. Per optimizer step, with ``g_n`` node ``n``'s
mean gradient (reduced over ``local`` at full precision):

* warm-up (full precision, the first ``qgz_warmup_steps`` steps): ``g_n`` is
  all-reduced over ``node``, clipped by the global norm, and Adam runs as
  usual (``m`` and ``v`` both update);
* compressed: Adam's second moment ``v`` is frozen (its bias correction
  too; ``qgz_refresh_every = N`` runs every ``N``-th step after the warm-up
  at full precision, which updates ``v`` as an average over time, decayed by
  ``b2**k`` after ``k`` frozen steps, and re-expresses the carries in the
  new ``d``), so ``d = sqrt(v_hat) + eps`` is a fixed per-coordinate scale and the
  momentum recursion holds for ``u = m / d``, the update direction. Node
  ``n`` forms its own ``b1 * u + (1 - b1) * clip_n * g_n / d`` around the
  shared ``u`` (``clip_n`` from node ``n``'s own gradient norm, the only norm
  known before the exchange), compresses it plus its sender carry, and the
  chunks are summed over nodes as in gradient qgZ (the halves of
  :func:`zeropp_jax.wire.qgz.cross_node_reduce`: ``reduce_encode``, an
  all-to-all, ``reduce_decode``); each receiver averages its chunk,
  compresses it once more with its receiver carry, and all nodes gather
  those codes (``gather_encode``, ``gathered_codes``, ``gather_decode``);
  or, with ``ZeroConfig.qgz_share`` ``"gather"`` (``"auto"`` with two
  nodes, the same bytes), every node gathers every node's codes and
  averages them itself (no receiver carry).
  Either way every node holds the same new ``u`` (stored as ``m = u * d``) and steps
  ``p -= lr * u / (1 - b1**t)``.

A frozen ``v`` can lag its coordinate's gradient without bound: one that had
no gradient in the warm-up (an embedding row of a token not seen yet) has
``d = eps`` and would step by ``lr (1 - b1) g / eps``. So the shared ``u`` is
held within the largest value Adam itself reaches
(:meth:`~zeropp_jax.step.adam.OneBitAdam.update_bound`, ``B``), and each
node's own ``u``, before it is coded, within ``nodes * B`` (the most a node
adds to a mean within ``B`` while the others add nothing), which keeps the
codes' block magnitudes, and so the coordinates sharing them, sane. What
these bounds cut is dropped, not deferred; ``metrics["bounded"]`` counts it.

Compressing ``u`` rather than ``m`` (1-bit Adam's paper compresses ``m``)
puts the code's error, one magnitude per block, in units of the update:
compressing ``m``, a coordinate whose ``v`` is tiny receives the block's
magnitude and steps by about ``lr * |m_block| / eps``, without bound (in the
example GPT the attention key biases: softmax ignores them, their gradient
is ~1e-12, rounding noise).

Both carries are optimizer state: what the two compressions lose is added to
the next step's momentum, nothing of it is lost, only deferred (why the carry sits
on the momentum rather than the gradient in front of Adam:
``benchmarks/RESULTS.md``).

Both kinds of step update the state a layer at a time, one unit after the
other (:mod:`zeropp_jax.step.momentum_exchange`), so their work space is a
layer's, not a unit's.

Layouts (``U`` = a unit's padded length, ``[L,]`` its layer axis if stacked):
``m`` and ``v`` are float32 ``(nodes, [L,] U)`` sharded
``P("node", [None,] "local")``: every node keeps its own copy of the whole
unit (the rows are equal: each node decodes the same codes, and warm-up
steps all-reduce the gradient), since it needs all of its ``local`` slice to
form its own momentum; the receiver carry is sharded like the parameters,
``P([None,] ("local", "node"))``; the sender carry is
:class:`zeropp_jax.wire.qgz.QgzState`'s, ``P("node", [None,] "local")``.

With ``ZeroConfig(node_replicated=True)`` (the ``zeropp-max`` preset) the
parameters are laid out like ``m``: ``(nodes, [L,] U)``, one equal row per
node. Each node then steps its whole ``local`` slice with the same ``u`` and
``v``, so the rows stay bit-identical, the per-layer gathers run over
``local`` only and no parameter crosses nodes: only the momentum codes
(compressed steps) and the gradient all-reduce (warm-up and refresh steps).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zeropp_jax.mesh import LOCAL, NODE
from zeropp_jax.step.accumulate import accumulate, over_devices, square_sum_or_nan, step_metrics
from zeropp_jax.step.adam import OneBitAdam, next_momentum, next_second_moment, preconditioner
from zeropp_jax.step.geometry import StepGeometry, padding_mask
from zeropp_jax.step.momentum_exchange import (
    compressed_update, own_chunk, over_layers, stepped_params,
)
from zeropp_jax.step.state import TrainState, ZeroOptState, initial_qgz_state
from zeropp_jax.step.state_io import scatter_opt_state
from zeropp_jax.wire import collectives
from zeropp_jax.wire.qgz import QgzState


class OneBitAdamState(NamedTuple):
    """1-bit Adam's state (in :class:`zeropp_jax.step.state.ZeroOptState` ``.inner``).

    Attributes:
      count: int32 ``()``, steps taken.
      v_count: int32 ``()``, the step count at ``v``'s last update (a
        full-precision step): ``v`` averages over that much time, so its bias
        correction is ``1 - b2**v_count``.
      m: dict unit -> float32 ``(nodes, [L,] U)``,
        ``P("node", [None,] "local")`` (one equal copy per node).
      v: dict unit -> float32 ``(nodes, [L,] U)``, like ``m``.
      receiver_carry: dict unit -> float32 ``([L,] U)`` sharded like the
        parameters (empty without error feedback or a second hop): what the second
        compression lost.
    """

    count: jax.Array
    v_count: jax.Array
    m: dict
    v: dict
    receiver_carry: dict


# ---------------------------------------------------------------- the rule
@dataclasses.dataclass(frozen=True)
class OneBitAdamRule:
    """Update rule: 1-bit Adam, run by the trainer inside shard_map.

    Attributes:
      optimizer: the hyperparameters (:func:`zeropp_jax.step.adam.onebit_adam`).
    """

    optimizer: OneBitAdam

    def init(self, geo: StepGeometry, params: dict) -> ZeroOptState:
        """Zero ``m``, ``v`` (one copy per node) and carries for float32 ``params``."""
        del params  # shapes come from the layout
        moments = geo.per_node_specs()
        receiver_specs = geo.shard_specs() if geo.receiver_carry else {}
        inner = OneBitAdamState(
            count=jnp.zeros((), jnp.int32),
            v_count=jnp.zeros((), jnp.int32),
            m=geo.zeros(moments, per_node=True),
            v=geo.zeros(moments, per_node=True),
            receiver_carry=geo.zeros(receiver_specs),
        )
        return ZeroOptState(inner, initial_qgz_state(geo))

    def carried_over(self, geo: StepGeometry, opt_state: Any, params: Any,
                     reference: ZeroOptState, step: int) -> ZeroOptState:
        """``reference`` (this rule's state at step 0) with Adam's moments and
        count taken from ``opt_state``, an ``optax.adam`` state over the
        model's ``params`` (from a loop of the user's own; its one
        ``optax.ScaleByAdamState``): ``m``, ``v`` from ``mu``, ``nu`` (one
        copy per node), ``count`` and ``v_count`` from its ``count``.

        Raises:
          ValueError: for another state, or where ``step`` is past the
            warm-up and Adam has taken no step (``opt_state`` ``None`` or
            fresh): the compressed steps would freeze ``v`` at zero.
        """
        def is_adam(x):
            return isinstance(x, optax.ScaleByAdamState)

        found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]
        if opt_state is not None and len(found) != 1:
            raise ValueError(
                "1-bit Adam carries over an optax Adam state: optax.adam(...).init(params) "
                "or a later one, holding one optax.ScaleByAdamState (mu, nu, count); "
                f"opt_state holds {len(found)}")
        taken = int(found[0].count) if found else 0
        if step >= geo.config.qgz_warmup_steps and not taken:
            raise ValueError(
                f"1-bit Adam at step {step}, past its warm-up of {geo.config.qgz_warmup_steps} "
                "steps, compresses at once and keeps Adam's second moment as it is, and "
                "nothing has estimated it: pass opt_state, an optax.adam state that has taken "
                "steps, or a step within the warm-up")
        if opt_state is None:
            return reference
        (adam,) = found
        inner = reference.inner._replace(count=adam.count, v_count=adam.count,
                                         m=adam.mu, v=adam.nu)
        return ZeroOptState(scatter_opt_state(geo, inner, params, reference.inner),
                            reference.qgz)

    def update(
        self, geo: StepGeometry, loss_fn: Callable, state: TrainState, batch: Any, *,
        compress: bool, key: jax.Array | None = None,
    ) -> tuple[TrainState, dict]:
        """One optimizer step (global, under ``jit``): everything inside shard_map."""
        inner: OneBitAdamState = state.opt_state.inner
        params_spec, moments_spec = geo.param_specs(), geo.per_node_specs()
        receiver_spec = geo.shard_specs() if geo.receiver_carry else {}
        sender_spec = geo.carry_specs()
        specs = (params_spec, moments_spec, moments_spec, receiver_spec, sender_spec)
        params, m, v, receiver_carry, sender_carry, v_count, metrics = jax.shard_map(
            functools.partial(_local_update, geo, loss_fn, self.optimizer, compress=compress),
            mesh=geo.mesh,
            in_specs=specs + (geo.batch_specs(batch), P(), P(), P(), P()),
            out_specs=specs + (P(), P()),
            check_vma=geo.check_vma,
        )(state.params, inner.m, inner.v, inner.receiver_carry, state.opt_state.qgz.carry,
          batch, inner.count, inner.v_count, state.step, key)  # key: an argument, not closed over
        taken = 1 - metrics.get("skipped", 0)  # a skipped step moves nothing
        inner = OneBitAdamState(inner.count + taken, v_count, m, v, receiver_carry)
        grad_rms = jnp.where(taken > 0, metrics["grad_rms"], state.opt_state.qgz.grad_rms)
        qgz = QgzState(carry=sender_carry, grad_rms=grad_rms)
        return TrainState(state.step + 1, params, ZeroOptState(inner, qgz)), metrics

    def extra_memory(self, geo: StepGeometry) -> int:
        """Bytes per device beyond optax Adam's ``m`` and ``v`` shards.

        ``m`` and ``v`` are the node's copies of this device's ``local``
        slice (``1/local`` of the model each, not ``1/(nodes*local)``), plus
        the receiver carry (``1/(nodes*local)``, with error feedback on
        the two hops).
        """
        padded = geo.layout.padded_numel
        extra = 2 * (padded // geo.local - padded // geo.n_devices)
        if geo.receiver_carry:
            extra += padded // geo.n_devices
        return 4 * extra


def _local_update(
    geo: StepGeometry, loss_fn: Callable, adam: OneBitAdam,
    params: dict, m: dict, v: dict, receiver_carry: dict, sender_carry: dict,
    batch: Any, count: jax.Array, v_count: jax.Array, step: jax.Array,
    key: jax.Array | None, *, compress: bool,
):
    """Per-device 1-bit Adam step (inside shard_map).

    Args:
      geo: the step geometry.
      loss_fn: the user's loss.
      adam: the hyperparameters.
      params: name -> float32 ``([L,] U / D)``, or with ``node_replicated``
        ``(1, [L,] U / local)``, this ``local`` slice (the same on every node).
      receiver_carry: name -> float32 ``([L,] U / D)`` (empty without
        error feedback).
      m, v: name -> float32 ``(1, [L,] U / local)``, this ``local`` slice
        (the same on every node).
      sender_carry: name -> float32 ``(1, [L,] U / local)`` or empty.
      batch: pytree of ``(B / D, ...)`` arrays.
      count, v_count: int32 scalars (steps taken; the step of ``v``'s last update).
      step: int32 scalar, the optimizer step (names the loss's keys).
      compress: the compressed variant (only where qgZ is active: ``QgzSchedule.forced``).
      key: the trainer's key for the loss, or ``None``.

    Returns:
      ``(params, m, v, receiver_carry, sender_carry, v_count, metrics)``.
      Full-precision steps all-reduce gradients over ``node``; compressed
      steps move momentum codes over ``node``
      (:func:`zeropp_jax.step.momentum_exchange.compressed_update`). Both
      update a unit a layer at a time, one unit after the other.
      With ``adam.skip_non_finite``, the inputs as they came where the
      reduced gradient (what Adam would see) held a NaN or an inf
      (``metrics["skipped"]`` 1, ``metrics["bounded"]`` 0).
    """
    before = (params, m, v, receiver_carry, sender_carry, v_count)
    cfg = geo.config
    replicated = cfg.node_replicated
    if replicated:
        params = {name: p[0] for name, p in params.items()}
    # full precision: summed over nodes per layer where the unit's plan takes NODE
    summed = () if compress else (NODE,)
    acc, outputs = accumulate(geo, loss_fn, params, batch, step=step, key=key, sum_axes=summed)
    local_index = jax.lax.axis_index(LOCAL)
    slice_masks = {u.name: padding_mask(u, local_index, u.padded // geo.local)
                   for u in geo.layout.units}
    # Full precision: the mean gradient over all devices, on every node.
    # Compressed: this node's mean gradient (the nodes' average is the mean).
    if compress:
        scale = geo.nodes / (geo.n_devices * cfg.grad_accum)
        grads = {name: a * scale for name, a in acc.items()}
    else:
        scale, wire_dtype = 1.0 / (geo.n_devices * cfg.grad_accum), geo.plan.reduce_dtype
        with jax.named_scope("cross_node_all_reduce"):
            grads = {u.name: scale * (acc[u.name] if geo.plan_of(u, summed).sum_axes else
                                      collectives.all_reduce(acc[u.name], (NODE,), wire_dtype,
                                                             sum_bits=geo.plan.sum_bits))
                     for u in geo.layout.units}
    grads = {name: jnp.where(slice_masks[name], g, 0.0) for name, g in grads.items()}
    # This node's squared norm (compressed) or the global one (full precision);
    # NaN exactly where an element of the reduced gradient is NaN or inf.
    sq_norm = jax.lax.psum(square_sum_or_nan(grads.values()), LOCAL)
    clip = adam.clip_scale(sq_norm)

    new = {key: {} for key in ("params", "m", "v", "receiver", "sender")}
    bounded = jnp.zeros((), jnp.float32)  # coordinates held at Adam's bound (compressed steps)
    count_now = count + 1
    new_v_count = v_count if compress else count_now  # the step of v's last update
    if compress:  # a layer at a time: momentum_exchange
        new["params"], new["m"], new["sender"], new["receiver"], bounded = compressed_update(
            geo, adam, params=params, m={n: x[0] for n, x in m.items()},
            v={n: x[0] for n, x in v.items()}, grads=grads, clip=clip, sq_norm=sq_norm,
            sender_carry={n: c[0] for n, c in sender_carry.items()},
            receiver_carry=receiver_carry, count=count, v_count=v_count, slice_masks=slice_masks)
        new["v"] = v
    token = sq_norm
    for u in () if compress else geo.layout.units:  # full precision, a layer at a time
        def body(carried, layer, u=u):
            # Exact, and the same on every node: all reduced the same
            # gradient. v is an average over time: a refresh after k
            # compressed steps decays it by b2**k.
            clipped = clip * layer["g"]
            denom_old = preconditioner(carried["v"], v_count, adam)
            b2_k = adam.b2 ** (count_now - v_count).astype(jnp.float32)
            out = {"m": next_momentum(carried["m"], clipped, adam.b1),
                   "v": next_second_moment(carried["v"], clipped, b2_k)}
            # the carries wait, re-expressed in the new update units
            ratio = denom_old / preconditioner(out["v"], count_now, adam)
            if "sender" in carried:
                out["sender"] = carried["sender"] * ratio
            if "receiver" in carried:
                out["receiver"] = carried["receiver"] * own_chunk(ratio, NODE)
            out["params"] = stepped_params(geo, u, carried["params"], out["m"], out["v"],
                                           count=count_now, v_count=new_v_count, adam=adam,
                                           slice_mask=slice_masks[u.name])
            # 0 (v is never negative), but only once this unit is done: chains the units
            return out, None, jnp.sum(out["v"] < 0, dtype=jnp.float32)

        name = u.name
        carried = {"m": m[name][0], "v": v[name][0], "params": params[name]}
        if name in sender_carry:
            carried["sender"] = sender_carry[name][0]
        if name in receiver_carry:
            carried["receiver"] = receiver_carry[name]
        carried, _, done = over_layers(u.stack, body, carried, {"g": grads[name]}, after=token)
        token = token + done  # the next unit waits for this one (momentum_exchange.tied)
        for key, x in carried.items():
            new[key][name] = x
    # the node axis back on what is stored per node
    for key in ("m", "sender") + (("v",) if not compress else ()):
        new[key] = {n: x[None] for n, x in new[key].items()}
    if replicated:
        new["params"] = {n: x[None] for n, x in new["params"].items()}
    # Compressed: the root mean square over nodes of each node's gradient norm
    # (the global gradient is never formed there); else the global norm. One
    # all-reduce for it (sq_norm is equal over local) and the bounded count.
    totals = over_devices(jnp.stack([sq_norm / geo.n_devices, bounded]))
    metrics = step_metrics(geo, outputs, totals[0], compress)
    metrics["bounded"] = totals[1].astype(jnp.int32)
    after = (new["params"], new["m"], new["v"], new["receiver"], new["sender"], new_v_count)
    if adam.skip_non_finite:  # totals[0] is NaN where any device's gradient was
        skipped = jnp.isnan(totals[0])
        after = jax.tree.map(lambda old, now: jnp.where(skipped, old, now), before, after)
        metrics["skipped"] = skipped.astype(jnp.int32)
        metrics["bounded"] = jnp.where(skipped, 0, metrics["bounded"])  # nothing was applied
    return (*after, metrics)

