"""Communication report read exactly from a compiled (post-optimization) HLO module.

Nothing here is timed: we parse ``jax.jit(f).lower(...).compile().as_text()`` and
list every collective instruction the program really executes, with its element
type, per-device payload, replica groups, how many times it runs per call of the
entry computation, and how many bytes it moves inside and across nodes of a
``(nodes, local)`` device mesh.

The work is done in three steps, one module each:

1. :mod:`~zeropp_jax.analysis.hlo` splits the text into computations and
   instructions and counts how often each computation runs per step (``while``
   trip counts multiply; conditional branches count once each).
2. :mod:`~zeropp_jax.analysis.replica_groups` expands each collective's
   replica groups to device ids (device ``i`` sits on node ``i // local``).
3. :mod:`~zeropp_jax.analysis.collectives` turns each collective instruction
   into a :class:`~zeropp_jax.analysis.collectives.Collective` with the bytes
   it moves within and across nodes.

This module gathers them into a :class:`CommReport`: totals per node / per
device, a summary per ``(kind, dtype, axis)``, JSON and a printable table.

Example:
    >>> compiled = jax.jit(step).lower(params, batch).compile()
    >>> report = comm_report(compiled, mesh_shape=(2, 4))
    >>> print(report.format_table())
    >>> report.inter_node_bytes  # per node per step, max over nodes
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeropp_jax.analysis.collectives import Collective, check_mesh_shape, parse_collectives

__all__ = [
    "CommReport",
    "MemoryStats",
    "SummaryRow",
    "comm_report",
]


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """Collectives sharing ``(kind, dtype, axis)``; byte fields are per step.

    ``operand_bytes``/``result_bytes`` are per device; ``inter_node_bytes`` is per
    node (max over nodes) and ``intra_node_bytes`` per device (max over devices).
    ``exact`` is False if any member has an unknown trip count or sits in a
    conditional.
    """

    kind: str
    dtype: str
    axis: str
    instructions: int
    executions: int
    operand_bytes: int
    result_bytes: int
    inter_node_bytes: int
    intra_node_bytes: int
    exact: bool


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Per-device sizes from ``Compiled.memory_analysis()`` (None where absent)."""

    argument_bytes: int | None
    output_bytes: int | None
    temp_bytes: int | None
    alias_bytes: int | None
    generated_code_bytes: int | None
    peak_bytes: int | None = None

    @classmethod
    def from_compiled(cls, compiled: Any) -> MemoryStats | None:
        """Reads ``compiled.memory_analysis()``; None if the backend has none."""
        analysis = getattr(compiled, "memory_analysis", None)
        if analysis is None:
            return None
        try:
            stats = analysis()
        except (NotImplementedError, RuntimeError):
            return None
        if isinstance(stats, (list, tuple)):  # some versions return one per device
            stats = stats[0] if stats else None
        if stats is None:
            return None

        def get(*names: str) -> int | None:
            for n in names:
                v = getattr(stats, n, None)
                if v is not None:
                    return int(v)
            return None

        return cls(
            argument_bytes=get("argument_size_in_bytes"),
            output_bytes=get("output_size_in_bytes"),
            temp_bytes=get("temp_size_in_bytes"),
            alias_bytes=get("alias_size_in_bytes"),
            generated_code_bytes=get("generated_code_size_in_bytes"),
            peak_bytes=get("peak_memory_in_bytes"),
        )


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x):
        return {f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


@dataclasses.dataclass(frozen=True)
class CommReport:
    """All collectives of one compiled program, plus optional memory sizes.

    Attributes:
        collectives: one entry per collective instruction, in HLO text order.
        mesh_shape: ``(nodes, local)``.
        memory: from ``Compiled.memory_analysis()``; None when built from text.
    """

    collectives: list[Collective]
    mesh_shape: tuple[int, int]
    memory: MemoryStats | None = None

    @property
    def inter_node_bytes(self) -> int:
        """Bytes one node receives from other nodes per step (max over nodes)."""
        nodes = self.mesh_shape[0]
        return max(
            (sum(c.inter_node_bytes_by_node[n] for c in self.collectives) for n in range(nodes)),
            default=0,
        )

    @property
    def intra_node_bytes(self) -> int:
        """Bytes one device receives from its own node per step (max over devices)."""
        devices = self.mesh_shape[0] * self.mesh_shape[1]
        return max(
            (sum(c.intra_node_bytes_by_device[d] for c in self.collectives)
             for d in range(devices)),
            default=0,
        )

    @property
    def exact(self) -> bool:
        """False if any count depends on an unknown trip count or a conditional."""
        return all(c.trip_count_known and not c.in_conditional for c in self.collectives)

    def summary(self) -> list[SummaryRow]:
        """Collectives grouped by ``(kind, dtype, axis)``, in first-seen order."""
        groups: dict[tuple[str, str, str], list[Collective]] = {}
        for c in self.collectives:
            groups.setdefault((c.kind, c.dtype, c.axis), []).append(c)
        rows = []
        for (kind, dtype, axis), cs in groups.items():
            sub = CommReport(cs, self.mesh_shape)
            rows.append(SummaryRow(
                kind=kind,
                dtype=dtype,
                axis=axis,
                instructions=len(cs),
                executions=sum(c.count for c in cs),
                operand_bytes=sum(c.operand_bytes * c.count for c in cs),
                result_bytes=sum(c.result_bytes * c.count for c in cs),
                inter_node_bytes=sub.inter_node_bytes,
                intra_node_bytes=sub.intra_node_bytes,
                exact=sub.exact,
            ))
        return rows

    def to_json(self) -> dict[str, Any]:
        """Plain dict (lists, ints, strs, bools, None) ready for ``json.dumps``."""
        return {
            "mesh_shape": list(self.mesh_shape),
            "inter_node_bytes": self.inter_node_bytes,
            "intra_node_bytes": self.intra_node_bytes,
            "exact": self.exact,
            "summary": _jsonable(self.summary()),
            "collectives": _jsonable(self.collectives),
            "memory": _jsonable(self.memory) if self.memory is not None else None,
        }

    def format_table(self) -> str:
        """Human-readable table; per-step bytes, ``~`` marks inexact counts."""
        header = ("kind", "dtype", "axis", "group", "count", "operand/dev", "result/dev",
                  "inter/node/step", "intra/dev/step", "computation")
        rows = []
        for c in self.collectives:
            flag = "" if c.trip_count_known and not c.in_conditional else "~"
            rows.append((c.kind, c.dtype, c.axis, str(c.group_size), f"{c.count}{flag}",
                         _human(c.operand_bytes), _human(c.result_bytes),
                         _human(c.inter_node_bytes_per_node), _human(c.intra_node_bytes_per_device),
                         c.computation))
        rows.append(("TOTAL", "", "", "", str(sum(c.count for c in self.collectives)), "", "",
                     f"{_human(self.inter_node_bytes)} ({self.inter_node_bytes})",
                     f"{_human(self.intra_node_bytes)} ({self.intra_node_bytes})", ""))
        widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
        fmt = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
        lines = [f"mesh (nodes, local) = {tuple(self.mesh_shape)}", fmt(header),
                 fmt(tuple("-" * w for w in widths)), *map(fmt, rows)]
        if not self.exact:
            lines.append("~ count inexact: unknown while trip count (counted once) "
                         "or conditional branch")
        if self.memory is not None:
            m = self.memory
            lines.append(
                "memory/device: " + ", ".join(
                    f"{k} {_human(v)}" for k, v in (
                        ("argument", m.argument_bytes), ("output", m.output_bytes),
                        ("temp", m.temp_bytes), ("alias", m.alias_bytes),
                        ("code", m.generated_code_bytes), ("peak", m.peak_bytes))))
        return "\n".join(lines)


def comm_report(compiled_or_hlo_text: Any, *, mesh_shape: tuple[int, int]) -> CommReport:
    """Builds a ``CommReport`` from a compiled program or its HLO text.

    Args:
        compiled_or_hlo_text: a ``jax.stages.Compiled`` (its ``memory_analysis()``
            is read too) or the string from its ``as_text()``.
        mesh_shape: ``(nodes, local)``, e.g. ``mesh.devices.shape``.

    Returns:
        The report.

    Example:
        >>> compiled = jax.jit(step).lower(params, batch).compile()
        >>> comm_report(compiled, mesh_shape=(2, 4)).inter_node_bytes
    """
    memory = None
    if isinstance(compiled_or_hlo_text, str):
        text = compiled_or_hlo_text
    else:
        as_text = getattr(compiled_or_hlo_text, "as_text", None)
        if as_text is None:
            raise TypeError(
                "comm_report expects a jax.stages.Compiled or HLO text, got "
                f"{type(compiled_or_hlo_text).__name__}.")
        text = as_text()
        memory = MemoryStats.from_compiled(compiled_or_hlo_text)
    mesh = check_mesh_shape(mesh_shape)
    return CommReport(parse_collectives(text, mesh_shape=mesh), mesh, memory)
