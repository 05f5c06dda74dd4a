"""What each asynchronous collective overlaps in a compiled, scheduled step.

On a GPU, XLA splits a collective into ``<kind>-start`` and ``<kind>-done``
and its scheduler places them in the instruction sequence of their
computation (the optimized HLO prints each computation in schedule order).
The kernels placed between a start and its done run while the collective is
in flight: that is all the compute that can hide its time. A collective
whose start is followed at once by its done is exposed.

:func:`async_overlaps` lists, per asynchronous collective, the kernels
scheduled inside its window and their estimated device-memory bytes
(:func:`~zeropp_jax.analysis.traffic.memory_traffic`), with the collective's
mesh axis and payload (:func:`~zeropp_jax.analysis.collectives.parse_collectives`).
XLA:CPU runs collectives synchronously, so a CPU program has none to list;
compile for a GPU (on one, or ``benchmarks/gpu_aot.py`` without one).
A schedule is not a timeline: whether the window's kernels take as long as
the transfer depends on the link and the kernels' speed.
"""

from __future__ import annotations

import dataclasses

from zeropp_jax.analysis.collectives import COLLECTIVE_KINDS, parse_collectives
from zeropp_jax.analysis.hlo import called_computations, multiplicities, parse_module
from zeropp_jax.analysis.traffic import memory_traffic

__all__ = ["Overlap", "async_overlaps"]


def _computes(opcode: str) -> bool:
    """A kernel-running instruction (one ``memory_traffic`` lists) that is not itself a collective."""
    return opcode.removesuffix("-start") not in COLLECTIVE_KINDS


@dataclasses.dataclass(frozen=True)
class Overlap:
    """One asynchronous collective and the compute scheduled while it is in flight.

    Attributes:
      name: the ``-start`` instruction.
      kind: ``all-gather``, ``reduce-scatter``, ``all-reduce``, ...
      computation: the computation holding it (a loop body runs it per iteration).
      count: executions per step (loop trip counts multiplied).
      axis: mesh axes it spans (``"local"``, ``"node"``, ``"node+local"``), or
        ``""`` where the collective parser did not read it.
      operand_bytes: its payload per device, one execution.
      kernels: kernel-running instructions between start and done.
      kernel_bytes: their estimated device-memory bytes, one execution.
    """

    name: str
    kind: str
    computation: str
    count: int
    axis: str
    operand_bytes: int
    kernels: int
    kernel_bytes: int


def async_overlaps(hlo_text: str, mesh_shape: tuple[int, int]) -> list[Overlap]:
    """Every ``-start``/``-done`` collective pair of a scheduled program, in text order.

    Args:
      hlo_text: ``compiled.as_text()`` of a GPU executable (scheduled HLO).
      mesh_shape: ``(nodes, local)`` of the program's mesh.

    Returns:
      One :class:`Overlap` per pair (``copy-start`` host transfers excluded);
      empty for a program with no asynchronous collectives (e.g. XLA:CPU's).
    """
    comps, entry = parse_module(hlo_text)
    counts = multiplicities(comps, entry)
    traffic = {o.name: o for o in memory_traffic(hlo_text)}
    collectives = {c.name: c for c in parse_collectives(hlo_text, mesh_shape=mesh_shape)}
    out = []
    for cname, comp in comps.items():
        if cname not in counts or counts[cname].count == 0:
            continue
        order = {inst.name: k for k, inst in enumerate(comp.instructions)}
        for k, inst in enumerate(comp.instructions):
            if not inst.opcode.endswith("-start") or inst.opcode == "copy-start":
                continue
            done = next((d for d in comp.instructions[k + 1:]
                         if d.opcode.endswith("-done") and d.operands
                         and d.operands[0][0] == inst.name), None)
            if done is None:
                continue
            window = [w for w in comp.instructions[k + 1:order[done.name]]
                      if w.name in traffic and _computes(w.opcode)]
            c = collectives.get(inst.name) or _wrapped(inst, comps, collectives)
            out.append(Overlap(
                name=inst.name, kind=c.kind if c else inst.opcode[: -len("-start")],
                computation=cname,
                count=counts[cname].count, axis=c.axis if c else "",
                operand_bytes=c.operand_bytes if c else 0, kernels=len(window),
                kernel_bytes=sum(traffic[w.name].read + traffic[w.name].written
                                 for w in window)))
    return out


def _wrapped(inst, comps: dict, collectives: dict):
    """The collective an ``async-start`` runs in its wrapped computation, or ``None``.

    XLA wraps collectives without a ``-start`` form of their own (e.g. a GPU
    reduce-scatter or all-to-all) as ``async-start(...), calls=%wrapped``.
    """
    for names in called_computations(inst).values():
        for name in names:
            for inner in comps[name].instructions if name in comps else ():
                if inner.name in collectives:
                    return collectives[inner.name]
    return None

