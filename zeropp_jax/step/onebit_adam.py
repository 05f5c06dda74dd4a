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
  chunks are summed over nodes as in gradient qgZ
  (:func:`zeropp_jax.wire.qgz.cross_node_reduce`); each receiver averages its
  chunk, compresses it once more with its receiver carry, and all nodes
  gather those codes (:func:`zeropp_jax.wire.qgz.cross_node_share`); or,
  with ``ZeroConfig.qgz_share`` ``"gather"`` (``"auto"`` with two nodes, the
  same bytes), every node gathers every node's codes and averages them itself
  (:func:`zeropp_jax.wire.qgz.cross_node_gather_mean`, no receiver carry).
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
from jax.sharding import PartitionSpec as P

from zeropp_jax.mesh import LOCAL, NODE
from zeropp_jax.step.accumulate import accumulate, over_devices, square_sum_or_nan, step_metrics
from zeropp_jax.step.adam import (
    OneBitAdam, adam_step, next_momentum, next_second_moment, preconditioner,
)
from zeropp_jax.step.geometry import StepGeometry, padding_mask
from zeropp_jax.step.state import TrainState, ZeroOptState, initial_qgz_state
from zeropp_jax.wire import collectives
from zeropp_jax.wire.qgz import (
    QgzState, cross_node_gather_mean, cross_node_reduce, cross_node_share,
)


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


def own_chunk(x: jax.Array, axis: str) -> jax.Array:
    """This device's chunk of ``x`` ``(..., r)`` split ``axis_size`` ways on the last axis.

    The chunk a tiled reduce-scatter over ``axis`` would keep: ``(..., r / k)``.
    Runs inside shard_map; reads ``axis``'s index, moves nothing.
    """
    k = jax.lax.axis_size(axis)
    if k == 1:
        return x
    chunks = jnp.reshape(x, x.shape[:-1] + (k, x.shape[-1] // k))
    return jax.lax.dynamic_index_in_dim(chunks, jax.lax.axis_index(axis), axis=-2, keepdims=False)


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
      steps move momentum codes over ``node`` (:func:`_exchange_momenta`).
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
    if compress:
        denoms = {name: preconditioner(v[name][0], v_count, adam) for name in m}
        shared, new["sender"], new["receiver"], bounded = _exchange_momenta(
            geo, adam.b1, adam.update_bound(count + 1), {n: m[n][0] / d for n, d in denoms.items()},
            {n: clip * grads[n] / d for n, d in denoms.items()}, sender_carry, receiver_carry)
    for u in geo.layout.units:
        name = u.name
        m_slice, v_slice = m[name][0], v[name][0]
        clipped = clip * grads[name]
        if compress:
            m_slice = jnp.where(slice_masks[name], shared[name], 0.0) * denoms[name]
        else:
            # Exact, and the same on every node: all reduced the same
            # gradient. v is an average over time: a refresh after k
            # compressed steps decays it by b2**k.
            denom_old = preconditioner(v_slice, v_count, adam)
            b2_k = adam.b2 ** (count_now - v_count).astype(jnp.float32)
            m_slice = next_momentum(m_slice, clipped, adam.b1)
            v_slice = next_second_moment(v_slice, clipped, b2_k)
            # the carries wait, re-expressed in the new update units
            ratio = denom_old / preconditioner(v_slice, count_now, adam)
            if name in sender_carry:
                new["sender"][name] = sender_carry[name] * ratio[None]
            if name in receiver_carry:
                new["receiver"][name] = receiver_carry[name] * own_chunk(ratio, NODE)
        new["m"][name], new["v"][name] = m_slice[None], v_slice[None]
        if replicated:  # every node steps its whole local slice, identically
            stepped = adam_step(params[name], m_slice, v_slice, count=count_now,
                                v_count=new_v_count, hyper=adam)
            new["params"][name] = jnp.where(slice_masks[name], stepped, params[name])[None]
            continue
        stepped = adam_step(
            params[name], own_chunk(m_slice, NODE), own_chunk(v_slice, NODE),
            count=count_now, v_count=new_v_count, hyper=adam,
        )
        mask = geo.shard_mask(u, params[name].shape[-1])
        new["params"][name] = jnp.where(mask, stepped, params[name])
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


def _exchange_momenta(
    geo: StepGeometry, b1: float, bound: jax.Array, u_slices: dict, g_slices: dict,
    sender_carry: dict, receiver_carry: dict,
) -> tuple[dict, dict, dict, jax.Array]:
    """A compressed step's momentum exchange, every unit's (inside shard_map).

    Works in the preconditioned space ``u = m / (sqrt(v_hat) + eps)`` (``v``
    is frozen, so the momentum recursion is the same there): the 1-bit
    code's shared block magnitude then errs in units of the update, not of
    ``m``, where a coordinate with a tiny ``v`` (a gradient that is ~0, e.g.
    attention key biases) would turn the code's error into an unbounded step.

    Each node's own new ``u`` is held within ``nodes * bound`` before it is
    coded and the shared ``u`` within ``bound``
    (:meth:`~zeropp_jax.step.adam.OneBitAdam.update_bound`, which Adam never
    exceeds: only a coordinate whose frozen ``v`` lags its gradient gets
    there; see the module docstring).

    Args:
      b1: Adam's momentum decay.
      bound: float32 ``()``, the largest ``|u|`` Adam reaches at this step.
      u_slices, g_slices: name -> float32 ``([L,] U / local)``: this slice's
        ``m`` and clipped node-mean gradient, divided by the preconditioner.
      sender_carry, receiver_carry: name -> float32 ``(1, [L,] U / local)``,
        ``([L,] U / D)`` (a name without a carry is missing).

    Returns:
      ``(u, sender_carry, receiver_carry, bounded)``: name -> the new ``u``
      of this slice, the same on every node (float32 ``([L,] U / local)``),
      the new carries (dicts like the arguments), and float32 ``()`` what
      this device held: its values of the node's ``u`` held within
      ``nodes * bound``, plus its coordinates of the shared ``u`` held
      within ``bound`` divided by ``nodes`` (every node holds them), so the
      sum over devices counts each held value once. Moves codes (of
      ``ZeroConfig.qgz_code``) over ``node``: with ``geo.gathered_share``
      one all-gather for all units; else per unit an all-to-all and an
      all-gather.
    """
    cfg = geo.config
    local_u = {name: next_momentum(u, g_slices[name], b1) for name, u in u_slices.items()}
    local_u, held_here = _held_within(local_u, geo.nodes * bound)
    wire = dict(bits=cfg.qgz_bits, block=cfg.qgz_block, scale_dtype=cfg.scale_dtype,
                kernels=geo.kernels, code=cfg.qgz_code)
    if geo.gathered_share:
        with jax.named_scope("cross_node_momentum"):
            shared, sent = cross_node_gather_mean(
                local_u, {name: c[0] for name, c in sender_carry.items()}, **wire)
        received = {}
    else:
        shared, sent, received = {}, {}, {}
        for name, x in local_u.items():
            with jax.named_scope(f"cross_node_{name}"):
                summed, sent[name], _ = cross_node_reduce(
                    x, sender_carry[name][0] if name in sender_carry else None,
                    reduce_dtype=geo.plan.reduce_dtype, compress=True, **wire)
                shared[name], received[name] = cross_node_share(
                    summed / geo.nodes, receiver_carry.get(name), **wire)
    shared, held_shared = _held_within(shared, bound)
    return (shared, {n: c[None] for n, c in sent.items() if c is not None},
            {n: c for n, c in received.items() if c is not None},
            held_here + held_shared / geo.nodes)


def _held_within(u: dict, bound: jax.Array) -> tuple[dict, jax.Array]:
    """``u`` (name -> float32 array) clipped to ``[-bound, bound]``, and how many
    values the clip changed (float32 ``()``, this device's)."""
    held = sum(jnp.sum(jnp.abs(x) > bound, dtype=jnp.float32) for x in u.values())
    return {name: jnp.clip(x, -bound, bound) for name, x in u.items()}, held
