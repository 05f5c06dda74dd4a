"""Flags and set-up shared by ``zeropp-train`` and ``zeropp-comm``.

JAX is imported only after :func:`prepare_devices`: on a host without
accelerators the simulated CPU device count has to be fixed before JAX
starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from zeropp_jax.config import PRESETS, QGZ_CODES, QGZ_MODES, QGZ_TARGETS

# Global-norm clipping of the CLI's optimizer.
CLIP_NORM = 1.0

DEFAULT_SIMULATED_MESH = "2x4"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Model, data, mesh and ZeRO++ flags (same for train and comm)."""
    g = parser.add_argument_group("mesh and data")
    g.add_argument(
        "--mesh",
        default=None,
        help="NODESxLOCAL, e.g. 2x4 (default: the real topology; 2x4 simulated "
        "on a CPU-only host)",
    )
    g.add_argument(
        "--data",
        default=None,
        help="text file or .npy of token ids (default: the Python standard "
        "library's source, byte tokens)",
    )
    g.add_argument("--batch-size", type=positive_int, default=16, help="global batch (sequences per optimizer step)")
    g.add_argument("--seq-len", type=positive_int, default=128)
    g.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--seed", type=int, default=0)

    g = parser.add_argument_group("multi-host (jax.distributed)")
    g.add_argument(
        "--coordinator", default=None, metavar="HOST:PORT",
        help="coordinator address of a multi-process run (default: from the "
        "environment: SLURM, Open MPI, or zeropp-launch)",
    )
    g.add_argument("--num-processes", type=positive_int, default=None)
    g.add_argument("--process-id", type=int, default=None)

    g = parser.add_argument_group("model (GPT decoder, byte-level)")
    g.add_argument("--layers", type=positive_int, default=4)
    g.add_argument("--d-model", type=positive_int, default=128)
    g.add_argument("--heads", type=positive_int, default=4)
    g.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate")
    g.add_argument(
        "--lr-schedule", default="cosine", choices=("cosine", "constant"),
        help="cosine: linear warm-up then cosine decay to lr/10 over --steps",
    )
    g.add_argument(
        "--lr-warmup", type=non_negative_int, default=None,
        help="learning-rate warm-up steps (default: 10%% of --steps)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        help="compute dtype of gathered parameters: auto (bf16 on GPU, fp32 on "
        "CPU), bf16, fp32, fp16",
    )

    g = parser.add_argument_group("ZeRO++ (a preset, then overrides)")
    g.add_argument("--preset", default="zero3", help=f"one of {', '.join(PRESETS)}")
    g.add_argument("--qwz-bits", type=int, default=None, choices=(0, 8, 4))
    g.add_argument("--qwz-block", type=positive_int, default=None)
    g.add_argument("--hpz", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--qgz", default=None, choices=QGZ_MODES)
    g.add_argument(
        "--qgz-error-feedback", action=argparse.BooleanOptionalAction, default=None
    )
    g.add_argument(
        "--qgz-code", default=None, choices=QGZ_CODES,
        help="1-bit code: sign (scaled sign, for error feedback) or dither "
        "(unbiased; needs --no-qgz-error-feedback and --qgz-target gradient)",
    )
    g.add_argument(
        "--qgz-target", default=None, choices=QGZ_TARGETS,
        help="what qgZ compresses across nodes: the gradient (error feedback on the "
        "gradient) or Adam's momentum (1-bit Adam: error feedback on the momentum, "
        "Adam's second moment frozen after --qgz-warmup); default: the preset's "
        "(momentum for qgz and zeropp)",
    )
    g.add_argument(
        "--qgz-refresh-every", type=non_negative_int, default=None,
        help="with --qgz-target momentum: every N-th step after the warm-up runs at full "
        "precision and refreshes Adam's second moment (0: never)",
    )
    g.add_argument("--qgz-block", type=positive_int, default=None)
    g.add_argument(
        "--qgz-warmup", type=non_negative_int, default=None,
        help="optimizer steps at full precision before qgZ compresses",
    )
    g.add_argument(
        "--qgz-min-grad-rms", type=non_negative_float, default=None,
        help="compress only while the gradient RMS is at least this (0: always)",
    )
    g.add_argument(
        "--scale-dtype", default=None, choices=("float32", "bfloat16"),
        help="dtype of the per-block quantization scales on the wire (qwZ and qgZ)",
    )
    g.add_argument(
        "--implementation", default=None, choices=("auto", "xla", "pallas"),
        help="quantization kernels",
    )


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks that need no JAX (fail before any device or compile work)."""
    if args.preset not in PRESETS:
        parser.error(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    if args.mesh is not None:
        from zeropp_jax.mesh import parse_mesh_shape

        try:
            parse_mesh_shape(args.mesh)
        except ValueError as e:
            parser.error(str(e))
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if args.dtype not in ("auto", "bf16", "bfloat16", "fp32", "float32", "fp16", "float16"):
        parser.error(f"--dtype must be auto, bf16, fp32 or fp16, got {args.dtype!r}")
    if args.data is not None:
        if not os.path.exists(args.data):
            parser.error(f"--data {args.data}: no such file")
        if os.path.isfile(args.data) and os.path.getsize(args.data) == 0:
            parser.error(f"--data {args.data}: the file is empty")


def prepare_devices(args: argparse.Namespace) -> None:
    """Asks XLA for enough simulated host devices before JAX is imported.

    Only the host (CPU) platform is affected; on a GPU machine JAX still uses
    the GPUs. Must run before JAX creates its backends (the first device
    query), which importing ``jax`` does not do.
    """
    from zeropp_jax.mesh import parse_mesh_shape  # no JAX import

    from zeropp_jax import distributed

    nodes, local = parse_mesh_shape(args.mesh or DEFAULT_SIMULATED_MESH)
    processes = args.num_processes or int(os.environ.get(distributed.ENV_NUM_PROCESSES) or 1)
    count = local if processes > 1 else nodes * local  # one node per process
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={count}".strip()
        )


def parse_and_prepare(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parses and validates the flags, then sets up devices and processes.

    Everything that can be checked without JAX fails here, before any device
    or compilation work.
    """
    args = parser.parse_args(argv)
    validate_args(parser, args)
    prepare_devices(args)
    init_distributed(args)
    return args


def init_distributed(args: argparse.Namespace) -> None:
    """Joins a multi-process run if the flags or the environment describe one."""
    from zeropp_jax import distributed

    distributed.initialize(
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )


def build_mesh(args: argparse.Namespace):
    import jax

    from zeropp_jax.mesh import default_mesh_shape, make_mesh, parse_mesh_shape

    if args.mesh is not None:
        nodes, local = parse_mesh_shape(args.mesh)
    elif jax.default_backend() == "cpu" and jax.process_count() == 1:
        nodes, local = parse_mesh_shape(DEFAULT_SIMULATED_MESH)
    else:
        nodes, local = default_mesh_shape()
    return make_mesh(nodes, local)


def build_config(args: argparse.Namespace):
    from zeropp_jax.config import ZeroConfig

    return ZeroConfig.from_preset(
        args.preset,
        compute_dtype=None if args.dtype == "auto" else args.dtype,
        qwz_bits=args.qwz_bits,
        qwz_block=args.qwz_block,
        hpz=args.hpz,
        qgz=args.qgz,
        qgz_error_feedback=args.qgz_error_feedback,
        qgz_code=args.qgz_code,
        qgz_target=args.qgz_target,
        qgz_seed=args.seed,
        qgz_block=args.qgz_block,
        qgz_warmup_steps=args.qgz_warmup,
        qgz_min_grad_rms=args.qgz_min_grad_rms,
        qgz_refresh_every=args.qgz_refresh_every,
        grad_accum=args.grad_accum,
        scale_dtype=args.scale_dtype,
        implementation=args.implementation,
    )


def build_model(args: argparse.Namespace, vocab_size: int):
    from zeropp_jax.models import gpt

    return gpt.GPTConfig(
        vocab_size=vocab_size,
        seq_len=args.seq_len,
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
    )


def build_trainer(args: argparse.Namespace, mesh, model_cfg, params_or_shapes) -> Any:
    """The GPT trainer: per-layer gathering over the stacked blocks."""
    import functools

    import zeropp_jax as zp
    from zeropp_jax.models import gpt
    from zeropp_jax.step.trainer import global_batch_size_check

    config = build_config(args)
    global_batch_size_check(args.batch_size, mesh.size, config.grad_accum)
    loss = functools.partial(gpt.loss_fn, cfg=model_cfg, gather=zp.gather, layer=zp.layer)
    optimizer = make_optimizer(
        args.lr,
        schedule=args.lr_schedule,
        total_steps=getattr(args, "steps", None),
        warmup=args.lr_warmup,
        qgz_target=config.qgz_target,
    )
    return zp.make_trainer(
        loss, optimizer, params_or_shapes, mesh=mesh, config=config,
        per_layer=True, stacked=("blocks",),
    )


def make_optimizer(
    lr: float,
    *,
    schedule: str = "constant",
    total_steps: int | None = None,
    warmup: int | None = None,
    qgz_target: str = "gradient",
):
    """The default optimizer: global-norm clipping at 1, then Adam.

    With ``qgz_target="momentum"`` the same Adam and clipping as 1-bit Adam
    (:func:`zeropp_jax.onebit_adam`, which the trainer runs itself).

    Args:
      lr: peak learning rate.
      schedule: ``"constant"``, or ``"cosine"``: linear warm-up over
        ``warmup`` steps (default 10% of ``total_steps``), then cosine decay
        to ``lr / 10`` at ``total_steps``. Without ``total_steps`` (e.g. for
        the communication report) the schedule does not matter and a
        constant rate is used.
    """
    import optax

    if schedule == "cosine" and total_steps:
        if warmup is None:
            warmup = total_steps // 10
        warmup = min(warmup, total_steps - 1)
        lr = optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup_steps=warmup, decay_steps=total_steps, end_value=lr / 10
        )
    elif schedule not in ("cosine", "constant"):
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; use cosine or constant")
    if qgz_target == "momentum":
        from zeropp_jax.step.onebit_adam import onebit_adam

        return onebit_adam(lr, clip_norm=CLIP_NORM)
    return optax.chain(optax.clip_by_global_norm(CLIP_NORM), optax.adam(lr))


def fail(message: str) -> "None":
    """Prints ``error: message`` and exits with status 2.

    On a multi-process run the process exits at once, so that peers blocked
    in a collective with it fail fast instead of waiting at the exit barrier.
    """
    from zeropp_jax import distributed

    print(f"error: {message}", file=sys.stderr)
    distributed.exit_now(2)
