"""zeropp-max's inter-node bytes against zero3's, the way a GPU cluster sends them.

Every figure is what one node takes in from other nodes per optimizer step
under a two-level algorithm (each remote byte enters a node once), with
full-precision payloads and quantization scales at the widths a bf16 GPU run
puts on the wire (``--dtype bf16``; XLA:CPU compiles bf16 collectives as f32,
and the report counts them at bf16), read from the compiled step of the
example GPT at the CLI defaults (nothing runs):

* ``compressed``: 1-bit Adam's compressed step;
* ``cycle``: the mean over one refresh cycle (``refresh_every - 1``
  compressed steps and one full-precision step), the steady state;
* ``run``: the mean over a ``--steps`` run, the warm-up's full-precision
  steps included.

for the meshes ``2x4``, ``4x2`` and ``8x1`` (8 simulated CPU devices) at
grad-accum 1 and 4. The ``run`` mean is the figure a user's run of
``--steps`` steps sees; a longer run approaches the ``cycle`` mean. Targets
(issue 19, set on the steady state): the cycle mean at least 16x below
zero3 at grad-accum 1 and 64x at grad-accum 4; the run mean is printed
beside each.

A last row scales the ``2x4`` profile to 48 nodes x 8 GPUs, the ZeRO++
paper's cluster, with the cost model
(:meth:`~zeropp_jax.analysis.comm_profile.CommProfile.bytes_at`): a
prediction, not a measurement, and no target, since scaling both presets'
bytes by the same link factors leaves the ``2x4`` ratio unchanged.

Prints a markdown table, PASS/FAIL per target and, on its last line, one
JSON object; exits 0 either way (a measurement). About 3.5 minutes per mesh
on 2 cores (11 for the three).

Usage::

  python benchmarks/compact_wire.py
  python benchmarks/compact_wire.py --preset zeropp --meshes 2x4
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from zeropp_jax.cli.flags import positive_int  # noqa: E402
from zeropp_jax.config import PRESETS  # noqa: E402

MICRO_BATCH = 16  # sequences per micro-batch: 2 per device on 8 devices
ACCUMS = (1, 4)
TARGETS = {1: 16.0, 4: 64.0}  # cycle mean vs zero3, by grad-accum
PAPER_NODES, PAPER_GPUS = 48, 8


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure(preset: str, mesh: str, accum: int, steps: int) -> dict:
    """Compiles ``preset``'s step variants on ``mesh`` and returns its figures."""
    from zeropp_jax.cli import comm, common

    parser = comm.build_parser()
    args = parser.parse_args([
        "--preset", preset, "--mesh", mesh, "--grad-accum", str(accum),
        "--batch-size", str(MICRO_BATCH * accum), "--dtype", "bf16", "--steps", str(steps),
    ])
    common.validate_args(parser, args)
    result, _ = comm.report(args)
    variants = result["variants"]
    compressed = variants.get("compressed", variants.get("step"))["report"]["inter_node_bytes"]
    full = variants.get("full_precision", variants.get("step"))["report"]["inter_node_bytes"]
    return {
        "compressed": compressed,
        "full_precision": full,
        # no refresh cycle (no 1-bit Adam): every step is the compressed one
        "cycle": result["cycle_inter_node_bytes"] if "refresh_every" in result else compressed,
        "run": result["schedule"]["inter_node_bytes"],
        "refresh_every": result.get("refresh_every"),
        "full_precision_steps": result["schedule"]["full_precision_steps"],
    }


def at_paper_scale(preset: str, accum: int) -> dict:
    """Cost-model bytes per node at 48 x 8 (cycle mean for a refresh schedule)."""
    from zeropp_jax.analysis.cluster import V100_CLUSTER, Workload
    from zeropp_jax.analysis.comm_profile import profile_preset

    out = {}
    for name in (preset, "zero3"):
        profile = profile_preset(name, grad_accum=accum, batch_size=MICRO_BATCH * accum)
        workload = Workload(params=profile.params, tokens_per_gpu=1.0, float_bytes=2)
        cluster = V100_CLUSTER.replace(nodes=PAPER_NODES, gpus_per_node=PAPER_GPUS)
        out[name] = profile.bytes_at(cluster, workload)[0]
    return {"cycle": out[preset], "zero3": out["zero3"], "ratio": out["zero3"] / out[preset]}


def _meshes(text: str) -> list[str]:
    """``"2x4,4x2"`` -> the meshes, each checked before anything compiles."""
    from zeropp_jax.mesh import parse_mesh_shape

    out = []
    for mesh in (m for m in text.split(",") if m):
        try:
            nodes, local = parse_mesh_shape(mesh)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
        if nodes < 2 or nodes * local != 8:
            raise argparse.ArgumentTypeError(
                f"mesh {mesh}: give 8 devices over at least 2 nodes (2x4, 4x2, 8x1); zero3 "
                "moves nothing between the nodes of a one-node mesh")
        out.append(mesh)
    if not out:
        raise argparse.ArgumentTypeError("give at least one mesh, e.g. 2x4")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="zeropp-max", choices=[p for p in PRESETS if p != "zero3"])
    parser.add_argument("--meshes", default="2x4,4x2,8x1", type=_meshes,
                        help="NODESxLOCAL list, each of 8 devices and at least 2 nodes")
    parser.add_argument("--steps", type=positive_int, default=400,
                        help="the run the 'run' mean is taken over (warm-up included)")
    args = parser.parse_args(argv)
    from zeropp_jax import provenance

    start = time.perf_counter()
    rows, targets = [], []
    for mesh in args.meshes:
        for accum in ACCUMS:
            _log(f"[{time.perf_counter() - start:6.0f}s] {mesh} accum {accum}: compiling")
            got = measure(args.preset, mesh, accum, args.steps)
            zero3 = measure("zero3", mesh, accum, args.steps)["compressed"]
            row = {"mesh": mesh, "grad_accum": accum, "zero3": zero3, **got,
                   **{f"x_{k}": zero3 / got[k] for k in ("compressed", "cycle", "run")}}
            rows.append(row)
            targets.append({"name": f"cycle vs zero3, {mesh}, grad-accum {accum}",
                            "value": row["x_cycle"], "limit": TARGETS[accum],
                            "pass": row["x_cycle"] >= TARGETS[accum],
                            "run": row["x_run"]})
    _log(f"[{time.perf_counter() - start:6.0f}s] 48x8 from the cost model")
    paper = {accum: at_paper_scale(args.preset, accum) for accum in ACCUMS}

    print(f"# {args.preset}: inter-node bytes per node per step vs zero3 (two-level, bf16)\n")
    print("| mesh | accum | zero3 | compressed | full precision | cycle (refresh every) "
          "| run of {} steps | x zero3: compressed / cycle / run |".format(args.steps))
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['mesh']} | {r['grad_accum']} | {r['zero3']:,} | {r['compressed']:,} | "
              f"{r['full_precision']:,} | {r['cycle']:,.0f} ({r['refresh_every']}) | "
              f"{r['run']:,.0f} | {r['x_compressed']:.1f} / {r['x_cycle']:.1f} / {r['x_run']:.1f} |")
    for accum, p in paper.items():
        print(f"| {PAPER_NODES}x{PAPER_GPUS} (cost model's prediction from the 2x4 profile) | {accum} | "
              f"{p['zero3']:,.0f} | | | {p['cycle']:,.0f} | | - / {p['ratio']:.1f} / - |")
    print()
    for t in targets:
        print(f"{'PASS' if t['pass'] else 'FAIL'}: {t['name']}: {t['value']:.1f}x "
              f"(at least {t['limit']:.0f}x); over the {args.steps}-step run, warm-up "
              f"included: {t['run']:.1f}x")
    print(json.dumps({"preset": args.preset, "steps": args.steps, "rows": rows,
                      "paper_scale": {str(k): v for k, v in paper.items()},
                      "targets": targets, "provenance": provenance.record(),
                      "seconds": round(time.perf_counter() - start, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
