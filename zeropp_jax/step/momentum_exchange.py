"""1-bit Adam's step, a layer at a time (inside shard_map).

:mod:`zeropp_jax.step.onebit_adam` describes the algorithm; this module runs
its compressed step, and the per-layer loop (:func:`over_layers`) that its
full-precision step uses too, so that a stacked unit's float32 work space
is a layer's, not the unit's. Handled a unit at a time, the preconditioner,
``u = m / d``, every node's decoded rows and the new carries of a stacked
unit were each ``1/local`` of the whole unit, and at 8 layers the step's
temporaries held about twice the model (``benchmarks/RESULTS.md``, "Stop
54"). The collectives are the same: the codes of every unit move together,
in one packed all-gather over ``node`` (``ZeroConfig.qgz_share``
``"gather"``), or per unit in an all-to-all and an all-gather
(``"two-hop"``). Around them, three passes over the layers:

1. encode: each node's new ``u`` of the layer, held within ``nodes * B``,
   coded with its sender carry;
2. (two-hop only) each receiver's summed chunk of the layer, averaged and
   coded again with its receiver carry;
3. settle: the layer's shared ``u`` decoded and held within ``B``, then
   ``m = u * d``, the carry the codes left, and the parameters' Adam step.

The carries, ``m`` and the parameters are rewritten in place, one layer at a
time (the state is donated). Between the passes the carry that the last
exchange settles (the sender's with ``"gather"``, the receiver's with
``"two-hop"``, whose sender carry is final after pass 1) holds its
:func:`zeropp_jax.wire.qgz.gather_encode` ``pending`` value. An unstacked
unit (one wrapped block, the embeddings) is one "layer"; the units run one
after the other (:func:`tied`), so its work space is that unit's.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from zeropp_jax.mesh import NODE
from zeropp_jax.step.adam import OneBitAdam, adam_step, next_momentum, preconditioner
from zeropp_jax.step.geometry import StepGeometry
from zeropp_jax.wire import collectives
from zeropp_jax.wire.qgz import (
    gather_decode, gather_encode, gathered_codes, reduce_decode, reduce_encode,
)


def over_layers(stack: int | None, body: Callable, inplace: dict, reads: Any, *,
                after: jax.Array) -> tuple:
    """``body`` run over a unit's layers one at a time, once ``after`` exists (local).

    Args:
      stack: the unit's layer count, or ``None`` for an unstacked unit
        (``body`` then runs once on the whole arrays).
      body: ``(inplace, reads) -> (inplace, out, count)`` on one layer's
        slices ``(1, ...)`` (each array's leading axis cut to one): the new
        values of ``inplace`` (the same structure and shapes), any pytree
        ``out`` and a float32 ``()`` count.
      inplace: dict of arrays ``(L, ...)`` rewritten layer by layer.
      reads: pytree of arrays ``(L, ...)`` only read.
      after: float32 ``()``, never negative (NaN and inf are fine): ``body``
        sees its arguments through :func:`tied`, so none of its work starts
        before ``after`` exists.

    Returns:
      ``(inplace, out, count)``: the rewritten arrays, ``out`` stacked
      ``(L, ...)`` (its layers' leading axes of one dropped) and the sum of
      the counts over layers.
    """
    def run(arrays, layer):
        new, out, count = body(tied(arrays, after), tied(layer, after))
        # The new values are written once all of the layer's float results
        # exist, so every read of the old ones comes first: else XLA copies the
        # whole buffers (every iteration, in the loop) to write them in place
        # while other work still reads them. Integer codes are not waited for:
        # with int8/int4 sign codes and two hops, XLA still copies the sender
        # carry (review 23; every preset's 1-bit code is free of copies).
        return tied(new, _nan_count((new, out, count))), out, count

    if stack is None:
        return run(inplace, reads)

    def one_layer(arrays, layer):
        cut = lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=True)
        new, out, count = run(jax.tree.map(cut, arrays), jax.tree.map(cut, reads))
        arrays = jax.tree.map(lambda a, x: jax.lax.dynamic_update_index_in_dim(a, x, layer, 0),
                              arrays, new)
        return arrays, (jax.tree.map(lambda o: o[0], out), count)

    inplace, (out, counts) = jax.lax.scan(one_layer, inplace, jnp.arange(stack))
    return inplace, out, jnp.sum(counts)


def _nan_count(tree: Any) -> jax.Array:
    """float32 ``()``: the NaNs among ``tree``'s float leaves (arrays or Python scalars;
    never negative). XLA can compute it only once all of them exist; integer leaves
    (codes) are not waited for."""
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    return sum((jnp.sum(jnp.isnan(x), dtype=jnp.float32) for x in leaves
                if jnp.issubdtype(x.dtype, jnp.floating)), jnp.zeros((), jnp.float32))


def tied(tree: Any, after: jax.Array) -> Any:
    """``tree``'s arrays, as values XLA can only compute once ``after`` exists.

    ``after`` is never negative (it may be NaN or inf), so the test
    ``after < 0`` that picks each array cannot change it. Without it, what
    depends on the state alone (``sqrt(v)``, ``m / d``, for every unit at
    once) is computed as early as the state exists, before the backward
    pass, and held through it: ``1/local`` of the model. XLA:CPU drops
    optimization barriers before scheduling and folds a test of a constant,
    so only a test of a computed value orders the work. Chaining ``after``
    through each unit's counts runs the units one after the other: most of
    the saving for unstacked units (Hugging Face GPT-2 with ``wrap=``, 8
    blocks: 30.3 against 14.9 MB of temporaries in a compressed step), a
    little for stacked ones, whose loop does most.
    """
    return jax.tree.map(lambda x: jnp.where(after < 0, jnp.zeros((), x.dtype), x), tree)


def stepped_params(
    geo: StepGeometry, unit: Any, p: jax.Array, m: jax.Array, v: jax.Array, *,
    count: jax.Array, v_count: jax.Array, adam: OneBitAdam, slice_mask: jax.Array,
) -> jax.Array:
    """The parameters after Adam's step, padding left as it was.

    Args:
      p: float32 ``([L,] U / D)``, or with ``node_replicated`` this ``local``
        slice ``([L,] U / local)``.
      m, v: float32 ``([L,] U / local)``, the new moments of this ``local`` slice.
      count, v_count: int32 ``()``: steps taken including this one; the step
        of ``v``'s last update.
      slice_mask: bool ``(U / local,)``, the slice's real entries.

    Reads ``node``'s index (this device's chunk of the slice); moves nothing.
    """
    hyper = dict(count=count, v_count=v_count, hyper=adam)
    if geo.config.node_replicated:  # every node steps its whole local slice, identically
        return jnp.where(slice_mask, adam_step(p, m, v, **hyper), p)
    stepped = adam_step(p, own_chunk(m, NODE), own_chunk(v, NODE), **hyper)
    return jnp.where(geo.shard_mask(unit, p.shape[-1]), stepped, p)


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


def compressed_update(
    geo: StepGeometry, adam: OneBitAdam, *, params: dict, m: dict, v: dict, grads: dict,
    clip: jax.Array, sq_norm: jax.Array, sender_carry: dict, receiver_carry: dict, count: jax.Array,
    v_count: jax.Array, slice_masks: dict,
) -> tuple[dict, dict, dict, dict, jax.Array]:
    """A compressed step's momentum exchange and Adam step, every unit's (inside shard_map).

    Args:
      adam: the hyperparameters.
      params: name -> float32 ``([L,] U / D)``, or with ``node_replicated``
        ``([L,] U / local)``.
      m, v, grads: name -> float32 ``([L,] U / local)``, this ``local``
        slice's moments (the same on every node) and this node's mean
        gradient (its padding zero).
      clip: float32 ``()``, this node's clipping factor.
      sq_norm: float32 ``()``, this node's squared gradient norm: the
        work waits for it (:func:`tied`).
      sender_carry, receiver_carry: name -> float32 ``([L,] U / local)``,
        ``([L,] U / D)`` (a name without a carry is missing).
      count, v_count: int32 ``()``: steps taken before this one; the step of
        ``v``'s last update.
      slice_masks: name -> bool ``(U / local,)``, the slice's real entries.

    Returns:
      ``(params, m, sender_carry, receiver_carry, bounded)``: dicts like the
      arguments, and float32 ``()`` what this device held (its values of
      the node's ``u`` held within ``nodes * bound``, plus its coordinates
      of the shared ``u`` held within ``bound`` divided by ``nodes``, since
      every node holds them): the sum over devices counts each held value
      once. Moves codes of ``ZeroConfig.qgz_code`` over ``node``: with
      ``geo.gathered_share`` one all-gather for all units, else per unit an
      all-to-all and an all-gather.
    """
    cfg = geo.config
    wire = dict(bits=cfg.qgz_bits, block=cfg.qgz_block, kernels=geo.kernels, code=cfg.qgz_code)
    bound = adam.update_bound(count + 1)
    node_bound = geo.nodes * bound
    units = geo.layout.units
    sender_carry, receiver_carry = dict(sender_carry), dict(receiver_carry)

    def encode(u, token):  # pass 1: this node's u of each layer, coded with its sender carry
        def body(carried, layer):
            d = preconditioner(layer["v"], v_count, adam)
            x = next_momentum(layer["m"] / d, clip * layer["g"] / d, adam.b1)
            held = jnp.sum(jnp.abs(x) > node_bound, dtype=jnp.float32)
            x, carry = jnp.clip(x, -node_bound, node_bound), carried.get("c")
            if geo.gathered_share:
                q, pending = gather_encode(x, carry, scale_dtype=cfg.scale_dtype, **wire)
            else:
                q, _, pending = reduce_encode(x, carry, scale_dtype=cfg.scale_dtype, **wire)
            return ({} if carry is None else {"c": pending}), q, held
        carried = {"c": sender_carry[u.name]} if u.name in sender_carry else {}
        reads = {"m": m[u.name], "v": v[u.name], "g": grads[u.name]}
        carried, q, held = over_layers(u.stack, body, carried, reads, after=token)
        if carried:
            sender_carry[u.name] = carried["c"]
        return q, held

    def share(u, received, token):  # pass 2 (two-hop): each receiver's mean chunk, coded again
        def body(carried, layer):
            y = reduce_decode(layer, **wire) / geo.nodes
            q, pending = gather_encode(y, carried.get("c"), scale_dtype=cfg.scale_dtype, **wire)
            return ({} if pending is None else {"c": pending}), q, jnp.zeros((), jnp.float32)
        carried = {"c": receiver_carry[u.name]} if u.name in receiver_carry else {}
        carried, q, _ = over_layers(u.stack, body, carried, received, after=token)
        if carried:
            receiver_carry[u.name] = carried["c"]
        return gathered_codes(q)

    # The units one after the other (tied): each waits for the last one's count.
    coded, held_here, token = {}, jnp.zeros((), jnp.float32), sq_norm
    for u in units:
        coded[u.name], held = encode(u, token)
        held_here, token = held_here + held, token + held
    if geo.gathered_share:
        with jax.named_scope("cross_node_momentum"):
            with jax.named_scope(collectives.EVERY_NODE_SCOPE):  # bytes grow with the nodes
                gathered = gathered_codes(coded)
        pending = sender_carry
    else:
        gathered, pending = {}, receiver_carry
        for u in units:
            with jax.named_scope(f"cross_node_{u.name}"):
                gathered[u.name] = share(u, collectives.all_to_all_chunks(coded[u.name], NODE),
                                         token)

    new_params, new_m, held_shared = {}, {}, jnp.zeros((), jnp.float32)
    for u in units:  # pass 3: the shared u, m = u * d, the carry, Adam's step
        mask = slice_masks[u.name]

        def body(carried, layer, u=u, mask=mask):
            values, carry = gather_decode(layer["codes"], carried.get("c"), mean=geo.gathered_share,
                                          **wire)
            held = jnp.sum(jnp.abs(values) > bound, dtype=jnp.float32)
            d = preconditioner(layer["v"], v_count, adam)
            m_new = jnp.where(mask, jnp.clip(values, -bound, bound), 0.0) * d
            p = stepped_params(geo, u, carried["p"], m_new, layer["v"], count=count + 1,
                               v_count=v_count, adam=adam, slice_mask=mask)
            return {"p": p, "m": m_new, **({} if carry is None else {"c": carry})}, None, held

        carried = {"p": params[u.name], "m": m[u.name]}
        if u.name in pending:
            carried["c"] = pending[u.name]
        reads = {"codes": gathered[u.name], "v": v[u.name]}
        carried, _, held = over_layers(u.stack, body, carried, reads, after=token)
        new_params[u.name], new_m[u.name] = carried["p"], carried["m"]
        if "c" in carried:
            pending[u.name] = carried["c"]
        held_shared, token = held_shared + held, token + held
    return new_params, new_m, sender_carry, receiver_carry, held_here + held_shared / geo.nodes
