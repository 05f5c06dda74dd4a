"""The headline figure of a trainer's step: inter-node bytes per node, and zero3's.

What a node must take in over its inter-node link per optimizer step under a
two-level algorithm (:attr:`CommReport.inter_node_bytes
<zeropp_jax.analysis.comm_report.CommReport.inter_node_bytes>`), with
full-precision payloads at the run's compute and reduce dtypes, for each
compiled variant of the step and averaged over a whole qgZ schedule (the
warm-up's and refreshes' full-precision steps included). Beside it, what a
two-level ZeRO-3 of the same model moves (:func:`zero3_inter_node_bytes`),
so ``zeropp-train``'s closing summary shows the saving.
"""

from __future__ import annotations

from typing import Any

from zeropp_jax.analysis.comm_report import CommReport, comm_report, hlo_dtype
from zeropp_jax.analysis.hlo import dtype_bytes

__all__ = [
    "float_dtypes",
    "report_dtypes",
    "full_precision_steps",
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


def step_reports(trainer, params_shapes: Any, batch: Any) -> dict[str, CommReport]:
    """Compiles a trainer's step variants from shapes and reports each.

    Args:
      trainer: a :class:`zeropp_jax.Trainer`.
      params_shapes: the full parameters' shapes (``jax.eval_shape`` of init).
      batch: the global batch's shapes and dtypes.

    Returns:
      ``{"compressed": ..., "full_precision": ...}`` when qgZ is active,
      else ``{"step": ...}``; reports count payloads at :func:`report_dtypes`.
    """
    mesh_shape = (trainer.nodes, trainer.local)
    return {
        name: comm_report(trainer.compile_from_shapes(params_shapes, batch, compress=compress),
                          mesh_shape=mesh_shape, **report_dtypes(trainer))
        for name, compress in step_variants(trainer).items()
    }


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


def zero3_inter_node_bytes(trainer) -> int:
    """About what a two-level ZeRO-3 of ``trainer``'s model moves into each
    node per optimizer step, from the model's size alone (nothing compiled).

    ``ZERO3_PASSES`` passes of the padded model per micro-batch at the
    compute dtype, of which a node lacks the ``(nodes - 1) / nodes`` held
    elsewhere. A compiled ZeRO-3 step (``zeropp-comm --preset zero3``) moves
    somewhat more where the model uses a parameter twice (the example GPT's
    tied embedding is gathered once more in the forward), and less when
    gathered parameters are kept for the backward (whole-model gathering).
    """
    width = dtype_bytes(hlo_dtype(float_dtypes(trainer)[0]))
    nodes = trainer.nodes
    per_pass = trainer.layout.padded_numel * width * (nodes - 1) / nodes
    return round(ZERO3_PASSES * trainer.config.grad_accum * per_pass)


def _is_zero3(config) -> bool:
    return not config.qwz_bits and not config.hpz and config.qgz == "off"


def step_bytes(trainer, params_shapes: Any, batch: Any, *, steps: int) -> dict:
    """The headline figures of a trainer's step, for a summary.

    Returns:
      ``inter_node_bytes``: per node per step, two-level, of the compressed
      variant (or the only one); ``mean_inter_node_bytes``: averaged over
      ``steps`` steps of the schedule; ``full_precision_steps``: how many of
      them run at full precision; ``zero3_inter_node_bytes``: the step's own
      figure when it is a ZeRO-3 step (no qwZ, hpZ or qgZ), otherwise
      :func:`zero3_inter_node_bytes`, with ``zero3_source`` saying which.
    """
    reports = step_reports(trainer, params_shapes, batch)
    first = next(iter(reports.values()))
    main = first.inter_node_bytes
    full = full_precision_steps(trainer.schedule, steps)
    full_report = reports.get("full_precision", first)
    mean = schedule_mean(main, full_report.inter_node_bytes, full, steps)
    compiled = _is_zero3(trainer.config)
    return {"inter_node_bytes": main, "mean_inter_node_bytes": round(mean),
            "full_precision_steps": full,
            "zero3_inter_node_bytes": main if compiled else zero3_inter_node_bytes(trainer),
            "zero3_source": "compiled" if compiled else "model size"}


def summary_line(figures: dict, *, steps: int) -> str:
    """One line for a newcomer: ``step_bytes``' figures beside zero3's."""
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    zero3 = figures["zero3_inter_node_bytes"]
    line = f"inter-node bytes per node per step (two-level): {mib(figures['inter_node_bytes'])}"
    if figures["full_precision_steps"]:
        line += (f", {mib(figures['mean_inter_node_bytes'])} averaged over the {steps} steps "
                 f"({figures['full_precision_steps']} at full precision)")
    if figures["zero3_source"] == "compiled":
        return line + " (this is zero3)"
    ratio = zero3 / max(figures["mean_inter_node_bytes"], 1)
    return line + (f"; zero3 would move about {mib(zero3)} (3 passes of the model, from its "
                   f"size): {ratio:.1f}x as much")
