"""``zeropp-comm``: what one train step moves, read from the compiled program.

Compiles the step for the same model, mesh and config flags as
``zeropp-train`` (nothing runs, no data is read beyond its vocabulary) and
prints, per collective kind, dtype and mesh axis, the bytes each node takes
in over its inter-node link and each device over intra-node links, counting
loop trip counts, plus per-device memory from the compiler.

The inter-node headline and the intra-node figure are two-level (each remote
byte enters a node once and is forwarded inside it, as NCCL's hierarchical
algorithms and DeepSpeed's ZeRO-3 send it); the flat sums over devices (what
an all-device algorithm such as gloo's sends) are columns beside them.
Full-precision payloads are counted at the run's compute and reduce dtypes
(XLA:CPU compiles bf16 collectives as f32).

When qgZ is active the schedule switches between two compiled variants
(compressed, and full precision during warm-up, refreshes or below the
gradient gate); both are reported, and their mean over ``--steps`` steps of
the schedule.
"""

from __future__ import annotations

import argparse
import json
import sys

from zeropp_jax.cli import common, data_flags, flags
from zeropp_jax.files import output_problem

PROG = "zeropp-comm"  # the name in --help and in error lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Compile the ZeRO train step without running it and report "
        "its communication (inter-node / intra-node bytes per step) and memory. Reports "
        "the zero3 preset unless --preset says otherwise.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--dump-hlo", default=None, metavar="FILE",
                        help="write the compiled HLO text here (the compressed step's, when "
                             "there are two variants)")
    parser.add_argument(
        "--steps", type=common.positive_int, default=300,
        help="steps of the run whose qgZ schedule (warm-up, refreshes) the mean is taken over",
    )
    common.add_common_args(parser)
    flags.hide_training_flags(parser)  # refused by _check_flags
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = common.parse_and_prepare(parser, argv, check=_check_flags)
    try:
        result, hlo = report(args)
    except (ValueError, FileNotFoundError) as e:
        common.fail(PROG, str(e))
    import jax

    if jax.process_index() != 0:
        return 0  # every process compiled the same program; one reports it
    if args.dump_hlo:
        with open(args.dump_hlo, "w") as f:
            f.write(hlo)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_result(result))
    return 0


def _check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Training flags are refused; ``--dump-hlo``'s path is checked before the
    compile, not after it."""
    flags.refuse_training_flags(parser, args)
    if args.dump_hlo is not None:
        problem = output_problem("--dump-hlo", args.dump_hlo, {"--data": args.data})
        if problem:
            parser.error(problem)


def report(args: argparse.Namespace) -> tuple[dict, str]:
    """Compiles the step variants and returns ``(json_dict, main_hlo_text)``."""
    import jax

    from zeropp_jax.analysis import headline
    from zeropp_jax.analysis.comm_report import comm_report
    from zeropp_jax.models import gpt

    mesh = common.build_mesh(args)
    model_cfg = common.build_model(args, data_flags.data_vocab(args))
    shapes = jax.eval_shape(lambda k: gpt.init_params(model_cfg, k), jax.random.key(args.seed))
    trainer = common.build_trainer(args, mesh, model_cfg, shapes)
    batch = jax.ShapeDtypeStruct((args.batch_size, args.seq_len + 1), jax.numpy.int32)
    variants = {"compressed": True, "full_precision": False} if trainer.qgz_active else {"step": False}
    out = {
        "trainer": trainer.describe(),
        "model": {
            "params": trainer.layout.numel,
            "param_bytes_fp32": 4 * trainer.layout.numel,
            "tokens_per_step": args.batch_size * args.seq_len,
        },
        "variants": {},
    }
    main_hlo = ""
    for name, compress in variants.items():
        compiled = trainer.compile_from_shapes(shapes, batch, compress=compress)
        hlo = compiled.as_text()
        main_hlo = main_hlo or hlo
        rep = comm_report(compiled, mesh_shape=(trainer.nodes, trainer.local),
                          **headline.report_dtypes(trainer))
        out["variants"][name] = {"report": rep.to_json(), "table": rep.format_table()}
    first = next(iter(out["variants"].values()))["report"]
    for key in ("inter_node_bytes", "flat_inter_node_bytes", "intra_node_bytes",
                "flat_intra_node_bytes", "float_dtypes"):
        out[key] = first[key]
    out["memory"] = first.get("memory")
    refresh = trainer.config.qgz_refresh_every
    if trainer.qgz_active and refresh:
        # 1-bit Adam's refresh: one full-precision step in every `refresh`
        # after the warm-up; the mean over that cycle is the steady state.
        full = out["variants"]["full_precision"]["report"]
        out["refresh_every"] = refresh
        for key in ("inter_node_bytes", "intra_node_bytes"):
            out[f"cycle_{key}"] = headline.schedule_mean(first[key], full[key], 1, refresh)
    full_steps = headline.full_precision_steps(trainer.schedule, args.steps)
    out["schedule"] = {"steps": args.steps, "full_precision_steps": full_steps}
    for key in ("inter_node_bytes", "flat_inter_node_bytes", "intra_node_bytes",
                "flat_intra_node_bytes"):
        full = out["variants"].get("full_precision", {"report": first})["report"][key]
        out["schedule"][key] = headline.schedule_mean(first[key], full, full_steps, args.steps)
    # the headline under zeropp-train's summary's name for it
    out["schedule_inter_node_bytes"] = out["schedule"]["inter_node_bytes"]
    return out, main_hlo


def format_result(result: dict) -> str:
    t = result["trainer"]
    lines = [
        f"zeropp-comm: preset={t['config']['preset']} mesh={t['mesh']['node']}x{t['mesh']['local']} "
        f"params={t['params']:,} compute={t['compute_dtype']} grad_accum={t['config']['grad_accum']}",
        "state per device: " + ", ".join(
            f"{k} {v / 2**20:.2f} MiB" for k, v in t["memory_per_device"].items()
        ),
    ]
    mib = lambda b: f"{b / 2**20:.3f} MiB"  # noqa: E731
    sched = result["schedule"]
    lines.append(
        f"inter-node per node per "
        f"{'compressed step' if sched['full_precision_steps'] else 'step'}: "
        f"{mib(result['inter_node_bytes'])} two-level"
        f"{'' if sched['full_precision_steps'] else ' (headline)'}, "
        f"{mib(result['flat_inter_node_bytes'])} flat (every device's transfer counted)")
    if result["float_dtypes"]:
        lines.append("full-precision payloads counted at the run's dtypes: gathers {}, "
                     "reductions {}".format(*result["float_dtypes"]))
    if sched["full_precision_steps"]:
        lines.append(
            f"mean over {sched['steps']} steps ({sched['full_precision_steps']} at full "
            f"precision: warm-up and refreshes; a gradient gate is not counted): inter-node "
            f"{mib(sched['inter_node_bytes'])}/node two-level (headline), "
            f"{mib(sched['flat_inter_node_bytes'])} flat")
    if "refresh_every" in result:
        lines.append(
            f"mean over one refresh cycle ({result['refresh_every'] - 1} compressed steps + 1 "
            f"full-precision): inter-node {result['cycle_inter_node_bytes'] / 2**20:.3f} MiB/node "
            f"two-level, "
            f"intra-node {result['cycle_intra_node_bytes'] / 2**20:.3f} MiB/device"
        )
    for name, variant in result["variants"].items():
        lines.append("")
        lines.append(f"[{name}] per optimizer step")
        lines.append(variant["table"])
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
