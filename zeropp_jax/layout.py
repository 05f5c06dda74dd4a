"""Flat, padded parameter units: how a pytree is stored as ZeRO-3 shards.

A *unit* is what one all-gather fetches (FSDP's wrap unit, one layer): the
leaves of a sub-pytree, flattened in tree order, concatenated and padded with
zeros so that every one of the ``D = nodes * local`` devices holds an equal
shard whose length is a multiple of ``align`` (``ZeroConfig.alignment()``).
Any leaf shape works: scalars, odd sizes, sizes that are not multiples of 8
or of ``D``.
With ``leaf_align > 1`` (the qwZ block when qwZ is on) every leaf starts at
a multiple of it, zeros filling the gaps, so no quantization block holds
values of two tensors (whose scales may differ 100-fold: a LayerNorm's bias
and scale).

A *stacked* unit holds ``L`` layers of identical structure (the usual
``lax.scan`` layout): leaves of shape ``(L, *s)`` become a ``(L, padded)``
array, and slicing row ``i`` gives layer ``i``'s unit.

Global storage of a unit (a ``jax.Array``): float32 ``(padded,)`` or
``(L, padded)``, last axis sharded over ``("local", "node")`` so device
``(n, l)`` holds chunk ``l * nodes + n`` (see :mod:`zeropp_jax.mesh`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# split_units / join_units (a parameter tree <-> its units' sub-trees) live
# with the key-path functions; imported here for their callers.
from zeropp_jax.tree_paths import (  # noqa: F401
    REMAINDER, WHOLE_MODEL, cut_paths, join_units, split_units,
)


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Where one leaf lives inside its unit's flat vector.

    Attributes:
      path: ``jax.tree_util.keystr`` of the leaf inside the unit.
      shape: the leaf's shape (per layer for stacked units).
      dtype: the leaf's original dtype (restored on export).
      offset: first element in the flat vector.
      size: number of elements (``prod(shape)``; 1 for scalars).
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """Static description of one unit (hashable: used as pytree aux data).

    Attributes:
      name: the unit's key in the parameter dict (or ``"params"``).
      treedef: structure of the unit's sub-pytree (per layer if stacked).
      leaves: one :class:`LeafSpec` per leaf, in tree order.
      stack: number of stacked layers, or ``None`` for a single unit.
      numel: real elements per layer.
      padded: stored elements per layer (multiple of ``devices * align``).
        Leaves may have gaps of zeros between them (``leaf_align`` of
        :func:`build_layout`); their offsets say where each one starts.
    """

    name: str
    treedef: Any
    leaves: tuple[LeafSpec, ...]
    stack: int | None
    numel: int
    padded: int

    @property
    def global_shape(self) -> tuple[int, ...]:
        return (self.padded,) if self.stack is None else (self.stack, self.padded)

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of the real elements, adjacent leaves merged."""
        out: list[list[int]] = []
        for spec in self.leaves:
            if out and out[-1][1] == spec.offset:
                out[-1][1] += spec.size
            else:
                out.append([spec.offset, spec.offset + spec.size])
        return tuple((a, b) for a, b in out)

    @property
    def extent(self) -> int:
        """Elements up to the end of the last leaf (real ones plus gaps)."""
        last = self.leaves[-1]
        return last.offset + last.size


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """How the whole parameter pytree maps onto units.

    Attributes:
      units: the units, in the parameter dict's key order.
      whole_model: ``True`` when the pytree is one unit (no per-layer
        gathering); then the user's loss sees plain parameters.
      n_devices: devices the units are padded for.
      paths: with nested units (a wrap policy), the key path of each unit's
        sub-pytree in the parameter tree, in ``units`` order; the
        :data:`REMAINDER` unit's path is ``()``: the whole tree less the
        other units' sub-pytrees, left out (no unit, no path) when that
        holds no leaf. Empty for top-level units.
      empty_rest: the structure of the leafless rest the units are pasted
        into: with nested units and no remainder unit (e.g. ``{"encoder": {}}``),
        and with top-level units (the empty top-level mapping, of its type).
    """

    units: tuple[UnitLayout, ...]
    whole_model: bool
    n_devices: int
    paths: tuple[tuple[str, ...], ...] = ()
    empty_rest: Any = None

    @property
    def has_remainder(self) -> bool:
        """Whether the first unit is a wrap policy's :data:`REMAINDER`."""
        return bool(self.paths) and self.paths[0] == ()

    def unit(self, name: str) -> UnitLayout:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units)

    @property
    def numel(self) -> int:
        """Real parameter count."""
        return sum(u.numel * (u.stack or 1) for u in self.units)

    @property
    def padded_numel(self) -> int:
        return sum(u.padded * (u.stack or 1) for u in self.units)

    @property
    def largest_unit_numel(self) -> int:
        """Elements of the largest single gather (one layer)."""
        return max(u.padded for u in self.units)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def padded_length(elements: int, n_devices: int, align: int) -> int:
    """A unit's stored elements per layer when its leaves end at ``elements``:
    a multiple of ``n_devices * align``, one shard at least."""
    return _round_up(max(elements, 1), n_devices * align)


def _unit_layout(
    name: str, tree: Any, *, stacked: bool, n_devices: int, align: int, leaf_align: int = 1
) -> UnitLayout:
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not leaves_with_path:
        raise ValueError(f"parameter unit {name!r} has no array leaves")
    specs = []
    offset = 0
    stack = None
    for path, leaf in leaves_with_path:
        leaf_path = jax.tree_util.keystr(path)
        shape = tuple(np.shape(leaf))
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"parameter {leaf_path} (of unit {name!r}) has dtype {dtype}; ZeRO shards only "
                "floating-point parameters (keep integer state outside the params)"
            )
        if stacked:
            if not shape or not shape[0]:
                raise ValueError(
                    f"stacked unit {name!r}: leaf {leaf_path} has shape {shape}, but every "
                    "leaf of a stacked unit needs a leading layer axis of at least one layer"
                )
            if stack is None:
                stack = shape[0]
            elif shape[0] != stack:
                raise ValueError(
                    f"stacked unit {name!r}: leaf {leaf_path} has {shape[0]} layers "
                    f"along axis 0 but earlier leaves have {stack}"
                )
            shape = shape[1:]
        size = math.prod(shape)
        offset = _round_up(offset, leaf_align)
        specs.append(LeafSpec(leaf_path, shape, jnp.dtype(dtype), offset, size))
        offset += size
    padded = padded_length(offset, n_devices, align)
    numel = sum(spec.size for spec in specs)
    return UnitLayout(name, treedef, tuple(specs), stack, numel, padded)


def build_layout(
    params: Any,
    *,
    n_devices: int,
    align: int,
    per_layer: bool = True,
    stacked: Sequence[str] = (),
    leaf_align: int = 1,
    units: Sequence[Sequence[str]] = (),
) -> ParamLayout:
    """Plans the units of a parameter pytree.

    Args:
      params: the full parameter pytree (arrays or ``ShapeDtypeStruct``s).
      n_devices: number of devices the shards are spread over.
      align: each device's shard is a multiple of this many elements.
      per_layer: if ``True``, ``params`` must be a dict with string keys and
        each top-level entry is one unit (gathered when the model calls
        ``gather`` on it); if ``False`` the whole pytree is one unit,
        gathered before the loss.
      stacked: top-level keys whose leaves carry a leading layer axis; each
        layer is gathered separately.
      leaf_align: start every leaf at a multiple of this many elements
        (the qwZ block: then no quantization block mixes two tensors).
      units: key paths of nested sub-pytrees (dicts of dicts), each one
        unit named by its keys joined with ``/``; the rest of the tree is
        one more unit, :data:`REMAINDER`, unless it holds no leaf (a wrap
        policy's layout); then ``stacked`` holds key paths among them
        (layers under ``nn.scan``).

    Returns:
      The :class:`ParamLayout`.
    """
    stacked = (stacked,) if isinstance(stacked, str) else tuple(stacked)  # "blocks" as ("blocks",)
    if units:
        return _nested_layout(
            params, [tuple(p) for p in units], n_devices=n_devices,
            align=align, leaf_align=leaf_align, stacked=stacked,
        )
    if not per_layer:
        if stacked:
            raise ValueError("stacked units need per-layer gathering; pass per_layer=True or "
                             "drop stacked")
        unit = _unit_layout(WHOLE_MODEL, params, stacked=False, n_devices=n_devices,
                            align=align, leaf_align=leaf_align)
        return ParamLayout((unit,), True, n_devices)
    if not isinstance(params, Mapping):
        raise ValueError(
            "per-layer gathering needs the parameters as a dict whose top-level "
            f"entries are the layers (units); got {type(params).__name__}. Use "
            "per_layer=False to gather the whole model at once"
        )
    named = [k for k in params if not isinstance(k, str)]
    if named:
        raise ValueError(
            f"per-layer gathering names each unit after its top-level parameter key, "
            f"which must be a string; got the key(s) {named} of types "
            f"{sorted({type(k).__name__ for k in named})}: use string keys (e.g. "
            f"{{{str(named[0])!r}: ...}}), or per_layer=False"
        )
    missing = [k for k in stacked if k not in params]
    if missing:
        raise ValueError(f"stacked names {missing} are not top-level parameter keys "
                         f"{list(params)}")
    units = tuple(
        _unit_layout(
            k, v, stacked=k in stacked, n_devices=n_devices, align=align,
            leaf_align=leaf_align,
        )
        for k, v in params.items()
    )
    empty = jax.tree_util.tree_structure(cut_paths(params, [(k,) for k in params])[0])
    return ParamLayout(units, False, n_devices, empty_rest=empty)


def _nested_layout(
    params: Any, paths: list, *, n_devices: int, align: int, leaf_align: int,
    stacked: tuple,
) -> ParamLayout:
    """One unit per nested sub-pytree in ``paths``, plus the remainder if it has leaves."""
    stacked = {tuple(p) for p in stacked}
    if () in paths or len(set(paths)) < len(paths) or any(a != b and b[: len(a)] == a for a in paths for b in paths):
        raise ValueError(f"nested unit paths must be non-empty and disjoint, got {paths}")
    rest, subtrees = cut_paths(params, paths)
    kw = dict(n_devices=n_devices, align=align, leaf_align=leaf_align)
    layouts = [_unit_layout("/".join(map(str, p)), t, stacked=p in stacked, **kw)
               for p, t in zip(paths, subtrees)]
    if not jax.tree_util.tree_leaves(rest):  # every parameter is in a unit
        empty = jax.tree_util.tree_structure(rest)
        return ParamLayout(tuple(layouts), False, n_devices, tuple(paths), empty)
    layouts.insert(0, _unit_layout(REMAINDER, rest, stacked=False, **kw))
    return ParamLayout(tuple(layouts), False, n_devices, ((),) + tuple(paths))


def flatten_unit(tree: Any, unit: UnitLayout) -> jax.Array:
    """Packs a unit's sub-pytree into its float32 flat vector.

    Returns:
      float32 ``(padded,)``, or ``(L, padded)`` for a stacked unit.
    """
    leaves = jax.tree_util.tree_leaves(tree)
    lead = () if unit.stack is None else (unit.stack,)
    parts, end = [], 0
    for spec, x in zip(unit.leaves, leaves):
        if spec.offset > end:  # the gap before a leaf aligned to leaf_align
            parts.append(jnp.zeros(lead + (spec.offset - end,), jnp.float32))
        parts.append(jnp.reshape(jnp.asarray(x, jnp.float32), lead + (-1,)))
        end = spec.offset + spec.size
    parts.append(jnp.zeros(lead + (unit.padded - end,), jnp.float32))
    return jnp.concatenate(parts, axis=-1)


def unit_leaves(flat: Any, unit: UnitLayout, dtype: Any = None) -> list:
    """The unit's leaves cut out of its flat vector, in tree order.

    Args:
      flat: ``(..., padded)`` ``jax.Array``, or a host ``np.ndarray`` (then
        the leaves are numpy too, with no device round trip); any leading
        axes (e.g. the layer axis of a stacked unit) are kept on every leaf.
      unit: the unit's layout.
      dtype: cast every leaf to this dtype; ``None`` keeps ``flat.dtype``.
        Pass ``"original"`` to restore each leaf's own dtype.

    Returns:
      One array per leaf, shaped ``(..., *leaf.shape)``.
    """
    lead = flat.shape[:-1]
    if isinstance(flat, np.ndarray):
        cut = [np.reshape(flat[..., s.offset:s.offset + s.size], lead + s.shape) for s in unit.leaves]
    else:
        cut = _cut_leaves(flat, unit)
    leaves = []
    for spec, x in zip(unit.leaves, cut):
        if dtype == "original":
            x = x.astype(spec.dtype)
        elif dtype is not None:
            x = x.astype(dtype)
        leaves.append(x)
    return leaves


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _cut_leaves(flat: jax.Array, unit: UnitLayout) -> list:
    """The leaves' slices of ``flat`` ``(..., padded)``, reshaped, in ``flat.dtype``.

    Its backward assembles the flat cotangent in one concatenation (zeros in
    the gaps): differentiating the slices one by one would give each leaf's
    cotangent as a zero-padded copy of the whole unit, summed in a chain,
    i.e. memory and time quadratic in the number of leaves of a unit (the
    whole model, with ``per_layer=False``).
    """
    lead = flat.shape[:-1]
    return [
        jnp.reshape(jax.lax.slice_in_dim(flat, s.offset, s.offset + s.size, axis=-1),
                    lead + s.shape)
        for s in unit.leaves
    ]


def _cut_leaves_fwd(flat, unit):
    return _cut_leaves(flat, unit), None


def _cut_leaves_bwd(unit, _, cotangents):
    first = unit.leaves[0]
    lead = cotangents[0].shape[: cotangents[0].ndim - len(first.shape)]
    dtype = cotangents[0].dtype  # the primal's: every slice has flat's dtype
    parts, end = [], 0
    for spec, ct in zip(unit.leaves, cotangents):
        if spec.offset > end:
            parts.append(jnp.zeros(lead + (spec.offset - end,), dtype))
        parts.append(jnp.reshape(ct, lead + (-1,)))
        end = spec.offset + spec.size
    if unit.padded > end:
        parts.append(jnp.zeros(lead + (unit.padded - end,), dtype))
    return (jnp.concatenate(parts, axis=-1),)


_cut_leaves.defvjp(_cut_leaves_fwd, _cut_leaves_bwd)


def unflatten_unit(flat: jax.Array, unit: UnitLayout, dtype: Any = None) -> Any:
    """Inverse of :func:`flatten_unit`: the unit's sub-pytree.

    The leaves are :func:`unit_leaves` (same arguments) put back into the
    unit's tree structure.
    """
    return jax.tree_util.tree_unflatten(unit.treedef, unit_leaves(flat, unit, dtype))


def params_shapes(layout: ParamLayout) -> Any:
    """The full parameter pytree as ``jax.ShapeDtypeStruct`` leaves.

    What :func:`unflatten_unit` gives back for every unit (original leaf
    shapes and dtypes, stacked units with their layer axis), joined by
    :func:`join_units`; computed without data.
    """

    def unflatten_all():
        trees = {
            u.name: unflatten_unit(jnp.zeros(u.global_shape, jnp.float32), u, "original")
            for u in layout.units
        }
        return join_units(trees, layout)

    return jax.eval_shape(unflatten_all)
