"""The collectives a compiled program executes, with the bytes each one moves.

Reads the collective instructions of a post-optimization HLO module (parsed by
:mod:`~zeropp_jax.analysis.hlo`, groups expanded by
:mod:`~zeropp_jax.analysis.replica_groups`) on a ``(nodes, local)`` device
mesh, where logical device ``i`` sits on node ``i // local``. (The collectives
the library *issues* live in :mod:`zeropp_jax.wire.collectives`; these are the
ones XLA compiled.)

Bytes received per device per execution, for a group of size ``g`` with
per-device operand bytes ``I`` and result bytes ``O``, from every *other*
member: all-gather ``O/g``; reduce-scatter ``I/g``; all-reduce ``2*I/g``
(ring: reduce-scatter then all-gather); all-to-all ``I/g``;
collective-permute: the whole operand from its source. A member on another
node makes the bytes inter-node.

These are *flat* counts: every device's transfer is counted, as an algorithm
that connects every device to every other (gloo's) sends them. A two-level
algorithm (NCCL's hierarchical and ring paths, DeepSpeed's ZeRO-3) brings each
distinct remote byte into a node once and forwards it over intra-node links:
:func:`two_level_bytes` counts that, ``local`` times less for a gather over
all devices.

Async pairs (``all-gather-start``/``-done`` ...) are counted once, at the start;
the result shape is read from the matching ``-done``.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Any

from zeropp_jax.analysis.hlo import (
    CallContext,
    Computation,
    Instruction,
    Shape,
    attr_value,
    metadata_op_name,
    multiplicities,
    parse_module,
    shape_bytes,
    shape_leaves,
)
from zeropp_jax.analysis.replica_groups import parse_replica_groups
from zeropp_jax.wire.collectives import FLOAT_BITS_SCOPE, PACKED_SCOPE

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "METRIC_BYTES",
    "add_permute_bytes",
    "check_mesh_shape",
    "link_bytes",
    "parse_collectives",
    "payload_role",
    "two_level_bytes",
]

COLLECTIVE_KINDS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

# All-reduces of at most this many bytes per device carry step metrics (the
# loss, the gradient norm: a few scalars; ZeRO never all-reduces parameters
# or gradients), whose size does not grow with the model.
METRIC_BYTES = 64

FLOAT_DTYPES = ("f64", "f32", "bf16", "f16")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled program.

    Byte fields: ``operand_bytes`` / ``result_bytes`` are per device for one
    execution (summed over tuple elements). ``inter_node_bytes_per_node`` and
    ``intra_node_bytes_per_device`` are *per step* (one call of the entry
    computation, i.e. already multiplied by ``count``): bytes received by all
    devices of one node from devices on other nodes (max over nodes), and bytes
    one device receives from devices of its own node (max over devices). The
    ``*_by_node`` / ``*_by_device`` tuples hold every node's / device's value.

    Attributes:
        kind: one of ``COLLECTIVE_KINDS`` (async ``-start`` forms use the base kind).
        dtype: element type, e.g. ``"bf16"``; distinct types of a tuple joined by ``+``.
        operand_bytes: per-device operand bytes, one execution.
        result_bytes: per-device result bytes, one execution.
        group_size: replica-group size (2 for a collective-permute pair, 1 if no data moves).
        num_groups: number of replica groups (source-target pairs for a permute).
        axis: ``"local"``, ``"node"``, ``"node+local"`` or ``"none"``.
        count: executions per step (loop trip counts multiplied).
        inter_node_bytes_per_node: see above.
        intra_node_bytes_per_device: see above.
        computation: name of the HLO computation holding the instruction.
        name: HLO instruction name.
        trip_count_known: False if an enclosing ``while`` had no known trip count
            (its body was counted once).
        in_conditional: True inside a ``conditional`` branch (each branch counted
            once, so ``count`` is an upper bound).
        replica_groups: the groups (or source-target pairs) as logical device ids.
        inter_node_bytes_by_node: per step, for each node.
        intra_node_bytes_by_device: per step, for each device.
        op_name: the JAX op path from the instruction's metadata (``""`` when
            absent), e.g. ``jit(step)/shard_map/cross_node_embed/packed_bytes/all_to_all``;
            :mod:`zeropp_jax.wire.collectives` names a collective that carries
            several arrays (a quantized payload's codes and scales) as bytes
            (``packed_bytes``).
    """

    kind: str
    dtype: str
    operand_bytes: int
    result_bytes: int
    group_size: int
    num_groups: int
    axis: str
    count: int
    inter_node_bytes_per_node: int
    intra_node_bytes_per_device: int
    computation: str
    name: str
    trip_count_known: bool
    in_conditional: bool
    replica_groups: tuple[tuple[int, ...], ...]
    inter_node_bytes_by_node: tuple[int, ...]
    intra_node_bytes_by_device: tuple[int, ...]
    op_name: str = ""


def check_mesh_shape(mesh_shape: Any) -> tuple[int, int]:
    """``mesh_shape`` as two positive ints ``(nodes, local)``, or a ValueError."""
    try:
        nodes, local = (int(v) for v in mesh_shape)
    except (TypeError, ValueError):
        raise ValueError(f"mesh_shape must be (nodes, local), got {mesh_shape!r}.") from None
    if nodes < 1 or local < 1:
        raise ValueError(f"mesh_shape entries must be positive, got {mesh_shape!r}.")
    return nodes, local


def _result_shape(inst: Instruction, done: Instruction | None) -> Shape:
    if not inst.opcode.endswith("-start"):
        return inst.shape
    if done is not None:
        return done.shape
    # No -done found: all-gather-start is (operands, results); collective-permute-start
    # is (operand, output, contexts...); all-reduce-start has the result shape.
    if inst.opcode != "all-reduce-start" and isinstance(inst.shape, tuple) and len(inst.shape) >= 2:
        return inst.shape[1]
    return inst.shape


def add_permute_bytes(pairs, operand_bytes, local: int, inter: list, intra: list) -> None:
    """Adds one collective-permute execution's received bytes, in place.

    Each ``(source, target)`` pair moves the whole operand: into ``target``'s
    node (``inter[node]``) when the source sits on another node, otherwise
    into the target device over intra-node links (``intra[device]``).
    """
    for src, dst in pairs:
        _add_transfer(src, dst, operand_bytes, local, inter, intra)


def _add_transfer(src: int, dst: int, nbytes, local: int, inter: list, intra: list) -> None:
    """Credits ``nbytes`` moved from device ``src`` to device ``dst``, in place.

    Into ``dst``'s node (``inter[node]``) when ``src`` sits on another node,
    otherwise to ``dst`` over intra-node links (``intra[dst]``); nothing when
    ``src == dst``. Devices are numbered node-major, ``local`` per node.
    """
    if src == dst:
        return
    if src // local != dst // local:
        inter[dst // local] += nbytes
    else:
        intra[dst] += nbytes


def _axis(groups: list[list[int]], local: int) -> str:
    moving = [g for g in groups if len(set(g)) > 1]
    if not moving:
        return "none"
    if all(len({d // local for d in g}) == 1 for g in moving):
        return "local"
    if all(len({d % local for d in g}) == 1 for g in moving):
        return "node"
    return "node+local"


def _make_collective(inst: Instruction, comp: Computation, ctx: CallContext,
                     symbols: dict[str, Instruction], done: Instruction | None,
                     nodes: int, local: int) -> Collective:
    kind = inst.opcode.removesuffix("-start")
    num_devices = nodes * local
    where = f"{inst.name} in {comp.name}"

    if kind == "collective-permute":
        spec = attr_value(inst, "source_target_pairs")
        pairs = parse_replica_groups(spec, num_devices=num_devices) if spec else []
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"Bad source_target_pairs of {where}.")
        groups = pairs
    else:
        spec = attr_value(inst, "replica_groups")
        groups = (parse_replica_groups(spec, num_devices=num_devices) if spec
                  else [list(range(num_devices))])
    for g in groups:
        for d in g:
            if not 0 <= d < num_devices:
                raise ValueError(
                    f"{where}: replica group names device {d}, outside the mesh {nodes}x{local} "
                    f"({num_devices} devices). Is mesh_shape right?")

    operand_shapes = []
    for name, shape in inst.operands:
        if shape is None and name in symbols:
            shape = symbols[name].shape
        operand_shapes.append(shape)
    result = _result_shape(inst, done)
    out_b = shape_bytes(result)
    g = max((len(x) for x in groups), default=1) if kind != "collective-permute" else 2
    if operand_shapes and all(s is not None for s in operand_shapes):
        in_b = sum((shape_bytes(s) for s in operand_shapes), Fraction(0))
        dtype_leaves = [a for s in operand_shapes for a in shape_leaves(s)]
    else:  # operand not found: derive it from the result
        in_b = {"all-gather": out_b / g, "reduce-scatter": out_b * g}.get(kind, out_b)
        dtype_leaves = shape_leaves(result)
    dtypes = list(dict.fromkeys(a.dtype for a in dtype_leaves))

    inter = [Fraction(0)] * nodes
    intra = [Fraction(0)] * num_devices
    if kind == "collective-permute":
        add_permute_bytes(groups, in_b, local, inter, intra)
    else:
        for group in groups:
            size = len(group)
            if size < 2:
                continue
            per_peer = {"all-gather": out_b / size,
                        "all-reduce": 2 * in_b / size}.get(kind, in_b / size)
            for d in group:
                for peer in group:
                    _add_transfer(peer, d, per_peer, local, inter, intra)
    inter_step = tuple(round(b * ctx.count) for b in inter)
    intra_step = tuple(round(b * ctx.count) for b in intra)
    moving = any(len(set(x)) > 1 for x in groups)
    return Collective(
        kind=kind,
        dtype="+".join(dtypes),
        operand_bytes=round(in_b),
        result_bytes=round(out_b),
        group_size=g if moving else 1,
        num_groups=len(groups),
        axis=_axis(groups, local),
        count=ctx.count,
        inter_node_bytes_per_node=max(inter_step, default=0),
        intra_node_bytes_per_device=max(intra_step, default=0),
        computation=comp.name,
        name=inst.name,
        trip_count_known=ctx.trip_count_known,
        in_conditional=ctx.in_conditional,
        replica_groups=tuple(tuple(x) for x in groups),
        inter_node_bytes_by_node=inter_step,
        intra_node_bytes_by_device=intra_step,
        op_name=metadata_op_name(inst),
    )


def parse_collectives(hlo_text: str, *, mesh_shape: tuple[int, int]) -> list[Collective]:
    """Lists the collectives of a post-optimization HLO module.

    Args:
        hlo_text: ``compiled.as_text()`` of a ``jax.jit(...).lower(...).compile()``.
        mesh_shape: ``(nodes, local)``; logical device ``i`` is on node ``i // local``.

    Returns:
        One ``Collective`` per collective instruction reachable from ``ENTRY`` (async
        pairs counted once, at the ``-start``), in text order.

    Raises:
        ValueError: if the text is not an HLO module, its header's device count
            (``num_partitions``, ``replica_count``) is not ``nodes * local``, or a
            replica group names a device outside the mesh.
    """
    nodes, local = check_mesh_shape(mesh_shape)
    comps, entry = parse_module(hlo_text)
    header = hlo_text.lstrip().split("\n", 1)[0]
    counts = dict(re.findall(r"\b(num_partitions|replica_count)=(\d+)", header))
    devices = int(counts.get("num_partitions", 1)) * int(counts.get("replica_count", 1))
    if counts and devices != nodes * local:
        raise ValueError(f"the program runs on {devices} devices (its HLO header: "
                         f"num_partitions x replica_count), but mesh_shape {(nodes, local)} has "
                         f"{nodes * local}: pass the mesh the program was compiled for")
    contexts = multiplicities(comps, entry)
    kinds = set(COLLECTIVE_KINDS) | {k + "-start" for k in COLLECTIVE_KINDS}
    out = []
    for comp in comps.values():
        if comp.name not in contexts:
            continue  # unreachable from ENTRY: never executes
        symbols = {inst.name: inst for inst in comp.instructions}
        dones = {}
        for inst in comp.instructions:
            if inst.opcode.endswith("-done") and inst.operands:
                dones[inst.operands[0][0]] = inst
        for inst in comp.instructions:
            if inst.opcode in kinds:
                out.append(_make_collective(inst, comp, contexts[comp.name], symbols,
                                            dones.get(inst.name), nodes, local))
    return out


def payload_role(c: Collective) -> str:
    """What a collective carries: ``"packed"`` (several arrays as bytes, e.g. a
    quantized payload's codes and scales: named by
    :mod:`zeropp_jax.wire.collectives`), ``"metric"`` (a few scalars),
    ``"float"`` (full-precision parameters or gradients, also a 2-byte float
    moved as its ``u16`` bits) or ``"other"``."""
    if f"/{PACKED_SCOPE}/" in c.op_name:
        return "packed"
    if f"/{FLOAT_BITS_SCOPE}/" in c.op_name:
        return "float"
    if c.kind == "all-reduce" and max(c.operand_bytes, c.result_bytes) <= METRIC_BYTES:
        return "metric"
    if c.dtype in FLOAT_DTYPES:
        return "float"
    return "other"


def two_level_bytes(c: Collective, mesh_shape: tuple[int, int]) -> tuple[list, list]:
    """Per-step link bytes of one collective under a two-level algorithm.

    Each distinct remote byte enters a node once (exchange across nodes, then
    forward inside the node). For a group with ``m`` members on a node, ``k``
    nodes and ``size`` members in all, per-device operand ``I`` and result
    ``O``: all-gather brings ``(size - m) * O / size`` into the node;
    reduce-scatter ``(k - 1) * m * I / size`` (remote partial sums of the
    node's chunks); all-reduce both; all-to-all cannot be merged
    (``m * (size - m) * I / size``); a collective-permute moves its operand
    once per pair. Each device then takes over intra-node links what it needs
    (or must hand on) minus its share of what the node's link carried.

    Args:
      c: a collective from :func:`parse_collectives`.
      mesh_shape: ``(nodes, local)`` of the compiled program.

    Returns:
      ``(inter, intra)``: bytes entering each node over its inter-node link
      (a list of ``nodes`` floats) and bytes each device receives over
      intra-node links (``nodes * local`` floats), per step (times ``c.count``).
    """
    nodes, local = mesh_shape
    inter = [0.0] * nodes
    intra = [0.0] * (nodes * local)
    I, O = float(c.operand_bytes), float(c.result_bytes)  # noqa: E741 - the math's names
    if c.kind == "collective-permute":  # one source per byte: no merging possible
        add_permute_bytes(c.replica_groups, I, local, inter, intra)
    else:
        for group in c.replica_groups:
            size = len(group)
            if size < 2:
                continue
            by_node: dict[int, list[int]] = {}
            for d in group:
                by_node.setdefault(d // local, []).append(d)
            k = len(by_node)
            for n, members in by_node.items():
                m = len(members)
                rs_in = (k - 1) * m * I / size
                inter[n] += {"all-gather": (size - m) * O / size, "reduce-scatter": rs_in,
                             "all-reduce": rs_in + (size - m) * I / size,
                             "all-to-all": m * (size - m) * I / size}[c.kind]
                own_share = (size - m) / (size * m)
                dev = {"all-gather": O * ((size - 1) / size - own_share),
                       "reduce-scatter": I * ((size - 1) / size - own_share),
                       "all-reduce": 2 * I * ((size - 1) / size - own_share),
                       "all-to-all": (m - 1) * I / size}[c.kind]
                for d in members:
                    intra[d] += dev
    return [b * c.count for b in inter], [b * c.count for b in intra]


def link_bytes(c: Collective, mesh_shape: tuple[int, int]) -> tuple[float, float]:
    """:func:`two_level_bytes`' maxima: ``(inter-node bytes into the busiest
    node, intra-node bytes into the busiest device)``, per step."""
    inter, intra = two_level_bytes(c, mesh_shape)
    return max(inter), max(intra)
