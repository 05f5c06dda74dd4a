"""Speedup on the emulated two-node cluster against the tokens each device computes per step.

ZeRO-3's link bytes per step follow the model's size; its compute follows the
model's size times the tokens per step. So how much of a slow link a step can
hide, and how much ZeRO++ can win back, depends on the tokens each device
computes. This runs ``zeropp-cluster-bench`` once per workload (global batch x
sequence length; the model is the same apart from its position table), with
every other flag passed through, and collects the records: speedup over the
two-level zero3 against tokens per device, one line per link rate, measured
beside the bench's cost model.

Needs what ``zeropp-cluster-bench`` needs (root, ``ip``, ``tc``); exits 2
without it. Progress of each workload on stderr, one JSON object on stdout::

  sudo python benchmarks/cluster_tokens.py --workloads 8x32,8x64,8x128,16x128 \\
      --figure benchmarks/figures/cluster_tokens_bf16.png -- \\
      --rates 50,0 --presets zero3-2level,zeropp --steps 16 --repeats 2 \\
      --keep-activations --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from zeropp_jax.cli.cluster_bench import LOCAL, NODES
from zeropp_jax.cli.cluster_report import figure_problem, rate_name, sources_of
from zeropp_jax.files import output_problem

BASELINE = "zero3-2level"  # of cluster_report.BASELINES: rows keep its speedup keys


def workload(text: str) -> tuple[int, int]:
    """``"8x64"`` -> ``(8, 64)``: global batch (sequences per step) x sequence length."""
    try:
        batch, seq = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not BATCHxSEQ, e.g. 8x64 (global batch 8, sequence length 64)"
        ) from None
    if batch <= 0 or seq <= 0 or batch % (NODES * LOCAL):
        raise argparse.ArgumentTypeError(
            f"{text!r}: batch and sequence length must be positive and the batch a multiple "
            f"of the {NODES * LOCAL} devices, e.g. 8x64"
        )
    return batch, seq


def widths(text: str) -> list[int]:
    """``"128,256"`` -> ``[128, 256]``: model widths (``--d-model``), positive."""
    try:
        out = [int(v) for v in text.split(",") if v]
    except ValueError:
        out = []
    if not out or any(d <= 0 for d in out):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give positive model widths, comma-separated, e.g. 128,256")
    return out


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Flags after `--` go to zeropp-cluster-bench (and through it to zeropp-train); "
        "--batch-size, --seq-len and --json are set here.",
    )
    parser.add_argument("--workloads", default="8x32,8x64,8x128,16x128",
                        type=lambda s: [workload(w) for w in s.split(",") if w],
                        help="BATCHxSEQ list (default: 8x32,8x64,8x128,16x128)")
    parser.add_argument("--d-models", default=[128], metavar="D,...",
                        type=widths,
                        help="model widths (zeropp-train --d-model), each with every workload "
                        "(default: 128, the example GPT's)")
    parser.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                        help="run nothing: merge the rows of these earlier results (this "
                        "script's --json) and print and draw them")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the result here")
    parser.add_argument("--figure", default=None, metavar="FILE",
                        help="draw speedup against tokens per device here")
    options, rest = parser.parse_known_args(argv)
    bench_flags = rest[1:] if rest[:1] == ["--"] else rest
    taken = [f for f in bench_flags if f.split("=")[0] in ("--batch-size", "--seq-len", "--d-model", "--json")]
    if taken:
        parser.error(f"drop {', '.join(taken)}: --workloads and --d-models set the batch, "
                     "sequence length and width, and --json is this script's own")
    # outputs checked before a sweep of many minutes, not after it
    problem = ((options.json and output_problem("--json", options.json))
               or (options.figure and figure_problem(options.figure)))
    if problem:
        parser.error(problem)
    options.earlier = []
    for path in options.from_json or ():
        try:
            with open(path) as f:
                earlier = json.load(f)
        except (OSError, ValueError) as e:
            parser.error(f"--from-json {path}: {e}")
        if not isinstance(earlier, dict) or not {"bench_commands", "rows"} <= set(earlier):
            parser.error(f"--from-json {path}: not this script's --json (a zeropp-cluster-bench "
                         "file is pooled by zeropp-cluster-bench --pool)")
        options.earlier.append((path, earlier))
    return options, bench_flags


class WorkloadFailed(Exception):
    """A ``zeropp-cluster-bench`` run exited with ``returncode``."""

    def __init__(self, returncode: int):
        super().__init__(returncode)
        self.returncode = returncode


def run_workload(d_model: int, batch: int, seq: int, bench_flags, out_dir: str) -> dict:
    """One ``zeropp-cluster-bench`` run; its JSON, or :class:`WorkloadFailed`."""
    path = os.path.join(out_dir, f"{d_model}-{batch}x{seq}.json")
    cmd = [sys.executable, "-m", "zeropp_jax.cli.cluster_bench", *bench_flags,
           "--d-model", str(d_model), "--batch-size", str(batch), "--seq-len", str(seq),
           "--json", path]
    print(f"cluster_tokens: d_model {d_model}, workload {batch}x{seq}: {' '.join(cmd[1:])}",
          file=sys.stderr, flush=True)
    # The bench's table and progress bar go to this process's stderr.
    done = subprocess.run(cmd, stdout=sys.stderr)
    if done.returncode != 0:
        raise WorkloadFailed(done.returncode)
    with open(path) as f:
        return json.load(f)


def rows(d_model: int, batch: int, seq: int, bench: dict) -> list[dict]:
    """One row per (preset, rate) of a workload's records."""
    tokens = batch * seq
    out = []
    for r in bench["records"]:
        out.append({
            "d_model": d_model, "batch_size": batch, "seq_len": seq, "tokens_per_step": tokens,
            "tokens_per_device": tokens // (NODES * LOCAL),
            "preset": r["preset"], "rate_mbit": r["rate_mbit"],
            "step_time_s": r["step_time_s"], "cycle_step_time_s": r["cycle_step_time_s"],
            "speedup_vs_zero3_2level": r.get("speedup_vs_zero3_2level"),
            "cycle_speedup_vs_zero3_2level": r.get("cycle_speedup_vs_zero3_2level"),
            "predicted_speedup_vs_zero3_2level": r.get("predicted_speedup_vs_zero3_2level"),
            "link_bytes_per_node_per_step": r["link_bytes_per_node_per_step"],
        })
    return out


def draw(table: list[dict], path: str) -> None:
    """Speedup (left) and step time (right) against tokens per device, log2 axis.

    Colour: link rate; marker: model width; right panel: dashed for ZeRO++.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    presets = [BASELINE, *sorted({r["preset"] for r in table} - {BASELINE})]
    rates = sorted({r["rate_mbit"] for r in table}, key=lambda v: (v == 0, v))
    d_models = sorted({r["d_model"] for r in table})
    colors = {rate: f"C{i}" for i, rate in enumerate(rates)}
    marks = {d: m for d, m in zip(d_models, "os^vD")}

    def points(preset, d_model, rate, *keys):
        return sorted(tuple(r[k] for k in ("tokens_per_device", *keys)) for r in table
                      if (r["preset"], r["d_model"], r["rate_mbit"]) == (preset, d_model, rate))

    for preset in presets[1:]:
        for d_model in d_models:
            for rate in rates:
                pts = points(preset, d_model, rate, "speedup_vs_zero3_2level",
                             "predicted_speedup_vs_zero3_2level")
                pts = [p for p in pts if p[1] is not None]
                if not pts:
                    continue
                label = f"{preset}, d_model {d_model} @ {rate_name(rate)}"
                left.plot([p[0] for p in pts], [p[1] for p in pts], marker=marks[d_model],
                          color=colors[rate], label=label)
                # Unlimited is where the model takes its compute times from: no prediction.
                pred = [(p[0], p[2]) for p in pts if p[2] is not None and rate != 0]
                if pred:
                    left.plot([p[0] for p in pred], [p[1] for p in pred], "x:",
                              color=colors[rate], alpha=0.6)
    left.plot([], [], "kx:", alpha=0.6, label="cost model (x)")
    left.axhline(1.0, color="gray", lw=0.8)
    left.set(ylabel=f"speedup over {BASELINE}", title="speedup over the two-level zero3")
    for preset in presets:
        for d_model in d_models:
            for rate in rates:
                pts = points(preset, d_model, rate, "step_time_s")
                if pts:
                    right.plot([p[0] for p in pts], [p[1] for p in pts], marker=marks[d_model],
                               color=colors[rate], ls="-" if preset == BASELINE else "--",
                               label=f"{preset}, d_model {d_model} @ {rate_name(rate)}")
    right.set(ylabel="median step time (s)", title="step time (solid: baseline)", yscale="log")
    plain = matplotlib.ticker.FormatStrFormatter("%.1f")
    right.yaxis.set_major_formatter(plain)
    right.yaxis.set_minor_formatter(plain)
    ticks = sorted({r["tokens_per_device"] for r in table})
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("tokens per device per step")
        ax.legend(fontsize=6.5, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    """Runs (or merges) the workloads; prints the JSON and writes ``--json`` /
    ``--figure``. ``sources`` holds where every bench ran (its provenance;
    an earlier file's own sources when merging), ``provenance`` this run's.
    A workload that fails stops the sweep with its exit code, after the
    finished workloads' rows are printed and written (``"failed"`` names it)."""
    options, bench_flags = parse_args(sys.argv[1:] if argv is None else argv)
    table, commands, sources, failed = [], [], [], None
    for path, earlier in options.earlier:
        commands.extend(earlier["bench_commands"])
        table.extend(earlier["rows"])
        sources.extend(sources_of(path, earlier))
    if not options.earlier:
        with tempfile.TemporaryDirectory(prefix="cluster-tokens-") as out_dir:
            try:
                for d_model in options.d_models:
                    for batch, seq in options.workloads:
                        bench = run_workload(d_model, batch, seq, bench_flags, out_dir)
                        commands.append(bench["command"])
                        table.extend(rows(d_model, batch, seq, bench))
                        sources.append({"d_model": d_model, "workload": f"{batch}x{seq}",
                                        "provenance": bench.get("provenance")})
            except WorkloadFailed as e:
                failed = {"d_model": d_model, "workload": f"{batch}x{seq}",
                          "exit_code": e.returncode}
    from zeropp_jax import provenance

    result = {"command": sys.argv, "bench_commands": commands, "rows": table,
              "sources": sources, "provenance": provenance.record(),
              **({"failed": failed} if failed else {})}
    text = json.dumps(result)
    print(text)
    if options.json:
        with open(options.json, "w") as f:
            f.write(text)
    if options.figure and table:
        draw(table, options.figure)
    return failed["exit_code"] if failed else 0


if __name__ == "__main__":
    sys.exit(main())
