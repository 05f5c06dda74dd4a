"""Sub-pytrees at key paths of nested dicts: cut out and pasted back.

A wrap policy's layout (:func:`zeropp_jax.layout.build_layout` with
``units=``) stores each wrapped module's parameters as its own unit and the
rest of the tree as one more; :func:`cut_paths` and :func:`paste_paths`
split a parameter tree that way and join it again, :func:`split_units` and
:func:`join_units` any :class:`~zeropp_jax.layout.ParamLayout`'s units, and
:func:`check_unit_trees` checks a tree against them.
"""

from __future__ import annotations

import collections
from typing import Any, Mapping, Sequence

import jax
import numpy as np

# Unit names: the whole model as one unit, and a wrap policy's remainder.
WHOLE_MODEL = "params"
REMAINDER = "rest"


def _same_mapping(like: Mapping, items: dict) -> Mapping:
    """``items`` as a mapping of ``like``'s type (a ``FrozenDict`` stays one)."""
    if type(like) is dict:
        return items
    if isinstance(like, collections.defaultdict):
        return type(like)(like.default_factory, items)
    try:
        return type(like)(items)
    except TypeError as e:
        raise TypeError(
            f"cannot rebuild a parameter mapping of type {type(like).__name__} from a "
            f"dict ({e}); nested units need mappings built as type(m)(dict) (dict, "
            "FrozenDict, OrderedDict)"
        ) from None


def _children(node: Mapping) -> dict:
    """A mapping's entries as they are stored: ``nnx.State`` wraps a nested
    dict in a new ``State`` when it is read, so it is read through its
    ``raw_mapping`` (the tree comes back with plain dicts where it had them)."""
    raw = getattr(node, "raw_mapping", None)
    return dict(raw if isinstance(raw, Mapping) else node)


def _cut(node: Any, path: tuple, depth: int) -> tuple[Mapping, Any]:
    """``(node less the sub-pytree at path[depth:], that sub-pytree)``."""
    key = path[depth]
    if not isinstance(node, Mapping) or key not in node:
        raise ValueError(f"no parameter sub-tree at {'/'.join(map(str, path[: depth + 1]))}")
    items = _children(node)
    if depth + 1 == len(path):
        sub = items.pop(key)
    else:
        items[key], sub = _cut(items[key], path, depth + 1)
    return _same_mapping(node, items), sub


def _paste(node: Mapping, path: tuple, sub: Any) -> Mapping:
    """``node`` with ``sub`` at key path ``path``."""
    items = _children(node)
    items[path[0]] = sub if len(path) == 1 else _paste(items[path[0]], path[1:], sub)
    return _same_mapping(node, items)


def cut_paths(params: Any, paths: Sequence[tuple[str, ...]]) -> tuple[Any, list]:
    """``(rest, subtrees)``: ``params`` less the sub-pytrees at ``paths``.

    The mappings along each path are copied into new ones of the same type
    (a ``FrozenDict`` stays one; the caller's tree is unchanged); a mapping
    emptied by the cut stays in ``rest``, empty.
    """
    rest, subtrees = params, []
    for path in paths:
        rest, sub = _cut(rest, tuple(path), 0)
        subtrees.append(sub)
    return rest, subtrees


def paste_paths(rest: Any, paths: Sequence[tuple[str, ...]], subtrees: Sequence[Any]) -> Any:
    """Inverse of :func:`cut_paths` (copies the mappings along each path,
    keeping their types)."""
    tree = rest
    for path, sub in zip(paths, subtrees):
        tree = _paste(tree, tuple(path), sub)
    return tree


def split_units(params: Any, layout: Any) -> dict[str, Any]:
    """The sub-pytree of each unit of a :class:`~zeropp_jax.layout.ParamLayout`,
    keyed by unit name."""
    if layout.whole_model:
        return {WHOLE_MODEL: params}
    if layout.paths:
        first = int(layout.has_remainder)
        rest, subtrees = cut_paths(params, layout.paths[first:])
        return dict(zip(layout.names, [rest] * first + subtrees))
    return {u.name: params[u.name] for u in layout.units}


def leaf_indices(tree: Any, layout: Any) -> dict[str, list[int]]:
    """Each unit's leaves (by :func:`split_units`), as their indices among
    ``tree``'s leaves, in the unit's leaf order."""
    numbered = jax.tree.unflatten(jax.tree.structure(tree), range(len(jax.tree.leaves(tree))))
    return {name: jax.tree.leaves(sub) for name, sub in split_units(numbered, layout).items()}


def join_units(trees: Mapping[str, Any], layout: Any) -> Any:
    """Inverse of :func:`split_units`; without a remainder unit the wrapped
    units are pasted into the layout's leafless ``empty_rest``, and top-level
    units are put in a mapping of its type (a ``FrozenDict`` stays one)."""
    if layout.whole_model:
        return trees[WHOLE_MODEL]
    if layout.paths:
        first = int(layout.has_remainder)
        rest = trees[REMAINDER] if first else jax.tree_util.tree_unflatten(layout.empty_rest, [])
        return paste_paths(rest, layout.paths[first:], [trees[n] for n in layout.names[first:]])
    items = {u.name: trees[u.name] for u in layout.units}
    if layout.empty_rest is None:
        return items
    return _same_mapping(jax.tree_util.tree_unflatten(layout.empty_rest, []), items)


def check_unit_trees(params: Any, layout: Any) -> None:
    """Raises ``ValueError`` unless ``params`` fits ``layout``'s units
    (:class:`~zeropp_jax.layout.ParamLayout`): each unit's leaves at the same
    key paths (those missing or extra are named) with the same shapes."""
    try:
        trees = split_units(params, layout)
    except (KeyError, IndexError, TypeError) as e:  # a unit's sub-tree is not there
        raise ValueError(f"the parameters lack what make_trainer was given: no {e} in "
                         f"them (units {', '.join(u.name for u in layout.units)})") from None
    for u in layout.units:
        structure = jax.tree_util.tree_structure(trees[u.name])
        if structure != u.treedef:  # per layer and stacked alike
            given = _leaf_paths(trees[u.name])
            expected = _leaf_paths(jax.tree_util.tree_unflatten(u.treedef, [0] * u.treedef.num_leaves))
            diff = "; ".join(f"{what} {', '.join(sorted(paths))}" for what, paths in (
                ("extra", given - expected), ("missing", expected - given)) if paths)
            raise ValueError(f"parameters of unit {u.name!r} differ from the ones make_trainer "
                             f"was given: {diff or f'structure {structure}, expected {u.treedef}'}")
        for spec, leaf in zip(u.leaves, jax.tree_util.tree_leaves(trees[u.name])):
            shape = tuple(np.shape(leaf))
            expected = spec.shape if u.stack is None else (u.stack,) + spec.shape
            if shape != expected:
                raise ValueError(f"parameter {u.name}{spec.path} has shape {shape}, expected "
                                 f"{expected}")


def _leaf_paths(tree: Any) -> set[str]:
    return {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
