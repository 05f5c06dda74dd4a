"""``zeropp-launch``: run one command as N local processes of a multi-process job.

Simulates N hosts on one machine: every process gets its own CPU devices and
joins ``jax.distributed`` through a coordinator on ``127.0.0.1`` (collectives
over gloo). Example::

  zeropp-launch -n 2 --devices-per-process 4 -- zeropp-train --mesh 2x4

Process ``i`` runs the command with these environment variables (read by
:func:`zeropp_jax.distributed.initialize`)::

  ZEROPP_COORDINATOR=127.0.0.1:PORT  ZEROPP_NUM_PROCESSES=N  ZEROPP_PROCESS_ID=i
  JAX_PLATFORMS=cpu  XLA_FLAGS=--xla_force_host_platform_device_count=K
  PYTHONUNBUFFERED=1  ZEROPP_HEARTBEAT=FD:INODE

(other ``XLA_FLAGS`` are kept). ``K`` is ``--devices-per-process``, by default
the ``LOCAL`` of a ``--mesh NxLOCAL`` in the command, else 1.

Each output line of process ``i`` is printed with the prefix ``[i] `` (stdout
to stdout, stderr to stderr). The launch succeeds only if every process exits
with status 0. As soon as one fails (non-zero exit or killed by a signal) the
others are stopped -- SIGTERM, then SIGKILL after ``--kill-grace`` seconds --
so a run whose peer is gone cannot hang in a collective; the launcher then
names the process that failed and how, and exits non-zero (the failed
process's exit code, or 128 + signal number). Ctrl-C and SIGTERM stop all
processes too.

Processes that call :func:`zeropp_jax.distributed.initialize` (every
zeropp command does) send a heartbeat to the launcher each second
(:mod:`zeropp_jax.heartbeat`). A process whose heartbeat stops for
``--stall-timeout`` seconds (stopped, frozen) is named as stalled; one that
has not beaten ``--start-timeout`` seconds after a peer's first (hung or
slow before ``initialize``) is named as not started. Either way all are
stopped and the launch exits 1. When a process fails while a peer has been
silent for a while, the silent peer is named: the others abort because of it.
If the launcher dies, even by SIGKILL, its processes are killed too.

This module is the command line; :mod:`zeropp_jax.cli._processes` starts,
watches and stops the processes and relays their output.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from zeropp_jax.cli._processes import (
    DEFAULT_KILL_GRACE_S,
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_STALL_TIMEOUT_S,
    HOST,
    launch,
)
from zeropp_jax.cli.flags import number_type
from zeropp_jax.mesh import parse_mesh_shape

MAX_PORT = 65535  # TCP's largest port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeropp-launch",
        usage="zeropp-launch -n N [--devices-per-process K] [--timeout S] [options] -- COMMAND [ARGS ...]",
        description="Run COMMAND as N local processes of one jax.distributed job "
        "(simulated hosts: CPU devices, gloo collectives, coordinator on "
        f"{HOST}). Output lines are prefixed with the process index; if any "
        "process fails, the others are stopped and the launch fails.",
        epilog="example: zeropp-launch -n 2 --devices-per-process 4 -- "
        "zeropp-train --mesh 2x4 --preset zeropp --steps 10",
    )
    parser.add_argument(
        "-n", "--num-processes", dest="n", type=_int_at_least(1), required=True,
        metavar="N", help="number of processes (simulated hosts)",
    )
    parser.add_argument(
        "--devices-per-process", type=_int_at_least(1), default=None, metavar="K",
        help="simulated CPU devices per process; the mesh is N x K (default: "
        "LOCAL of a '--mesh NxLOCAL' in the command, else 1)",
    )
    parser.add_argument(
        "--timeout", type=_positive_float, default=None, metavar="S",
        help="stop all processes and fail (exit 124) after S seconds (default: no limit)",
    )
    parser.add_argument(
        "--kill-grace", type=_non_negative_float, default=DEFAULT_KILL_GRACE_S,
        metavar="S", help="seconds between SIGTERM and SIGKILL when stopping "
        f"processes (default: {DEFAULT_KILL_GRACE_S:g})",
    )
    parser.add_argument(
        "--port", type=_int_at_least(1, MAX_PORT), default=None,
        help="coordinator port (default: a free one)",
    )
    parser.add_argument(
        "--stall-timeout", type=_non_negative_float, default=DEFAULT_STALL_TIMEOUT_S,
        metavar="S", help="name a process whose heartbeat stopped S seconds ago as "
        f"stalled and stop all (default: {DEFAULT_STALL_TIMEOUT_S:g}; 0: never)",
    )
    parser.add_argument(
        "--start-timeout", type=_non_negative_float, default=DEFAULT_START_TIMEOUT_S,
        metavar="S", help="name a process with no heartbeat S seconds after a peer's "
        f"first as not started and stop all (default: {DEFAULT_START_TIMEOUT_S:g}; 0: never)",
    )
    return parser


def _int_at_least(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"expected an integer in {low}..{high}, got {value}")
        return value

    return parse


# Seconds: inf is taken (no limit), nan refused.
_positive_float = number_type(
    float, lambda v: v > 0, "_positive_float",
    unparsed="expected a number, got {text!r}", rejected="expected a positive number, got {text!r}")
_non_negative_float = number_type(
    float, lambda v: v >= 0, "_non_negative_float",
    unparsed="expected a number, got {text!r}", rejected="expected a number >= 0, got {text!r}")


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Splits ``argv`` at the first ``--``; returns ``(options, command)``."""
    parser = build_parser()
    argv = list(argv)
    if "--" not in argv:
        _, extra = parser.parse_known_args(argv)  # -h and bad values first
        hint = f" (got {' '.join(extra)!r} without '--' before it)" if extra else ""
        parser.error(
            f"missing the command to run{hint}: put it after '--', e.g. "
            "zeropp-launch -n 2 --devices-per-process 4 -- zeropp-train --mesh 2x4"
        )
    split = argv.index("--")
    options = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        parser.error("missing the command to run after '--'")
    return options, command


def devices_for_mesh(command: Sequence[str], num_processes: int) -> int | None:
    """The devices each process needs for a ``--mesh NODESxLOCAL`` in
    ``command``: ``LOCAL`` where NODES is ``num_processes`` (a node is a
    process), all ``NODES x LOCAL`` for one process; ``None`` without a
    readable ``--mesh``. Raises ``ValueError`` for NODES of another number of
    processes, which the command would refuse only once every process had
    started."""
    mesh = _mesh_in(command)
    if mesh is None:
        return None
    nodes, local = mesh
    if num_processes == 1:
        return nodes * local
    if nodes != num_processes:
        raise ValueError(
            f"the command's --mesh {nodes}x{local} has {nodes} nodes but -n {num_processes} "
            f"starts {num_processes} processes, and a node is one process: pass -n {nodes}, "
            f"or --mesh {num_processes}xLOCAL (--devices-per-process D runs the command as "
            "it is)")
    return local


def _mesh_in(command: Sequence[str]) -> tuple[int, int] | None:
    """``(NODES, LOCAL)`` of the ``--mesh`` in ``command``, if it parses."""
    for i, arg in enumerate(command):
        if arg == "--mesh" and i + 1 < len(command):
            text = command[i + 1]
        elif arg.startswith("--mesh="):
            text = arg[len("--mesh="):]
        else:
            continue
        try:
            return parse_mesh_shape(text)
        except ValueError:
            return None  # the command's own error names it
    return None


def main(argv: list[str] | None = None) -> int:
    options, command = parse_args(sys.argv[1:] if argv is None else argv)
    try:  # --devices-per-process given: the command's --mesh is its own business
        devices = options.devices_per_process or devices_for_mesh(command, options.n) or 1
        return launch(
            command, options.n,
            devices_per_process=devices,
            timeout_s=options.timeout,
            kill_grace_s=options.kill_grace,
            port=options.port,
            stall_timeout_s=options.stall_timeout or None,
            start_timeout_s=options.start_timeout or None,
        )
    except ValueError as e:
        print(f"zeropp-launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
