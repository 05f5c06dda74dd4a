"""The machine code of a program compiled for a GPU: PTX statistics and SASS counts.

Used by ``gpu_aot.py kernels`` on the PTX that XLA dumps for a Pallas kernel
compiled for a GPU (on a machine without one). :func:`ptx_kernels` reads
static figures of each ``.entry`` (statements, global and shared accesses,
barriers); :func:`machine_code` assembles the PTX with ``ptxas`` (registers
per thread from ``-v``) and counts its machine instructions with
``cuobjdump -sass`` (:func:`sass_counts`). The CUDA binaries come from the
PATH or NVIDIA's pip wheels (:func:`cuda_tool`); without them the figures
that need them are ``None``.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
from typing import NamedTuple

class PtxStats(NamedTuple):
    """Static figures of one PTX kernel (per thread, as written: no loop is unrolled here).

    Attributes:
      name: the ``.entry``'s name.
      threads: threads per program (``.reqntid``/``.maxntid``; 0 if absent).
      instructions: statements in the body (labels and directives excluded).
      global_loads, global_stores: ``ld.global`` / ``st.global`` statements.
      global_load_bytes, global_store_bytes: bytes they move (vector width x element size).
      shared: ``ld.shared`` and ``st.shared`` statements.
      barriers: ``bar.*`` statements.
      branches: ``bra`` statements (non-zero: the counts are not per-program totals).
      by_opcode: statements per opcode (``and.b32``, ``add.rn.f32``, ...).
    """

    name: str
    threads: int
    instructions: int
    global_loads: int
    global_stores: int
    global_load_bytes: int
    global_store_bytes: int
    shared: int
    barriers: int
    branches: int
    by_opcode: dict


_TYPE_BYTES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
               "b32": 4, "u32": 4, "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}


def _access_bytes(opcode: str) -> int:
    parts = opcode.split(".")
    width = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d+", p)), 1)
    return width * next((_TYPE_BYTES[p] for p in reversed(parts) if p in _TYPE_BYTES), 0)


def ptx_kernels(ptx: str) -> list[PtxStats]:
    """Every ``.entry`` of a PTX module with its :class:`PtxStats`."""
    out = []
    for m in re.finditer(r"\.entry\s+(\w+)", ptx):
        start = ptx.index("{", m.end())
        threads = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)", ptx[m.end():start])
        depth, end = 0, start
        for end in range(start, len(ptx)):
            depth += {"{": 1, "}": -1}.get(ptx[end], 0)
            if depth == 0:
                break
        body = re.sub(r"//[^\n]*", "", ptx[start + 1:end])
        ops = collections.Counter()
        for statement in re.split(r"[;\n]", body):
            s = statement.strip().lstrip("{}").strip()
            s = re.sub(r"^@!?%\w+\s+", "", s)  # predicate guard
            if not s or s.startswith(".") or s.endswith(":") or s.startswith(("}", ")")):
                continue
            ops[s.split()[0]] += 1
        glob_ld = {k: v for k, v in ops.items() if k.startswith("ld.global")}
        glob_st = {k: v for k, v in ops.items() if k.startswith("st.global")}
        out.append(PtxStats(
            name=m.group(1),
            threads=int(threads.group(1)) if threads else 0,
            instructions=sum(ops.values()),
            global_loads=sum(glob_ld.values()),
            global_stores=sum(glob_st.values()),
            global_load_bytes=sum(_access_bytes(k) * v for k, v in glob_ld.items()),
            global_store_bytes=sum(_access_bytes(k) * v for k, v in glob_st.items()),
            shared=sum(v for k, v in ops.items() if k.startswith(("ld.shared", "st.shared"))),
            barriers=sum(v for k, v in ops.items() if k.startswith(("bar.", "barrier."))),
            branches=sum(v for k, v in ops.items() if k.startswith("bra")),
            by_opcode=dict(ops.most_common()),
        ))
    return out


def cuda_tool(name: str) -> str | None:
    """A CUDA binary (``ptxas``, ``cuobjdump``, ``nvdisasm``) on the PATH or in
    NVIDIA's pip wheels (``nvidia-cuda-nvcc``, ``-cuobjdump``, ``-nvdisasm``);
    ``None`` if neither."""
    import shutil

    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia.cu13 as cuda_pkg  # the CUDA 13 wheels jax[cuda13] installs
    except ImportError:
        return None
    candidate = os.path.join(list(cuda_pkg.__path__)[0], "bin", name)
    return candidate if os.path.exists(candidate) else None


class MachineCode(NamedTuple):
    """What ``ptxas`` makes of a kernel: registers per thread (``ptxas -v``) and
    its SASS instructions per opcode (``cuobjdump -sass``; ``None`` without it)."""

    registers: int | None
    sass: dict | None


_SASS_LINE = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def machine_code(ptx: str, kernel: str, arch: str = "sm_90a") -> MachineCode:
    """Assembles ``ptx`` for ``arch`` and reads ``kernel``'s registers and SASS
    (``MachineCode(None, None)`` without ``ptxas``)."""
    import subprocess

    ptxas = cuda_tool("ptxas")
    if ptxas is None:
        return MachineCode(None, None)
    with tempfile.TemporaryDirectory(prefix="aot_ptxas_") as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", cubin],
                              capture_output=True, text=True, timeout=300)
        info = done.stderr.split(f"Compiling entry function '{kernel}'", 1)
        m = re.search(r"Used (\d+) registers", info[-1])
        regs = int(m.group(1)) if m and len(info) == 2 else None
        cuobjdump, nvdisasm = cuda_tool("cuobjdump"), cuda_tool("nvdisasm")
        if cuobjdump is None or nvdisasm is None or done.returncode:
            return MachineCode(regs, None)
        env = dict(os.environ, NVDISASM_PATH=os.path.dirname(nvdisasm))  # cuobjdump runs it
        listing = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                                 timeout=300, env=env).stdout
    return MachineCode(regs, sass_counts(listing, kernel))


def sass_counts(listing: str, kernel: str) -> dict | None:
    """SASS instructions per opcode of ``kernel`` in a ``cuobjdump -sass``
    listing (``NOP`` padding left out); ``None`` if the kernel is not in it."""
    body = listing.split(f"Function : {kernel}\n", 1)
    if len(body) != 2:
        return None
    ops = collections.Counter(_SASS_LINE.findall(body[1].split("Function : ", 1)[0]))
    ops.pop("NOP", None)  # alignment padding, never issued
    return dict(ops.most_common())


def compiled_ptx(lowered, dump_dir: str) -> str:
    """Compiles ``lowered`` with XLA's dump in ``dump_dir`` and returns all its PTX."""
    lowered.compile({"xla_dump_to": dump_dir})
    texts = [open(p).read() for p in sorted(glob.glob(os.path.join(dump_dir, "*.ptx")))]
    if not texts:
        raise RuntimeError(f"XLA wrote no PTX to {dump_dir}: was this compiled for a GPU?")
    return "\n".join(texts)
