"""qgZ: the once-per-step cross-node gradient reduction, with error feedback.

With hierarchical gradients (hpZ or qgZ on) every layer's gradient is first
reduce-scattered over ``local`` inside the node at full precision, and
accumulated over micro-batches.  Each device then holds a *node-partial*
gradient ``g`` of ``1/local`` of the unit.  This module sums it over nodes
and keeps this device's ``1/(nodes*local)`` chunk:

* full precision: one reduce-scatter over ``node``;
* compressed (``1bit``, ``int8``, ``int4``): ``x = g + carry``; ``x`` is cut
  into ``nodes`` chunks, each quantized block-wise; an all-to-all over
  ``node`` delivers to each node the codes of its chunk from every node,
  which it dequantizes and sums in float32 (a sum of 1-bit values is not
  1 bit, so the sum is never re-quantized).  With error feedback the new
  carry is ``x - dequantize(quantize(x))``: what compression lost is added to
  the next step's gradient, so nothing is lost, only deferred.

With ``code="dither"`` the 1-bit codes are unbiased instead
(:mod:`zeropp_jax.wire.dither`: block absmax scale, subtractive dither that each
receiver regenerates from ``key`` and the sender's node index); they are used
without error feedback.

The carry is optimizer state (:class:`QgzState`), stored per unit as a float32
``(nodes, [L,] padded)`` array, sharded ``P("node", [None,] "local")``:
row ``n`` is node ``n``'s carry, and device ``(n, l)`` holds the part that
compensates its own node-partial gradient.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zeropp_jax.wire import collectives
from zeropp_jax.wire import dither
from zeropp_jax.wire import kernels as kernels_lib
from zeropp_jax.wire import rotation
from zeropp_jax.mesh import NODE
from zeropp_jax.wire.quantization import ordered_chunk_sum


class QgzState(NamedTuple):
    """Cross-node reduction state, carried in the optimizer state.

    Attributes:
      carry: dict unit name -> float32 ``(nodes, [L,] padded)`` error-feedback
        carry, or an empty dict when error feedback is off.
      grad_rms: float32 scalar, root-mean-square of the last step's reduced
        gradient (drives the optional compression gate); a step whose
        gradient holds a NaN or an inf leaves it as it was.
    """

    carry: dict  # name -> float32 (nodes, [L,] padded), P(node, [None,] local)
    grad_rms: jax.Array  # float32 ()


def cross_node_reduce(
    g: jax.Array,
    carry: jax.Array | None,
    *,
    bits: int,
    block: int,
    scale_dtype: Any,
    reduce_dtype: Any,
    compress: bool,
    kernels: kernels_lib.Kernels = kernels_lib.XLA,
    code: str = "sign",
    key: jax.Array | None = None,
    sum_bits: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Sums node-partial gradients over ``node`` (runs inside shard_map).

    Args:
      g: float32 ``(..., r)``, this device's node-partial gradient
        (``r = padded / local``; ``r`` divisible by ``nodes * block``).
      carry: float32 ``(..., r)`` error-feedback carry, or ``None``.
      bits: 1, 4 or 8 when compressing.
      block: elements per scale.
      scale_dtype: dtype of the scales on the wire.
      reduce_dtype: dtype of the full-precision reduce-scatter.
      compress: compress (``True``) or reduce at full precision (``False``,
        which also flushes the carry into this step's gradient).
      kernels: the quantization kernels (XLA reference or Pallas; 1-bit
        compression with error feedback is one fused pass).
      code: ``"sign"`` (scaled sign, mean|x| per block, or absmax
        integers), ``"hadamard"`` (the same code of each block's randomized
        Hadamard rotation, with the sending node's own sign pattern,
        :mod:`zeropp_jax.wire.rotation`; the carry stays unrotated) or,
        1-bit only, ``"dither"`` (unbiased, :mod:`zeropp_jax.wire.dither`;
        needs ``key`` and ``carry=None``).
      key: uint32 scalar naming this step, unit and ``local`` index, the same
        on the devices that exchange chunks (only for ``code="dither"``).
      sum_bits: as :func:`zeropp_jax.wire.collectives.reduce_scatter`'s
        (the full-precision reduction of a 2-byte ``reduce_dtype``).

    Returns:
      ``(reduced, new_carry, transmitted)``: the float32 ``(..., r / nodes)``
      sum over nodes of this device's chunk; the new carry (``None`` if
      ``carry`` was ``None``); and the float32 ``(..., r)`` value this device
      put on the wire, dequantized (``x`` itself at full precision; at 1 bit
      ``x - new_carry``, which is that up to rounding), for the error-feedback
      accounting in tests. Touches ``node`` only.
    """
    x = g if carry is None else g + carry
    if not compress:
        reduced = collectives.reduce_scatter(x, (NODE,), reduce_dtype, sum_bits=sum_bits)
        new_carry = None if carry is None else jnp.zeros_like(carry)
        return reduced, new_carry, x
    nodes = jax.lax.axis_size(NODE)
    if bits == 1 and code == "dither":
        if carry is not None or key is None:
            raise ValueError(
                "the dithered 1-bit code needs a key and runs without error feedback "
                f"(got key={'set' if key is not None else None}, carry "
                f"{'set' if carry is not None else None})."
            )
        xc = _node_rows(x, nodes)
        me = jax.lax.axis_index(NODE)  # this device sends as `me` and receives chunk `me`
        xi = dither.uniform_noise(dither.stream_key(key, me), dither.element_counters(xc.shape))
        q = kernels.quantize_dithered(xc, xi, block=block, scale_dtype=scale_dtype)
        sent = jnp.reshape(dither.dequantize_dithered(q, xi, block=block), x.shape)
        received = collectives.all_to_all_chunks(q, NODE)
        # Chunk k of `received` is sender k's chunk `me` of its (..., nodes, c).
        senders = jnp.arange(nodes, dtype=jnp.uint32)
        keys = jnp.reshape(dither.stream_key(key, senders), (1,) * (xc.ndim - 2) + (nodes, 1))
        xi_in = dither.uniform_noise(keys, dither.element_counters(xc.shape, row=me))
        values = dither.dequantize_dithered(received, xi_in, block=block)
        return ordered_chunk_sum(values), None, sent  # the order of dequantize_sum
    q, sent, residual = reduce_encode(g, carry, bits=bits, block=block, scale_dtype=scale_dtype,
                                      kernels=kernels, code=code)
    received = collectives.all_to_all_chunks(q, NODE)  # row k: sender k's codes
    reduced = reduce_decode(received, bits=bits, block=block, kernels=kernels, code=code)
    new_carry = None if carry is None else residual
    return reduced, new_carry, sent


def reduce_encode(
    g: jax.Array, carry: jax.Array | None, *, bits: int, block: int, scale_dtype: Any,
    kernels: kernels_lib.Kernels, code: str,
) -> tuple[Any, jax.Array, jax.Array]:
    """The codes :func:`cross_node_reduce` sends (its first half; local, touches no mesh axis).

    Args:
      g, carry: float32 ``(..., r)`` (``carry`` may be ``None``), as
        :func:`cross_node_reduce`'s; ``code`` ``"sign"`` or ``"hadamard"``.

    Returns:
      ``(q, sent, residual)``: the ``Quantized`` codes of ``x = g + carry``
      cut into one row per node, ``(..., nodes, ·)``, ready for
      :func:`zeropp_jax.wire.collectives.all_to_all_chunks` over ``node``;
      float32 ``(..., r)`` what they decode to and ``x - sent`` (the new
      carry), both unrotated.
    """
    nodes = jax.lax.axis_size(NODE)
    q, sent, residual = _encode(
        _node_rows(g, nodes), None if carry is None else _node_rows(carry, nodes),
        bits=bits, block=block, scale_dtype=scale_dtype, kernels=kernels, code=code,
    )
    return q, jnp.reshape(sent, g.shape), jnp.reshape(residual, g.shape)


def reduce_decode(received: Any, *, bits: int, block: int, kernels: kernels_lib.Kernels,
                  code: str) -> jax.Array:
    """float32 ``(..., c)``: codes ``(..., nodes, ·)`` received from every node, decoded and
    summed in node order (:func:`cross_node_reduce`'s second half; local)."""
    return _decoded_sum(received, bits=bits, block=block, kernels=kernels, code=code)


def _node_rows(y: jax.Array, nodes: int) -> jax.Array:
    """``(..., nodes * w)`` -> ``(..., nodes, w)``: the last axis cut into one chunk per node."""
    return jnp.reshape(y, y.shape[:-1] + (nodes, y.shape[-1] // nodes))


def _encode(
    g: jax.Array, carry: jax.Array | None, *, bits: int, block: int, scale_dtype: Any,
    kernels: kernels_lib.Kernels, code: str,
) -> tuple[Any, jax.Array, jax.Array]:
    """Codes of ``x = g + carry`` with the ``"sign"`` or ``"hadamard"`` code.

    Returns ``(q, sent, residual)`` as :func:`_quantize_with_carry`, with
    ``sent`` and ``residual`` in ``x``'s own (unrotated) domain, float32
    ``(..., n)``: the carry never depends on the code.
    """
    if code == "sign":
        return _quantize_with_carry(
            g, carry, bits=bits, block=block, scale_dtype=scale_dtype, kernels=kernels)
    if code == "dither":
        raise ValueError(f"the 'dither' code is 1-bit only, got bits={bits}; use bits=1, or "
                         "code 'sign' or 'hadamard' at 4 or 8 bits.")
    if code != "hadamard":
        raise ValueError(f"code must be 'sign', 'hadamard' or 'dither' (1-bit), got {code!r}.")
    x = g if carry is None else g + carry
    sender = dict(pattern=jax.lax.axis_index(NODE), patterns=jax.lax.axis_size(NODE))
    q, _, residual = _quantize_with_carry(
        rotation.rotate(x, block, **sender), None,
        bits=bits, block=block, scale_dtype=scale_dtype, kernels=kernels)
    residual = rotation.unrotate(residual, block, **sender)
    return q, x - residual, residual


def gather_encode(
    x: jax.Array, carry: jax.Array | None, *, bits: int, block: int, scale_dtype: Any,
    kernels: kernels_lib.Kernels, code: str,
) -> tuple[Any, jax.Array | None]:
    """The codes this node sends of ``x + carry`` to be gathered by every node (local).

    The first of three steps that give every node every node's compressed
    ``x``: :func:`gathered_codes` moves the codes over ``node`` (those of
    many arrays as one collective) and :func:`gather_decode` decodes them,
    averaged (1-bit Adam's one-hop share: each node takes in ``nodes - 1``
    nodes' codes for the whole of ``x``; the two hops take in codes for
    ``2 (nodes - 1) / nodes`` of ``x``: the same bytes for two nodes, fewer
    beyond) or side by side (the second of its two hops, after
    :func:`cross_node_reduce`'s halves). Every node decodes the same bits,
    so all hold the same values; the new carry is ``x + carry`` less what
    this node's codes decode to.

    Args:
      x, carry: float32 ``(..., r)`` (``carry`` may be ``None``).
      code: ``"sign"`` or ``"hadamard"``.

    Returns:
      ``(q, pending)``: the ``Quantized`` codes and, with a carry, float32
      ``(..., r)`` what :func:`gather_decode` turns into the new carry: the
      residual itself for ``"sign"``, ``x + carry`` for ``"hadamard"``
      (whose residual comes from this node's own decoded row, so the sender
      rotates once, not twice); ``None`` without a carry.
    """
    if code != "hadamard":
        q, _, residual = _encode(
            x, carry, bits=bits, block=block, scale_dtype=scale_dtype, kernels=kernels, code=code)
        return q, None if carry is None else residual
    total = x if carry is None else x + carry
    rotated = rotation.rotate(total, block, pattern=jax.lax.axis_index(NODE),
                              patterns=jax.lax.axis_size(NODE))
    q, _, _ = _quantize_with_carry(rotated, None, bits=bits, block=block,
                                   scale_dtype=scale_dtype, kernels=kernels)
    return q, None if carry is None else total


def gathered_codes(q: Any) -> Any:
    """Every node's codes ``q`` (a pytree of ``(..., n)`` arrays), one row per sender
    ``(..., nodes, n)``: one collective over ``node``."""
    nodes = jax.lax.axis_size(NODE)
    return jax.tree.map(lambda a: _node_rows(a, nodes), collectives.all_gather(q, (NODE,)))


def gather_decode(
    gathered: Any, pending: jax.Array | None, *, bits: int, block: int,
    kernels: kernels_lib.Kernels, code: str, mean: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """Every node's codes decoded, and this node's new carry (local).

    The last of :func:`gather_encode`'s three steps.

    Args:
      gathered: codes ``(..., nodes, ·)`` from :func:`gathered_codes`.
      pending: :func:`gather_encode`'s, float32 ``(..., r)``, or ``None``.
      mean: average the rows (``(..., r)``, summed in node order), or lay
        them side by side (``(..., nodes * r)``, node order).

    Returns:
      ``(values, new_carry)``: float32, the same on every node; and the new
      carry ``x + carry`` less what this node sent (``None`` without one).
    """
    wire = dict(bits=bits, block=block, kernels=kernels, code=code)
    nodes = jax.lax.axis_size(NODE)
    if mean and code != "hadamard":  # one fused pass; the sender knew its residual
        return _decoded_sum(gathered, **wire) / nodes, pending
    rows = _decoded_rows(gathered, **wire)
    if pending is not None and code == "hadamard":
        pending = pending - jax.lax.dynamic_index_in_dim(
            rows, jax.lax.axis_index(NODE), axis=rows.ndim - 2, keepdims=False)
    if mean:
        return ordered_chunk_sum(rows) / nodes, pending
    return jnp.reshape(rows, rows.shape[:-2] + (-1,)), pending


def _decoded_rows(q: Any, *, bits: int, block: int, kernels: kernels_lib.Kernels,
                  code: str) -> jax.Array:
    """float32 ``(..., k, c)``: row ``i`` of codes ``(..., k, ·)`` decoded as sender ``i`` coded it."""
    values = kernels.dequantize(q, bits=bits, block=block, dtype=jnp.float32)
    return rotation.unrotate_rows(values, block) if code == "hadamard" else values


def _decoded_sum(q: Any, *, bits: int, block: int, kernels: kernels_lib.Kernels,
                 code: str) -> jax.Array:
    """float32 ``(..., c)``: the decoded rows of ``(..., k, ·)`` summed in row order."""
    if code != "hadamard":  # one fused pass
        return kernels.dequantize_sum(q, bits=bits, block=block)
    return ordered_chunk_sum(_decoded_rows(q, bits=bits, block=block, kernels=kernels, code=code))



def _quantize_with_carry(
    g: jax.Array,
    carry: jax.Array | None,
    *,
    bits: int,
    block: int,
    scale_dtype: Any,
    kernels: kernels_lib.Kernels,
) -> tuple[Any, jax.Array, jax.Array]:
    """Block-wise codes of ``x = g + carry`` (``g`` alone without a carry).

    Args:
      g, carry: float32 ``(..., n)`` (``carry`` may be ``None``).

    Returns:
      ``(q, sent, residual)``: the ``Quantized`` codes, what they decode to
      (float32 ``(..., n)``) and ``x - sent``, what compression lost. 1-bit
      runs as one fused kernel (:meth:`Kernels.compress_1bit_ef`), which
      returns the residual: ``sent`` is then ``x - residual``, the decoded
      value up to the rounding of those two subtractions. Without a carry
      every width runs :meth:`Kernels.quantize` (no zero carry read, no
      residual written where only the codes are used).
    """
    x = g if carry is None else g + carry
    if bits == 1 and carry is not None:
        q, residual = kernels.compress_1bit_ef(g, carry, block=block, scale_dtype=scale_dtype)
        return q, x - residual, residual
    q = kernels.quantize(x, bits=bits, block=block, scale_dtype=scale_dtype)
    sent = kernels.dequantize(q, bits=bits, block=block, dtype=jnp.float32)
    return q, sent, x - sent

