"""Communication report read exactly from a compiled (post-optimization) HLO module.

Nothing here is timed: we parse ``jax.jit(f).lower(...).compile().as_text()`` and
list every collective instruction the program really executes, with its element
type, per-device payload, replica groups, how many times it runs per call of the
entry computation, and how many bytes it moves inside and across nodes of a
``(nodes, local)`` device mesh.

Algorithm:

1. Split the text into computations and instructions. Operand shapes come from
   the defining instruction (or from the operand text, when the printer inlines
   them).
2. Walk the call graph from ``ENTRY``: ``while`` bodies run ``known_trip_count``
   times (from ``backend_config``; when XLA could not prove a trip count we count
   the body once and set ``trip_count_known=False``), conditional branches count
   once each (flagged ``in_conditional``), calls / fusions / ``async-start``
   wrappers once per call site. Nested loops multiply.
3. For each collective, expand its replica groups (explicit ``{{0,1},{2,3}}``,
   iota ``[2,4]<=[4,2]T(1,0)``, the Shardy mesh form ``mesh['a'=2,'b'=4] {'b'}``,
   or ``{}`` = all devices). Ids are logical device positions in mesh order
   (``mesh.devices.flat``): device ``i`` sits on node ``i // local``.
4. Bytes received per device per execution, for a group of size ``g`` with
   per-device operand bytes ``I`` and result bytes ``O``, from every *other*
   member: all-gather ``O/g``; reduce-scatter ``I/g``; all-reduce ``2*I/g``
   (ring: reduce-scatter then all-gather); all-to-all ``I/g``;
   collective-permute: the whole operand from its source. A member on another
   node makes the bytes inter-node.

Async pairs (``all-gather-start``/``-done`` ...) are counted once, at the start;
the result shape is read from the matching ``-done``.

Example:
    >>> compiled = jax.jit(step).lower(params, batch).compile()
    >>> report = comm_report(compiled, mesh_shape=(2, 4))
    >>> print(report.format_table())
    >>> report.inter_node_bytes  # per node per step, max over nodes
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "CommReport",
    "MemoryStats",
    "SummaryRow",
    "comm_report",
    "dtype_bytes",
    "parse_collectives",
    "parse_replica_groups",
]

COLLECTIVE_KINDS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

# Bytes per element; sub-byte types are packed.
_FIXED_DTYPE_BYTES = {
    "pred": Fraction(1),
    "s2": Fraction(1, 4), "u2": Fraction(1, 4),
    "s4": Fraction(1, 2), "u4": Fraction(1, 2),
    "s8": Fraction(1), "u8": Fraction(1),
    "s16": Fraction(2), "u16": Fraction(2), "f16": Fraction(2), "bf16": Fraction(2),
    "s32": Fraction(4), "u32": Fraction(4), "f32": Fraction(4),
    "s64": Fraction(8), "u64": Fraction(8), "f64": Fraction(8),
    "c64": Fraction(8), "c128": Fraction(16),
    "token": Fraction(0), "opaque": Fraction(0),
}


def dtype_bytes(dtype: str) -> Fraction:
    """Bytes per element of an HLO element type (``f8e4m3fn`` -> 1, ``f4e2m1fn`` -> 1/2)."""
    if dtype in _FIXED_DTYPE_BYTES:
        return _FIXED_DTYPE_BYTES[dtype]
    m = re.fullmatch(r"f(\d+)e\d+m\d+\w*", dtype)
    if m:
        return Fraction(int(m.group(1)), 8)
    raise ValueError(f"Unknown HLO element type {dtype!r}.")


# ----------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Array:
    dtype: str
    dims: tuple[int, ...]


# A shape is an _Array or a (possibly nested) tuple of shapes.
_Shape = Any

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _match_close(s: str, i: int) -> int:
    """Index just past the bracket closing the one opening at ``s[i]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for j in range(i, len(s)):
        c = s[j]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return j + 1
    raise ValueError(f"Unbalanced brackets in HLO text: {s[i:i + 80]!r}")


def _parse_shape(s: str, i: int) -> tuple[_Shape | None, int]:
    """Parses a shape at ``s[i:]``; returns ``(None, i)`` if there is none."""
    i = _skip_ws(s, i)
    if i < len(s) and s[i] == "(":
        j = _skip_ws(s, i + 1)
        elems = []
        if j < len(s) and s[j] == ")":
            return (), j + 1
        while True:
            elem, j = _parse_shape(s, j)
            if elem is None:
                return None, i
            elems.append(elem)
            j = _skip_ws(s, j)
            if j < len(s) and s[j] == ",":
                j += 1
                continue
            if j < len(s) and s[j] == ")":
                return tuple(elems), j + 1
            return None, i
    m = _ARRAY_RE.match(s, i)
    if not m:
        return None, i
    dims = []
    for d in m.group(2).split(","):
        d = d.strip().removeprefix("<=")  # dynamic dims are bounded: "<=8"
        if d:
            dims.append(int(d))
    j = m.end()
    if j < len(s) and s[j] == "{":  # layout, e.g. {1,0:T(8,128)}
        j = _match_close(s, j)
    return _Array(m.group(1), tuple(dims)), j


def _leaves(shape: _Shape) -> list[_Array]:
    if isinstance(shape, _Array):
        return [shape]
    return [leaf for elem in shape for leaf in _leaves(elem)]


def _shape_bytes(shape: _Shape) -> Fraction:
    return sum(
        (dtype_bytes(a.dtype) * int(np.prod(a.dims, dtype=np.int64)) for a in _leaves(shape)),
        Fraction(0),
    )


# ----------------------------------------------------------------------------
# Module structure
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Instruction:
    name: str
    opcode: str
    shape: _Shape
    operands: list[tuple[str | None, _Shape | None]]  # (name, inline shape)
    attrs: str  # raw text after the operand list
    attrs_clean: str  # same, with the inside of quoted strings blanked


@dataclasses.dataclass
class _Computation:
    name: str
    instructions: list[_Instruction]


_COMMENT_RE = re.compile(r"/\*.*?\*/")
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_INSTR_RE = re.compile(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{$")
_OPCODE_RE = re.compile(r"[a-z][a-z0-9\-_]*")
_COLLECTIVE_CALL_RE = re.compile(
    r"\s(?:all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


def _split_top_level(s: str) -> list[str]:
    """Splits on commas not nested in brackets."""
    parts, depth, start = [], 0, 0
    for j, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:j])
            start = j + 1
    parts.append(s[start:])
    return [p.strip() for p in parts if p.strip()]


def _parse_instruction(line: str) -> _Instruction | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    shape, i = _parse_shape(line, m.end())
    if shape is None:
        return None
    i = _skip_ws(line, i)
    om = _OPCODE_RE.match(line, i)
    if not om or om.end() >= len(line) or line[om.end()] != "(":
        return None
    close = _match_close(line, om.end())
    operands = []
    for tok in _split_top_level(line[om.end() + 1:close - 1]):
        op_shape, k = _parse_shape(tok, 0)
        name = tok[k:].strip() if op_shape is not None else tok
        name = name.lstrip("%") or None
        operands.append((name, op_shape))
    attrs = line[close:]
    return _Instruction(
        name=m.group(1),
        opcode=om.group(0),
        shape=shape,
        operands=operands,
        attrs=attrs,
        # Same length as attrs, so offsets found in one apply to the other.
        attrs_clean=_STRING_RE.sub(lambda q: '"' + " " * (len(q.group()) - 2) + '"', attrs),
    )


def _parse_module(hlo_text: str) -> tuple[dict[str, _Computation], str]:
    """Returns ``(computations by name, entry name)``."""
    if not isinstance(hlo_text, str):
        raise TypeError(f"Expected HLO text (str), got {type(hlo_text).__name__}.")
    comps: dict[str, _Computation] = {}
    entry = None
    current = None
    for raw in hlo_text.splitlines():
        line = _COMMENT_RE.sub("", raw).strip()
        if not line or line.startswith("HloModule") or line.startswith("//"):
            continue
        if line == "}":
            current = None
            continue
        if current is not None:
            inst = _parse_instruction(line)
            if inst is not None:
                current.instructions.append(inst)
            elif _COLLECTIVE_CALL_RE.search(line):
                raise ValueError(f"Could not parse collective instruction: {line[:200]!r}")
            continue
        h = _HEADER_RE.match(line)
        if h:
            current = _Computation(h.group(2), [])
            comps[current.name] = current
            if h.group(1):
                entry = current.name
    if entry is None:
        raise ValueError(
            "Text does not look like an HLO module (no ENTRY computation found). Pass "
            "`jax.jit(f).lower(...).compile()` or its `.as_text()`; `Lowered.as_text()` "
            "is StableHLO, not HLO."
        )
    return comps, entry


# ----------------------------------------------------------------------------
# Call graph and multiplicities
# ----------------------------------------------------------------------------

_SINGLE_REF_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_SET_REF_RE = re.compile(r"\b(calls|branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT_RE = re.compile(
    r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)'
)


def _refs(inst: _Instruction) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key, name in _SINGLE_REF_RE.findall(inst.attrs_clean):
        out.setdefault(key, []).append(name)
    for key, names in _SET_REF_RE.findall(inst.attrs_clean):
        out.setdefault(key, []).extend(n.strip().lstrip("%") for n in names.split(",") if n.strip())
    return out


@dataclasses.dataclass
class _Context:
    count: int = 0
    trip_count_known: bool = True
    in_conditional: bool = False


def _multiplicities(comps: dict[str, _Computation], entry: str) -> dict[str, _Context]:
    """Executions per entry call of every computation reachable from ``entry``."""
    edges: dict[str, list[tuple[str, int, bool, bool]]] = {}
    for comp in comps.values():
        out = edges[comp.name] = []
        for inst in comp.instructions:
            op = inst.opcode
            if op.endswith("-done") or op.endswith("-update"):
                continue  # same async computation as its -start: count it once
            refs = _refs(inst)
            if op == "while":
                m = _TRIP_COUNT_RE.search(inst.attrs)
                known = m is not None
                n = int(m.group(1)) if known else 1
                out += [(c, n, known, False) for c in refs.get("body", [])]
                out += [(c, n + 1 if known else 1, known, False) for c in refs.get("condition", [])]
            elif op == "conditional":
                for key in ("branch_computations", "true_computation", "false_computation"):
                    out += [(c, 1, True, True) for c in refs.get(key, [])]
            else:
                out += [(c, 1, True, False) for names in refs.values() for c in names]

    # Topological order (callers before callees) by DFS post-order from entry.
    order, state = [], {}

    def visit(name: str) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "active":
            raise ValueError(f"Recursive call graph at computation {name!r}.")
        if name not in comps:
            raise ValueError(f"Instruction refers to unknown computation {name!r}.")
        state[name] = "active"
        for callee, *_ in edges[name]:
            visit(callee)
        state[name] = "done"
        order.append(name)

    visit(entry)
    ctx = {name: _Context() for name in order}
    ctx[entry].count = 1
    for name in reversed(order):
        caller = ctx[name]
        for callee, factor, known, cond in edges[name]:
            c = ctx[callee]
            c.count += caller.count * factor
            c.trip_count_known &= caller.trip_count_known and known
            c.in_conditional |= caller.in_conditional or cond
    return ctx


# ----------------------------------------------------------------------------
# Replica groups
# ----------------------------------------------------------------------------

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
    for tok in _split_top_level(m.group("axes")):
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
    for tok in _split_top_level(m.group("group")):
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
        body = s[:_match_close(s, 0)]
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


_OP_NAME_RE = re.compile(r'\bop_name="((?:[^"\\]|\\.)*)"')


def _op_name(inst: _Instruction) -> str:
    """``metadata={op_name="..."}`` of an instruction, or ``""``."""
    m = _OP_NAME_RE.search(inst.attrs)
    return m.group(1) if m else ""


def _attr_value(inst: _Instruction, key: str) -> str | None:
    """Raw text after ``key=`` (outside quoted strings), or None."""
    m = re.search(rf"\b{key}=", inst.attrs_clean)
    return inst.attrs[m.end():] if m else None


# ----------------------------------------------------------------------------
# Public data types
# ----------------------------------------------------------------------------


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
            absent), e.g. ``jit(step)/shard_map/cross_node_embed/quantized_scales/all_to_all``;
            :mod:`zeropp_jax.wire.collectives` names the codes and scales of a
            quantized payload (``quantized_codes`` / ``quantized_scales``).
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


# ----------------------------------------------------------------------------
# Collective extraction
# ----------------------------------------------------------------------------


def _check_mesh_shape(mesh_shape: Any) -> tuple[int, int]:
    try:
        nodes, local = (int(v) for v in mesh_shape)
    except (TypeError, ValueError):
        raise ValueError(f"mesh_shape must be (nodes, local), got {mesh_shape!r}.") from None
    if nodes < 1 or local < 1:
        raise ValueError(f"mesh_shape entries must be positive, got {mesh_shape!r}.")
    return nodes, local


def _result_shape(inst: _Instruction, done: _Instruction | None) -> _Shape:
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


def _make_collective(inst: _Instruction, comp: _Computation, ctx: _Context,
                     symbols: dict[str, _Instruction], done: _Instruction | None,
                     nodes: int, local: int) -> Collective:
    kind = inst.opcode.removesuffix("-start")
    num_devices = nodes * local
    where = f"{inst.name} in {comp.name}"

    if kind == "collective-permute":
        spec = _attr_value(inst, "source_target_pairs")
        pairs = parse_replica_groups(spec, num_devices=num_devices) if spec else []
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"Bad source_target_pairs of {where}.")
        groups = pairs
    else:
        spec = _attr_value(inst, "replica_groups")
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
    out_b = _shape_bytes(result)
    g = max((len(x) for x in groups), default=1) if kind != "collective-permute" else 2
    if operand_shapes and all(s is not None for s in operand_shapes):
        in_b = sum((_shape_bytes(s) for s in operand_shapes), Fraction(0))
        dtype_leaves = [a for s in operand_shapes for a in _leaves(s)]
    else:  # operand not found: derive it from the result
        in_b = {"all-gather": out_b / g, "reduce-scatter": out_b * g}.get(kind, out_b)
        dtype_leaves = _leaves(result)
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
        op_name=_op_name(inst),
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
        ValueError: if the text is not an HLO module, or a replica group names a
            device outside the mesh.
    """
    nodes, local = _check_mesh_shape(mesh_shape)
    comps, entry = _parse_module(hlo_text)
    contexts = _multiplicities(comps, entry)
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
    mesh = _check_mesh_shape(mesh_shape)
    return CommReport(parse_collectives(text, mesh_shape=mesh), mesh, memory)
