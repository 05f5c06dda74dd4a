"""The collectives of the train step, each written once.

Every function here runs inside ``jax.shard_map`` over the ``(node, local)``
mesh and works on the LAST axis of its operand (leading axes, such as the
layer axis of a stacked unit, ride along).  ``axes`` is a tuple of mesh axis
names; the combined index over several axes is row-major in the order given
(``("local", "node")`` -> ``l * nodes + n``, the parameter shard order).
Collectives over a group of size 1 return their input unchanged, so a
``1x1`` mesh compiles to plain single-device code.

Payloads may be plain arrays or pytrees of arrays, such as
:class:`~zeropp_jax.wire.quantization.Quantized` pairs or every unit's codes
of a step. A payload of more than one array moves as ONE collective: its
arrays' bytes are packed into one ``uint8`` buffer per device and unpacked
on arrival (:func:`pack_bytes`, :func:`unpack_bytes`), so codes and scales
keep their exact widths on the wire (no backend widens a byte) and a step
pays one collective's latency, not one per array (on the emulated two-node
cluster a cross-node collective costs about a millisecond before its first
byte: ``benchmarks/RESULTS.md``). Packed collectives run under the named
scope :data:`PACKED_SCOPE`, so the compiled program says what they carry.

XLA:CPU compiles a collective of 2-byte floats as float32, twice the bytes a
GPU's NCCL sends. So a 2-byte float array moves as its bits (``uint16``,
under :data:`FLOAT_BITS_SCOPE`) on every backend, and with ``sum_bits`` (set
on CPU, :attr:`~zeropp_jax.step.geometry.StepGeometry.plan`) a reduction of
2-byte floats over one mesh axis runs as an exchange of bits and a local
float32 sum (:func:`_exchange_sum`): the bytes per device of a ring, so the
emulated cluster's link carries what a bf16 run on GPUs sends.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from zeropp_jax.wire import kernels as kernels_lib

Axes = Sequence[str]

# Named scope of a collective that carries several arrays packed into bytes
# (it appears in the compiled HLO's op_name metadata).
PACKED_SCOPE = "packed_bytes"
# Named scope of a collective that carries a 2-byte float array as its bits.
FLOAT_BITS_SCOPE = "float_bits"
# Named scope of an all-gather over ``node`` in which every node takes every
# other node's whole payload (1-bit Adam's one-hop share): its bytes per node
# grow as ``nodes - 1``, where a ZeRO gather's stay near the model's size.
EVERY_NODE_SCOPE = "from_every_node"


def _as_bytes(x: jax.Array) -> jax.Array:
    """``x`` ``(..., n)`` as ``uint8`` ``(..., n * itemsize)`` (a bitcast, no arithmetic)."""
    if x.dtype == jnp.uint8:
        return x
    b = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return b if b.ndim == x.ndim else jnp.reshape(b, x.shape[:-1] + (-1,))


def _from_bytes(b: jax.Array, dtype: Any) -> jax.Array:
    """Inverse of :func:`_as_bytes`: ``uint8`` ``(..., n * itemsize)`` -> ``dtype`` ``(..., n)``."""
    size = jnp.dtype(dtype).itemsize
    if size == 1:
        return b if dtype == jnp.uint8 else jax.lax.bitcast_convert_type(b, dtype)
    return jax.lax.bitcast_convert_type(jnp.reshape(b, b.shape[:-1] + (-1, size)), dtype)


def pack_bytes(payload: Any) -> jax.Array:
    """Every array of ``payload`` as bytes, chunk by chunk, in one ``uint8`` buffer.

    Args:
      payload: a pytree of arrays ``(..., k, m)`` (each its own dtype,
        leading axes and ``m``; the same ``k``).

    Returns:
      ``uint8`` ``(k, total)``: row ``j`` holds chunk ``j`` of every array,
      leaf after leaf. Local: touches no mesh axis.
    """
    rows = [jnp.reshape(jnp.moveaxis(_as_bytes(x), -2, 0), (x.shape[-2], -1))
            for x in jax.tree.leaves(payload)]
    return jnp.concatenate(rows, axis=1)


def unpack_bytes(buffer: jax.Array, like: Any) -> Any:
    """The arrays of :func:`pack_bytes` back, from a buffer of any number of rows.

    Args:
      buffer: ``uint8`` ``(r, total)``, each row packed as one chunk of the
        arrays of ``like`` (which rows came from where is the caller's).
      like: the packed payload (arrays or ``jax.ShapeDtypeStruct`` objects,
        leaves ``(..., k, m)``).

    Returns:
      ``like``'s structure, leaves ``(..., r, m)`` in their own dtypes.
      Local: touches no mesh axis.
    """
    leaves, treedef = jax.tree.flatten(like)
    out, offset = [], 0
    for x in leaves:
        width = math.prod(x.shape[:-2]) * x.shape[-1] * jnp.dtype(x.dtype).itemsize
        rows = jax.lax.slice_in_dim(buffer, offset, offset + width, axis=1)
        offset += width
        rows = jnp.reshape(rows, (buffer.shape[0],) + tuple(x.shape[:-2]) + (-1,))
        out.append(_from_bytes(jnp.moveaxis(rows, 0, -2), x.dtype))
    return jax.tree.unflatten(treedef, out)


def axes_size(axes: Axes) -> int:
    """Number of devices in the group spanned by ``axes``."""
    return math.prod(jax.lax.axis_size(a) for a in axes)


def axes_index(axes: Axes) -> jax.Array:
    """This device's row-major index over ``axes`` (int32 scalar)."""
    index = jnp.int32(0)
    for a in axes:
        index = index * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return index


def _levels(axes: tuple[str, ...], two_level: bool) -> tuple[tuple[str, ...], ...]:
    """The groups one collective over ``axes`` runs as: all at once, or one axis at a time.

    Axes of size 1 are dropped (nothing moves over them).
    """
    if not two_level:
        return (axes,)
    return tuple((a,) for a in axes if jax.lax.axis_size(a) > 1)


def all_gather(payload: Any, axes: Axes, *, two_level: bool = False) -> Any:
    """Concatenates every device's payload along the last axis.

    Args:
      payload: array ``(..., n)`` or a pytree of such arrays (each its own
        dtype and shape; several move packed, as one collective per level).
      axes: mesh axes to gather over.
      two_level: gather over one axis at a time, the last (innermost) first:
        over ``("local", "node")`` a gather over ``node`` (one device per
        node, the only cross-node step), then over ``local``. The result is
        the same concatenation: row ``l`` of the second step is the
        ``node``-gather ``[x(l, 0), x(l, 1), ...]``, so position
        ``l * nodes + n`` holds ``x(l, n)``.

    Returns:
      The same structure with last axes ``n * axes_size(axes)``.
    """
    axes = tuple(axes)
    if axes_size(axes) == 1:
        return payload
    for group in reversed(_levels(axes, two_level)):
        rows = _on_chunks(
            lambda x, g=group: jax.lax.all_gather(x, g, axis=x.ndim - 2, tiled=True),
            jax.tree.map(lambda x: x[..., None, :], payload))  # leaves (..., devices, n)
        payload = jax.tree.map(lambda x: jnp.reshape(x, x.shape[:-2] + (-1,)), rows)
    return payload


def _is_half(dtype: Any) -> bool:
    """A 2-byte float (bf16, f16): compiled as float32 by XLA:CPU's collectives."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2


def _on_chunks(collective: Callable[[jax.Array], jax.Array], payload: Any) -> Any:
    """Runs ``collective`` (along the second-to-last axis, which it may
    lengthen) on ``payload`` as ONE collective.

    Several arrays move packed into bytes (:func:`pack_bytes`, under
    :data:`PACKED_SCOPE`), a 2-byte float as its ``uint16`` bits (under
    :data:`FLOAT_BITS_SCOPE`), any other single array as it is.
    """
    leaves = jax.tree.leaves(payload)
    if len(leaves) > 1:
        with jax.named_scope(PACKED_SCOPE):
            return unpack_bytes(collective(pack_bytes(payload)), payload)
    if not _is_half(leaves[0].dtype):
        return jax.tree.map(collective, payload)
    with jax.named_scope(FLOAT_BITS_SCOPE):
        return jax.tree.map(
            lambda x: jax.lax.bitcast_convert_type(
                collective(jax.lax.bitcast_convert_type(x, jnp.uint16)), x.dtype),
            payload)


def reduce_scatter(x: jax.Array, axes: Axes, dtype: Any = None, *,
                   two_level: bool = False, sum_bits: bool = False) -> jax.Array:
    """Sums ``x`` over ``axes`` and keeps this device's chunk of the last axis.

    Args:
      x: ``(..., n)`` with ``n`` divisible by ``axes_size(axes)``.
      axes: mesh axes to reduce over.
      dtype: dtype on the wire (``None``: ``x.dtype``); the result is cast
        back to ``x.dtype``.
      two_level: reduce over one axis at a time, the first (outermost) first:
        over ``("local", "node")`` a reduce-scatter over ``local`` keeps chunk
        ``l`` (``n / local`` long), then one over ``node`` keeps its
        sub-chunk ``n``, i.e. chunk ``l * nodes + n`` of ``x``, as in one
        step; only the second step crosses nodes, with ``1 / local`` of the
        data. Sums are the same up to float rounding (another order).
      sum_bits: a 2-byte float wire over one mesh axis (a level) moves as
        bits and is summed locally in float32 (:func:`_exchange_sum`).

    Returns:
      ``(..., n // axes_size(axes))``.
    """
    axes = tuple(axes)
    if axes_size(axes) == 1:
        return x
    out = x if dtype is None else x.astype(dtype)
    for group in _levels(axes, two_level):
        if sum_bits and len(group) == 1 and _is_half(out.dtype):
            out = _exchange_sum(out, group[0])
        else:
            out = jax.lax.psum_scatter(out, group, scatter_dimension=x.ndim - 1, tiled=True)
    return out.astype(x.dtype)


def _exchange_sum(x: jax.Array, axis: str) -> jax.Array:
    """:func:`reduce_scatter` of ``x`` ``(..., n)`` over one mesh axis as an
    all-to-all of its chunks' bits, summed here in float32 and rounded once.

    Each device sends and receives ``(size - 1) / size`` of ``x``, as in a
    ring reduce-scatter, at ``x``'s width on every backend.
    """
    size = jax.lax.axis_size(axis)
    chunks = jnp.reshape(x, x.shape[:-1] + (size, -1))
    received = all_to_all_chunks(chunks, axis)  # row j: device j's partial sum of our chunk
    return jnp.sum(received.astype(jnp.float32), axis=-2).astype(x.dtype)


def all_reduce(x: jax.Array, axes: Axes, dtype: Any = None, *,
               sum_bits: bool = False, varying: bool = False) -> jax.Array:
    """Sums ``x`` over ``axes``; every device gets the whole sum.

    Args:
      x: any shape.
      axes: mesh axes to reduce over.
      dtype: dtype on the wire (``None``: ``x.dtype``); the result is cast
        back to ``x.dtype``.
      sum_bits: a 2-byte float wire over one mesh axis runs as
        :func:`_exchange_sum` and an all-gather of the sums' bits (a ring
        all-reduce's bytes).
      varying: type the sum varying over ``axes`` on every path (a value
        bound for a varying input, such as a gradient sink).

    Returns:
      The sum, the same on every device; typed invariant over ``axes`` for
      shard_map's check (also for a group of one device), except on the
      ``sum_bits`` path (an all-gather: typed varying) and with ``varying``.
    """
    axes = tuple(axes)
    typed = (lambda s: jax.lax.pcast(s, axes, to="varying")) if varying else (lambda s: s)
    if axes_size(axes) == 1:
        # no transfer, but still a psum: the result is invariant over `axes`
        # (shard_map's replication check), and XLA drops a group of one
        return typed(jax.lax.psum(x, axes))
    wire = x if dtype is None else x.astype(dtype)
    if not (sum_bits and len(axes) == 1 and _is_half(wire.dtype)):
        return typed(jax.lax.psum(wire, axes)).astype(x.dtype)
    size = axes_size(axes)
    flat = jnp.pad(jnp.ravel(wire), (0, -wire.size % size))
    summed = all_gather(_exchange_sum(flat, axes[0]), axes)[:wire.size]
    return jnp.reshape(summed, x.shape).astype(x.dtype)


def all_to_all_chunks(payload: Any, axis: str) -> Any:
    """Sends chunk ``j`` of the second-to-last axis to device ``j`` of ``axis``.

    Args:
      payload: arrays ``(..., k, m)`` with ``k == axis size`` (a pytree).
      axis: one mesh axis name.

    Returns:
      Same shapes; chunk ``j`` now holds what device ``j`` sent here.
    """
    if jax.lax.axis_size(axis) == 1:
        return payload
    return _on_chunks(
        lambda x: jax.lax.all_to_all(x, axis, x.ndim - 2, x.ndim - 2, tiled=True), payload)


def encode_for_gather(
    x: jax.Array, *, bits: int, block: int, scale_dtype: Any, out_dtype: Any,
    kernels: kernels_lib.Kernels = kernels_lib.XLA,
) -> Any:
    """What this device sends in a (quantized) all-gather of ``x``.

    Args:
      x: float ``(..., n)``, ``n`` a multiple of ``block`` when quantized.
      bits: 0 (``x`` cast to ``out_dtype``), 8 or 4 (a ``Quantized`` pair).
      block: elements per scale.
      scale_dtype: dtype of the scales on the wire.
      out_dtype: the gathered result's dtype (the wire dtype when ``bits`` is 0).
      kernels: the quantization kernels (XLA reference or Pallas).

    Returns:
      ``out_dtype`` ``(..., n)`` or ``Quantized``. Local: touches no mesh axis.
    """
    if bits == 0:
        return x.astype(out_dtype)
    return kernels.quantize(x, bits=bits, block=block, scale_dtype=scale_dtype)


def decode_gathered(
    payload: Any, *, bits: int, block: int, out_dtype: Any,
    kernels: kernels_lib.Kernels = kernels_lib.XLA,
) -> jax.Array:
    """The values of a gathered payload of :func:`encode_for_gather`, in ``out_dtype``.

    Args:
      payload: with ``bits`` 0, an ``out_dtype`` array ``(..., n)``; else a
        ``Quantized`` pair: values int8 ``(..., n)`` (``bits`` 8) or uint8
        ``(..., n // 2)`` (``bits`` 4), scales ``(..., n // block)``
        (float32 or bfloat16). Leading axes (a gather's device axis, a
        stacked unit's layer axis) ride along.
      bits: 0, 8 or 4, as given to :func:`encode_for_gather`.
      block: elements per scale, as given to :func:`encode_for_gather`.
      out_dtype: the result's dtype (with ``bits`` 0 the payload is in it
        already and is returned as it is).
      kernels: the dequantization kernels (XLA reference or Pallas).

    Returns:
      ``out_dtype`` ``(..., n)``. Local: touches no mesh axis.
    """
    if bits == 0:
        return payload
    return kernels.dequantize(payload, bits=bits, block=block, dtype=out_dtype)
