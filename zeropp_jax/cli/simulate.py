"""``zeropp-simulate``: predicted time per step and throughput on a cluster.

Compiles the example GPT's train step for a preset (and for ``zero3``, the
baseline) on the simulated mesh, exactly as ``zeropp-comm`` does, and scales
each collective's bytes to the target model size and cluster with
:mod:`zeropp_jax.analysis.cost_model`. Nothing trains.

Examples::

  zeropp-simulate --preset zeropp --params 18B --inter-node-gbps 100
  zeropp-simulate --preset zeropp --qgz int4 --sweep-gbps 50,100,200,400,800
  zeropp-simulate --published          # vs the ZeRO++ paper's measurements
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from zeropp_jax.cli import common, data_flags, flags

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}

PROG = "zeropp-simulate"  # the name in --help and in error lines

# The preset simulated unless --preset says otherwise: the predictions compare
# it with zero3, the baseline, which as the target would only repeat its row.
DEFAULT_PRESET = "zeropp"


# The smallest --params taken: below it a number was meant with a suffix
# (--params 18 for 18B), and no cluster trains such a model data-parallel.
MIN_PARAMS = 1e6


def model_size(text: str) -> float:
    """``18B``, ``1.3b``, ``350M``, ``2e9`` -> parameters (at least ``MIN_PARAMS``)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([kmbgt]?)\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a model size such as 18B, 350M or 1.3e9, got {text!r}")
    params = float(m.group(1)) * _SUFFIX[m.group(2)]
    if params < MIN_PARAMS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is {params:g} parameters, fewer than {MIN_PARAMS:g}: give the size "
            f"with its unit, e.g. {text.strip()}B or {text.strip()}M")
    return params


def gbps_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected positive bandwidths in Gb/s separated by commas, e.g. 100,400, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    from zeropp_jax.analysis.cluster import V100_CLUSTER

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Predict time per step and throughput of a ZeRO++ preset on a GPU "
        "cluster from the compiled step's communication (see zeropp_jax.analysis.cost_model), "
        f"beside zero3's. Simulates the {DEFAULT_PRESET} preset unless --preset says otherwise.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--published", action="store_true",
        help="compare with the ZeRO++ paper's measured speed-ups (zero3 vs zeropp with "
        "int4 qgZ, as DeepSpeed runs it, on its 48x8 V100 testbed); the preset, "
        "cluster and workload flags are refused with it",
    )
    parser.add_argument(
        "--sweep-gbps", type=gbps_list, default=None, metavar="LIST",
        help="also predict at each inter-node bandwidth (Gb/s per node), e.g. 50,100,400",
    )
    parser.add_argument(
        "--steps", type=common.positive_int, default=None,
        help="predict the mean step of a run this long, qgZ's full-precision warm-up steps "
        "included (default: the steady state after the warm-up: the compressed step, or "
        "1-bit Adam's refresh cycle)",
    )
    g = parser.add_argument_group("cluster (default: the ZeRO++ paper's 48 x 8 V100)")
    g.add_argument("--nodes", type=common.positive_int, default=V100_CLUSTER.nodes,
                   help="(default: %(default)s)")
    g.add_argument("--gpus-per-node", type=common.positive_int, default=V100_CLUSTER.gpus_per_node,
                   help="(default: %(default)s)")
    g.add_argument("--inter-node-gbps", type=common.positive_float,
                   default=V100_CLUSTER.inter_node_gbits_per_s,
                   help="inter-node bandwidth per node, Gb/s (all NICs together) (default: %(default)s)")
    g.add_argument("--intra-node-gbs", type=common.positive_float,
                   default=V100_CLUSTER.intra_node_gbytes_per_s,
                   help="intra-node (NVLink) bandwidth per GPU, GB/s (default: %(default)s)")
    g.add_argument("--peak-tflops", type=common.positive_float, default=V100_CLUSTER.peak_tflops,
                   help="dense 16-bit peak per GPU, TFLOP/s (default: %(default)s)")
    g.add_argument("--efficiency", type=common.positive_float, default=V100_CLUSTER.efficiency,
                   help="fraction of peak the model's math reaches, in (0, 1] (default: %(default)s)")
    g = parser.add_argument_group("workload")
    g.add_argument("--params", type=model_size, default=18e9, help="model size, e.g. 18B (default: 18B)")
    g.add_argument("--tokens-per-gpu", type=common.positive_int, default=1024,
                   help="tokens per GPU per optimizer step (default: %(default)s)")
    g.add_argument("--float-bytes", type=int, choices=(2, 4), default=2,
                   help="bytes per full-precision value on the wire (2: bf16)")
    common.add_common_args(parser)
    parser.set_defaults(preset=DEFAULT_PRESET)
    for action in parser._actions:
        if action.dest == "dtype":
            action.help = f"the profiled step's compute dtype; {DTYPE_NOTE}"
    flags.hide_training_flags(parser)  # refused by check_flags
    return parser


# The target cluster and workload (a run's length too): --published compares
# fixed ones, the steady states the paper measured.
_TARGET_FLAGS = (
    "sweep_gbps", "nodes", "gpus_per_node", "inter_node_gbps", "intra_node_gbs",
    "peak_tflops", "efficiency", "params", "tokens_per_gpu", "float_bytes", "steps",
)
# What --dtype does not do here (comm_profile rescales float payloads).
DTYPE_NOTE = ("no prediction depends on it: full-precision payloads are counted at "
              "--float-bytes per value")
# ZeroConfig flags that every profiled config takes, the baselines' too (preset_config).
_SHARED_CONFIG_FLAGS = ("dtype", "grad_accum")


def _not_with_published() -> tuple[str, ...]:
    """Flags that --published does not use (it compares fixed settings): the
    target's, and every ZeroConfig flag but the shared ones."""
    config = tuple(dest for _, _, dest in common._config_flags()
                   if dest not in _SHARED_CONFIG_FLAGS)
    return _TARGET_FLAGS + config


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors for flags zeropp-simulate would not use (before any other check)."""
    flags.refuse_training_flags(parser, args)
    if args.published:
        given = flags.given_flags(parser, args, _not_with_published())
        if given:
            parser.error(
                f"--published compares the paper's fixed settings (zero3 vs "
                f"{_published_zeropp()} on 48x8 V100); drop {', '.join(given)}, or leave out "
                f"--published to simulate them")
    if args.efficiency > 1:
        parser.error(f"--efficiency must be in (0, 1], got {args.efficiency}")


def dtype_warnings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """A line when ``--dtype`` is given: it changes no figure of zeropp-simulate."""
    if args.dtype == parser.get_default("dtype"):
        return []
    return [f"{DTYPE_NOTE} (--dtype {args.dtype} only sets what the profiled step compiles at)"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = common.parse_and_prepare(parser, argv, check=check_flags)
    common.warn(PROG, dtype_warnings(parser, args))
    try:
        result = simulate(args)
    except ValueError as e:
        common.fail(PROG, str(e))
    import jax

    if jax.process_index() != 0:
        return 0
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


def simulate(args: argparse.Namespace) -> dict:
    """Profiles the steps and returns every prediction as plain data."""
    from zeropp_jax.analysis import cost_model as cm
    from zeropp_jax.step.trainer import global_batch_size_check

    # Everything that can be wrong in the flags fails before compiling.
    cluster = cm.Cluster(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        intra_node_gbytes_per_s=args.intra_node_gbs,
        inter_node_gbits_per_s=args.inter_node_gbps,
        peak_tflops=args.peak_tflops, efficiency=args.efficiency,
    )
    work = cm.Workload(params=args.params, tokens_per_gpu=args.tokens_per_gpu,
                       float_bytes=args.float_bytes)
    target_config = common.build_config(args)
    mesh = common.build_mesh(args)
    global_batch_size_check(args.batch_size, mesh.size, args.grad_accum)
    model = common.build_model(args, data_flags.data_vocab(args))  # --data's vocabulary
    step = {"mesh": mesh, "model": model, "batch_size": args.batch_size}

    def profile(config, label: str, steps: int | None = None):
        return cm.profile_config(config, label=label, steps=steps, **step)

    baseline = profile(preset_config(args, "zero3"), "zero3")
    out: dict = {"profile_mesh": list(baseline.mesh_shape), "profile_params": baseline.params}
    if args.published:
        # ZeRO++ as published: int4 gradients (not 1-bit Adam's momentum)
        zeropp = profile(preset_config(args, "zeropp", **cm.PUBLISHED_ZEROPP),
                         _published_zeropp())
        rows = cm.compare_published(baseline, zeropp)
        out["published"] = rows
        out["tolerance"] = cm.PUBLISHED_TOLERANCE
        out["cluster"] = _asdict(cm.V100_CLUSTER)
        return out

    # --preset zero3 as it is: the target is the baseline, shown once
    same = _same_step(target_config, preset_config(args, "zero3"))
    target = baseline if same else profile(target_config, _label(args), args.steps)
    out["averaged_over"] = _averaged_over(target_config, mesh.devices.shape[0], args.steps)
    out["cluster"] = _asdict(cluster)
    out["workload"] = _asdict(work)
    profiles = (baseline,) if same else (baseline, target)
    out["predictions"] = [_asdict(cm.predict(p, cluster, work)) for p in profiles]
    if args.sweep_gbps:
        sweep = []
        for gbps in args.sweep_gbps:
            c = cluster.replace(inter_node_gbits_per_s=gbps)
            a, b = cm.predict(target, c, work), cm.predict(baseline, c, work)
            sweep.append({
                "inter_node_gbps": gbps,
                "zero3_tokens_per_s": b.tokens_per_s_serial,
                "tokens_per_s": a.tokens_per_s_serial,
                "speedup_serial": b.step_s_serial / a.step_s_serial,
                "speedup_overlap": b.step_s_overlap / a.step_s_overlap,
            })
        out["sweep"] = sweep
    return out


def _same_step(a, b) -> bool:
    """Whether two configs compile the same step: equal but for the qgZ seed,
    which changes no byte, and fields ``a`` does not use (a block of a feature
    that is off: ``--preset zero3 --qwz-block 512`` is zero3's step)."""
    import dataclasses

    from zeropp_jax.config_checks import idle_fields

    unused = {name: getattr(b, name) for name in idle_fields(a)}
    return dataclasses.replace(a, qgz_seed=b.qgz_seed, **unused) == b


def _averaged_over(config, nodes: int, steps: int | None) -> str:
    """What the target's figures average (the profile's mesh has ``nodes``
    nodes): the run's steps, or the steady state."""
    from zeropp_jax.analysis.headline import full_precision_steps
    from zeropp_jax.step.schedule import QgzSchedule

    schedule = QgzSchedule.from_config(config, nodes)
    if not schedule.active:
        return "every step (no qgZ schedule)"
    if steps is not None:
        full = full_precision_steps(schedule, steps)
        return f"a {steps}-step run: {full} full-precision steps (warm-up and refreshes) included"
    refresh = (f"one refresh cycle ({config.qgz_refresh_every - 1} compressed steps + 1 "
               "full-precision)" if config.qgz_refresh_every else "the compressed step")
    return (f"the steady state: {refresh}; the {config.qgz_warmup_steps} full-precision "
            "warm-up steps left out (--steps N includes them)")


def preset_config(args: argparse.Namespace, preset: str, **overrides):
    """A reference preset's config: the command line's ZeRO++ flags apply only to
    the preset under study, never to the baselines; dtype and accumulation do."""
    from zeropp_jax.config import ZeroConfig

    return ZeroConfig.from_preset(
        preset, compute_dtype=None if args.dtype == "auto" else args.dtype,
        grad_accum=args.grad_accum, **overrides,
    )


def _label(args: argparse.Namespace) -> str:
    given = [f"--qgz {args.qgz}" if args.qgz else "",
             f"--qwz-bits {args.qwz_bits}" if args.qwz_bits is not None else "",
             {True: "--hpz", False: "--no-hpz", None: ""}[args.hpz],
             f"--qgz-code {args.qgz_code}" if args.qgz_code else "",
             f"--qgz-target {args.qgz_target}" if args.qgz_target else "",
             f"--scale-dtype {args.scale_dtype}" if args.scale_dtype else ""]
    return " ".join([args.preset] + [f for f in given if f])


def _asdict(x) -> dict:
    import dataclasses

    return dataclasses.asdict(x)


def _published_zeropp() -> str:
    """The paper's ZeRO++ as zeropp-train flags (``cost_model.PUBLISHED_ZEROPP``)."""
    from zeropp_jax.analysis import cost_model as cm

    return " ".join(["zeropp", *common.config_args(cm.PUBLISHED_ZEROPP)])


def format_result(result: dict) -> str:
    mesh = "x".join(map(str, result["profile_mesh"]))
    head = (f"profiles: the example GPT's compiled step ({result['profile_params']:,} params "
            f"with the shards' padding, "
            f"mesh {mesh}), bytes scaled to the target")
    if "published" in result:
        c = result["cluster"]
        lines = [
            head,
            f"cluster: {c['nodes']} nodes x {c['gpus_per_node']} V100, NVLink "
            f"{c['intra_node_gbytes_per_s']:g} GB/s/GPU, peak {c['peak_tflops']:g} TFLOP/s x "
            f"{c['efficiency']:g}; ZeRO++ = {_published_zeropp()} (DeepSpeed's qgZ is int4)",
            "",
            f"{'setting':<36} {'model':>6} {'published':>10} {'predicted':>10} "
            f"{'error':>7} {'overlap':>8}  within ±{result['tolerance']:.0%}",
        ]
        for r in result["published"]:
            pub = (f"{r['published']:.2f}" if r["low"] == r["high"]
                   else f"{r['low']:.2f}-{r['high']:.2f}")
            ok = "yes" if abs(r["serial_error"]) <= result["tolerance"] else "NO"
            lines.append(
                f"{r['point']:<36} {r['params'] / 1e9:>5.0f}B {pub:>10} {r['serial']:>9.2f}x "
                f"{r['serial_error']:>+7.1%} {r['overlap']:>7.2f}x  {ok}")
        lines.append("")
        lines.append("predicted = ZeRO-3 step time / ZeRO++ step time without compute/"
                     "communication overlap; 'overlap' assumes perfect overlap.")
        return "\n".join(lines)

    c, w = result["cluster"], result["workload"]
    lines = [
        head,
        f"cluster: {c['nodes']} nodes x {c['gpus_per_node']} GPUs, inter-node "
        f"{c['inter_node_gbits_per_s']:g} Gb/s/node, intra-node {c['intra_node_gbytes_per_s']:g} "
        f"GB/s/GPU, peak {c['peak_tflops']:g} TFLOP/s x {c['efficiency']:g}",
        f"workload: {w['params'] / 1e9:g}B params, {w['tokens_per_gpu']:g} tokens/GPU/step, "
        f"{w['float_bytes']}-byte float payloads",
        "",
        f"{'preset':<22} {'inter GB/node':>13} {'intra GB/GPU':>12} {'compute s':>9} "
        f"{'inter s':>8} {'intra s':>8} {'step s':>8} {'overlap s':>9} {'TFLOP/s/GPU':>11} "
        f"{'vs zero3':>8}",
    ]
    base = result["predictions"][0]
    for p in result["predictions"]:
        lines.append(
            f"{p['label']:<22} {p['inter_node_bytes'] / 1e9:>13.1f} "
            f"{p['intra_node_bytes'] / 1e9:>12.1f} {p['compute_s']:>9.2f} "
            f"{p['inter_node_s']:>8.2f} {p['intra_node_s']:>8.2f} {p['step_s_serial']:>8.2f} "
            f"{p['step_s_overlap']:>9.2f} {p['tflops_per_gpu_serial']:>11.1f} "
            f"{base['step_s_serial'] / p['step_s_serial']:>7.2f}x")
    if "sweep" in result:
        lines += ["", f"{'inter-node Gb/s':>15} {'zero3 tok/s':>12} {'tok/s':>12} "
                  f"{'speed-up':>9} {'overlap':>8}"]
        for s in result["sweep"]:
            lines.append(
                f"{s['inter_node_gbps']:>15g} {s['zero3_tokens_per_s']:>12,.0f} "
                f"{s['tokens_per_s']:>12,.0f} {s['speedup_serial']:>8.2f}x "
                f"{s['speedup_overlap']:>7.2f}x")
    lines.append("")
    lines.append("step s: no compute/communication overlap; overlap s: perfect overlap.")
    lines.append(f"{result['predictions'][-1]['label']} is averaged over {result['averaged_over']}.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
