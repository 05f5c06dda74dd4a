"""Communication, convergence and step time of every ZeRO++ preset vs ZeRO-3.

Runs on the simulated ``2x4`` CPU mesh (2 nodes x 4 devices) with the example
byte-level GPT at its CLI defaults, for the variants

=================  ======================================================
name               flags
=================  ======================================================
``zero3``          ``--preset zero3``
``qwz``            ``--preset qwz`` (int8 parameter gathers)
``hpz``            ``--preset hpz`` (secondary partition inside the node)
``qgz``            ``--preset qgz`` (1-bit Adam: 1-bit momentum with error
                   feedback; Adam's second moment from 100 full-precision
                   steps, refreshed by every 10th step)
``zeropp``         ``--preset zeropp`` (qwZ + hpZ + 1-bit Adam)
``qgz-noef``       ``--preset qgz --no-qgz-error-feedback``
``qgz-grad``       ``--preset qgz --qgz-target gradient`` (1-bit gradients
                   with error feedback, in front of optax's Adam)
``qgz-int4``       ``--preset qgz --qgz int4 --qgz-target gradient``
                   (int4 gradients, as the ZeRO++ paper)
``zeropp-dither``  ``--preset zeropp --qgz-target gradient --qgz-code
                   dither --no-qgz-error-feedback`` (the unbiased 1-bit
                   code on gradients, block 16, the preset's bfloat16
                   scales: 2 bits per value)
``zeropp-int4``    ``--preset zeropp --qgz int4 --qgz-target gradient
                   --scale-dtype float32 --qgz-warmup 0``: ZeRO++ as
                   DeepSpeed runs it (``cost_model.PUBLISHED_ZEROPP``: int4
                   gradients with float32 scales from the first step, no
                   full-precision warm-up)
=================  ======================================================

and measures

a. **communication** per optimizer step, read from the compiled step by
   :func:`zeropp_jax.cli.comm.report` (nothing runs) with ``--dtype bf16``
   (full-precision payloads at the 2 bytes a GPU run sends; XLA:CPU compiles
   them as f32 and the report counts them at bf16): inter-node bytes per node
   (two-level), averaged over a ``--steps`` run of each preset's qgZ schedule
   (its full-precision warm-up and refresh steps included; also the
   compressed step alone and 1-bit Adam's refresh-cycle mean), intra-node
   bytes per device (two-level, the remote bytes forwarded inside the node
   included) and per-device
   argument/temp memory, at ``--grad-accum 1`` (batch 16) and ``--grad-accum
   4`` (batch 64, so each micro-batch is the same 2 sequences per device),
   with ratios vs ``zero3``;
b. **convergence**: ``--steps`` optimizer steps of ``zeropp-train`` per
   variant and seed (``--seeds``), each in its own process (same seed, same
   data, the CLI's default optimizer and learning-rate schedule, and each
   preset's own qgZ schedule), the mean loss over the last 10% of steps vs
   ``zero3`` with the same seed, and its mean and standard deviation over
   the seeds (the loss targets are checked on the mean: single-seed gaps of
   quantized variants swing by about 1%, benchmarks/RESULTS.md);
c. **overhead** (XLA:CPU at the CLI's float32): time per step of every variant, all trainers built in THIS
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

  python benchmarks/presets.py                       # everything, 400 steps, seed 0
  python benchmarks/presets.py --skip-timing --skip-comm --seeds 0,1,2,3,4 \
      --variants zero3,qwz,hpz,zeropp,qgz,qgz-noef  # the loss targets, 5 seeds
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

# Name -> extra CLI flags (on top of the GPT defaults).
VARIANTS: dict[str, list[str]] = {
    "zero3": ["--preset", "zero3"],
    "qwz": ["--preset", "qwz"],
    "hpz": ["--preset", "hpz"],
    "qgz": ["--preset", "qgz"],
    "zeropp": ["--preset", "zeropp"],
    "qgz-noef": ["--preset", "qgz", "--no-qgz-error-feedback"],
    "qgz-grad": ["--preset", "qgz", "--qgz-target", "gradient"],
    "qgz-int4": ["--preset", "qgz", "--qgz", "int4", "--qgz-target", "gradient"],
    "zeropp-dither": [
        "--preset", "zeropp", "--qgz-target", "gradient", "--qgz-code", "dither",
        "--no-qgz-error-feedback",
    ],
    # ZeRO++ as DeepSpeed runs it: cost_model.PUBLISHED_ZEROPP as flags (a test keeps them equal)
    "zeropp-int4": [
        "--preset", "zeropp", "--qgz", "int4", "--qgz-target", "gradient",
        "--scale-dtype", "float32", "--qgz-warmup", "0",
    ],
}
BASELINE = "zero3"
# Variants without qgZ: no step of theirs compresses, at any length.
UNCOMPRESSED = frozenset({"zero3", "qwz", "hpz"})
CONFIG_KEYS = (
    "qwz_bits", "qwz_block", "hpz", "qgz", "qgz_code", "qgz_target", "qgz_block", "qgz_error_feedback",
    "qgz_warmup_steps", "qgz_min_grad_rms", "qgz_refresh_every", "scale_dtype",
)
ACCUMS = (1, 4)
COMM_DTYPE = "bf16"  # what a GPU run sends: the byte figures are counted at it
MICRO_BATCH = 16  # global sequences per micro-batch (the CLI's default batch)

# Targets: name -> (description, limit).
LIMITS = {
    "zeropp_inter_node_ratio_accum1": 1 / 5,
    "zeropp_inter_node_ratio_accum4": 1 / 16,
    "zeropp_loss_rel_diff": 0.01,
    "qwz_loss_rel_diff": 0.005,
    "hpz_loss_rel_diff": 0.005,
    "zeropp_dither_loss_rel_diff": 0.01,
    "qgz_noef_minus_qgz_loss": 0.0,
    "zeropp_time_ratio": 1.25,
}


def log(message: str) -> None:
    print(f"[presets] {message}", file=sys.stderr, flush=True)


def _ensure_devices() -> None:
    """8 simulated host devices; must run before JAX creates its backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={N_DEVICES}".strip()
        )


def _cli_args(parser: argparse.ArgumentParser, name: str, accum: int = 1,
              *extra: str) -> argparse.Namespace:
    argv = [
        "--mesh", MESH,
        "--grad-accum", str(accum),
        "--batch-size", str(MICRO_BATCH * accum),
        *VARIANTS[name],
        *extra,
    ]
    args = parser.parse_args(argv)
    from zeropp_jax.cli import common

    common.validate_args(parser, args)
    return args


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


# ---------------------------------------------------------------- a. comm
def measure_comm(variants: list[str], steps: int) -> dict:
    """Each variant's bytes at bf16 for a ``steps``-step run, by grad-accum."""
    from zeropp_jax.cli import comm

    parser = comm.build_parser()
    out: dict = {"dtype": COMM_DTYPE, "steps": steps}
    for accum in ACCUMS:
        rows: dict = {}
        for name in variants:
            t0 = time.perf_counter()
            result, _ = comm.report(_cli_args(parser, name, accum,
                                              "--dtype", COMM_DTYPE, "--steps", str(steps)))
            memory = result.get("memory") or {}
            cfg = result["trainer"]["config"]
            rows[name] = {
                "config": {k: cfg.get(k) for k in CONFIG_KEYS},
                # the mean over the run's schedule (warm-up and refreshes
                # included); the compressed step and the refresh cycle beside
                "inter_node_bytes": round(result["schedule"]["inter_node_bytes"]),
                "intra_node_bytes": round(result["schedule"]["intra_node_bytes"]),
                "full_precision_steps": result["schedule"]["full_precision_steps"],
                "compressed_inter_node_bytes": int(result["inter_node_bytes"]),
                "cycle_inter_node_bytes": (round(result["cycle_inter_node_bytes"])
                                           if "cycle_inter_node_bytes" in result else None),
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
def measure_convergence(steps: int, metrics_dir: str, seed: int, variants: list[str]) -> dict:
    """One seed: ``{variant: row}`` (``rel_diff_vs_zero3`` when zero3 ran)."""
    rows: dict = {}
    for name in variants:
        path = os.path.join(metrics_dir, f"{name}.jsonl")
        cmd = [
            sys.executable, "-m", "zeropp_jax.cli.train",
            "--mesh", MESH, *VARIANTS[name],
            "--steps", str(steps), "--seed", str(seed), "--no-progress", "--metrics-out", path,
        ]
        log(f"train {name} (seed {seed}): {' '.join(cmd[1:])}")
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


def summarize_seeds(per_seed: dict) -> dict:
    """``{seed: {variant: row}}`` -> ``{variant: summary over the seeds}``.

    A summary has ``seeds``, ``mean_loss_last_10pct`` and ``rel_diff_vs_zero3``
    (each a mean over the seeds where the run succeeded; the relative gap of
    each seed is to zero3 with the same seed), ``rel_diff_sd`` (sample
    standard deviation; ``None`` for one seed) and ``per_seed_rel_diff``.
    A variant that failed on every seed keeps the first ``error``.
    """
    names = list(dict.fromkeys(n for rows in per_seed.values() for n in rows))
    out: dict = {}
    for name in names:
        ok = {s: rows[name] for s, rows in per_seed.items()
              if name in rows and "mean_loss_last_10pct" in rows[name]}
        if not ok:
            errors = [rows[name]["error"] for rows in per_seed.values() if name in rows]
            out[name] = {"error": errors[0] if errors else "not run"}
            continue
        rels = {s: r["rel_diff_vs_zero3"] for s, r in ok.items() if "rel_diff_vs_zero3" in r}
        out[name] = {
            "seeds": sorted(ok),
            "mean_loss_last_10pct": statistics.fmean(r["mean_loss_last_10pct"] for r in ok.values()),
            "rel_diff_vs_zero3": statistics.fmean(rels.values()) if rels else None,
            "rel_diff_sd": statistics.stdev(rels.values()) if len(rels) > 1 else None,
            "per_seed_rel_diff": {str(s): v for s, v in sorted(rels.items())},
            "compressed_steps": ok[min(ok)]["compressed_steps"],
        }
    return out


# ---------------------------------------------------------------- c. timing
def measure_timing(rounds: int, steps_per_round: int, warmup: int, variants: list[str]) -> dict:
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
    for name in variants:
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

    names = list(variants)
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
def check_targets(comm: dict | None, conv: dict | None, timing: dict | None) -> tuple[dict, dict]:
    """``(targets, skipped)``: each measured target's value, limit and
    verdict; each skipped one's reason (not measured, or a loss target of a
    compressing variant whose run compressed no step: shorter than its
    warm-up, it would only repeat full-precision training)."""
    targets: dict = {}
    skipped: dict = {}

    def add(name: str, value: float | None, ok: bool | None, why: str = "not measured") -> None:
        if value is None or ok is None:
            skipped[name] = why
            return
        targets[name] = {"value": value, "limit": LIMITS[name], "pass": bool(ok)}

    def uncompressed(*presets: str) -> str | None:
        idle = [p for p in presets if p not in UNCOMPRESSED and conv and p in conv
                and conv[p].get("compressed_steps") == 0]
        return (f"{', '.join(idle)} compressed no step: --steps is not longer than the "
                "warm-up" if idle else None)

    for accum in ACCUMS:
        name = f"zeropp_inter_node_ratio_accum{accum}"
        row = comm["accum%d" % accum]["presets"].get("zeropp") if comm else None
        v = row["inter_ratio_vs_zero3"] if row else None
        add(name, v, None if v is None else v <= LIMITS[name])

    def rel(preset: str) -> float | None:
        if not conv:
            return None
        return conv.get(preset, {}).get("rel_diff_vs_zero3")

    for preset in ("zeropp", "qwz", "hpz", "zeropp-dither"):
        name = f"{preset.replace('-', '_')}_loss_rel_diff"
        v, why = rel(preset), uncompressed(preset)
        add(name, v, None if v is None or why else abs(v) <= LIMITS[name], why or "not measured")

    name = "qgz_noef_minus_qgz_loss"
    try:
        v = conv["qgz-noef"]["mean_loss_last_10pct"] - conv["qgz"]["mean_loss_last_10pct"]
    except (TypeError, KeyError):
        v = None
    why = uncompressed("qgz", "qgz-noef")
    add(name, v, None if v is None or why else v > LIMITS[name], why or "not measured")

    name = "zeropp_time_ratio"
    v = timing["zeropp"]["ratio_vs_zero3"] if timing and "zeropp" in timing else None
    add(name, v, None if v is None else v <= LIMITS[name])
    return targets, skipped


TARGET_TEXT = {
    "zeropp_inter_node_ratio_accum1": "zeropp inter-node bytes / zero3, accum 1 <= 1/5 "
                                      "(bf16, mean over the run's schedule)",
    "zeropp_inter_node_ratio_accum4": "zeropp inter-node bytes / zero3, accum 4 <= 1/16 "
                                      "(bf16, mean over the run's schedule)",
    "zeropp_loss_rel_diff": "zeropp last-10% loss within 1% of zero3 (mean over the seeds)",
    "qwz_loss_rel_diff": "qwz last-10% loss within 0.5% of zero3 (mean over the seeds)",
    "hpz_loss_rel_diff": "hpz last-10% loss within 0.5% of zero3 (mean over the seeds)",
    "zeropp_dither_loss_rel_diff": "zeropp-dither last-10% loss within 1% of zero3 (not an issue-3 target)",
    "qgz_noef_minus_qgz_loss": "qgz-noef last-10% loss > qgz (error feedback helps; mean over the seeds)",
    "zeropp_time_ratio": "zeropp time/step <= 1.25x zero3",
}


# ---------------------------------------------------------------- report
def _kib(n) -> str:
    return "-" if n is None else f"{n / 1024:,.1f}"


def _x(r) -> str:
    return "-" if r is None else f"{r:.3f}"


def _provenance(result: dict) -> dict:
    """The result's provenance record (``"code"`` in JSON written before stop 48)."""
    return result.get("provenance") or result["code"]


def format_report(result: dict) -> str:
    lines = [
        f"# ZeRO++ presets on the simulated {MESH} mesh (example GPT, {result.get('params', '?'):,} params)",
        "",
        f"code: {_provenance(result)['zeropp_jax']} (git {_provenance(result)['git']})",
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
                f"Inter-node: two-level, per node, full-precision payloads at {comm['dtype']}, "
                f"the mean over a {comm['steps']}-step run (warm-up and refreshes included; "
                "the compressed step and 1-bit Adam's refresh-cycle mean beside it). "
                "Intra-node: per device, two-level (remote bytes forwarded inside the node "
                "counted), the run's mean.",
                "",
                f"| preset | inter-node KiB/node, {comm['steps']}-step mean | vs zero3 "
                "| compressed step | refresh cycle | intra-node KiB/dev | vs zero3 "
                "| argument KiB/dev | temp KiB/dev |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for name, row in block["presets"].items():
                lines.append(
                    f"| {name} | {_kib(row['inter_node_bytes'])} | {_x(row['inter_ratio_vs_zero3'])} "
                    f"| {_kib(row['compressed_inter_node_bytes'])} "
                    f"| {_kib(row['cycle_inter_node_bytes'])} "
                    f"| {_kib(row['intra_node_bytes'])} | {_x(row['intra_ratio_vs_zero3'])} "
                    f"| {_kib(row['argument_bytes'])} | {_kib(row['temp_bytes'])} |"
                )
            lines.append("")
    conv = result.get("convergence")
    if conv:
        pct = lambda v: "-" if v is None else f"{100 * v:+.2f}%"  # noqa: E731
        seeds = ", ".join(str(s) for s in result["seeds"])
        lines += [
            f"## Convergence ({result['steps']} steps, seeds {seeds}, default data, zeropp-train defaults)",
            "",
            "| preset | mean loss last 10% | vs zero3 (mean over seeds) | sd | per seed | compressed steps |",
            "|---|---:|---:|---:|---|---:|",
        ]
        for name, row in conv.items():
            if "error" in row:
                lines.append(f"| {name} | {row['error']} | | | | |")
                continue
            per_seed = " / ".join(pct(v) for v in row["per_seed_rel_diff"].values())
            sd = row["rel_diff_sd"]
            lines.append(
                f"| {name} | {row['mean_loss_last_10pct']:.4f} | {pct(row['rel_diff_vs_zero3'])} "
                f"| {'-' if sd is None else f'{100 * sd:.2f}%'} | {per_seed} | {row['compressed_steps']} |"
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
    skipped = result["skipped_targets"]  # a list of names in files before stop 52
    for name, why in (skipped.items() if isinstance(skipped, dict) else
                      ((name, "not measured") for name in skipped)):
        lines.append(f"SKIP  {TARGET_TEXT[name]} ({why})")
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
    parser.add_argument("--seeds", default="0",
                        help="comma-separated seeds (initialization and data order) of the "
                        "convergence runs; targets use the mean over them (single-seed gaps "
                        "swing by about 1%%: benchmarks/RESULTS.md)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated variants to measure (zero3 is always included)")
    args = parser.parse_args(argv)
    if args.steps < 10:
        parser.error("--steps must be at least 10 (the last 10%% are averaged)")
    for flag, value, least in (("--rounds", args.rounds, 1),
                               ("--steps-per-round", args.steps_per_round, 1),
                               ("--warmup", args.warmup, 0)):
        if value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    try:
        seeds = list(dict.fromkeys(int(s) for s in args.seeds.split(",")))
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    if any(s < 0 for s in seeds):
        parser.error(f"--seeds must be integers >= 0, got {args.seeds!r}")
    if args.json_out:  # written at the end: a path that cannot be is refused now
        from zeropp_jax.files import output_problem

        problem = output_problem("--json-out", args.json_out)
        if problem:
            parser.error(problem)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    variants = [BASELINE] + [v for v in dict.fromkeys(variants) if v != BASELINE]

    _ensure_devices()
    from zeropp_jax import provenance

    started = time.perf_counter()
    result: dict = {
        "mesh": MESH,
        "steps": args.steps,
        "seeds": seeds,
        "variants": {k: " ".join(VARIANTS[k]) for k in variants},
        "provenance": provenance.record(),
    }

    comm = None
    if not args.skip_comm:
        log("a. communication (compile only)")
        comm = measure_comm(variants, args.steps)
        result["params"] = comm.pop("params")
        result["comm"] = comm
    timing = None
    if not args.skip_timing:
        log("c. step time (one process, round-robin)")
        timing = measure_timing(args.rounds, args.steps_per_round, args.warmup, variants)
        result["timing_setup"] = {
            "rounds": args.rounds, "steps_per_round": args.steps_per_round, "warmup": args.warmup,
        }
        result["timing"] = timing
    conv = None
    if not args.skip_convergence:
        log(f"b. convergence ({len(variants) * len(seeds)} trainings of {args.steps} steps)")
        with tempfile.TemporaryDirectory() as tmp:
            root = args.metrics_dir or tmp
            per_seed = {}
            for seed in seeds:
                directory = os.path.join(root, f"seed{seed}")
                os.makedirs(directory, exist_ok=True)
                per_seed[seed] = measure_convergence(args.steps, directory, seed, variants)
        result["convergence_runs"] = {str(s): rows for s, rows in per_seed.items()}
        conv = summarize_seeds(per_seed)
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
