"""Communication, convergence and step time of every ZeRO++ preset vs ZeRO-3.

Runs on the simulated ``2x4`` CPU mesh (2 nodes x 4 devices) with the example
byte-level GPT at its CLI defaults, for the variants

=================  ======================================================
name               flags
=================  ======================================================
``zero3``          ``--preset zero3``
``qwz``            ``--preset qwz`` (int8 parameter gathers)
``hpz``            ``--preset hpz`` (secondary partition inside the node)
``qgz``            ``--preset qgz`` (1-bit gradients, error feedback)
``zeropp``         ``--preset zeropp`` (all three)
``qgz-noef``       ``--preset qgz --no-qgz-error-feedback``
``qgz-int4``       ``--preset qgz --qgz int4``
``zeropp-dither``  ``--preset zeropp --qgz-code dither
                   --no-qgz-error-feedback`` (the unbiased 1-bit code,
                   block 16, float32 scales: 3 bits per value)
``zeropp-1bit-adam``  ``--preset zeropp --qgz-target momentum --qgz-warmup
                   100 --qgz-refresh-every 10`` (1-bit Adam: error feedback
                   on the momentum; Adam's second moment from 100
                   full-precision steps, refreshed by every 10th step)
``zeropp-1bit-adam-noef``  the same with ``--no-qgz-error-feedback``
=================  ======================================================

and measures

a. **communication** per optimizer step, read from the compiled step by
   :func:`zeropp_jax.cli.comm.report` (nothing runs): inter-node bytes per
   node, intra-node bytes per device and per-device argument/temp memory, at
   ``--grad-accum 1`` (batch 16) and ``--grad-accum 4`` (batch 64, so each
   micro-batch is the same 2 sequences per device), with ratios vs ``zero3``;
b. **convergence**: ``--steps`` optimizer steps of ``zeropp-train`` per
   variant, each in its own process (same seed, same data, the CLI's default
   optimizer and learning-rate schedule, and each preset's own qgZ schedule),
   and the mean loss over the last 10% of steps vs ``zero3``;
c. **overhead**: time per step of every variant, all trainers built in THIS
   process on the same 8 simulated devices, compiled and warmed up, then timed
   round-robin (the order rotates each round) with ``jax.block_until_ready``
   after every step; the median step time vs ``zero3``. qgZ variants are timed
   in their steady state, the compressed step (``compress=True``), whatever
   warm-up their preset has.

The table lists each variant's resolved config (block sizes, qgZ warm-up) and
where ``zeropp_jax`` was imported from, with its git commit: the convergence
runs take minutes each, so run them on a fixed checkout.

It prints a markdown report, PASS/FAIL per target and, on the last line, one
JSON object with every number. Progress goes to stderr. The exit code is 0
whether or not targets pass (this is a measurement).

Usage::

  python benchmarks/presets.py                       # everything, 400 steps
  python benchmarks/presets.py --steps 100 --json-out presets.json
  python benchmarks/presets.py --skip-convergence --skip-timing

On a CPU host the timing measures XLA:CPU compute on 2 or so cores shared by 8
simulated devices, where collectives are memory copies: it shows the compute
overhead of quantization, not the bandwidth saved.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

MESH = "2x4"
N_DEVICES = 8

# Full-precision steps before 1-bit Adam compresses (25% of the default 400
# steps; 1-bit Adam warms up for 15-25% of training), and the period of its
# full-precision steps that refresh Adam's second moment (benchmarks/RESULTS.md).
ONEBIT_ADAM_WARMUP = 100
ONEBIT_ADAM_REFRESH = 10
ONEBIT_ADAM = [
    "--preset", "zeropp", "--qgz-target", "momentum", "--qgz-warmup", str(ONEBIT_ADAM_WARMUP),
    "--qgz-refresh-every", str(ONEBIT_ADAM_REFRESH),
]

# Name -> extra CLI flags (on top of the GPT defaults).
VARIANTS: dict[str, list[str]] = {
    "zero3": ["--preset", "zero3"],
    "qwz": ["--preset", "qwz"],
    "hpz": ["--preset", "hpz"],
    "qgz": ["--preset", "qgz"],
    "zeropp": ["--preset", "zeropp"],
    "qgz-noef": ["--preset", "qgz", "--no-qgz-error-feedback"],
    "qgz-int4": ["--preset", "qgz", "--qgz", "int4"],
    "zeropp-dither": [
        "--preset", "zeropp", "--qgz-code", "dither", "--no-qgz-error-feedback",
    ],
    "zeropp-1bit-adam": ONEBIT_ADAM,
    "zeropp-1bit-adam-noef": [*ONEBIT_ADAM, "--no-qgz-error-feedback"],
}
BASELINE = "zero3"
CONFIG_KEYS = (
    "qwz_bits", "qwz_block", "hpz", "qgz", "qgz_code", "qgz_target", "qgz_block", "qgz_error_feedback",
    "qgz_warmup_steps", "qgz_min_grad_rms", "qgz_refresh_every", "scale_dtype",
)
ACCUMS = (1, 4)
MICRO_BATCH = 16  # global sequences per micro-batch (the CLI's default batch)

# Targets: name -> (description, limit).
LIMITS = {
    "zeropp_inter_node_ratio_accum1": 1 / 5,
    "zeropp_inter_node_ratio_accum4": 1 / 16,
    "zeropp_loss_rel_diff": 0.01,
    "qwz_loss_rel_diff": 0.005,
    "hpz_loss_rel_diff": 0.005,
    "zeropp_dither_loss_rel_diff": 0.01,
    "zeropp_1bit_adam_loss_rel_diff": 0.01,
    "qgz_noef_minus_qgz_loss": 0.0,
    "onebit_adam_noef_minus_ef_loss": 0.0,
    "zeropp_time_ratio": 1.25,
}


def code_version() -> dict:
    """Where ``zeropp_jax`` was imported from, and its git commit if any."""
    import zeropp_jax

    root = os.path.dirname(os.path.dirname(os.path.abspath(zeropp_jax.__file__)))
    out = {"zeropp_jax": os.path.dirname(os.path.abspath(zeropp_jax.__file__)), "git": None}
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "zeropp_jax"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        out["git"] = head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


def log(message: str) -> None:
    print(f"[presets] {message}", file=sys.stderr, flush=True)


def _ensure_devices() -> None:
    """8 simulated host devices; must run before JAX creates its backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={N_DEVICES}".strip()
        )


def _cli_args(parser: argparse.ArgumentParser, name: str, accum: int = 1) -> argparse.Namespace:
    argv = [
        "--mesh", MESH,
        "--grad-accum", str(accum),
        "--batch-size", str(MICRO_BATCH * accum),
        *VARIANTS[name],
    ]
    args = parser.parse_args(argv)
    from zeropp_jax.cli import common

    common.validate_args(parser, args)
    return args


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


# ---------------------------------------------------------------- a. comm
def measure_comm() -> dict:
    from zeropp_jax.cli import comm

    parser = comm.build_parser()
    out: dict = {}
    for accum in ACCUMS:
        rows: dict = {}
        for name in VARIANTS:
            t0 = time.perf_counter()
            result, _ = comm.report(_cli_args(parser, name, accum))
            memory = result.get("memory") or {}
            cfg = result["trainer"]["config"]
            rows[name] = {
                "config": {k: cfg.get(k) for k in CONFIG_KEYS},
                # steady state: the compressed step, or the mean over 1-bit
                # Adam's refresh cycle where it has one
                "inter_node_bytes": int(result.get("mean_inter_node_bytes", result["inter_node_bytes"])),
                "intra_node_bytes": int(result.get("mean_intra_node_bytes", result["intra_node_bytes"])),
                "argument_bytes": memory.get("argument_bytes"),
                "temp_bytes": memory.get("temp_bytes"),
                "variants": {
                    v: {
                        "inter_node_bytes": int(r["report"]["inter_node_bytes"]),
                        "intra_node_bytes": int(r["report"]["intra_node_bytes"]),
                    }
                    for v, r in result["variants"].items()
                },
            }
            if "params" not in out:
                out["params"] = int(result["model"]["params"])
            log(
                f"comm accum={accum} {name}: inter/node {rows[name]['inter_node_bytes']:,} B, "
                f"intra/dev {rows[name]['intra_node_bytes']:,} B "
                f"({time.perf_counter() - t0:.1f}s)"
            )
        base = rows[BASELINE]
        for row in rows.values():
            row["inter_ratio_vs_zero3"] = _ratio(row["inter_node_bytes"], base["inter_node_bytes"])
            row["intra_ratio_vs_zero3"] = _ratio(row["intra_node_bytes"], base["intra_node_bytes"])
        out[f"accum{accum}"] = {"batch_size": MICRO_BATCH * accum, "presets": rows}
    return out


# ----------------------------------------------------------- b. convergence
def measure_convergence(steps: int, metrics_dir: str, seed: int = 0) -> dict:
    rows: dict = {}
    for name in VARIANTS:
        path = os.path.join(metrics_dir, f"{name}.jsonl")
        cmd = [
            sys.executable, "-m", "zeropp_jax.cli.train",
            "--mesh", MESH, *VARIANTS[name],
            "--steps", str(steps), "--seed", str(seed), "--no-progress", "--metrics-out", path,
        ]
        log(f"train {name}: {' '.join(cmd[1:])}")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            log(f"train {name} FAILED (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
            rows[name] = {"error": f"exit code {proc.returncode}", "wall_seconds": round(wall, 1)}
            continue
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        losses = [r["loss"] for r in records]
        tail = losses[-max(1, len(losses) // 10):]
        rows[name] = {
            "steps": len(losses),
            "first_loss": losses[0],
            "final_loss": losses[-1],
            "mean_loss_last_10pct": statistics.fmean(tail),
            "compressed_steps": int(sum(r.get("compressed", 0) for r in records)),
            "train_seconds": round(records[-1]["time"], 2),
            "wall_seconds": round(wall, 1),
        }
        log(
            f"train {name}: last-10% loss {rows[name]['mean_loss_last_10pct']:.4f} "
            f"({wall:.0f}s wall)"
        )
    base = rows.get(BASELINE, {}).get("mean_loss_last_10pct")
    for row in rows.values():
        if base is not None and "mean_loss_last_10pct" in row:
            row["rel_diff_vs_zero3"] = (row["mean_loss_last_10pct"] - base) / base
    return rows


# ---------------------------------------------------------------- c. timing
def measure_timing(rounds: int, steps_per_round: int, warmup: int) -> dict:
    import jax

    from zeropp_jax import data
    from zeropp_jax.cli import common, train
    from zeropp_jax.models import gpt

    parser = train.build_parser()
    base_args = _cli_args(parser, BASELINE)
    if jax.device_count() != N_DEVICES:
        raise RuntimeError(
            f"timing needs {N_DEVICES} devices, JAX has {jax.device_count()} "
            "(is XLA_FLAGS forcing another host device count?)"
        )
    tokens, vocab = data.load_tokens(base_args.data)
    batches = data.TokenBatches(
        tokens, batch_size=base_args.batch_size, seq_len=base_args.seq_len, seed=base_args.seed
    )
    mesh = common.build_mesh(base_args)
    model_cfg = common.build_model(base_args, vocab)
    shapes = jax.eval_shape(lambda k: gpt.init_params(model_cfg, k), jax.random.key(base_args.seed))

    runs: dict = {}
    n_batches = warmup + steps_per_round
    for name in VARIANTS:
        args = _cli_args(parser, name)
        trainer = common.build_trainer(args, mesh, model_cfg, shapes)
        params = gpt.init_params(model_cfg, jax.random.key(args.seed))
        state = trainer.init(params)
        del params
        host = [trainer.shard_batch(batches.batch_at(i)) for i in range(n_batches)]
        t0 = time.perf_counter()
        # The steady-state variant: compressed whenever qgZ is on (a preset's
        # qgZ warm-up runs the full-precision variant for its first steps).
        compress = trainer.qgz_active
        for i in range(warmup):  # the first step compiles
            state, metrics = trainer.step(state, host[i], compress=compress)
            jax.block_until_ready((state, metrics))
        log(f"timing {name}: compiled and warmed up ({time.perf_counter() - t0:.1f}s)")
        runs[name] = {
            "trainer": trainer, "state": state, "batches": host[warmup:], "samples": [],
            "compress": compress,
        }

    names = list(VARIANTS)
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            run = runs[name]
            state = run["state"]
            for i in range(steps_per_round):
                t0 = time.perf_counter()
                state, metrics = run["trainer"].step(
                    state, run["batches"][i], compress=run["compress"]
                )
                jax.block_until_ready((state, metrics))
                run["samples"].append(time.perf_counter() - t0)
            run["state"] = state
        log(f"timing round {r + 1}/{rounds} done")

    out: dict = {}
    for name, run in runs.items():
        s = sorted(run["samples"])
        out[name] = {
            "median_step_s": statistics.median(s),
            "p10_step_s": s[int(0.1 * (len(s) - 1))],
            "p90_step_s": s[int(math.ceil(0.9 * (len(s) - 1)))],
            "samples": len(s),
            "compressed_variant": bool(run["compress"]),
        }
    base = out[BASELINE]["median_step_s"]
    base_p10 = out[BASELINE]["p10_step_s"]
    for row in out.values():
        row["ratio_vs_zero3"] = row["median_step_s"] / base
        row["p10_ratio_vs_zero3"] = row["p10_step_s"] / base_p10
    return out


# ---------------------------------------------------------------- targets
def check_targets(comm: dict | None, conv: dict | None, timing: dict | None) -> tuple[dict, list]:
    targets: dict = {}
    skipped: list = []

    def add(name: str, value: float | None, ok: bool | None) -> None:
        if value is None or ok is None:
            skipped.append(name)
            return
        targets[name] = {"value": value, "limit": LIMITS[name], "pass": bool(ok)}

    for accum in ACCUMS:
        name = f"zeropp_inter_node_ratio_accum{accum}"
        v = comm["accum%d" % accum]["presets"]["zeropp"]["inter_ratio_vs_zero3"] if comm else None
        add(name, v, None if v is None else v <= LIMITS[name])

    def rel(preset: str) -> float | None:
        if not conv:
            return None
        return conv.get(preset, {}).get("rel_diff_vs_zero3")

    for preset in ("zeropp", "qwz", "hpz", "zeropp-dither", "zeropp-1bit-adam"):
        name = f"{preset.replace('-', '_')}_loss_rel_diff"
        v = rel(preset)
        add(name, v, None if v is None else abs(v) <= LIMITS[name])

    name = "qgz_noef_minus_qgz_loss"
    try:
        v = conv["qgz-noef"]["mean_loss_last_10pct"] - conv["qgz"]["mean_loss_last_10pct"]
    except (TypeError, KeyError):
        v = None
    add(name, v, None if v is None else v > LIMITS[name])

    name = "onebit_adam_noef_minus_ef_loss"
    try:
        v = (conv["zeropp-1bit-adam-noef"]["mean_loss_last_10pct"]
             - conv["zeropp-1bit-adam"]["mean_loss_last_10pct"])
    except (TypeError, KeyError):
        v = None
    add(name, v, None if v is None else v > LIMITS[name])

    name = "zeropp_time_ratio"
    v = timing["zeropp"]["ratio_vs_zero3"] if timing else None
    add(name, v, None if v is None else v <= LIMITS[name])
    return targets, skipped


TARGET_TEXT = {
    "zeropp_inter_node_ratio_accum1": "zeropp inter-node bytes / zero3, accum 1 <= 1/5",
    "zeropp_inter_node_ratio_accum4": "zeropp inter-node bytes / zero3, accum 4 <= 1/16",
    "zeropp_loss_rel_diff": "zeropp last-10% loss within 1% of zero3",
    "qwz_loss_rel_diff": "qwz last-10% loss within 0.5% of zero3",
    "hpz_loss_rel_diff": "hpz last-10% loss within 0.5% of zero3",
    "zeropp_dither_loss_rel_diff": "zeropp-dither last-10% loss within 1% of zero3 (not an issue-3 target)",
    "zeropp_1bit_adam_loss_rel_diff": "zeropp-1bit-adam last-10% loss within 1% of zero3",
    "qgz_noef_minus_qgz_loss": "qgz-noef last-10% loss > qgz (error feedback helps)",
    "onebit_adam_noef_minus_ef_loss": "zeropp-1bit-adam-noef last-10% loss > zeropp-1bit-adam (error feedback on the momentum helps)",
    "zeropp_time_ratio": "zeropp time/step <= 1.25x zero3",
}


# ---------------------------------------------------------------- report
def _kib(n) -> str:
    return "-" if n is None else f"{n / 1024:,.1f}"


def _x(r) -> str:
    return "-" if r is None else f"{r:.3f}"


def format_report(result: dict) -> str:
    lines = [
        f"# ZeRO++ presets on the simulated {MESH} mesh (example GPT, {result.get('params', '?'):,} params)",
        "",
        f"code: {result['code']['zeropp_jax']} (git {result['code']['git']})",
        "",
    ]
    comm = result.get("comm")
    if comm:
        lines += [
            "| preset | qwZ bits/block | hpZ | qgZ mode/block | error feedback | qgZ warm-up steps |",
            "|---|---|---|---|---|---:|",
        ]
        for name, row in comm["accum1"]["presets"].items():
            c = row["config"]
            mode = c["qgz"] + ("-dither" if c.get("qgz_code") == "dither" else "")
            mode += "-momentum" if c.get("qgz_target") == "momentum" else ""
            lines.append(
                f"| {name} | {c['qwz_bits']}/{c['qwz_block']} | {c['hpz']} | {mode}/{c['qgz_block']} "
                f"| {c['qgz_error_feedback']} | {c['qgz_warmup_steps']} |"
            )
        lines.append("")
        for accum in ACCUMS:
            block = comm[f"accum{accum}"]
            lines += [
                f"## Communication per optimizer step, grad-accum {accum} (batch {block['batch_size']})",
                "",
                "| preset | inter-node KiB/node | vs zero3 | intra-node KiB/dev | vs zero3 | argument KiB/dev | temp KiB/dev |",
                "|---|---:|---:|---:|---:|---:|---:|",
            ]
            for name, row in block["presets"].items():
                lines.append(
                    f"| {name} | {_kib(row['inter_node_bytes'])} | {_x(row['inter_ratio_vs_zero3'])} "
                    f"| {_kib(row['intra_node_bytes'])} | {_x(row['intra_ratio_vs_zero3'])} "
                    f"| {_kib(row['argument_bytes'])} | {_kib(row['temp_bytes'])} |"
                )
            lines.append("")
    conv = result.get("convergence")
    if conv:
        lines += [
            f"## Convergence ({result['steps']} steps, seed {result.get('seed', 0)}, default data, zeropp-train defaults)",
            "",
            "| preset | first loss | final loss | mean loss last 10% | vs zero3 | compressed steps | train s |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, row in conv.items():
            if "error" in row:
                lines.append(f"| {name} | {row['error']} | | | | | |")
                continue
            rel = row.get("rel_diff_vs_zero3")
            lines.append(
                f"| {name} | {row['first_loss']:.4f} | {row['final_loss']:.4f} "
                f"| {row['mean_loss_last_10pct']:.4f} | {'-' if rel is None else f'{100 * rel:+.2f}%'} "
                f"| {row['compressed_steps']} | {row['train_seconds']:.0f} |"
            )
        lines.append("")
    timing = result.get("timing")
    if timing:
        t = result["timing_setup"]
        lines += [
            f"## Time per step (one process, {t['rounds']} rounds x {t['steps_per_round']} steps, round-robin)",
            "",
            "| preset | median ms/step | p10 | p90 | median vs zero3 | p10 vs zero3 |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, row in timing.items():
            lines.append(
                f"| {name} | {1e3 * row['median_step_s']:.1f} | {1e3 * row['p10_step_s']:.1f} "
                f"| {1e3 * row['p90_step_s']:.1f} | {row['ratio_vs_zero3']:.3f} "
                f"| {row['p10_ratio_vs_zero3']:.3f} |"
            )
        lines.append("")
    lines += ["## Targets", ""]
    for name, t in result["targets"].items():
        lines.append(
            f"{'PASS' if t['pass'] else 'FAIL'}  {TARGET_TEXT[name]}: value {t['value']:.6g}, limit {t['limit']:.6g}"
        )
    for name in result["skipped_targets"]:
        lines.append(f"SKIP  {TARGET_TEXT[name]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps per preset (convergence)")
    parser.add_argument("--skip-convergence", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-comm", action="store_true")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds")
    parser.add_argument("--steps-per-round", type=int, default=10, help="timed steps per preset per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per preset (the first compiles)")
    parser.add_argument("--metrics-dir", default=None, help="keep the per-preset metrics JSONL here")
    parser.add_argument("--json-out", default=None, help="also write the JSON result here")
    parser.add_argument("--seed", type=int, default=0,
                        help="initialization and data order of the convergence runs (single-seed "
                        "gaps vary several-fold between seeds: benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)
    if args.steps < 10:
        parser.error("--steps must be at least 10 (the last 10% are averaged)")

    _ensure_devices()
    started = time.perf_counter()
    result: dict = {
        "mesh": MESH,
        "steps": args.steps,
        "seed": args.seed,
        "variants": {k: " ".join(v) for k, v in VARIANTS.items()},
        "code": code_version(),
    }

    comm = None
    if not args.skip_comm:
        log("a. communication (compile only)")
        comm = measure_comm()
        result["params"] = comm.pop("params")
        result["comm"] = comm
    timing = None
    if not args.skip_timing:
        log("c. step time (one process, round-robin)")
        timing = measure_timing(args.rounds, args.steps_per_round, args.warmup)
        result["timing_setup"] = {
            "rounds": args.rounds, "steps_per_round": args.steps_per_round, "warmup": args.warmup,
        }
        result["timing"] = timing
    conv = None
    if not args.skip_convergence:
        log(f"b. convergence ({len(VARIANTS)} trainings of {args.steps} steps)")
        if args.metrics_dir:
            os.makedirs(args.metrics_dir, exist_ok=True)
            conv = measure_convergence(args.steps, args.metrics_dir, args.seed)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                conv = measure_convergence(args.steps, tmp, args.seed)
        result["convergence"] = conv

    result["targets"], result["skipped_targets"] = check_targets(comm, conv, timing)
    result["seconds"] = round(time.perf_counter() - started, 1)
    if "params" not in result:
        from zeropp_jax.models import gpt

        result["params"] = gpt.count_params(gpt.GPTConfig())
    print(format_report(result), flush=True)
    line = json.dumps(result, sort_keys=False)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
