"""Memory traffic of a compiled program, estimated from its optimized HLO.

A step that moves nothing between devices (a one-GPU mesh) is bound by the
bytes its kernels read from and write to device memory. XLA's own
``compiled.cost_analysis()`` counts a ``while`` body once, whatever its trip
count, so a step that scans its layers looks ``L`` times cheaper than it is.
:func:`memory_traffic` counts instead, per instruction XLA runs as a kernel
(a fusion, a copy, a dot, a custom call, a collective, ...) in ``ENTRY`` or
in a computation ``ENTRY`` reaches through ``while`` / ``conditional`` /
``call``:

* bytes read: each operand's bytes, except that an operand a fusion reads
  only through ``slice`` / ``dynamic-slice`` (after bitcasts, converts,
  other element-wise instructions of the same element count, or other
  slices) counts as the slices' bytes (a
  loop body reading one layer of a stacked array reads that layer, not the
  stack), and an unfused ``dynamic-slice`` reads its result's bytes;
* bytes written: the result's bytes, except an in-place
  ``dynamic-update-slice`` (unfused, or the root of its fusion), which
  writes only its update and does not read the buffer it updates;
* times how often it runs per call (:func:`~zeropp_jax.analysis.hlo.multiplicities`,
  trip counts multiplied through nested loops).

It is an estimate, not a measurement: caches, buffers XLA shares in other
ways, and another backend's fusion decisions change the real figure. Its
use is comparing two programs compiled the same way (the trainer's step and
plain ``jax.jit``), and finding the instructions that make the difference.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from zeropp_jax.analysis.hlo import (
    Computation,
    Instruction,
    called_computations,
    dtype_bytes,
    metadata_op_name,
    multiplicities,
    parse_module,
    shape_bytes,
)

__all__ = ["OpTraffic", "memory_traffic", "traffic_summary"]

# Instructions that run no kernel of their own (or whose bytes are counted elsewhere).
_NO_KERNEL = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while",
    "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier",
    "add-dependency", "domain",
})
_SLICES = frozenset({"slice", "dynamic-slice"})
# Element for element (same element count as the operand): a slice after them
# reads only the sliced elements of that operand.
_PASS_THROUGH = frozenset({
    "bitcast", "reshape", "convert", "copy", "add", "subtract", "multiply", "divide",
    "maximum", "minimum", "select", "compare", "clamp", "negate", "abs", "sign",
    "round-nearest-even", "round-nearest-afz", "floor", "ceil", "and", "or", "xor", "not",
    "shift-left", "shift-right-logical", "shift-right-arithmetic", "exponential", "log",
    "sqrt", "rsqrt", "tanh", "logistic", "power", "remainder", "is-finite",
})


@dataclasses.dataclass(frozen=True)
class OpTraffic:
    """One kernel-running instruction and its estimated device-memory traffic.

    Attributes:
      name: the instruction's name in the HLO.
      opcode: its opcode (``fusion``, ``copy``, ``custom-call``, ...).
      op_name: the JAX operation it came from (``metadata={op_name=...}``; may be empty).
      count: executions per call of the program.
      read: bytes read per execution.
      written: bytes written per execution.
    """

    name: str
    opcode: str
    op_name: str
    count: int
    read: int
    written: int

    @property
    def total(self) -> int:
        """Bytes read and written over all executions."""
        return self.count * (self.read + self.written)


def _control_computations(comps: dict[str, Computation], entry: str) -> set[str]:
    """``entry`` and every computation it runs as control flow (not fusion bodies)."""
    out, todo = {entry}, [entry]
    while todo:
        for inst in comps[todo.pop()].instructions:
            if inst.opcode in ("while", "conditional", "call"):
                for names in called_computations(inst).values():
                    for c in names:
                        if c in comps and c not in out and not _is_reducer(comps[c]):
                            out.add(c)
                            todo.append(c)
    return out


def _is_reducer(comp: Computation) -> bool:
    """A scalar ``to_apply`` computation (e.g. of an all-reduce), not control flow."""
    return all(not getattr(i.shape, "dims", ()) for i in comp.instructions)


def _fusion_bytes(fused: Computation, operand_bytes: list[int]) -> tuple[int, int]:
    """``(read, written)`` of a fusion from its fused computation.

    The root (or each element of a tuple root) that is a
    ``dynamic-update-slice`` of a fused parameter (through bitcasts) updates
    that parameter's buffer in place: the buffer is not read, and only the
    update is written.
    """
    params: dict[int, str] = {}
    users: dict[str, list[Instruction]] = {}
    by_name = {i.name: i for i in fused.instructions}
    for i in fused.instructions:
        if i.opcode == "parameter":
            params[int(i.operands[0][0])] = i.name
        for name, _ in i.operands:
            if name:
                users.setdefault(name, []).append(i)
    root = fused.instructions[-1]
    outputs = ([by_name.get(n) for n, _ in root.operands] if root.opcode == "tuple"
               else [root])
    buffers, written = set(), 0
    for out in outputs:
        out = _through_bitcasts(out, by_name)
        if out is not None and out.opcode == "dynamic-update-slice":
            buffers.add(getattr(_through_bitcasts(by_name.get(out.operands[0][0]), by_name),
                                "name", None))
            update, shape = out.operands[1]
            written += int(shape_bytes(shape if shape is not None else by_name[update].shape))
        elif out is not None:
            written += int(shape_bytes(out.shape))
    read = 0
    for k, nbytes in enumerate(operand_bytes):
        name = params.get(k)
        if name in buffers:
            continue  # updated in place, not read
        sliced = _slices_read(name, users, by_name)
        read += nbytes if sliced is None else min(sliced, nbytes)
    return read, written


def _through_bitcasts(inst: Instruction | None, by_name: dict) -> Instruction | None:
    while inst is not None and inst.opcode == "bitcast" and inst.operands[0][0]:
        inst = by_name.get(inst.operands[0][0])
    return inst


def _slices_read(name: str, users: dict[str, list[Instruction]], by_name: dict,
                 scale: float = 1.0, seen: set[str] | None = None) -> int | None:
    """Bytes a fused parameter is read through slices, or ``None`` if some use
    reads it whole.

    Seen through bitcasts, reshapes, converts and other element-wise
    instructions of the same element count (at the parameter's own width),
    and through slices of slices (the inner slice is what is read). Each
    instruction is visited once (``seen``), so an operand used twice by one
    instruction, or paths that meet again, count their slices once.
    """
    seen = set() if seen is None else seen
    uses = users.get(name, [])
    if not uses:
        return None
    width = _itemsize(by_name[name]) if name in by_name else None
    total = 0
    for u in uses:
        if u.name in seen:
            continue
        seen.add(u.name)
        ratio = scale * (width / _itemsize(u) if width and _itemsize(u) else 1.0)
        if u.opcode in _SLICES and u.operands[0][0] == name:
            own = int(shape_bytes(u.shape) * ratio)
            # a slice of a slice: a walk of its own, so that what it finds
            # cannot hide a whole read from the other paths
            inner = _slices_read(u.name, users, by_name, ratio, set(seen))
            total += own if inner is None else min(own, inner)
        elif u.opcode in _PASS_THROUGH and _elements(u) == _elements(by_name.get(name)):
            inner = _slices_read(u.name, users, by_name, ratio, seen)
            if inner is None:
                return None
            total += inner
        else:
            return None
    return total


def _elements(inst: Instruction | None) -> int | None:
    """Elements of a single-array instruction, else ``None``."""
    dims = getattr(getattr(inst, "shape", None), "dims", None)
    return None if dims is None else int(np.prod(dims, dtype=np.int64))


def _itemsize(inst: Instruction) -> float | None:
    """Bytes per element of a single-array instruction, else ``None``."""
    dtype = getattr(inst.shape, "dtype", None)
    return None if dtype is None else float(dtype_bytes(dtype))


def memory_traffic(hlo_text: str) -> list[OpTraffic]:
    """Every kernel-running instruction of a compiled program, with its bytes.

    Args:
      hlo_text: ``compiled.as_text()`` (optimized HLO, any backend).

    Returns:
      One :class:`OpTraffic` per instruction, in computation and text order.
    """
    comps, entry = parse_module(hlo_text)
    counts = multiplicities(comps, entry)
    shapes = {i.name: i.shape for c in comps.values() for i in c.instructions}
    out = []
    for cname in sorted(_control_computations(comps, entry)):
        comp, count = comps[cname], counts[cname].count
        for inst in comp.instructions:
            op = inst.opcode
            if op in _NO_KERNEL or op.endswith("-done") or op.endswith("-update"):
                continue
            operand_bytes = [int(shape_bytes(s if s is not None else shapes.get(n, ())))
                             for n, s in inst.operands]
            fused = called_computations(inst).get("calls", [None])[0] if op == "fusion" else None
            if fused in comps:
                read, written = _fusion_bytes(comps[fused], operand_bytes)
            elif op == "dynamic-slice":
                read = written = int(shape_bytes(inst.shape))
            elif op == "dynamic-update-slice":
                read = written = operand_bytes[1]
            else:
                read, written = sum(operand_bytes), int(shape_bytes(inst.shape))
            out.append(OpTraffic(inst.name, op, metadata_op_name(inst), count, read, written))
    return out


def traffic_summary(ops: Iterable[OpTraffic], *, top: int = 20) -> dict:
    """Plain data for a report: totals, bytes per opcode and the largest instructions.

    Returns:
      ``{"bytes": total, "by_opcode": {opcode: bytes}, "top": [{name, opcode,
      op_name, count, bytes}, ...]}`` with the ``top`` largest by total bytes.
    """
    ops = list(ops)
    by_opcode: dict[str, int] = {}
    for o in ops:
        by_opcode[o.opcode] = by_opcode.get(o.opcode, 0) + o.total
    largest = sorted(ops, key=lambda o: -o.total)[:top]
    return {
        "bytes": sum(o.total for o in ops),
        "by_opcode": dict(sorted(by_opcode.items(), key=lambda kv: -kv[1])),
        "top": [dict(name=o.name, opcode=o.opcode, op_name=o.op_name, count=o.count,
                     bytes=o.total) for o in largest],
    }
