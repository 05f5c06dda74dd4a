"""Sub-pytrees at key paths of nested dicts: cut out and pasted back.

A wrap policy's layout (:func:`zeropp_jax.layout.build_layout` with
``units=``) stores each wrapped module's parameters as its own unit and the
rest of the tree as one more; these two functions split a parameter tree
that way and join it again.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence


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
