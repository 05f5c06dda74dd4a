"""Flags and set-up shared by ``zeropp-train`` and ``zeropp-comm``.

JAX is imported only after :func:`prepare_devices`: on a host without
accelerators the simulated CPU device count has to be fixed before JAX
starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from typing import Any, Callable

# argparse value types, re-exported for the commands (common.positive_int, ...)
from zeropp_jax.cli.flags import (  # noqa: F401
    non_negative_float, non_negative_int, positive_float, positive_int, seed_int,
)
from zeropp_jax.config import ZeroConfig
from zeropp_jax.config_checks import idle_fields
from zeropp_jax.step.geometry import IdleOnMeshWarning

# Global-norm clipping of the CLI's optimizer.
CLIP_NORM = 1.0

DEFAULT_SIMULATED_MESH = "2x4"


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
    g.add_argument("--batch-size", type=positive_int, default=16,
                   help="global batch: sequences per optimizer step (default: %(default)s)")
    g.add_argument("--seq-len", type=positive_int, default=128,
                   help="tokens per sequence (default: %(default)s)")
    g.add_argument("--seed", type=seed_int, default=0,
                   help="initialization and data order (default: %(default)s)")

    g = parser.add_argument_group("multi-host (jax.distributed)")
    g.add_argument(
        "--coordinator", default=None, metavar="HOST:PORT",
        help="coordinator address of a multi-process run (default: from the "
        "environment: SLURM, Open MPI, or zeropp-launch)",
    )
    g.add_argument("--num-processes", type=positive_int, default=None)
    g.add_argument("--process-id", type=int, default=None)

    g = parser.add_argument_group("model (GPT decoder, byte-level)")
    g.add_argument("--layers", type=positive_int, default=4, help="(default: %(default)s)")
    g.add_argument("--d-model", type=positive_int, default=128, help="(default: %(default)s)")
    g.add_argument("--heads", type=positive_int, default=4, help="(default: %(default)s)")
    g.add_argument("--vocab-size", type=positive_int, default=None,
                   help="embedding rows (default: the largest id of --data + 1; 256 for "
                   "text and the bundled data); give the tokenizer's to resume or fine-tune "
                   "on another shard")
    g.add_argument("--lr", type=positive_float, default=3e-3,
                   help="peak learning rate (default: %(default)s)")
    g.add_argument(
        "--lr-schedule", default="cosine", choices=("cosine", "constant"),
        help="cosine: linear warm-up then cosine decay to lr/10 over --steps; "
        "constant: linear warm-up (only with --lr-warmup) then --lr",
    )
    g.add_argument(
        "--lr-warmup", type=non_negative_int, default=None,
        help="linear learning-rate warm-up steps, with either schedule (default: "
        "10%% of --steps with cosine, none with constant)",
    )

    add_config_args(parser.add_argument_group(
        "ZeRO++ (a preset, then overrides)",
        "Each flag sets one field of zeropp_jax.ZeroConfig; a flag left out keeps the "
        "preset's value.",
    ))


# How a ZeroConfig field's ``parse`` and ``at_least`` read a flag's text.
_PARSERS = {
    (str, None): None,
    (int, None): int,
    (int, 0): non_negative_int,
    (int, 1): positive_int,
    (float, 0): non_negative_float,
}


def _config_flags() -> list[tuple[dataclasses.Field, str, str]]:
    """``(field, flag, dest)`` of every ZeroConfig field that has a flag, in field order."""
    out = []
    for f in dataclasses.fields(ZeroConfig):
        flag = f.metadata["flag"]
        if flag is None:
            continue
        flag = flag or "--" + f.name.replace("_", "-")
        out.append((f, flag, flag[2:].replace("-", "_")))
    return out


def config_args(fields: dict[str, Any]) -> list[str]:
    """The zeropp-train flags that set ZeroConfig ``fields`` (name -> value,
    not a bool), e.g. ``{"qgz": "int4"}`` -> ``["--qgz", "int4"]``."""
    flags = {f.name: flag for f, flag, _ in _config_flags()}
    unknown = sorted(set(fields) - set(flags))
    if unknown:
        raise ValueError(f"no zeropp-train flag sets ZeroConfig field(s) {unknown}")
    booleans = sorted(name for name, value in fields.items() if isinstance(value, bool))
    if booleans:
        raise ValueError(f"boolean field(s) {booleans} are set by --name / --no-name, not a value")
    return [arg for name, value in fields.items() for arg in (flags[name], str(value))]


def add_config_args(group) -> None:
    """Adds one flag per ZeroConfig field to ``group`` (a parser or argument group).

    Each flag's help, choices, type and default come from its field (see
    ``zeropp_jax.config._field``). A flag left out keeps the preset's value
    (default ``None``) unless the field gives the flag another default.
    """
    for f, flag, _ in _config_flags():
        meta = f.metadata
        kwargs: dict[str, Any] = dict(
            default=meta["cli_default"], help=meta["help"].replace("%", "%%"),
        )
        if meta["parse"] is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _PARSERS[meta["parse"], meta["at_least"]]
            kwargs["choices"] = meta["choices"]
        group.add_argument(flag, **kwargs)


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks that need no devices (fail before any device or compile work).

    The ZeRO flags are checked by building their :class:`ZeroConfig`, whose
    ``ValueError`` becomes the usage error.
    """
    try:
        config = build_config(args)  # ZeroConfig's own checks (preset, dtypes, qgZ combinations)
    except ValueError as e:
        parser.error(_named_by_flag(str(e)))
    if args.mesh is not None:
        from zeropp_jax.mesh import parse_mesh_shape
        from zeropp_jax.step.batch import global_batch_size_check

        try:
            nodes, local = parse_mesh_shape(args.mesh)
        except ValueError as e:
            parser.error(str(e))
        try:
            global_batch_size_check(args.batch_size, nodes * local, config.grad_accum)
        except ValueError as e:
            parser.error(f"--mesh {args.mesh}, --batch-size {args.batch_size}: {e}")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if args.data is not None:
        if not os.path.exists(args.data):
            parser.error(f"--data {args.data}: no such file")
        if os.path.isfile(args.data) and os.path.getsize(args.data) == 0:
            parser.error(f"--data {args.data}: the file is empty")


def _named_by_flag(message: str) -> str:
    """A ZeroConfig error that begins with a field's name (``compute_dtype
    must be ...``), begun with the field's flag instead (``--dtype must be
    ...``), which is what the user typed."""
    for f, flag, _ in _config_flags():
        if message.startswith(f.name + " "):
            none = f.metadata["none_name"]
            return flag + message[len(f.name):] + (f"; or {none}" if none else "")
    return message


def prepare_devices(args: argparse.Namespace) -> None:
    """Asks XLA for enough simulated host devices before JAX is imported.

    Only the host (CPU) platform is affected; on a GPU machine JAX still uses
    the GPUs. Must run before JAX creates its backends (the first device
    query), which importing ``jax`` does not do.
    """
    from zeropp_jax.mesh import parse_mesh_shape  # no JAX import

    from zeropp_jax import distributed

    nodes, local = parse_mesh_shape(args.mesh or DEFAULT_SIMULATED_MESH)
    settings = distributed.resolve(args.coordinator, args.num_processes, args.process_id)
    processes = settings[1] if settings else 1
    count = local if processes > 1 else nodes * local  # one node per process
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={count}".strip()
        )


def parse_and_prepare(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None,
) -> argparse.Namespace:
    """Parses and validates the flags, then sets up devices and processes.

    Everything that can be checked without JAX fails here, before any device
    or compilation work: first ``check(parser, args)``, the command's own
    flags (usage errors through ``parser.error``), then the shared ones.
    """
    args = parser.parse_args(argv)
    if check is not None:
        check(parser, args)
    validate_args(parser, args)
    check_processes(parser, args)
    prepare_devices(args)
    init_distributed(args, parser.prog)
    warn(parser.prog, idle_flag_warnings(parser, args))
    return args


def warn(prog: str, warnings: list[str]) -> None:
    """Prints each warning to stderr as ``prog: warning: ...``, from process 0
    only (after :func:`init_distributed`, so under any launcher)."""
    import jax

    if warnings and jax.process_index() == 0:
        for warning in warnings:
            print(f"{prog}: warning: {warning}", file=sys.stderr, flush=True)


def idle_flag_warnings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """One line per flag given for a feature that is off (``--preset zero3
    --qgz-warmup 100``): the flag changes nothing, which the user should know."""
    idle = idle_fields(build_config(args))
    out = []
    for f, flag, dest in _config_flags():
        value = getattr(args, dest)
        if f.name in idle and value != parser.get_default(dest):
            shown = {True: flag, False: f"--no-{flag[2:]}"}.get(value, f"{flag} {value}")
            out.append(f"{shown} has no effect: {idle[f.name]}")
    return out


def check_processes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The multi-host flags (or ``ZEROPP_*`` variables) fit together: a usage
    error naming the flag otherwise, before JAX starts."""
    from zeropp_jax import distributed

    try:
        distributed.resolve(args.coordinator, args.num_processes, args.process_id)
    except ValueError as e:
        parser.error(str(e))


# Flags that may differ between the processes of one run: who each is, what
# only process 0 writes or shows, and --data (each host's path to it; its
# tokens are compared, zeropp_jax.cli.data_flags).
_PER_PROCESS_FLAGS = frozenset({"process_id", "coordinator", "num_processes", "metrics_out",
                                "no_progress", "json", "dump_hlo", "data"})


def init_distributed(args: argparse.Namespace, prog: str) -> None:
    """Joins a multi-process run if the flags or the environment describe
    one, and refuses processes started with different flags (but those of
    ``_PER_PROCESS_FLAGS``), naming them."""
    from zeropp_jax import agreement, distributed

    try:
        distributed.initialize(
            coordinator=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    except ValueError as e:  # a cluster environment JAX cannot set up from
        fail(prog, str(e))
    try:
        differ = agreement.differing({k: repr(v) for k, v in vars(args).items()
                                        if k not in _PER_PROCESS_FLAGS})
    except ValueError as e:  # another tool or version: other flags
        fail(prog, f"the processes were started with other flags: {e}")
    if differ:
        fail(prog, "the processes were started with different flags: " + ", ".join(
            f"--{k.replace('_', '-')} (this process: {getattr(args, k)!r}; processes {p} differ "
            "from process 0)" for k, p in differ.items())
            + "; start every process with the same command (zeropp-launch does)")


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


def build_config(args: argparse.Namespace) -> ZeroConfig:
    """The ZeroConfig of the flags; raises ``ValueError`` on a bad combination."""
    overrides = {}
    for f, _, dest in _config_flags():
        value = getattr(args, dest)
        if value is not None and value == f.metadata["none_name"]:  # --dtype auto
            value = None
        overrides[f.name] = value
    preset = overrides.pop("preset")
    # --seed seeds the data, the model and the dithered code's noise alike.
    return ZeroConfig.from_preset(preset, qgz_seed=args.seed, **overrides)


def build_model(args: argparse.Namespace, vocab_size: int):
    """The example GPT's config (``ValueError`` for ``--dtype fp16`` on a CPU)."""
    import jax

    from zeropp_jax.config_checks import parse_dtype
    from zeropp_jax.models import gpt

    if args.dtype != "auto" and parse_dtype(args.dtype) == jax.numpy.float16 \
            and jax.default_backend() == "cpu":
        raise ValueError(
            "--dtype fp16 does not run on a CPU: XLA:CPU has no float16 matrix product with "
            "float32 results (the example GPT's logits); use --dtype bf16 or fp32 here "
            "(fp16 runs on a GPU)")
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
    with warnings.catch_warnings():  # guards.start_warnings says it with the flags to use
        warnings.simplefilter("ignore", IdleOnMeshWarning)
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
      schedule: ``"constant"``: ``lr`` after a linear warm-up over
        ``warmup`` steps (default none); or ``"cosine"``: linear warm-up
        over ``warmup`` steps (default 10% of ``total_steps``), then cosine
        decay to ``lr / 10`` at ``total_steps``. Without ``total_steps``
        (e.g. for the communication report) the cosine schedule does not
        matter and a constant rate is used.
      total_steps: the run's length (the cosine schedule's).
      warmup: warm-up steps (see ``schedule``).
    """
    import optax

    if schedule not in ("cosine", "constant"):
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; use cosine or constant")
    if schedule == "cosine" and total_steps:
        if warmup is None:
            warmup = total_steps // 10
        warmup = min(warmup, total_steps - 1)
        lr = optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup_steps=warmup, decay_steps=total_steps, end_value=lr / 10
        )
    elif schedule == "constant" and warmup:
        lr = optax.warmup_constant_schedule(0.0, lr, warmup_steps=warmup)
    if qgz_target == "momentum":
        from zeropp_jax.step.adam import onebit_adam

        return onebit_adam(lr, clip_norm=CLIP_NORM)
    return optax.chain(optax.clip_by_global_norm(CLIP_NORM), optax.adam(lr))


def fail(prog: str, message: str) -> "None":
    """Prints ``prog: error: message`` (argparse's form; ``prog`` the tool's
    name, as its parser's ``prog``) and exits with status 2.

    On a multi-process run the process exits at once, so that peers blocked
    in a collective with it fail fast instead of waiting at the exit barrier.
    """
    from zeropp_jax import distributed

    print(f"{prog}: error: {message}", file=sys.stderr)
    distributed.exit_now(2)
