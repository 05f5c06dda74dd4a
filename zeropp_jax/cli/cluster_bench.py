"""``zeropp-cluster-bench``: wall-clock step times on an emulated two-node cluster.

Builds two network namespaces joined by a rate-limited veth pair
(:mod:`zeropp_jax.cli.netns`), and for every link rate and preset runs the
same ``zeropp-train`` job as two processes, one per namespace (2 nodes x 4
CPU devices, gloo collectives over the veth, coordinator on node 0's
address). For each run it measures, over the steps after ``--warmup``:

* the median step time (with ``--repeats``, over the runs' steps pooled;
  the repeats are rounds over the whole sweep; differences of the ``time``
  field of the metrics file, which process 0 writes after each step's
  metrics reach the host) and
  tokens per second; for a qgZ preset, of its compressed steps;
* for a 1-bit Adam preset, the median full-precision (refresh) step too,
  and the mean over the preset's refresh cycle, ``((N - 1) * compressed +
  full) / N``: the bench refreshes every ``REFRESH_PROBE_EVERY`` steps so
  that the timed window holds refresh steps, while ``N`` is the preset's
  own ``qgz_refresh_every``; and the mean over a run of
  ``cluster_report.RUN_STEPS`` steps of the preset's own schedule, its qgZ
  warm-up included (the bench's runs warm up for one step; a user's run of
  zeropp for 100);
* the bytes that crossed the link per step and node, compressed and
  full-precision steps apart: the veth's receive counters of both
  namespaces, read whenever a metrics line appears (a read races the next
  step's first bytes; :func:`zeropp_jax.cli.cluster_report.bytes_by_kind`
  fits per-step figures to the cumulative counts, where that race is one
  bounded term per run).

At each rate of each round, before the presets, a link probe
(:mod:`zeropp_jax.cli.link_probe`) measures the payload rate the link
carries for the collectives a two-level step sends.

Then, at each rate, every preset's speedup over ``zero3`` (flat collectives:
gloo connects every device to every other, so each remote device's share
crosses the link) and over ``zero3-2level`` (``--hierarchical``: one device
per node crosses), and the cost model's predicted speedup
(:mod:`zeropp_jax.cli.cluster_model`): the emulated cluster is 2 nodes x 4
devices whose compute time comes from the preset's step at unlimited rate
and whose inter-node bandwidth is the probed payload rate; bytes are the
model's two-level count of the compiled step. Prints a table, writes
``--json`` (one record per preset and rate) and draws ``--figure``
(:mod:`zeropp_jax.cli.cluster_report`).

Example (as root)::

  zeropp-cluster-bench --rates 50,0 --presets zero3,zero3-2level,zeropp --steps 8

Without root, ``ip`` or ``tc`` it says so and exits 2. The namespaces, the
veth pair and the ``/etc/netns`` files are removed on every exit, Ctrl-C and
SIGTERM included. Timings on a machine shared with other work are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from typing import Sequence

from zeropp_jax import provenance
from zeropp_jax.analysis import cost_model
from zeropp_jax.cli import cluster_model, cluster_report, common, netns
from zeropp_jax.cli.cluster_run import LOCAL, NODES, RunFailed, probe_link, run_once
from zeropp_jax.files import output_problem

# Ends the qgZ presets' flags: their runs compress from step 1 (the timed
# steps are the compressed ones, not the warm-up's). own_schedule() leaves it
# out: a user's run of the preset warms up for the preset's own steps.
BENCH_QGZ_WARMUP = ("--qgz-warmup", "1")
# The presets of the sweep: zeropp-train flags.
PRESETS: dict[str, tuple[str, ...]] = {
    "zero3": ("--preset", "zero3"),
    "zero3-2level": ("--preset", "zero3", "--hierarchical"),
    "qwz": ("--preset", "qwz"),
    # qwZ's all-device gathers, run two-level as a GPU cluster would (the flat
    # qwz crosses the link like the flat zero3)
    "qwz-2level": ("--preset", "qwz", "--hierarchical"),
    "hpz": ("--preset", "hpz"),
    "zeropp": ("--preset", "zeropp", *BENCH_QGZ_WARMUP),
    "zeropp-max": ("--preset", "zeropp-max", *BENCH_QGZ_WARMUP),
    # ZeRO++ as DeepSpeed runs it: int4 gradients, float32 scales
    "zeropp-int4": ("--preset", "zeropp", *common.config_args(cost_model.PUBLISHED_ZEROPP),
                    *BENCH_QGZ_WARMUP),
}
# 1-bit Adam refreshes every qgz_refresh_every (10-40) steps, too rarely for
# a short timed window; the bench's runs refresh this often instead. Rarer
# refreshes tell the compressed steps' bytes apart more surely (a refresh
# sends 6-25x a compressed step); a window of 13 steps after a warm-up of 3
# holds one.
REFRESH_PROBE_EVERY = 8
# The first jax.distributed coordinator port of a sweep (each run and probe its own).
FIRST_PORT = 20000
# What --pool may be given besides the files.
POOL_FLAGS = ("--pool", "--json", "--figure", "--no-predict")


class _Stop(Exception):
    """SIGTERM / SIGHUP: stop, tear down, exit."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeropp-cluster-bench",
        allow_abbrev=False,  # --preset is zeropp-train's, not an abbreviation of --presets
        description="Step times of ZeRO-3 / ZeRO++ presets on an emulated 2-node cluster "
        "(network namespaces joined by a tc-limited veth; needs root, ip and tc). "
        "Other arguments are passed to zeropp-train (model flags: --layers, --d-model, "
        "--heads, --seq-len, --batch-size, --dtype, ...).",
        epilog="example: zeropp-cluster-bench --rates 50,0 --presets zero3,zero3-2level,zeropp "
        "--steps 8",
    )
    parser.add_argument("--rates", type=_rates, default=_rates("50,200,1000,0"),
                        help="link rates in Mbit/s, 0 = unlimited (default: 50,200,1000,0)")
    parser.add_argument("--presets", type=_presets, default=list(PRESETS),
                        help=f"comma-separated, of {', '.join(PRESETS)} (default: all)")
    parser.add_argument("--steps", type=common.positive_int, default=10,
                        help="optimizer steps per run (default: 10)")
    parser.add_argument("--warmup", type=common.positive_int, default=3,
                        help="first steps left out of the timing, compilation included "
                        "(default: 3; fewer than --steps)")
    parser.add_argument("--repeats", type=common.positive_int, default=1,
                        help="runs per preset and rate, their timed steps pooled; run as "
                        "rounds over the whole sweep (default: 1; single runs on a shared "
                        "machine vary by about 10%%)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the records here")
    parser.add_argument("--figure", default=None, metavar="FILE",
                        help="draw speedup vs link rate here (matplotlib; .png, .svg, ...)")
    parser.add_argument("--no-predict", action="store_true",
                        help="skip the cost model's predictions (they compile each preset "
                        "once more in this process)")
    parser.add_argument("--timeout", type=common.positive_float, default=900.0, metavar="S",
                        help="fail a run that takes longer than S seconds (default: 900)")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="keep the runs' logs and metrics here (default: a temporary "
                        "directory, removed at the end)")
    parser.add_argument("--pool", nargs="+", default=None, metavar="JSON",
                        help="run nothing: pool the runs of earlier sweeps' --json files "
                        "(same zeropp-train flags, --steps and --warmup) as more rounds, "
                        "then report them as one sweep; needs no root")
    return parser


def _rates(text: str) -> list[float]:
    try:
        rates = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected Mbit/s numbers like 50,200,0, got {text!r}")
    if not rates or any(r < 0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected rates >= 0 (0 = unlimited), got {text!r}")
    return rates


def _presets(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown preset(s) {unknown or text!r}; choose from {', '.join(PRESETS)}")
    return names


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """``(bench options, zeropp-train flags)``; the train flags are checked here."""
    from zeropp_jax.cli import train

    parser = build_parser()
    options, train_flags = parser.parse_known_args(argv)
    # written after the sweep: a path that cannot be is refused now
    problem = ((options.json and output_problem("--json", options.json))
               or (options.figure and cluster_report.figure_problem(options.figure)))
    if problem:
        parser.error(problem)
    pooled = [os.path.abspath(path) for path in options.pool or ()]
    if options.json and os.path.abspath(options.json) in pooled:
        parser.error(f"--json {options.json} is one of the --pool inputs; give another file")
    if options.pool is not None:
        given = sorted({a.split("=")[0] for a in argv if a.startswith("-")} - set(POOL_FLAGS))
        if given:
            parser.error(f"{', '.join(given)}: --pool takes the flags of the sweeps it pools "
                         f"(with it only {', '.join(POOL_FLAGS)})")
        return options, []
    if options.warmup >= options.steps:
        parser.error(f"--warmup {options.warmup} must be less than --steps {options.steps}")
    train_parser = train.build_parser()
    known = {s for action in train_parser._actions for s in action.option_strings}
    given = {f.split("=")[0] for f in train_flags if f.startswith("--")}
    if given - known:  # zeropp-train would read "--pres" as "--preset", unchecked here
        parser.error(f"{', '.join(sorted(given - known))}: not a flag of the bench or of "
                     "zeropp-train (give zeropp-train's flags in full: zeropp-train --help)")
    clash = sorted(given & {"--mesh", "--steps", "--metrics-out", "--preset", "--coordinator",
                            "--num-processes", "--process-id", "--checkpoint-dir", "--resume"})
    if clash:
        parser.error(f"{', '.join(clash)}: set by the bench itself (use --presets / --steps)")
    for name in options.presets:
        args = train_parser.parse_args(
            train_command_flags(name, train_flags, options.steps, probe_refresh=True))
        common.validate_args(train_parser, args)
    return options, train_flags


def train_command_flags(preset: str, train_flags: Sequence[str], steps: int, *,
                        probe_refresh: bool = False) -> list[str]:
    """zeropp-train's flags for one run (without the metrics file); with
    ``probe_refresh`` a 1-bit Adam preset refreshes every
    ``REFRESH_PROBE_EVERY`` steps (unless ``train_flags`` say otherwise)."""
    probe = []
    if probe_refresh and refresh_every(preset, train_flags):
        probe = ["--qgz-refresh-every", str(REFRESH_PROBE_EVERY)]
    # --allow-divergence: the bench times steps and counts bytes; with a
    # one-step warm-up 1-bit Adam's frozen v comes from one gradient, and a
    # short run's loss may blow up without changing what a step sends.
    return ["--mesh", f"{NODES}x{LOCAL}", "--steps", str(steps), "--lr-schedule", "constant",
            "--no-progress", "--allow-divergence", *PRESETS[preset], *probe, *train_flags]


def refresh_every(preset: str, train_flags: Sequence[str]) -> int:
    """The preset's own ``qgz_refresh_every`` with ``train_flags`` (0: none)."""
    return own_schedule(preset, train_flags).refresh_every


def own_schedule(preset: str, train_flags: Sequence[str]):
    """The qgZ schedule (a :class:`zeropp_jax.step.schedule.QgzSchedule`; no
    warm-up or refresh where qgZ is off) of a user's run of ``preset`` with
    ``train_flags``: without the runs' :data:`BENCH_QGZ_WARMUP`."""
    from zeropp_jax.cli import train
    from zeropp_jax.step.schedule import QgzSchedule

    own = PRESETS[preset]
    if own[-len(BENCH_QGZ_WARMUP):] == BENCH_QGZ_WARMUP:
        own = own[:-len(BENCH_QGZ_WARMUP)]
    flags = ["--mesh", f"{NODES}x{LOCAL}", *own, *train_flags]
    schedule = QgzSchedule.from_config(
        common.build_config(train.build_parser().parse_args(flags)), NODES)
    return schedule if schedule.active else QgzSchedule(active=False)


def sweep(options, train_flags, log_dir: str, progress) -> list[dict]:
    """Every (rate, preset) run on one emulated cluster; returns the records.

    The repeats are rounds over the whole sweep (round 1: every rate and
    preset, then round 2, ...), so that a slow spell of a shared machine
    falls on every preset alike instead of on one preset's runs; each
    record pools its preset's runs at its rate.
    """
    points = [(rate, preset) for rate in options.rates for preset in options.presets]
    runs: dict[tuple[float, str], list[dict]] = {point: [] for point in points}
    probes: dict[float, list[dict]] = {rate: [] for rate in options.rates}
    with netns.TwoNodeCluster() as cluster:
        for repeat in range(options.repeats):
            for index, (rate, preset) in enumerate(points):
                # a coordinator port per run, and the next one for the probe before it
                port = FIRST_PORT + 2 * (repeat * len(points) + index)
                if index == 0 or points[index - 1][0] != rate:
                    cluster.set_rate(rate)
                    progress.set_description(f"link probe @ {cluster_report.rate_name(rate)}")
                    probe = probe_link(cluster, rate, log_dir=log_dir,
                                       run_id=f"probe_{rate:g}mbit_{repeat}", port=port + 1,
                                       timeout_s=options.timeout)
                    probes[rate].append(probe)
                    progress.write(f"  link probe @ {cluster_report.rate_name(rate)}: "
                                   f"{_fmt_gbits(probe['payload_gbits_per_s'])} payload")
                name = f"{preset} @ {cluster_report.rate_name(rate)}"
                progress.set_description(f"{name} ({repeat + 1}/{options.repeats})")
                run = run_once(
                    cluster, train_command_flags(preset, train_flags, options.steps,
                                                 probe_refresh=True),
                    warmup=options.warmup, steps=options.steps, log_dir=log_dir,
                    run_id=f"{preset}_{rate:g}mbit_{repeat}",
                    port=port,
                    timeout_s=options.timeout,
                )
                runs[rate, preset].append(run)
                progress.update(1)
                times = [run["step_times_s"][i]
                         for i in cluster_report.main_steps(run["compressed"])]
                progress.write(f"  {name:>24} ({repeat + 1}/{options.repeats}): "
                               f"{statistics.median(times):.3f} s/step (median of {len(times)})")
    return _records(runs, train_flags, probes)


def _fmt_gbits(gbits: float | None) -> str:
    return "no rate (the large gather was not slower)" if not gbits else f"{gbits * 1e3:,.1f} Mbit/s"


def pool(paths: Sequence[str]) -> tuple[list[str], dict, list[dict]]:
    """Pools the runs of earlier sweeps (their ``--json`` files) per preset and rate.

    Returns:
      ``(train flags, header, records)``: the sweeps' common zeropp-train
      flags, ``steps`` and ``warmup``; one record per (preset, rate) of any
      sweep, pooling every sweep's runs of it (speedups and predictions not
      yet added).

    Raises:
      ValueError: a file that is not a bench's JSON, or sweeps of different
        train flags, ``--steps`` or ``--warmup`` (their steps are not alike).
    """
    runs: dict[tuple[float, str], list[dict]] = {}
    probes: dict[float, list[dict]] = {}
    sources: list[dict] = []
    first = None
    for path in paths:
        with open(path) as f:
            sweep_json = json.load(f)
        if not {"command", "steps", "warmup", "records"} <= set(sweep_json):
            raise ValueError(f"{path}: not a zeropp-cluster-bench --json file")
        sources.extend(cluster_report.sources_of(path, sweep_json))
        # a pooled file records its flags; a sweep's, its command line
        flags = sweep_json.get("train_flags")
        if flags is None:
            flags = parse_args(sweep_json["command"][1:])[1]
        this = (flags, sweep_json["steps"], sweep_json["warmup"])
        if first is None:
            first = (path, *this)
        elif this != first[1:]:
            raise ValueError(f"{path} ran zeropp-train flags {flags}, --steps {this[1]}, "
                             f"--warmup {this[2]}; {first[0]} ran {first[1]}, --steps "
                             f"{first[2]}, --warmup {first[3]}: pool sweeps of one workload")
        probed = set()
        for rec in sweep_json["records"]:
            runs.setdefault((rec["rate_mbit"], rec["preset"]), []).extend(
                cluster_report.runs_of(rec))
            if rec["rate_mbit"] not in probed:  # every record of a rate holds its probes
                probed.add(rec["rate_mbit"])
                probes.setdefault(rec["rate_mbit"], []).extend(rec.get("link_probes") or [])
    _, train_flags, steps, warmup = first
    header = {"steps": steps, "warmup": warmup, "pooled": list(paths), "sources": sources}
    return train_flags, header, _records(runs, train_flags, probes)


def _records(runs: dict[tuple[float, str], list[dict]], train_flags: Sequence[str],
             probes: dict[float, list[dict]]) -> list[dict]:
    """One record per ``(rate, preset)`` of ``runs``, in its order, pooling that point's
    runs and holding the link probes at its rate."""
    from zeropp_jax.cli import train

    args = train.build_parser().parse_args(train_command_flags("zero3", train_flags, 1))
    schedules = {preset: own_schedule(preset, train_flags) for _, preset in runs}
    return [cluster_report.record(preset, rate, pooled, args.batch_size * args.seq_len,
                                  schedules[preset].refresh_every,
                                  warmup=schedules[preset].warmup_steps,
                                  flags=" ".join(PRESETS[preset]),
                                  probes=probes.get(rate, ()))
            for (rate, preset), pooled in runs.items()]


def _install_stop_handlers() -> None:
    def handler(signum, frame):
        raise _Stop(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    options, train_flags = parse_args(sys.argv[1:] if argv is None else argv)
    _predict_devices()
    if options.pool is not None:
        try:
            train_flags, header, records = pool(options.pool)
        except (OSError, ValueError) as e:
            print(f"zeropp-cluster-bench: cannot pool: {e}", file=sys.stderr)
            return 2
        return _report(options, train_flags, header, records)
    reason = netns.unavailable_reason()
    if reason is not None:
        print(f"zeropp-cluster-bench: cannot build the emulated cluster: {reason}",
              file=sys.stderr)
        return 2
    from tqdm import tqdm

    _install_stop_handlers()
    keep_logs = options.log_dir is not None
    log_dir = options.log_dir or tempfile.mkdtemp(prefix="zeropp-cluster-bench-")
    os.makedirs(log_dir, exist_ok=True)
    total = len(options.rates) * len(options.presets) * options.repeats
    progress = tqdm(total=total, unit="run", dynamic_ncols=True, file=sys.stderr)
    try:
        records = sweep(options, train_flags, log_dir, progress)
    except RunFailed as e:
        keep_logs = True
        print(f"zeropp-cluster-bench: a run failed: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Stop):
        print("zeropp-cluster-bench: interrupted; the cluster was torn down", file=sys.stderr)
        return 130
    finally:
        progress.close()
        if not keep_logs:
            subprocess.run(("rm", "-rf", log_dir))
    return _report(options, train_flags,
                   {"steps": options.steps, "warmup": options.warmup}, records)


def _predict_devices() -> None:
    """This process compiles each preset for the predictions: 8 CPU devices
    (the runs' processes get their own device count from process_env)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _report(options, train_flags: Sequence[str], header: dict, records: list[dict]) -> int:
    """Speedups, predictions, the table, ``--json`` and ``--figure`` of a sweep's records."""
    cluster_report.add_speedups(records)
    curves = {}
    if not options.no_predict:
        curves = cluster_model.add_predictions(records, train_command_flags, train_flags)
    print(cluster_report.format_table(records))
    if curves:
        print(cluster_model.describe(records))
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"command": sys.argv, "nodes": NODES, "local": LOCAL,
                       "provenance": provenance.record(devices=False),
                       "train_flags": list(train_flags), **header,
                       "records": records}, f, indent=1)
    if options.figure:
        cluster_report.draw(records, options.figure, curves)
    return 0


if __name__ == "__main__":
    sys.exit(main())
