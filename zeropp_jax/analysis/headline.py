"""The headline figure of a trainer's step: inter-node bytes per node, and zero3's.

What a node must take in over its inter-node link per optimizer step under a
two-level algorithm (:attr:`CommReport.inter_node_bytes
<zeropp_jax.analysis.comm_report.CommReport.inter_node_bytes>`), with
full-precision payloads at the run's compute and reduce dtypes, for each
compiled variant of the step and averaged over a whole qgZ schedule (the
warm-up's and refreshes' full-precision steps included). Beside it, what a
two-level ZeRO-3 of the same model moves (:func:`zero3_inter_node_bytes`),
so ``zeropp-train``'s closing summary shows the saving; a run that does not
compute in bfloat16 (float32 on a CPU) also gets its figures at bfloat16,
the dtype a GPU run sends (:func:`gpu_float_dtypes`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from zeropp_jax.analysis.comm_report import CommReport, comm_report, hlo_dtype
from zeropp_jax.analysis.hlo import dtype_bytes
from zeropp_jax.config import SHARD_ALIGNMENT
from zeropp_jax.layout import padded_length

__all__ = [
    "float_dtypes",
    "report_dtypes",
    "full_precision_steps",
    "compile_variants",
    "gpu_float_dtypes",
    "schedule_mean",
    "step_bytes",
    "step_reports",
    "step_variants",
    "summary_line",
    "zero3_inter_node_bytes",
]

# ZeRO-3 moves the whole model across nodes three times per micro-batch: the
# forward's gather, the backward's gather again, and the gradient's
# reduce-scatter.
ZERO3_PASSES = 3


def float_dtypes(trainer) -> tuple[Any, Any]:
    """``(compute dtype, reduce dtype)`` a trainer's full-precision gathers and
    reductions use (the reduce dtype defaults to the compute dtype)."""
    reduce = trainer.config.reduce_dtype
    return trainer.compute_dtype, trainer.compute_dtype if reduce is None else reduce


def report_dtypes(trainer) -> dict[str, Any]:
    """Keyword arguments of :func:`~zeropp_jax.analysis.comm_report.comm_report`
    that count a trainer's payloads at the widths its run puts on the wire:
    full precision at :func:`float_dtypes` (XLA:CPU compiles bf16 collectives
    as f32; packed quantized payloads are bytes, counted as compiled)."""
    return {"float_dtypes": float_dtypes(trainer)}


def gpu_float_dtypes(trainer) -> tuple[Any, Any]:
    """:func:`float_dtypes` of the same run on a GPU, where ``--dtype auto``
    computes in bfloat16: bf16 gathers, and bf16 reductions unless the config
    names a reduce dtype."""
    reduce = trainer.config.reduce_dtype
    return jnp.bfloat16, jnp.bfloat16 if reduce is None else reduce


def compile_variants(trainer, params_shapes: Any, batch: Any) -> dict[str, Any]:
    """Compiles a trainer's step variants (:func:`step_variants`) from shapes.

    Args:
      trainer: a :class:`zeropp_jax.Trainer`.
      params_shapes: the full parameters' shapes (``jax.eval_shape`` of init).
      batch: the global batch's shapes and dtypes.

    Returns:
      ``{name: jax.stages.Compiled}`` in :func:`step_variants`' order.
    """
    return {name: trainer.compile_from_shapes(params_shapes, batch, compress=compress)
            for name, compress in step_variants(trainer).items()}


def step_reports(trainer, params_shapes: Any = None, batch: Any = None, *,
                 compiled: dict[str, Any] | None = None,
                 dtypes: tuple[Any, Any] | None = None) -> dict[str, CommReport]:
    """Reports a trainer's step variants, compiling them unless given.

    Args:
      trainer: a :class:`zeropp_jax.Trainer`.
      params_shapes, batch: as :func:`compile_variants` (unused with ``compiled``).
      compiled: :func:`compile_variants`' result, to report without compiling.
      dtypes: the ``(gather, reduce)`` dtypes full-precision payloads are
        counted at; :func:`float_dtypes` (the run's) by default.

    Returns:
      ``{"compressed": ..., "full_precision": ...}`` when qgZ is active,
      else ``{"step": ...}``.
    """
    if compiled is None:
        compiled = compile_variants(trainer, params_shapes, batch)
    dtypes = float_dtypes(trainer) if dtypes is None else dtypes
    mesh_shape = (trainer.nodes, trainer.local)
    return {name: comm_report(c, mesh_shape=mesh_shape, float_dtypes=dtypes)
            for name, c in compiled.items()}


def step_variants(trainer) -> dict[str, bool]:
    """A trainer's compiled step variants by name, each with its ``compress`` flag:
    ``{"compressed": True, "full_precision": False}`` when qgZ is active, else
    ``{"step": False}``."""
    return ({"compressed": True, "full_precision": False} if trainer.qgz_active
            else {"step": False})


def full_precision_steps(schedule, steps: int) -> int:
    """How many of steps ``0 .. steps - 1`` run the full-precision variant
    under ``schedule``'s warm-up and refresh rules (a gradient-RMS gate,
    which depends on the data, is not counted)."""
    if not schedule.active:
        return 0
    return sum(not schedule.compress_at(s, float("inf")) for s in range(steps))


def schedule_mean(compressed: float, full_precision: float, full_steps: int, steps: int) -> float:
    """Per-step mean of a figure over ``steps`` steps, ``full_steps`` of them at full precision."""
    return ((steps - full_steps) * compressed + full_steps * full_precision) / steps


def zero3_inter_node_bytes(trainer, dtype: Any = None) -> int:
    """About what a two-level ZeRO-3 of ``trainer``'s model moves into each
    node per optimizer step, from the model's size alone (nothing compiled).

    ``ZERO3_PASSES`` passes of the model, as zero3 pads it
    (:func:`zero3_padded_numel`), per micro-batch at ``dtype`` (default: the
    run's compute dtype), of which a node lacks the ``(nodes - 1) / nodes``
    held elsewhere. A compiled ZeRO-3 step
    (``zeropp-comm --preset zero3``) moves somewhat more where the model uses
    a parameter twice (the example GPT's tied embedding is gathered once more
    in the forward), and less when gathered parameters are kept for the
    backward (whole-model gathering).
    """
    width = dtype_bytes(hlo_dtype(float_dtypes(trainer)[0] if dtype is None else dtype))
    nodes = trainer.nodes
    per_pass = zero3_padded_numel(trainer.layout, nodes * trainer.local) * width
    return round(ZERO3_PASSES * trainer.config.grad_accum * per_pass * (nodes - 1) / nodes)


def zero3_padded_numel(layout, n_devices: int) -> int:
    """Elements zero3 stores of ``layout``'s units on ``n_devices`` devices:
    each unit's real elements per layer padded to ``n_devices *
    SHARD_ALIGNMENT`` (zero3 quantizes nothing and does not align leaves),
    times its layers. A qwZ or qgZ run pads its own shards further (its
    blocks), which zero3 would not move."""
    return sum(padded_length(u.numel, n_devices, SHARD_ALIGNMENT) * (u.stack or 1)
               for u in layout.units)


def _is_zero3(config) -> bool:
    return not config.qwz_bits and not config.hpz and config.qgz == "off"


def _figures(trainer, reports: dict[str, CommReport], dtype: Any, full: int, steps: int
             ) -> dict:
    """The compressed (or only) step's bytes, their mean over ``steps`` steps
    of which ``full`` run at full precision, and zero3's at ``dtype``."""
    first = next(iter(reports.values()))
    full_report = reports.get("full_precision", first)
    mean = schedule_mean(first.inter_node_bytes, full_report.inter_node_bytes, full, steps)
    return {"inter_node_bytes": first.inter_node_bytes,
            "schedule_inter_node_bytes": round(mean),
            "zero3_inter_node_bytes": (first.inter_node_bytes if _is_zero3(trainer.config)
                                       else zero3_inter_node_bytes(trainer, dtype))}


def step_bytes(trainer, params_shapes: Any, batch: Any, *, steps: int) -> dict:
    """The headline figures of a trainer's step, for a summary.

    Returns:
      ``inter_node_bytes``: per node per step, two-level, of the compressed
      variant (or the only one); ``schedule_inter_node_bytes``: averaged over
      ``steps`` steps of the schedule; ``full_precision_steps``: how many of
      them run at full precision; ``zero3_inter_node_bytes``: the step's own
      figure when it is a ZeRO-3 step (no qwZ, hpZ or qgZ), otherwise
      :func:`zero3_inter_node_bytes`, with ``zero3_source`` saying which;
      ``dtype``: the compute dtype full-precision payloads are counted at.
      When that is not bfloat16 (float32 on a CPU), ``at_bf16`` holds the
      three byte figures of the same compiled program with full-precision
      payloads counted at :func:`gpu_float_dtypes`, what a GPU run sends.
    """
    compiled = compile_variants(trainer, params_shapes, batch)
    dtype = float_dtypes(trainer)[0]
    full = full_precision_steps(trainer.schedule, steps)
    out = _figures(trainer, step_reports(trainer, compiled=compiled), dtype, full, steps)
    out.update(full_precision_steps=full,
               zero3_source="compiled" if _is_zero3(trainer.config) else "model size",
               dtype=jnp.dtype(dtype).name)
    if hlo_dtype(dtype) != "bf16":
        gpu = gpu_float_dtypes(trainer)
        out["at_bf16"] = _figures(
            trainer, step_reports(trainer, compiled=compiled, dtypes=gpu), gpu[0], full, steps)
    return out


def _line(figures: dict, *, steps: int, full_steps: int, zero3_source: str) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    line = mib(figures["inter_node_bytes"])
    if full_steps:
        line += (f" a compressed step, {mib(figures['schedule_inter_node_bytes'])} averaged "
                 f"over the {steps} steps ({full_steps} at full precision)")
    if zero3_source == "compiled":
        return line + " (this is zero3)"
    if not figures["zero3_inter_node_bytes"]:  # one node: no ratio to give
        return line + " (one node: nothing crosses nodes, for zero3 either)"
    ratio = figures["zero3_inter_node_bytes"] / max(figures["schedule_inter_node_bytes"], 1)
    of = f"the {steps}-step average" if full_steps else "as much"
    return line + (f"; zero3 would move about {mib(figures['zero3_inter_node_bytes'])} (3 passes "
                   f"of the model, from its size): {ratio:.1f}x {of}")


def summary_line(figures: dict, *, steps: int) -> str:
    """A newcomer's lines: :func:`step_bytes`' figures beside zero3's, at the
    run's dtype and, when that is not bfloat16, at bfloat16 (a GPU run's)."""
    common = {"steps": steps, "full_steps": figures["full_precision_steps"],
              "zero3_source": figures["zero3_source"]}
    line = (f"inter-node bytes per node per step (two-level, {figures['dtype']} as this run): "
            + _line(figures, **common))
    if "at_bf16" in figures:
        line += ("\nat bfloat16, a GPU run's default dtype (the same program's "
                 "full-precision payloads at 2 bytes): " + _line(figures["at_bf16"], **common))
    return line
