"""Replica groups of an HLO collective, expanded to lists of device ids.

XLA prints the groups of a collective in several forms: explicit
``{{0,1},{2,3}}``, iota ``[2,4]<=[4,2]T(1,0)``, the Shardy mesh form
``mesh['a'=2,'b'=4] {'b'}``, or ``{}`` = all devices. Ids are logical device
positions in mesh order (``mesh.devices.flat``): on a ``(nodes, local)`` mesh
device ``i`` sits on node ``i // local``.
"""

from __future__ import annotations

import re

import numpy as np

from zeropp_jax.analysis.hlo import match_close, split_top_level

__all__ = ["parse_replica_groups"]

_IOTA_RE = re.compile(r"\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
_MESH_RE = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]\s*(?:,\s*device_ids=\((?P<ids>[^)]*(?:\([^)]*\))?[^)]*)\))?"
    r"\s*\{(?P<group>[^}]*)\}"
)


def _ints(s: str) -> list[int]:
    return [int(t) for t in re.findall(r"-?\d+", s)]


def _iota(reshape: list[int], perm: list[int] | None) -> np.ndarray:
    arr = np.arange(int(np.prod(reshape)), dtype=np.int64).reshape(reshape)
    if perm:
        if sorted(perm) != list(range(len(reshape))):
            raise ValueError(f"Bad iota transpose T{tuple(perm)} for dims {reshape}.")
        arr = arr.transpose(perm)
    return arr.reshape(-1)


def _mesh_axes_groups(m: re.Match) -> list[list[int]]:
    """Groups of the Shardy mesh form ``mesh['a'=2,'b'=4] {'b'}`` (sub-axes ``'a':(1)2``)."""
    names, sizes = [], []
    for tok in split_top_level(m.group("axes")):
        name, size = tok.rsplit("=", 1)
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    total = int(np.prod(sizes))
    ids = m.group("ids")
    if ids is None:
        devices = np.arange(total, dtype=np.int64)
    else:
        im = re.fullmatch(r"\s*\[([\d,\s]+)\](?:<=\[([\d,\s]+)\])?(?:T\(([\d,\s]+)\))?\s*", ids)
        if im:
            reshape = _ints(im.group(2) or im.group(1))
            devices = _iota(reshape, _ints(im.group(3)) if im.group(3) else None)
        else:
            devices = np.asarray(_ints(ids), dtype=np.int64)
    if devices.size != total:
        raise ValueError(f"Mesh device_ids {ids!r} do not match axis sizes {sizes}.")

    # Axis references: (mesh axis index, pre_size or None, size).
    refs = []
    for tok in split_top_level(m.group("group")):
        am = re.fullmatch(r"['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?", tok)
        if not am or am.group(1) not in names:
            raise ValueError(f"Bad mesh axis reference {tok!r} (mesh axes {names}).")
        dim = names.index(am.group(1))
        pre = int(am.group(2)) if am.group(2) else None
        refs.append((dim, pre, int(am.group(3)) if am.group(3) else sizes[dim]))

    # Split every mesh dim into the sub-dims its references need, then move the
    # referenced sub-dims (in reference order) to the end.
    split_dims: list[int] = []
    ref_axis: dict[int, int] = {}  # index in refs -> index in split_dims
    for dim, size in enumerate(sizes):
        mine = sorted((r[1] or 1, k) for k, r in enumerate(refs) if r[0] == dim)
        prefix = 1
        for pre, k in mine:
            if pre % prefix:
                raise ValueError(f"Overlapping sub-axes of mesh axis {names[dim]!r}.")
            if pre != prefix:
                split_dims.append(pre // prefix)
                prefix = pre
            ref_axis[k] = len(split_dims)
            split_dims.append(refs[k][2])
            prefix *= refs[k][2]
        if prefix != size:
            if size % prefix:
                raise ValueError(f"Sub-axes do not divide mesh axis {names[dim]!r}.")
            split_dims.append(size // prefix)
    grouped = [ref_axis[k] for k in range(len(refs))]
    perm = [a for a in range(len(split_dims)) if a not in grouped] + grouped
    group_size = int(np.prod([refs[k][2] for k in range(len(refs))]))
    arr = devices.reshape(split_dims).transpose(perm).reshape(-1, group_size)
    return arr.tolist()


def parse_replica_groups(spec: str, *, num_devices: int) -> list[list[int]]:
    """Expands an HLO ``replica_groups`` value into explicit groups.

    Args:
        spec: the text after ``replica_groups=``: explicit ``{{0,1},{2,3}}``, empty
            ``{}`` (all devices in one group), iota ``[2,4]<=[8]`` /
            ``[4,2]<=[2,4]T(1,0)`` (iota over prod of the ``<=`` dims, reshaped to
            them, transposed by ``T``, reshaped to ``[num_groups, group_size]``), or the
            Shardy mesh form ``mesh['x'=2,'y'=4] {'y'}``. Trailing text is ignored.
        num_devices: number of devices in the program (used for ``{}``).

    Returns:
        List of groups, each a list of logical device ids.

    Example:
        >>> parse_replica_groups("[4,2]<=[2,4]T(1,0)", num_devices=8)
        [[0, 4], [1, 5], [2, 6], [3, 7]]
    """
    s = spec.strip()
    if s.startswith("{"):
        body = s[:match_close(s, 0)]
        groups = [_ints(g) for g in re.findall(r"\{([^{}]*)\}", body[1:-1])]
        return groups if groups else [list(range(num_devices))]
    m = _IOTA_RE.match(s)
    if m:
        dims = _ints(m.group(1))
        reshape = _ints(m.group(2))
        if len(dims) != 2 or dims[0] * dims[1] != int(np.prod(reshape)):
            raise ValueError(
                f"Bad iota replica groups {spec!r}: need [groups,size]<=[dims] "
                "of equal size.")
        flat = _iota(reshape, _ints(m.group(3)) if m.group(3) else None)
        return flat.reshape(dims).tolist()
    m = _MESH_RE.match(s)
    if m:
        return _mesh_axes_groups(m)
    m = re.match(r"maximal_mesh\[device_id=(\d+)\]", s)
    if m:
        return [[int(m.group(1))]]
    raise ValueError(f"Unrecognized replica_groups format: {spec[:120]!r}")

