"""Optimized HLO text as data: computations, instructions, shapes and call counts.

The input is ``jax.jit(f).lower(...).compile().as_text()``, the
post-optimization module XLA really runs. This module knows nothing about
collectives' bytes or meshes; :mod:`~zeropp_jax.analysis.collectives` builds
on it.

1. Split the text into computations and instructions. Operand shapes come from
   the defining instruction (or from the operand text, when the printer inlines
   them). A shape is an array ``f32[8,128]{1,0}`` or a nested tuple of them;
   its bytes use the packed width of its element type (:func:`dtype_bytes`).
2. Walk the call graph from ``ENTRY`` (:func:`multiplicities`): ``while``
   bodies run ``known_trip_count`` times (from ``backend_config``; when XLA
   could not prove a trip count we count the body once and set
   ``trip_count_known=False``), conditional branches count once each (flagged
   ``in_conditional``), calls / fusions / ``async-start`` wrappers once per
   call site. Nested loops multiply.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = [
    "ArrayShape",
    "CallContext",
    "Computation",
    "Instruction",
    "Shape",
    "attr_value",
    "called_computations",
    "dtype_bytes",
    "match_close",
    "metadata_op_name",
    "multiplicities",
    "parse_module",
    "shape_bytes",
    "shape_leaves",
    "split_top_level",
]

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
class ArrayShape:
    """One array of an HLO shape: element type (``"f32"``) and dims (layout dropped)."""

    dtype: str
    dims: tuple[int, ...]


# A shape is an ArrayShape or a (possibly nested) tuple of shapes.
Shape = Any

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def match_close(s: str, i: int) -> int:
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


def _parse_shape(s: str, i: int) -> tuple[Shape | None, int]:
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
        j = match_close(s, j)
    return ArrayShape(m.group(1), tuple(dims)), j


def shape_leaves(shape: Shape) -> list[ArrayShape]:
    """The arrays of a shape, tuples flattened in order."""
    if isinstance(shape, ArrayShape):
        return [shape]
    return [leaf for elem in shape for leaf in shape_leaves(elem)]


def shape_bytes(shape: Shape) -> Fraction:
    """Bytes of a shape (sum over its arrays; sub-byte types packed)."""
    return sum(
        (dtype_bytes(a.dtype) * int(np.prod(a.dims, dtype=np.int64)) for a in shape_leaves(shape)),
        Fraction(0),
    )


# ----------------------------------------------------------------------------
# Module structure
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Instruction:
    """One instruction line: ``name = shape opcode(operands), attrs``."""

    name: str
    opcode: str
    shape: Shape
    operands: list[tuple[str | None, Shape | None]]  # (name, inline shape)
    attrs: str  # raw text after the operand list
    attrs_clean: str  # same, with the inside of quoted strings blanked


@dataclasses.dataclass
class Computation:
    """A named computation and its instructions in text order."""

    name: str
    instructions: list[Instruction]


_COMMENT_RE = re.compile(r"/\*.*?\*/")
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_INSTR_RE = re.compile(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{$")
_OPCODE_RE = re.compile(r"[a-z][a-z0-9\-_]*")
_COLLECTIVE_CALL_RE = re.compile(
    r"\s(?:all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


def split_top_level(s: str) -> list[str]:
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


def _parse_instruction(line: str) -> Instruction | None:
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
    close = match_close(line, om.end())
    operands = []
    for tok in split_top_level(line[om.end() + 1:close - 1]):
        op_shape, k = _parse_shape(tok, 0)
        name = tok[k:].strip() if op_shape is not None else tok
        name = name.lstrip("%") or None
        operands.append((name, op_shape))
    attrs = line[close:]
    return Instruction(
        name=m.group(1),
        opcode=om.group(0),
        shape=shape,
        operands=operands,
        attrs=attrs,
        # Same length as attrs, so offsets found in one apply to the other.
        attrs_clean=_STRING_RE.sub(lambda q: '"' + " " * (len(q.group()) - 2) + '"', attrs),
    )


def parse_module(hlo_text: str) -> tuple[dict[str, Computation], str]:
    """Returns ``(computations by name, entry name)``."""
    if not isinstance(hlo_text, str):
        raise TypeError(f"Expected HLO text (str), got {type(hlo_text).__name__}.")
    comps: dict[str, Computation] = {}
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
            current = Computation(h.group(2), [])
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


def called_computations(inst: Instruction) -> dict[str, list[str]]:
    """Computations an instruction names, by attribute (``calls``, ``body``, ``to_apply``, ...)."""
    out: dict[str, list[str]] = {}
    for key, name in _SINGLE_REF_RE.findall(inst.attrs_clean):
        out.setdefault(key, []).append(name)
    for key, names in _SET_REF_RE.findall(inst.attrs_clean):
        out.setdefault(key, []).extend(n.strip().lstrip("%") for n in names.split(",") if n.strip())
    return out


@dataclasses.dataclass
class CallContext:
    """How often a computation runs per call of ``ENTRY``, and how sure that count is."""

    count: int = 0
    trip_count_known: bool = True
    in_conditional: bool = False


def multiplicities(comps: dict[str, Computation], entry: str) -> dict[str, CallContext]:
    """Executions per entry call of every computation reachable from ``entry``."""
    edges: dict[str, list[tuple[str, int, bool, bool]]] = {}
    for comp in comps.values():
        out = edges[comp.name] = []
        for inst in comp.instructions:
            op = inst.opcode
            if op.endswith("-done") or op.endswith("-update"):
                continue  # same async computation as its -start: count it once
            refs = called_computations(inst)
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
    ctx = {name: CallContext() for name in order}
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
# Instruction attributes
# ----------------------------------------------------------------------------

_OP_NAME_RE = re.compile(r'\bop_name="((?:[^"\\]|\\.)*)"')


def metadata_op_name(inst: Instruction) -> str:
    """``metadata={op_name="..."}`` of an instruction, or ``""``."""
    m = _OP_NAME_RE.search(inst.attrs)
    return m.group(1) if m else ""


def attr_value(inst: Instruction, key: str) -> str | None:
    """Raw text after ``key=`` (outside quoted strings), or None."""
    m = re.search(rf"\b{key}=", inst.attrs_clean)
    return inst.attrs[m.end():] if m else None

