"""Sub-pytrees at key paths of nested dicts: cut out and pasted back.

A wrap policy's layout (:func:`zeropp_jax.layout.build_layout` with
``units=``) stores each wrapped module's parameters as its own unit and the
rest of the tree as one more; :func:`cut_paths` and :func:`paste_paths`
split a parameter tree that way and join it again, :func:`split_units` and
:func:`join_units` any :class:`~zeropp_jax.layout.ParamLayout`'s units.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax

# Unit names: the whole model as one unit, and a wrap policy's remainder.
WHOLE_MODEL = "params"
REMAINDER = "rest"


def cut_paths(params: Any, paths: Sequence[tuple[str, ...]]) -> tuple[Any, list]:
    """``(rest, subtrees)``: ``params`` less the sub-pytrees at ``paths``.

    The dicts along each path are copied (the caller's tree is unchanged);
    a dict emptied by the cut stays in ``rest`` as ``{}``.
    """
    rest = dict(params)
    subtrees = []
    for path in paths:
        node = rest
        for i, key in enumerate(path[:-1]):
            if not isinstance(node.get(key), Mapping):
                raise ValueError(f"no parameter sub-tree at {'/'.join(map(str, path[: i + 1]))}")
            node[key] = dict(node[key])
            node = node[key]
        if path[-1] not in node:
            raise ValueError(f"no parameter sub-tree at {'/'.join(map(str, path))}")
        subtrees.append(node.pop(path[-1]))
    return rest, subtrees


def paste_paths(rest: Any, paths: Sequence[tuple[str, ...]], subtrees: Sequence[Any]) -> Any:
    """Inverse of :func:`cut_paths` (copies the dicts along each path)."""
    tree = dict(rest)
    for path, sub in zip(paths, subtrees):
        node = tree
        for key in path[:-1]:
            node[key] = dict(node[key])
            node = node[key]
        node[path[-1]] = sub
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


def join_units(trees: Mapping[str, Any], layout: Any) -> Any:
    """Inverse of :func:`split_units`; without a remainder unit the wrapped
    units are pasted into the layout's leafless ``empty_rest``."""
    if layout.whole_model:
        return trees[WHOLE_MODEL]
    if layout.paths:
        first = int(layout.has_remainder)
        rest = trees[REMAINDER] if first else jax.tree_util.tree_unflatten(layout.empty_rest, [])
        return paste_paths(rest, layout.paths[first:], [trees[n] for n in layout.names[first:]])
    return {u.name: trees[u.name] for u in layout.units}
