"""Records, speedups, the table and the figure of ``zeropp-cluster-bench``.

Records are the bench's dicts (one per preset and link rate, ``rate_mbit``
0 = unlimited): :func:`record` makes one from a point's runs (and the link
probes at its rate), :func:`add_speedups` adds its speedups over the
baselines measured at the same rate. Besides the step a record holds two
means of it: over the preset's refresh cycle, and over a whole run of
:data:`RUN_STEPS` steps of the preset's own schedule (its qgZ warm-up and
refreshes included: the figure a user's run gets). The cost model's predictions are
:mod:`zeropp_jax.cli.cluster_model`'s; :func:`draw` draws them beside the
measured points.
"""

from __future__ import annotations

import os
import statistics
from typing import Callable, Sequence

from zeropp_jax.cli import netns

BASELINES = ("zero3", "zero3-2level")
# Bench presets with all-device collectives: over gloo they cross the link as
# its all-device algorithm sends them (several times the two-level count the
# model uses), so the figure draws no model line for them or against them.
FLAT_PRESETS = ("zero3", "qwz")
# The run over which run_step_time_s averages the preset's own schedule: the
# length of the project's convergence runs (of which a 100-step qgZ warm-up
# is a quarter).
RUN_STEPS = 400


def _by_key(records: Sequence[dict]) -> dict:
    return {(r["preset"], r["rate_mbit"]): r for r in records}


def add_speedups(records: list[dict]) -> None:
    """Adds ``speedup_vs_<baseline>`` (baseline step time / this one),
    ``cycle_speedup_vs_<baseline>`` (the same over a refresh cycle, the
    refresh step included) and ``run_speedup_vs_<baseline>`` (over a run of
    :data:`RUN_STEPS` steps, warm-up and refreshes included); ``None`` where
    either was not measured."""
    index = _by_key(records)
    ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    for r in records:
        for base in BASELINES:
            other = index.get((base, r["rate_mbit"]), {})
            name = base.replace("-", "_")
            r[f"speedup_vs_{name}"] = ratio(other.get("step_time_s"), r["step_time_s"])
            for kind in ("cycle", "run"):
                r[f"{kind}_speedup_vs_{name}"] = ratio(other.get(f"{kind}_step_time_s"),
                                                       r.get(f"{kind}_step_time_s"))


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _per_node_mean(by_step: list[list[int]]) -> list[float]:
    return [sum(node) / len(by_step) for node in zip(*by_step)]


def bytes_by_kind(runs: Sequence[tuple[list[list[int]], list[int]]]
                  ) -> tuple[float, float | None]:
    """Per-step counts of compressed and full-precision steps, from racing counter reads.

    A counter is read when a step's metrics line appears. No step waits for
    the host, so the next step is already sending then: each read holds
    some part of the next step's bytes (zeropp: up to its whole hpZ gather,
    0.45 MB against 0.6 MB for the step), and a single step's figure is off
    by as much either way. The cumulative count is not: after ``k`` steps it
    is the steps' bytes plus one bounded race term. So the per-step bytes of
    each kind are the least-squares slopes of the cumulative counts (mean
    over nodes) on the cumulative numbers of compressed and full-precision
    steps, with an offset per run (the race at its first read); the error
    is of one race term over the run's length, not per step. A run's last
    read is left out when the run has more than one step (nothing follows
    that step, so its read races nothing and would bias the slope down).

    Args:
      runs: per run, ``(per_step, compressed)``: per timed step one count per
        node, and 1 if the step was compressed (all 0: one kind).

    Returns:
      ``(main, full)``: the compressed steps' bytes per step (every step's,
      when none is compressed) and the full-precision steps' (``None`` when
      there are none besides, or none the reads can tell apart).
    """
    import numpy as np

    if not any(any(kinds) for _, kinds in runs):
        runs = [(per_step, [1] * len(per_step)) for per_step, _ in runs]
    rows, counts = [], []
    for index, (per_step, kinds) in enumerate(runs):
        totals = [sum(node) / len(node) for node in per_step]
        used = len(totals) - 1 if len(totals) > 1 else len(totals)
        cumulative, compressed, full = 0.0, 0, 0
        points = [(0.0, 0, 0)]
        for total, kind in zip(totals[:used], kinds[:used]):
            cumulative, compressed, full = cumulative + total, compressed + kind, full + 1 - kind
            points.append((cumulative, compressed, full))
        for cumulative, compressed, full in points:
            offsets = [0.0] * len(runs)
            offsets[index] = 1.0
            rows.append([compressed, full, *offsets])
            counts.append(cumulative)
    design, counts = np.asarray(rows), np.asarray(counts)
    has_full = bool(design[:, 1].any())
    if not has_full:
        design = np.delete(design, 1, axis=1)
    fit, _, rank, _ = np.linalg.lstsq(design, counts, rcond=None)
    if has_full and rank < design.shape[1]:  # the full steps' column is not told apart
        design = np.delete(design, 1, axis=1)
        fit, has_full = np.linalg.lstsq(design, counts, rcond=None)[0], False
    return float(fit[0]), float(fit[1]) if has_full else None


def main_steps(compressed: Sequence[int]) -> list[int]:
    """Indices of the steps a record's main figures describe: the compressed
    steps where there are any, else every step."""
    return [i for i, c in enumerate(compressed) if c] or list(range(len(compressed)))


def _run_mean(compressed: float, full: float | None, warmup: int, refresh: int
              ) -> tuple[int, float | None]:
    """``(full-precision steps, mean step time)`` of a run of :data:`RUN_STEPS`
    steps of the qgZ schedule of ``warmup`` and ``refresh``."""
    from zeropp_jax.analysis.headline import full_precision_steps, schedule_mean
    from zeropp_jax.step.schedule import QgzSchedule

    schedule = QgzSchedule(active=True, warmup_steps=warmup, refresh_every=refresh)
    full_steps = full_precision_steps(schedule, RUN_STEPS)
    if not full_steps:
        return 0, compressed
    if full is None:
        return full_steps, None
    return full_steps, schedule_mean(compressed, full, full_steps, RUN_STEPS)


def record(preset: str, rate: float, runs: Sequence[dict], tokens_per_step: int,
           refresh: int = 0, *, warmup: int = 0, flags: str = "",
           probes: Sequence[dict] = ()) -> dict:
    """The JSON record of one preset at one rate (speedups and predictions are added later).

    ``runs`` are :func:`zeropp_jax.cli.cluster_run.run_once`'s results
    (the repeats; their timed steps are pooled), ``flags`` the preset's
    zeropp-train flags, ``probes`` :func:`zeropp_jax.cli.cluster_run.probe_link`'s
    results at ``rate`` (``link_probe_gbits_per_s`` is their median).

    ``step_time_s`` is the median of the compressed steps where the runs
    have any (else of every timed step); ``cycle_step_time_s`` the mean over
    a refresh cycle of ``refresh`` steps (the median step otherwise, or
    ``None`` when no full-precision step was timed); ``run_step_time_s`` the
    mean over a run of :data:`RUN_STEPS` steps of the preset's own qgZ
    schedule (a warm-up of ``warmup`` steps, then a refresh every
    ``refresh``): its full-precision steps at the full-precision median, the
    rest at ``step_time_s`` (the median step without either, ``None`` when
    no full-precision step was timed). ``refresh`` and ``warmup`` are the
    preset's own, not the bench runs' (which refresh more often and warm up
    for one step). The link bytes and
    frames per step are :func:`bytes_by_kind`'s, and
    ``link_payload_bytes_per_node_per_step`` is the bytes less each frame's
    Ethernet, IP and TCP headers (:data:`zeropp_jax.cli.netns.FRAME_HEADER_BYTES`).
    """
    pooled = {key: [v for run in runs for v in (run.get(key) or [])] for key in runs[0]}
    times, kinds = pooled["step_times_s"], pooled["compressed"]
    main = main_steps(kinds)
    full = [i for i, c in enumerate(kinds) if not c] if any(kinds) else []
    median = statistics.median(times[i] for i in main)
    full_s = statistics.median(times[i] for i in full) if full else None
    cycle = median
    if refresh:
        cycle = None if full_s is None else ((refresh - 1) * median + full_s) / refresh
    run_full, run_mean = _run_mean(median, full_s, warmup, refresh)
    link, full_link = bytes_by_kind([(run["link_rx_bytes"], run["compressed"]) for run in runs])
    rates = [p["payload_gbits_per_s"] for p in probes if p.get("payload_gbits_per_s")]
    frames = None
    if all(run.get("link_rx_frames") for run in runs):
        frames = bytes_by_kind([(run["link_rx_frames"], run["compressed"]) for run in runs])[0]
    return {
        "preset": preset,
        "flags": flags,
        "rate_mbit": rate,
        "step_time_s": median,
        "full_precision_step_time_s": full_s,
        "refresh_every": refresh,
        "cycle_step_time_s": cycle,
        "warmup_steps": warmup,
        "run_steps_total": RUN_STEPS,
        "run_full_precision_steps": run_full,
        "run_step_time_s": run_mean,
        "step_times_s": times,
        "compressed": kinds,
        # timed steps per run, in the order pooled above
        "run_steps": [len(run["step_times_s"]) for run in runs],
        "tokens_per_s": tokens_per_step / median,
        "link_bytes_per_node_per_step": link,
        "link_bytes_by_node_per_step": _per_node_mean([pooled["link_rx_bytes"][i] for i in main]),
        "full_precision_link_bytes_per_node_per_step": full_link,
        "link_frames_per_node_per_step": frames,
        # per timed step, per node, as read (for a re-analysis)
        "link_rx_bytes_by_step": pooled["link_rx_bytes"],
        "link_rx_frames_by_step": pooled.get("link_rx_frames") or None,
        # what the frames carried beyond their Ethernet/IP/TCP headers: the
        # collectives' payload plus gloo's own message headers
        "link_payload_bytes_per_node_per_step": (
            None if frames is None else link - netns.FRAME_HEADER_BYTES * frames),
        "link_probes": list(probes),
        "link_probe_gbits_per_s": statistics.median(rates) if rates else None,
    }


def sources_of(path: str, saved: dict) -> list[dict]:
    """Where the runs of a saved JSON ``saved`` (read from ``path``) were made:
    its own ``sources`` when it merged earlier files, else its path and its
    provenance record."""
    return saved.get("sources") or [{"path": path, "provenance": saved.get("provenance")}]


def runs_of(rec: dict) -> list[dict]:
    """The runs a :func:`record` pooled, split again by its ``run_steps`` (the
    keys :func:`record` reads), so that the runs of several sweeps can be pooled."""
    runs, start = [], 0
    frames = rec.get("link_rx_frames_by_step")
    for n in rec["run_steps"]:
        part = slice(start, start + n)
        runs.append({"step_times_s": rec["step_times_s"][part],
                     "compressed": rec["compressed"][part],
                     "link_rx_bytes": rec["link_rx_bytes_by_step"][part],
                     "link_rx_frames": frames[part] if frames else None})
        start += n
    return runs


def rate_name(rate: float) -> str:
    return "unlimited" if rate == 0 else f"{rate:g} Mbit/s"


def format_table(records: Sequence[dict]) -> str:
    """One row per (rate, preset): measured (median and refresh cycle) and
    predicted step time, speedups, link bytes (all frames, their payload
    without Ethernet/IP/TCP headers, and the model's payload count).

    The speedups over ``zero3-2level``: of the median step, its prediction,
    over the preset's refresh cycle (``x 2level cycle``) and over a run of
    :data:`RUN_STEPS` steps of the preset's own schedule, its qgZ warm-up
    and refreshes included (``x 2level run``: what a user's run of the preset
    gains; ``-`` where its full-precision step was not timed).
    """
    head = ("rate", "preset", "step s", "cycle s", "tok/s", "x zero3", "pred", "x 2level", "pred",
            "x 2level cycle", "x 2level run", "MB/node/step", "payload MB", "model MB")
    rows = [head]
    for r in records:
        mb = lambda x: None if x is None else x / 1e6  # noqa: E731
        rows.append((
            rate_name(r["rate_mbit"]), r["preset"], _fmt(r["step_time_s"], ".3f"),
            _fmt(r.get("cycle_step_time_s"), ".3f"),
            _fmt(r["tokens_per_s"], ",.0f"), _fmt(r.get("speedup_vs_zero3"), ".2f"),
            _fmt(r.get("predicted_speedup"), ".2f"),
            _fmt(r.get("speedup_vs_zero3_2level"), ".2f"),
            _fmt(r.get("predicted_speedup_vs_zero3_2level"), ".2f"),
            _fmt(r.get("cycle_speedup_vs_zero3_2level"), ".2f"),
            _fmt(r.get("run_speedup_vs_zero3_2level"), ".2f"),
            _fmt(mb(r["link_bytes_per_node_per_step"]), ".3f"),
            _fmt(mb(r.get("link_payload_bytes_per_node_per_step")), ".3f"),
            _fmt(mb(r.get("model_link_bytes_per_node_per_step")), ".3f"),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def figure_problem(path: str) -> str | None:
    """Why :func:`draw` could not write ``path`` (one line), or ``None``."""
    from matplotlib.backend_bases import FigureCanvasBase

    from zeropp_jax.files import output_problem

    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix and suffix not in FigureCanvasBase.get_supported_filetypes():  # none: png
        return f"--figure {path}: matplotlib cannot write this file type; use .png, .pdf or .svg"
    return output_problem("--figure", path)


def draw(records: Sequence[dict], path: str, curves: dict[str, Callable] | None = None) -> None:
    """Speedup over each measured baseline vs link rate: points measured, lines predicted.

    A filled marker is the speedup of the median step; where a preset's mean
    over a run of :data:`RUN_STEPS` steps (qgZ warm-up and refreshes
    included) differs from it, a hollow one of the same color is that run's.
    The unlimited rate is drawn right of the largest finite rate.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    curves = curves or {}
    finite = sorted({r["rate_mbit"] for r in records if r["rate_mbit"]}) or [100.0]
    x_unlimited = finite[-1] * 4
    bases = [b for b in BASELINES if any(r["preset"] == b for r in records)]
    fig, axes = plt.subplots(1, max(len(bases), 1), figsize=(6 * max(len(bases), 1), 4.5),
                             squeeze=False)
    grid = np.geomspace(finite[0] / 1.5, finite[-1] * 1.5, 60)
    presets = list(dict.fromkeys(r["preset"] for r in records))
    for ax, base in zip(axes[0], bases):
        key = f"speedup_vs_{base.replace('-', '_')}"
        for i, preset in enumerate(p for p in presets if p != base):
            color = f"C{i}"
            mine = [r for r in records if r["preset"] == preset and r.get(key)]
            ax.plot([r["rate_mbit"] or x_unlimited for r in mine], [r[key] for r in mine],
                    "o", color=color, label=f"{preset} measured")
            runs = [r for r in mine if r.get(f"run_{key}")
                    and r.get("run_step_time_s") != r["step_time_s"]]
            if runs:
                ax.plot([r["rate_mbit"] or x_unlimited for r in runs],
                        [r[f"run_{key}"] for r in runs], "o", color=color, mfc="none",
                        label=f"{preset} over a {RUN_STEPS}-step run")
            if preset in curves and base in curves and not {preset, base} & set(FLAT_PRESETS):
                pred = [curves[base](x) / curves[preset](x) for x in grid]
                ax.plot(grid, pred, "-", color=color, alpha=0.6, label=f"{preset} model")
                ax.plot([x_unlimited], [curves[base](0) / curves[preset](0)], "_", color=color,
                        markersize=14)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ticks = finite + [x_unlimited]
        ax.set_xticks(ticks, [f"{t:g}" for t in finite] + ["unl."])
        ax.set_xlabel("link rate per node and direction (Mbit/s)")
        ax.set_ylabel(f"speedup over {base} (step time)")
        ax.set_title(f"2 nodes x 4 CPU devices, vs {base}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
