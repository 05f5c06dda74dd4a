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

The headline, ``inter_node_bytes``, is what a node must take in under a
two-level algorithm (each remote byte enters a node once, then is forwarded
inside it: NCCL's hierarchical and ring algorithms, DeepSpeed's ZeRO-3),
the figure the cost model uses. ``flat_inter_node_bytes`` counts every
device's transfer, as an algorithm connecting every device to every other
(gloo's) sends it: ``local`` times more for a gather over all devices, the
same for collectives over ``node`` (one device per node). ``intra_node_bytes``
is the same algorithm's inside-the-node side (a device takes in what it
needs, and what it hands on, less its share of what the node's link
carried; ``nodes`` times the flat count for a gather over all devices),
``flat_intra_node_bytes`` the all-device algorithm's.

Full-precision payloads can be counted at the dtypes the run uses
(``float_dtypes``): XLA:CPU compiles bf16 collectives as f32, which would
double a bf16 run's bytes (the library's own collectives move 2-byte floats
as ``u16`` bits, and on CPU reduce them over one axis as bits: only what
still compiles wider is narrowed). Quantized payloads (codes and scales packed into
bytes, :mod:`zeropp_jax.wire.collectives`) are counted as compiled: a byte
is never widened.

Example:
    >>> compiled = jax.jit(step).lower(params, batch).compile()
    >>> report = comm_report(compiled, mesh_shape=(2, 4))
    >>> print(report.format_table())
    >>> report.inter_node_bytes  # per node per step, max over nodes
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeropp_jax.analysis.collectives import (
    Collective,
    check_mesh_shape,
    parse_collectives,
    payload_role,
    two_level_bytes,
)
from zeropp_jax.analysis.hlo import dtype_bytes

__all__ = [
    "CommReport",
    "MemoryStats",
    "SummaryRow",
    "comm_report",
    "hlo_dtype",
]

_HLO_DTYPES = {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def hlo_dtype(dtype: Any) -> str:
    """HLO element type of a float dtype: ``jnp.bfloat16`` or ``"bfloat16"`` -> ``"bf16"``."""
    if isinstance(dtype, str) and dtype in _HLO_DTYPES.values():
        return dtype
    import numpy as np

    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in _HLO_DTYPES:
        raise ValueError(
            f"a full-precision wire dtype must be one of {sorted(_HLO_DTYPES)}, got {dtype!r}")
    return _HLO_DTYPES[name]


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """Collectives sharing ``(kind, dtype, axis)``; byte fields are per step.

    ``dtype`` is the counted element type (see ``CommReport.float_dtypes``);
    ``operand_bytes``/``result_bytes`` are per device; ``inter_node_bytes`` is
    per node, two-level (max over nodes), ``flat_inter_node_bytes`` per node
    with every device's transfer counted, ``intra_node_bytes`` per device,
    two-level (max over devices), and ``flat_intra_node_bytes`` per device
    with every device's transfer counted. ``exact`` is False if any member
    has an unknown trip count or sits in a conditional.
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
    flat_inter_node_bytes: int = 0
    flat_intra_node_bytes: int = 0


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
        collectives: one entry per collective instruction, in HLO text order,
            with the compiled element types and flat byte counts.
        mesh_shape: ``(nodes, local)``.
        memory: from ``Compiled.memory_analysis()``; None when built from text.
        float_dtypes: ``(gathered, reduced)`` HLO element types the run puts on
            the wire for full-precision parameters and gradients (e.g.
            ``("bf16", "bf16")``), or None to count every collective as
            compiled. A full-precision collective compiled wider (XLA:CPU
            carries bf16 collectives as f32) is counted at this width:
            all-gathers and permutes at the first, reductions and
            all-to-alls at the second. Packed quantized payloads and metric
            scalars keep their compiled widths.
    """

    collectives: list[Collective]
    mesh_shape: tuple[int, int]
    memory: MemoryStats | None = None
    float_dtypes: tuple[str, str] | None = None

    def wire_dtype(self, c: Collective) -> str:
        """The element type ``c`` is counted at (its compiled one unless narrowed).

        A collective of several element types (XLA's combiners merge arrays
        into one collective; ``c.dtype`` then reads e.g. ``"f32+bf16"``) is
        counted at its compiled widths: which of its arrays a narrowing would
        apply to is not known.
        """
        if payload_role(c) != "float" or self.float_dtypes is None or "+" in c.dtype:
            return c.dtype
        gathered, reduced = self.float_dtypes
        want = gathered if c.kind in ("all-gather", "collective-permute") else reduced
        return want if dtype_bytes(want) < dtype_bytes(c.dtype) else c.dtype

    def width_ratio(self, c: Collective) -> float:
        """Counted over compiled element width of ``c`` (1 unless narrowed)."""
        wire = self.wire_dtype(c)
        return 1.0 if wire == c.dtype else float(dtype_bytes(wire) / dtype_bytes(c.dtype))

    def _max_sum(self, per_collective) -> int:
        totals = None
        for c in self.collectives:
            values = [v * self.width_ratio(c) for v in per_collective(c)]
            totals = values if totals is None else [t + v for t, v in zip(totals, values)]
        return round(max(totals)) if totals else 0

    @property
    def inter_node_bytes(self) -> int:
        """Bytes one node takes in from other nodes per step under a two-level
        algorithm (each remote byte enters the node once; max over nodes)."""
        return self._max_sum(lambda c: two_level_bytes(c, self.mesh_shape)[0])

    @property
    def flat_inter_node_bytes(self) -> int:
        """Bytes one node's devices receive from other nodes per step, every
        device's transfer counted (an all-device algorithm; max over nodes)."""
        return self._max_sum(lambda c: c.inter_node_bytes_by_node)

    @property
    def intra_node_bytes(self) -> int:
        """Bytes one device takes in from its own node per step under the
        two-level algorithm of ``inter_node_bytes`` (max over devices)."""
        return self._max_sum(lambda c: two_level_bytes(c, self.mesh_shape)[1])

    @property
    def flat_intra_node_bytes(self) -> int:
        """Bytes one device receives from its own node per step, every
        device's transfer counted (an all-device algorithm; max over devices)."""
        return self._max_sum(lambda c: c.intra_node_bytes_by_device)

    @property
    def exact(self) -> bool:
        """False if any count depends on an unknown trip count or a conditional."""
        return all(c.trip_count_known and not c.in_conditional for c in self.collectives)

    def counted_bytes(self, c: Collective) -> tuple[float, float, float, float]:
        """``(two-level inter-node, flat inter-node, two-level intra-node, flat
        intra-node)`` bytes of one collective per step at its counted width
        (busiest node / device)."""
        scale = self.width_ratio(c)
        inter, intra = two_level_bytes(c, self.mesh_shape)
        return (max(inter) * scale, c.inter_node_bytes_per_node * scale,
                max(intra) * scale, c.intra_node_bytes_per_device * scale)

    @property
    def narrowed(self) -> bool:
        """Whether any collective is counted narrower than compiled."""
        return any(self.wire_dtype(c) != c.dtype for c in self.collectives)

    def summary(self) -> list[SummaryRow]:
        """Collectives grouped by ``(kind, counted dtype, axis)``, in first-seen order."""
        groups: dict[tuple[str, str, str], list[Collective]] = {}
        for c in self.collectives:
            groups.setdefault((c.kind, self.wire_dtype(c), c.axis), []).append(c)
        rows = []
        for (kind, dtype, axis), cs in groups.items():
            sub = dataclasses.replace(self, collectives=cs, memory=None)
            rows.append(SummaryRow(
                kind=kind,
                dtype=dtype,
                axis=axis,
                instructions=len(cs),
                executions=sum(c.count for c in cs),
                operand_bytes=round(sum(c.operand_bytes * c.count * self.width_ratio(c) for c in cs)),
                result_bytes=round(sum(c.result_bytes * c.count * self.width_ratio(c) for c in cs)),
                inter_node_bytes=sub.inter_node_bytes,
                intra_node_bytes=sub.intra_node_bytes,
                exact=sub.exact,
                flat_inter_node_bytes=sub.flat_inter_node_bytes,
                flat_intra_node_bytes=sub.flat_intra_node_bytes,
            ))
        return rows

    def to_json(self) -> dict[str, Any]:
        """Plain dict (lists, ints, strs, bools, None) ready for ``json.dumps``.

        ``inter_node_bytes`` / ``intra_node_bytes`` are the two-level figures,
        ``flat_inter_node_bytes`` / ``flat_intra_node_bytes`` the flat ones;
        ``collectives`` are as compiled (their dtypes and flat
        bytes), the totals and ``summary`` at ``float_dtypes``.
        """
        return {
            "mesh_shape": list(self.mesh_shape),
            "inter_node_bytes": self.inter_node_bytes,
            "flat_inter_node_bytes": self.flat_inter_node_bytes,
            "intra_node_bytes": self.intra_node_bytes,
            "flat_intra_node_bytes": self.flat_intra_node_bytes,
            "float_dtypes": list(self.float_dtypes) if self.float_dtypes else None,
            "exact": self.exact,
            "summary": _jsonable(self.summary()),
            "collectives": _jsonable(self.collectives),
            "memory": _jsonable(self.memory) if self.memory is not None else None,
        }

    def format_table(self) -> str:
        """Human-readable table; per-step bytes, ``~`` marks inexact counts."""
        header = ("kind", "dtype", "axis", "group", "count", "operand/dev", "result/dev",
                  "inter/node/step", "flat inter/node", "intra/dev/step", "flat intra/dev",
                  "computation")
        rows = []
        for c in self.collectives:
            flag = "" if c.trip_count_known and not c.in_conditional else "~"
            wire, scale = self.wire_dtype(c), self.width_ratio(c)
            rows.append((c.kind, c.dtype if wire == c.dtype else f"{wire}*", c.axis,
                         str(c.group_size), f"{c.count}{flag}",
                         _human(round(c.operand_bytes * scale)),
                         _human(round(c.result_bytes * scale)),
                         *(_human(round(b)) for b in self.counted_bytes(c)), c.computation))
        rows.append(("TOTAL", "", "", "", str(sum(c.count for c in self.collectives)), "", "",
                     f"{_human(self.inter_node_bytes)} ({self.inter_node_bytes})",
                     f"{_human(self.flat_inter_node_bytes)} ({self.flat_inter_node_bytes})",
                     f"{_human(self.intra_node_bytes)} ({self.intra_node_bytes})",
                     f"{_human(self.flat_intra_node_bytes)} ({self.flat_intra_node_bytes})", ""))
        widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
        fmt = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
        lines = [f"mesh (nodes, local) = {tuple(self.mesh_shape)}", fmt(header),
                 fmt(tuple("-" * w for w in widths)), *map(fmt, rows),
                 "inter/node/step, intra/dev/step: two-level (each remote byte enters a node "
                 "once and is forwarded inside it, as NCCL's hierarchical algorithms and "
                 "DeepSpeed send it); flat: every device's transfer counted (an all-device "
                 "algorithm, e.g. gloo's)"]
        if self.narrowed:
            counted = []
            if self.float_dtypes is not None:
                counted.append("gathers {}, reductions {}".format(*self.float_dtypes))
            lines.append(f"* compiled as a wider float by this backend (XLA:CPU carries bf16 "
                         f"collectives as f32); counted at the run's dtypes: "
                         f"{', '.join(counted)}")
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


def comm_report(
    compiled_or_hlo_text: Any,
    *,
    mesh_shape: tuple[int, int],
    float_dtypes: tuple[Any, Any] | None = None,
) -> CommReport:
    """Builds a ``CommReport`` from a compiled program or its HLO text.

    Args:
        compiled_or_hlo_text: a ``jax.stages.Compiled`` (its ``memory_analysis()``
            is read too) or the string from its ``as_text()``.
        mesh_shape: ``(nodes, local)``, e.g. ``mesh.devices.shape``.
        float_dtypes: ``(compute dtype, reduce dtype)`` of the run (e.g.
            ``(jnp.bfloat16, jnp.bfloat16)``): full-precision gathers and
            reductions compiled wider are counted at these widths (see
            :class:`CommReport`). None: every collective as compiled.

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
    if float_dtypes is not None:
        gathered, reduced = float_dtypes
        float_dtypes = (hlo_dtype(gathered), hlo_dtype(reduced))
    return CommReport(parse_collectives(text, mesh_shape=mesh), mesh, memory, float_dtypes)
