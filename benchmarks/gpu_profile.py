"""Where a compiled step's device time goes: a profiler trace summed per kernel.

Used by ``gpu_train_probe.py --profile-dir``: :func:`trace_steps` runs a few
steps under ``jax.profiler.trace`` (with a Perfetto JSON trace), and
:func:`kernel_times` reads that trace back and sums the device's kernels
per step, each named by the HLO instruction it runs (the kernel's
``hlo_op`` argument, or its own name when that is an instruction's name) with
that instruction's opcode and JAX ``op_name`` from the compiled module. On a
GPU the device's events are the kernels and copies CUPTI recorded; on the CPU
(to exercise the code) the executable's thunks, which the CPU runtime names
after their HLO instructions.

The result is measured time, not a model; what it cannot attribute (a
library kernel without an ``hlo_op``) is listed under its kernel name.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from typing import Any, Callable

from zeropp_jax.analysis.hlo import metadata_op_name, parse_module

__all__ = ["kernel_times", "trace_steps"]

DEVICE_MARKERS = ("/device:GPU", "GPU:", "/device:TPU")  # process names of device tracks


def trace_steps(step: Callable, state: Any, batch: Any, steps: int, log_dir: str) -> Any:
    """Runs ``steps`` steps under the profiler; returns the last state.

    ``step(state, batch) -> (state, aux)``; the trace is written below
    ``log_dir`` (``plugins/profile/<run>/perfetto_trace.json.gz``).
    """
    import jax

    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for _ in range(steps):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
    return state


def _events(log_dir: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"),
                             recursive=True), key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz below {log_dir}")
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def kernel_times(log_dir: str, hlo_text: str, steps: int, *, top: int = 25) -> dict:
    """Device time per step, per kernel, from the latest trace below ``log_dir``.

    Args:
      log_dir: what :func:`trace_steps` wrote to.
      hlo_text: the traced program's ``compiled.as_text()``.
      steps: how many steps the trace holds.
      top: kernels listed, the longest first.

    Returns:
      ``{"source", "device_us_per_step", "by_opcode": {opcode: us},
      "top": [{kernel, hlo_op, opcode, op_name, us_per_step, calls_per_step}]}``;
      ``source`` says which events were summed (device tracks, or the CPU's
      thunks named after HLO instructions).
    """
    events = _events(log_dir)
    comps, _ = parse_module(hlo_text)
    insts = {i.name: i for c in comps.values() for i in c.instructions}
    sanitized = {_sanitize(n): n for n in insts}  # GPU kernels are named without dots
    names = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {pid for pid, n in names.items() if any(m in n for m in DEVICE_MARKERS)}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if device:
        spans = [e for e in spans if e.get("pid") in device]
        # kernels and copies run on streams; other lines of a device (XLA Ops, Steps)
        # are derived from them and would count them again
        streams = {key for key, n in threads.items() if key[0] in device and "Stream" in n}
        if streams:
            spans = [e for e in spans if (e.get("pid"), e.get("tid")) in streams]
        source = "device tracks: " + ", ".join(
            sorted({f"{names[p]} / {threads.get((p, t), t)}"
                    for p, t in {(e.get("pid"), e.get("tid")) for e in spans}}))
    else:
        source = "host thunks named after HLO instructions (no device track)"
        spans = [e for e in spans if e.get("name") in insts]
    per_kernel: dict[tuple[str, str], list[float]] = {}
    for e in spans:
        args = e.get("args") or {}
        hlo_op = (args.get("hlo_op") or (e["name"] if e["name"] in insts else "")
                  or sanitized.get(_sanitize(e["name"]), ""))
        per_kernel.setdefault((e["name"], hlo_op), []).append(float(e["dur"]))
    rows = []
    by_opcode: dict[str, float] = {}
    for (kernel, hlo_op), durs in per_kernel.items():
        inst = insts.get(hlo_op)
        opcode = inst.opcode if inst else "(not in the module)"
        us = sum(durs) / steps
        by_opcode[opcode] = by_opcode.get(opcode, 0.0) + us
        rows.append(dict(kernel=kernel[:120], hlo_op=hlo_op, opcode=opcode,
                         op_name=metadata_op_name(inst)[-120:] if inst else "",
                         us_per_step=us, calls_per_step=len(durs) / steps))
    rows.sort(key=lambda r: -r["us_per_step"])
    return {
        "source": source,
        "device_us_per_step": sum(r["us_per_step"] for r in rows),
        "by_opcode": dict(sorted(by_opcode.items(), key=lambda kv: -kv[1])),
        "top": rows[:top],
    }
